"""Compressors by name: one registry for both backends, refusing duplicates.

Two kinds share one namespace (a name is never both):

* codecs (:func:`register`, :func:`create`, :func:`names`): ``compress -> payload`` on one
  worker, on both backends; every Option's Comp/Decomp steps can carry them;
* collective compressors (:func:`register_collective`, :func:`create_collective`,
  :func:`collective_names`): compression that is itself a sequence of all-reduces
  (PowerSGD); they declare in their :class:`~byteps_espresso.kernels.base.Capabilities`
  which Options they can follow.

:func:`capabilities` answers for either kind.

Example:
    >>> from byteps_espresso.kernels import create
    >>> c = create("fp16", backend="numba")
"""

from __future__ import annotations

from typing import Any

from byteps_espresso.kernels.base import BACKENDS, Capabilities, Compressor

__all__ = ["by_wire_id", "capabilities", "collective_names", "create", "create_collective",
           "defaults", "names", "register", "register_collective", "wire_id"]

_CLASSES: dict[tuple[str, str], type[Compressor]] = {}
_WIRE_IDS: dict[int, str] = {}
_COLLECTIVE: dict[str, type] = {}


def register(cls: type[Compressor]) -> type[Compressor]:
    """Class decorator: add one (algorithm, backend) implementation.

    Raises:
        ValueError: the (name, backend) pair or the wire id is already taken.
    """
    if cls.backend not in BACKENDS:
        raise ValueError(f"{cls.__name__}: backend {cls.backend!r} is not one of {BACKENDS}")
    key = (cls.name, cls.backend)
    if cls.name in _COLLECTIVE:
        raise ValueError(f"compressor {cls.name!r} is already a collective compressor")
    if key in _CLASSES:
        raise ValueError(f"compressor {cls.name!r} for backend {cls.backend!r} is registered twice")
    owner = _WIRE_IDS.get(cls.wire_id)
    if owner is not None and owner != cls.name:
        raise ValueError(f"wire id {cls.wire_id} of {cls.name!r} is already used by {owner!r}")
    _WIRE_IDS[cls.wire_id] = cls.name
    _CLASSES[key] = cls
    return cls


def register_collective(cls: type) -> type:
    """Class decorator: add a collective compressor (``name``, ``capabilities``, ``defaults``).

    Raises:
        ValueError: the name is taken (by a codec or another collective compressor).
    """
    name = cls.name
    if name in _COLLECTIVE or name in names():
        raise ValueError(f"compressor {name!r} is registered twice")
    if not isinstance(getattr(cls, "capabilities", None), Capabilities):
        raise ValueError(f"{cls.__name__}: a collective compressor declares its capabilities")
    _COLLECTIVE[name] = cls
    return cls


def names() -> list[str]:
    """Registered codec names (elementwise, both backends), sorted."""
    return sorted({name for name, _ in _CLASSES})


def collective_names() -> list[str]:
    """Registered collective compressor names (PowerSGD), sorted."""
    return sorted(_COLLECTIVE)


def _unknown(name: str) -> ValueError:
    return ValueError(f"unknown compressor {name!r}; choose one of {', '.join(names())} "
                      f"(collective: {', '.join(collective_names())})")


def capabilities(name: str) -> Capabilities:
    """What compressor ``name`` needs from an Option (codec or collective compressor)."""
    if name in _COLLECTIVE:
        return _COLLECTIVE[name].capabilities
    for (algo, _), cls in _CLASSES.items():
        if algo == name:
            return cls.capabilities
    raise _unknown(name)


def create_collective(name: str, **params: Any) -> Any:
    """Build collective compressor ``name`` (its state object) with its parameters.

    Raises:
        ValueError: unknown name or a bad parameter.
    """
    cls = _COLLECTIVE.get(name)
    if cls is None:
        raise ValueError(f"unknown collective compressor {name!r}; choose one of "
                         f"{', '.join(collective_names())}")
    return cls(**params)


def create(name: str, backend: str = "torch", **params: Any) -> Compressor:
    """Build compressor ``name`` on ``backend`` with its parameters.

    Raises:
        ValueError: unknown name or backend (the message lists the valid ones), or a bad
            parameter (the compressor's own message).
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    if name in _COLLECTIVE:
        raise ValueError(f"{name!r} compresses through collective all-reduces and has no "
                         f"standalone payload: build it with create_collective({name!r}) and "
                         "run it on the Options kernels/CONTRACT.md lists for it")
    cls = _CLASSES.get((name, backend))
    if cls is None:
        raise _unknown(name)
    return cls(**params)


def defaults(name: str) -> dict[str, Any]:
    """The parameters algorithm ``name`` accepts, with their default values.

    Callers holding job-wide settings (such as ``ESPRESSO_SEED``) pass only the ones the
    algorithm accepts: ``create`` refuses unknown parameters.
    """
    if name in _COLLECTIVE:
        return dict(_COLLECTIVE[name].defaults)
    for (algo, _), cls in _CLASSES.items():
        if algo == name:
            return dict(cls.defaults)
    raise _unknown(name)


def wire_id(name: str) -> int:
    """The stable codec number of algorithm ``name`` on the wire."""
    for wid, owner in _WIRE_IDS.items():
        if owner == name:
            return wid
    raise ValueError(f"unknown compressor {name!r}; choose one of {', '.join(names())}")


def by_wire_id(wid: int) -> str:
    """The algorithm name for codec number ``wid``; raises ValueError when unknown."""
    try:
        return _WIRE_IDS[wid]
    except KeyError:
        raise ValueError(f"unknown codec id {wid}; known ids: {sorted(_WIRE_IDS)}") from None
