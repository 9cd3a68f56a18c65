"""fp16: cast to IEEE half precision (round to nearest even); the sum is taken in float32.

Payload: ``(float16[numel],)``. Deterministic; both backends give identical bits: the numba
kernel reproduces torch's float32->float16 conversion (round to nearest even, subnormals
rounded exactly, every NaN becomes the quiet NaN 0x7E00 with its sign), which also equals
numpy's cast for every non-NaN input. NaN/Inf pass through; values beyond the float16 range
(|x| >= 65520) become +-inf (documented in CONTRACT.md).
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np
import torch
from byteps_espresso.kernels.base import Capabilities, Compressor, Ctx, Payload
from byteps_espresso.kernels.registry import register
from numba import njit, prange

WIRE_ID = 1
# Every float16 bit pattern decoded to float32 (exact), for the numba decoder.
_TO_FLOAT32 = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16) \
    .astype(np.float32)


@njit(parallel=True, cache=True)
def to_half_bits(x, out):  # pragma: no cover - compiled
    """float32 -> float16 bit patterns (uint16), round to nearest even, branch-free select.

    Normal results add the rounding bias 0xFFF plus the lowest kept bit before dropping 13
    significand bits while rebasing the exponent from 127 to 15; subnormal results are
    ``rint(|x| * 2**24)`` (exact product, round half even); >= 2**16 gives Inf (NaN: 0x7E00).
    """
    u = x.view(np.uint32)
    for i in prange(x.size):
        v = np.int64(u[i])
        a = v & 0x7FFFFFFF
        sign = (v >> 16) & 0x8000
        normal = (a - 0x38000000 + 0xFFF + ((a >> 13) & 1)) >> 13
        sub = np.int64(np.rint(min(abs(x[i]), np.float32(1.0)) * np.float32(16777216.0)))
        big = 0x7E00 if a > 0x7F800000 else 0x7C00
        half = big if a >= 0x47800000 else (sub if a < 0x38800000 else normal)
        out[i] = np.uint16(half | sign)


@njit(parallel=True, cache=True)
def gather(table, codes, out):  # pragma: no cover - compiled
    """out[i] = table[codes[i]]."""
    for i in prange(codes.size):
        out[i] = table[codes[i]]


class _Fp16(Compressor):
    name = "fp16"
    wire_id = WIRE_ID
    payload_dtypes: ClassVar = (np.dtype(np.float16),)
    # Payloads sum in half precision, each addition rounded (an AllreduceC of the casts, as
    # DDP's fp16_compress_hook all-reduces them): the sum of casts decodes to the sum of the
    # inputs up to that rounding.
    capabilities: ClassVar = Capabilities(linear=True)

    def compressed_nbytes(self, numel: int, step: int | None = None) -> int:
        return 2 * numel


class HalfCastTorch(Compressor):
    """The decode of the torch half-precision codecs (fp16, bf16): a widening cast of the
    payload's values, into a new tensor or straight into a receiver's buffer."""

    def half(self, payload: Payload) -> torch.Tensor:
        """The payload's values as a half-precision tensor."""
        raise NotImplementedError

    def decode(self, payload: Payload, ctx: Ctx) -> torch.Tensor:
        return self.half(payload).to(torch.float32)

    def decompress_into(self, payload: Payload, ctx: Ctx, out: torch.Tensor) -> None:
        self.check_payload(payload, ctx)
        out.copy_(self.half(payload))  # the cast of decode, into place


@register
class Fp16Torch(_Fp16, HalfCastTorch):
    backend = "torch"

    def encode(self, flat: torch.Tensor, ctx: Ctx) -> Payload:
        return (flat.to(torch.float16),)

    def half(self, payload: Payload) -> torch.Tensor:
        return payload[0]


@register
class Fp16Numba(_Fp16):
    backend = "numba"

    def encode(self, flat: np.ndarray, ctx: Ctx) -> Payload:
        out = np.empty(flat.size, np.uint16)
        to_half_bits(flat, out)
        return (out.view(np.float16),)

    def decode(self, payload: Payload, ctx: Ctx) -> np.ndarray:
        out = np.empty(ctx.numel, np.float32)
        gather(_TO_FLOAT32, payload[0].view(np.uint16), out)
        return out
