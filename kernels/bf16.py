"""bf16: keep the upper 16 bits of each float32, rounded to nearest even.

Payload: ``(uint16[numel],)`` holding bfloat16 bit patterns (numpy has no bfloat16 dtype).
Deterministic; the numba kernel reproduces torch's float32->bfloat16 conversion bit for bit
(round to nearest even, every NaN becomes the quiet NaN 0x7FC0). NaN/Inf pass through; values
that round beyond the bfloat16 range become +-inf.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np
import torch
from byteps_espresso.kernels.base import Compressor, Ctx, Payload
from byteps_espresso.kernels.fp16 import HalfCastTorch
from byteps_espresso.kernels.registry import register
from numba import njit, prange

WIRE_ID = 2
_QUIET_NAN = np.uint16(0x7FC0)


@njit(parallel=True, cache=True)
def to_bf16(u, out):  # pragma: no cover - compiled
    """uint32 view of float32 -> uint16 bfloat16 bits (round to nearest even) into ``out``."""
    for i in prange(u.size):
        v = u[i]
        rounded = np.uint16((v + np.uint32(0x7FFF) + ((v >> np.uint32(16)) & np.uint32(1)))
                            >> np.uint32(16))
        nan = (v & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
        out[i] = _QUIET_NAN if nan else rounded


@njit(parallel=True, cache=True)
def from_bf16(b, out):  # pragma: no cover - compiled
    """uint16 bfloat16 bits -> float32 bit patterns (uint32, exact) into ``out``."""
    for i in prange(b.size):
        out[i] = np.uint32(b[i]) << np.uint32(16)


class _Bf16(Compressor):
    name = "bf16"
    wire_id = WIRE_ID
    payload_dtypes: ClassVar = (np.dtype(np.uint16),)

    def compressed_nbytes(self, numel: int, step: int | None = None) -> int:
        return 2 * numel


@register
class Bf16Torch(_Bf16, HalfCastTorch):
    backend = "torch"

    def encode(self, flat: torch.Tensor, ctx: Ctx) -> Payload:
        return (flat.to(torch.bfloat16).view(torch.uint16),)

    def half(self, payload: Payload) -> torch.Tensor:
        return payload[0].view(torch.bfloat16)


@register
class Bf16Numba(_Bf16):
    backend = "numba"

    def encode(self, flat: np.ndarray, ctx: Ctx) -> Payload:
        out = np.empty(flat.size, np.uint16)
        to_bf16(flat.view(np.uint32), out)
        return (out,)

    def decode(self, payload: Payload, ctx: Ctx) -> np.ndarray:
        out = np.empty(ctx.numel, np.uint32)
        from_bf16(payload[0], out)
        return out.view(np.float32)
