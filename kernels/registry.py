"""Compressors by name: one registry for both backends, refusing duplicates.

Example:
    >>> from byteps_espresso.kernels import create
    >>> c = create("fp16", backend="numba")
"""

from __future__ import annotations

from typing import Any

from byteps_espresso.kernels.base import BACKENDS, Compressor

__all__ = ["by_wire_id", "create", "defaults", "names", "register", "wire_id"]

_CLASSES: dict[tuple[str, str], type[Compressor]] = {}
_WIRE_IDS: dict[int, str] = {}


def register(cls: type[Compressor]) -> type[Compressor]:
    """Class decorator: add one (algorithm, backend) implementation.

    Raises:
        ValueError: the (name, backend) pair or the wire id is already taken.
    """
    if cls.backend not in BACKENDS:
        raise ValueError(f"{cls.__name__}: backend {cls.backend!r} is not one of {BACKENDS}")
    key = (cls.name, cls.backend)
    if key in _CLASSES:
        raise ValueError(f"compressor {cls.name!r} for backend {cls.backend!r} is registered twice")
    owner = _WIRE_IDS.get(cls.wire_id)
    if owner is not None and owner != cls.name:
        raise ValueError(f"wire id {cls.wire_id} of {cls.name!r} is already used by {owner!r}")
    _WIRE_IDS[cls.wire_id] = cls.name
    _CLASSES[key] = cls
    return cls


def names() -> list[str]:
    """Registered algorithm names, sorted."""
    return sorted({name for name, _ in _CLASSES})


def create(name: str, backend: str = "torch", **params: Any) -> Compressor:
    """Build compressor ``name`` on ``backend`` with its parameters.

    Raises:
        ValueError: unknown name or backend (the message lists the valid ones), or a bad
            parameter (the compressor's own message).
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    cls = _CLASSES.get((name, backend))
    if cls is None:
        raise ValueError(f"unknown compressor {name!r}; choose one of {', '.join(names())}")
    return cls(**params)


def defaults(name: str) -> dict[str, Any]:
    """The parameters algorithm ``name`` accepts, with their default values.

    Callers holding job-wide settings (such as ``ESPRESSO_SEED``) pass only the ones the
    algorithm accepts: ``create`` refuses unknown parameters.
    """
    for (algo, _), cls in _CLASSES.items():
        if algo == name:
            return dict(cls.defaults)
    raise ValueError(f"unknown compressor {name!r}; choose one of {', '.join(names())}")


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
