"""The compressor contract shared by the worker (torch ops) and the servers (numba kernels).

See CONTRACT.md next to this file for the invariants every compressor keeps.

A compressor turns a dense tensor into a *payload*: a tuple of contiguous 1-D arrays with
fixed dtypes. The payload is the only thing that crosses the wire. The *ctx* stays local and
can always be rebuilt from the tensor's shape and dtype (:meth:`Compressor.context`), so a
server or a peer that only received bytes can decode them.

Backends:
    ``torch``  payload arrays are ``torch.Tensor`` on the input's device.
    ``numba``  payload arrays are ``numpy.ndarray``; kernels are ``@njit`` functions.
A payload from one backend decodes with the other after :func:`to_numpy` / :func:`to_torch`.

Subclasses implement two pure steps, :meth:`Compressor.encode` (flat input -> payload) and
:meth:`Compressor.decode` (checked payload -> flat output); the base class validates inputs,
payloads and parameters around them.
"""

from __future__ import annotations

import abc
import contextlib
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch

__all__ = [
    "BACKENDS",
    "ELEMENTWISE",
    "MAX_NUMEL",
    "Capabilities",
    "Compressor",
    "Ctx",
    "NonFiniteError",
    "Payload",
    "PayloadError",
    "check_input",
    "check_ratio",
    "key_seed",
    "to_numpy",
    "to_torch",
]

BACKENDS = ("torch", "numba")

# Largest tensor a compressor accepts, in elements: sparse indices are int32 on the wire.
MAX_NUMEL = 2**31 - 1

# A payload is a tuple of 1-D contiguous arrays (torch tensors or numpy arrays).
Payload = tuple[Any, ...]


class PayloadError(ValueError):
    """A payload does not match its ctx: wrong number of arrays, dtype, length or content."""


class NonFiniteError(ValueError):
    """The input holds NaN or Inf and the codec cannot encode it faithfully."""


@dataclass(frozen=True)
class Ctx:
    """Local decoding context: everything a decoder needs that is not in the payload.

    Attributes:
        shape: the original tensor's shape.
        dtype: the original dtype name (``"float32"``).
        name: the tensor's name; selects error-feedback residuals and seeds random draws.
        step: the iteration number; seeds random draws together with ``name``.
    """

    shape: tuple[int, ...]
    dtype: str = "float32"
    name: str = ""
    step: int = 0
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class Capabilities:
    """What a compressor needs from the Option that carries it (CONTRACT.md, "Capabilities").

    The decision tree reads these to prune the Options a compressor cannot follow.

    Attributes:
        elementwise: compresses any flat range of a tensor on its own (a shard after a
            divisible step, a PS partition); False: needs the whole tensor.
        needs_shape: needs the tensor's matrix shape, not just its element count.
        linear: payloads of several workers sum (element by element) to the payload of the
            summed input, so aggregation is a plain all-reduce of payloads.
        collective_rounds: all-reduces of payloads inside one compression (0: the codec
            compresses alone; PowerSGD: 2, P then Q).
        backends: the backends that implement it (``Comp(cpu)`` needs ``numba``).
        recompressible: a server or a later step may decompress, sum and compress again.
    """

    elementwise: bool = True
    needs_shape: bool = False
    linear: bool = False
    collective_rounds: int = 0
    backends: tuple[str, ...] = BACKENDS
    recompressible: bool = True


#: The capabilities of every codec that compresses a flat range alone (the default).
ELEMENTWISE = Capabilities()


class Compressor(abc.ABC):
    """Base class: subclasses implement the pure kernels for one algorithm and backend.

    Subclasses set ``name`` (registry name), ``wire_id`` (stable codec number on the wire),
    ``backend``, ``payload_dtypes`` (the numpy dtype of each payload array, in order) and
    ``defaults`` (every accepted parameter with its default value).
    """

    name: ClassVar[str]
    wire_id: ClassVar[int]
    backend: ClassVar[str]
    payload_dtypes: ClassVar[tuple[np.dtype, ...]]
    defaults: ClassVar[dict[str, Any]] = {}
    # Whether the same input always gives the same payload (no random draws).
    deterministic: ClassVar[bool] = True
    # Whether E[decompress(compress(x))] == x over the random draws.
    unbiased: ClassVar[bool] = False
    # Signs required of the float32 scales in the payload's last array (+1: >= 0, -1: <= 0);
    # empty when the payload carries no scales. Checked on decode (finite, right sign).
    scale_signs: ClassVar[tuple[int, ...]] = ()
    # What the Option carrying it must provide (see Capabilities).
    capabilities: ClassVar[Capabilities] = ELEMENTWISE

    def __init__(self, **params: Any) -> None:
        unknown = sorted(set(params) - set(self.defaults))
        if unknown:
            valid = ", ".join(sorted(self.defaults)) or "none"
            raise ValueError(f"{self.name}: unknown parameter(s) {', '.join(unknown)}; "
                             f"valid parameters: {valid}")
        self.params = {**self.defaults, **params}
        self.validate_params()

    def validate_params(self) -> None:  # noqa: B027 - optional hook
        """Raise ValueError for a bad parameter value (subclasses extend)."""

    # ---- the contract ------------------------------------------------------------------------
    def compress(self, x: Any, *, name: str = "", step: int = 0) -> tuple[Payload, Ctx]:
        """Compress a contiguous float32 tensor/array.

        Args:
            x: a non-empty contiguous float32 ``torch.Tensor`` (torch backend) or
                ``numpy.ndarray`` (numba backend).
            name: the tensor's name (seeds random draws, keys per-tensor state).
            step: the iteration (seeds random draws).

        Returns:
            ``(payload, ctx)``: the wire arrays and the local decoding context.

        Raises:
            TypeError: wrong array type or dtype.
            ValueError: empty, non-contiguous or too large input.
            NonFiniteError: NaN/Inf in the input of a codec that cannot carry it.
        """
        self._check_array_type(x, "input")
        check_input(x, f"{self.name}: tensor {name!r}")
        flat = x.detach().reshape(-1) if isinstance(x, torch.Tensor) else x.reshape(-1)
        ctx = Ctx(tuple(int(d) for d in x.shape), "float32", name, int(step))
        with self._threads(ctx.numel):
            return self.encode(flat, ctx), ctx

    def decompress(self, payload: Payload, ctx: Ctx) -> Any:
        """Rebuild a dense tensor/array of ``ctx.shape`` (float32) from a payload.

        Raises:
            PayloadError: the payload's arrays do not fit ``ctx`` (count, type, dtype, length,
                content such as out-of-range indices).
        """
        self.check_payload(payload, ctx)
        with self._threads(ctx.numel):
            return self.decode(payload, ctx).reshape(ctx.shape)

    def aggregate(self, payloads: Sequence[Payload], ctx: Ctx) -> Any:
        """Decompress each payload and sum them in list order (deterministic)."""
        if not payloads:
            raise PayloadError(f"{self.name}: aggregate needs at least one payload")
        total = self.decompress(payloads[0], ctx)
        for payload in payloads[1:]:
            total += self.decompress(payload, ctx)
        return total

    def decompress_into(self, payload: Payload, ctx: Ctx, out: torch.Tensor) -> None:
        """``out[:] = decompress(payload, ctx)`` (``out``: a flat float32 tensor of
        ``ctx.numel``, a slice of a larger one on any device): a receiver's pieces decoded
        into one buffer. Codecs whose decode is a cast write it there directly."""
        got = self.decompress(payload, ctx)
        out.copy_(got.reshape(-1) if isinstance(got, torch.Tensor)
                  else torch.from_numpy(np.ascontiguousarray(got).reshape(-1)))

    def subtract_decoded(self, payload: Payload, ctx: Ctx, out: Any) -> None:
        """``out -= decompress(payload, ctx)`` in place (``out``: ``ctx.shape``, float32, the
        array type of this backend): what error feedback keeps of an input. Codecs that can
        decode straight into the subtraction override it (bit for bit the same)."""
        out -= self.decompress(payload, ctx)

    @abc.abstractmethod
    def encode(self, flat: Any, ctx: Ctx) -> Payload:
        """Pure kernel step: a checked 1-D float32 array -> payload."""

    @abc.abstractmethod
    def decode(self, payload: Payload, ctx: Ctx) -> Any:
        """Pure kernel step: a checked payload -> 1-D float32 array of ``ctx.numel``."""

    @abc.abstractmethod
    def compressed_nbytes(self, numel: int, step: int | None = None) -> int:
        """Exact bytes on the wire for a tensor of ``numel`` elements.

        ``step`` matters only to codecs with a schedule (dgc's sparsity warm-up); None means
        the steady state after any warm-up, which is what the cost model prices.
        """

    # ---- state between calls (checkpoints) --------------------------------------------------
    #: Names of the per-tensor state arrays this compressor keeps between calls (signum's
    #: momentum, a wrapper's residual); empty for a stateless codec.
    state_slots: ClassVar[tuple[str, ...]] = ()

    def export_state(self) -> dict[str, dict[str, Any]]:
        """The state kept between calls: ``{tensor name: {slot: array}}`` (the arrays
        themselves, not copies; the backend's array type). Empty for a stateless codec."""
        return {}

    def import_state(self, state: dict[str, dict[str, Any]]) -> None:
        """Replace the state kept between calls with ``state`` (as :meth:`export_state`
        gives it, arrays already of this backend's type and device).

        Raises:
            ValueError: a slot this compressor does not keep.
        """
        _check_slots(self, state, self.state_slots)

    # ---- shared helpers ---------------------------------------------------------------------
    def context(self, shape: Sequence[int], dtype: str = "float32", *, name: str = "",
                step: int = 0) -> Ctx:
        """The ctx a receiver rebuilds from the shape and dtype it was told about."""
        return Ctx(tuple(int(d) for d in shape), dtype, name, step)

    @staticmethod
    def payload_nbytes(payload: Payload) -> int:
        """Exact bytes the payload's arrays occupy on the wire."""
        total = 0
        for arr in payload:
            if isinstance(arr, torch.Tensor):
                total += arr.numel() * arr.element_size()
            else:
                total += int(arr.nbytes)
        return total

    def stage(self, step: int | None) -> int | None:
        """The stage of a schedule that iteration ``step`` is in: payload lengths are the same
        for every step of one stage (dgc's sparsity warm-up); None: the steady state."""
        return None

    @property
    def steady_step(self) -> int:
        """The first iteration of the steady state (0 without a schedule)."""
        return 0

    def payload_lengths(self, numel: int, step: int | None = None) -> tuple[int, ...]:
        """Element count of each payload array for a tensor of ``numel`` elements.

        The default derives them from :meth:`compressed_nbytes` for single-array payloads;
        multi-array codecs override it. The wire decoder checks received frames against it.
        ``step``: the iteration, for codecs with a schedule (None: the steady state).
        """
        if len(self.payload_dtypes) != 1:
            raise NotImplementedError(f"{type(self).__name__} must define payload_lengths")
        itemsize = np.dtype(self.payload_dtypes[0]).itemsize
        return (self.compressed_nbytes(numel, step) // itemsize,)

    def check_payload(self, payload: Payload, ctx: Ctx) -> None:
        """Raise :class:`PayloadError` unless the payload's arrays fit ``ctx``."""
        if not isinstance(payload, tuple | list):
            raise PayloadError(f"{self.name}: payload must be a tuple of arrays, "
                               f"got {type(payload).__name__}")
        expected = self.payload_lengths(ctx.numel, ctx.step)
        if len(payload) != len(expected):
            raise PayloadError(
                f"{self.name}: payload has {len(payload)} arrays, expected {len(expected)}"
            )
        for i, (arr, dtype, length) in enumerate(
            zip(payload, self.payload_dtypes, expected, strict=True)
        ):
            self._check_array_type(arr, f"payload array {i}", PayloadError)
            got_dtype = _np_dtype(arr)
            if got_dtype != np.dtype(dtype):
                raise PayloadError(
                    f"{self.name}: payload array {i} has dtype {got_dtype}, expected "
                    f"{np.dtype(dtype)}"
                )
            got_len = arr.numel() if isinstance(arr, torch.Tensor) else arr.size
            if got_len != length or arr.ndim != 1:
                raise PayloadError(
                    f"{self.name}: payload array {i} has shape {tuple(arr.shape)}, expected "
                    f"({length},) for a tensor of {ctx.numel} elements"
                )
        self.check_payload_content(payload, ctx)

    def check_payload_content(self, payload: Payload, ctx: Ctx) -> None:
        """Raise :class:`PayloadError` for well-shaped payloads with impossible content.

        The base class checks the scales declared by ``scale_signs``; subclasses extend.
        """
        if not self.scale_signs:
            return
        scales = payload[-1]
        values = scales.tolist()
        for value, sign in zip(values, self.scale_signs, strict=True):
            if not np.isfinite(value) or value * sign < 0:
                raise PayloadError(f"{self.name}: payload scales {values} must be finite with "
                                   f"signs {self.scale_signs}")

    def _check_array_type(self, arr: Any, what: str, exc: type[Exception] = TypeError) -> None:
        want = torch.Tensor if self.backend == "torch" else np.ndarray
        if not isinstance(arr, want):
            hint = "to_torch" if self.backend == "torch" else "to_numpy"
            raise exc(f"{self.name} ({self.backend} backend): {what} must be a "
                      f"{want.__module__}.{want.__name__}, got {type(arr).__name__}; "
                      f"convert with byteps_espresso.kernels.{hint}")

    def _threads(self, numel: int) -> contextlib.AbstractContextManager[None]:
        if self.backend != "numba":
            return contextlib.nullcontext()
        from byteps_espresso.kernels._exact import threads_for

        return threads_for(numel)

    def non_finite(self, ctx: Ctx) -> NonFiniteError:
        """The error for a NaN/Inf input (see CONTRACT.md)."""
        return NonFiniteError(
            f"{self.name}: tensor {ctx.name!r} (step {ctx.step}) contains NaN or Inf, which "
            f"{self.name} cannot encode; fix the diverging gradient (lower the learning rate, "
            "clip gradients) or use fp16/bf16, which carry NaN/Inf through"
        )

    def __repr__(self) -> str:
        params = ", ".join(f"{k}={v!r}" for k, v in sorted(self.params.items()))
        return f"{type(self).__name__}({params})"


def _check_slots(who: Compressor, state: dict[str, dict[str, Any]],
                 slots: Sequence[str]) -> None:
    unknown = sorted({slot for entry in state.values() for slot in entry} - set(slots))
    if unknown:
        raise ValueError(f"{type(who).__name__}: state slot(s) {unknown} are not kept by this "
                         f"compressor (it keeps {list(slots) or 'none'}); restore state saved "
                         "with the same compressor and wrappers")


def _np_dtype(arr: Any) -> np.dtype:
    if isinstance(arr, torch.Tensor):
        return torch.empty((), dtype=arr.dtype).numpy().dtype
    return arr.dtype


def check_input(x: Any, who: str) -> None:
    """Reject inputs no compressor accepts, with a message that says what to change."""
    if isinstance(x, torch.Tensor):
        if x.dtype != torch.float32:
            raise TypeError(f"{who}: expected a float32 tensor, got {x.dtype}; cast with .float()")
        if not x.is_contiguous():
            raise ValueError(f"{who}: tensor is not contiguous; call .contiguous() first")
        numel = x.numel()
    elif isinstance(x, np.ndarray):
        if x.dtype != np.float32:
            raise TypeError(f"{who}: expected a float32 array, got {x.dtype}; "
                            "cast with .astype(np.float32)")
        if not x.flags.c_contiguous:
            raise ValueError(f"{who}: array is not C-contiguous; use np.ascontiguousarray")
        numel = x.size
    else:
        raise TypeError(f"{who}: expected a torch.Tensor or numpy.ndarray, got {type(x).__name__}")
    if numel == 0:
        raise ValueError(f"{who}: cannot compress an empty tensor")
    if numel > MAX_NUMEL:
        raise ValueError(f"{who}: {numel} elements exceed the limit of {MAX_NUMEL}; "
                         "split the tensor into partitions")


def check_ratio(who: str, ratio: Any) -> float:
    """Validate a sparsification ratio: a number in (0, 1]."""
    if isinstance(ratio, bool) or not isinstance(ratio, int | float) or not 0 < ratio <= 1:
        raise ValueError(f"{who}: ratio must be a number in (0, 1], got {ratio!r}")
    return float(ratio)


def check_int(who: str, param: str, value: Any, lo: int, hi: int) -> int:
    """Validate an integer parameter in [lo, hi]."""
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or not lo <= value <= hi:
        raise ValueError(f"{who}: {param} must be an integer in [{lo}, {hi}], got {value!r}")
    return int(value)


def key_seed(seed: int, name: str, step: int) -> int:
    """A 63-bit seed from (seed, tensor name, step), equal on every worker and backend."""
    mixed = zlib.crc32(name.encode()) ^ (seed * 0x9E3779B1) ^ (step * 0x85EBCA77)
    return mixed & 0x7FFF_FFFF_FFFF_FFFF


def to_numpy(payload: Payload) -> Payload:
    """A payload's arrays as numpy arrays (host copies of device tensors)."""
    return tuple(a.detach().cpu().numpy() if isinstance(a, torch.Tensor) else a for a in payload)


def to_torch(payload: Payload, device: torch.device | str = "cpu") -> Payload:
    """A payload's arrays as torch tensors on ``device`` (zero-copy for host arrays)."""
    return tuple(
        a.to(device) if isinstance(a, torch.Tensor)
        else torch.from_numpy(np.ascontiguousarray(a)).to(device)
        for a in payload
    )
