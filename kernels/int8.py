"""int8: symmetric linear quantization with one float32 scale per tensor.

``scale = max|x| / 127`` and ``q = clip(round_half_even(x / scale), -127, 127)``; the decoder
returns ``q * scale``. Payload: ``(int8[numel], float32[1] scale)``. Deterministic and
bit-identical on both backends: the maximum is an exact integer reduction over the float bits,
the scale is computed on the host once, and both backends perform the same IEEE division and
round-half-even. NaN/Inf input raises :class:`NonFiniteError` (the scale would be poisoned).
A tensor whose largest magnitude is below 127 * 2**-150 (all tiny subnormals) encodes as zeros.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np
import torch
from byteps_espresso.kernels import _exact
from byteps_espresso.kernels.base import Compressor, Ctx, Payload
from byteps_espresso.kernels.registry import register
from numba import njit, prange

WIRE_ID = 3
LEVELS = 127  # codes in [-127, 127]; -128 is never produced


@njit(parallel=True, cache=True)
def quantize(x, scale, out):  # pragma: no cover - compiled
    """x / scale, rounded half to even and clipped to [-127, 127], into int8 ``out``."""
    for i in prange(x.size):
        q = np.rint(x[i] / scale)
        out[i] = np.int8(min(max(q, np.float32(-LEVELS)), np.float32(LEVELS)))


@njit(parallel=True, cache=True)
def dequantize(q, scale, out):  # pragma: no cover - compiled
    """q * scale into float32 ``out``."""
    for i in prange(q.size):
        out[i] = np.float32(q[i]) * scale


def scale_of(amax_bits: int) -> np.float32:
    """The quantization step for a largest magnitude given as float32 bits."""
    return _exact.bits_to_float(amax_bits) / np.float32(LEVELS)


class _Int8(Compressor):
    name = "int8"
    wire_id = WIRE_ID
    scale_signs = (1,)
    payload_dtypes: ClassVar = (np.dtype(np.int8), np.dtype(np.float32))

    def compressed_nbytes(self, numel: int, step: int | None = None) -> int:
        return numel + 4

    def payload_lengths(self, numel: int, step: int | None = None) -> tuple[int, ...]:
        return (numel, 1)

    def _scale(self, amax_bits: int, ctx: Ctx) -> np.float32:
        if amax_bits >= 0x7F800000:
            raise self.non_finite(ctx)
        return scale_of(amax_bits)


@register
class Int8Torch(_Int8):
    backend = "torch"

    def encode(self, flat: torch.Tensor, ctx: Ctx) -> Payload:
        scale = self._scale(_exact.abs_max_bits_torch(flat), ctx)
        scale_t = torch.tensor([scale], dtype=torch.float32, device=flat.device)
        if scale == 0:
            return torch.zeros(flat.numel(), dtype=torch.int8, device=flat.device), scale_t
        q = torch.round(flat / scale_t).clamp_(-LEVELS, LEVELS).to(torch.int8)
        return q, scale_t

    def decode(self, payload: Payload, ctx: Ctx) -> torch.Tensor:
        return payload[0].to(torch.float32) * payload[1]


@register
class Int8Numba(_Int8):
    backend = "numba"

    def encode(self, flat: np.ndarray, ctx: Ctx) -> Payload:
        u = flat.view(np.uint32)
        scale = self._scale(int(_exact.abs_max_bits(u)), ctx)
        scale_a = np.array([scale], np.float32)
        if scale == 0:
            return np.zeros(flat.size, np.int8), scale_a
        out = np.empty(flat.size, np.int8)
        quantize(flat, scale, out)
        return out, scale_a

    def decode(self, payload: Payload, ctx: Ctx) -> np.ndarray:
        out = np.empty(ctx.numel, np.float32)
        dequantize(payload[0], payload[1][0], out)
        return out
