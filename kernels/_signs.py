"""Shared parts of the sign codecs (signsgd, signum, efsignsgd, onebit).

Payload: ``(uint8[ceil(numel / 8)] packed sign bits, float32[n_scales] scales...)``; the
decoder maps bit 0 / bit 1 through a two-entry table built from the scales
(:meth:`SignCodec.table`), so every sign codec shares one decode kernel per backend.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np
import torch
from byteps_espresso.kernels import _bits
from byteps_espresso.kernels._bits import decode_lut_torch, packed_len
from byteps_espresso.kernels.base import Compressor, Ctx, Payload

__all__ = ["SignCodec", "SignCodecNumba", "SignCodecTorch"]


class SignCodec(Compressor):
    """Packed sign bits plus ``n_scales`` float32 scales."""

    n_scales: ClassVar[int] = 0

    def compressed_nbytes(self, numel: int) -> int:
        return packed_len(numel, 1) + 4 * self.n_scales

    def payload_lengths(self, numel: int) -> tuple[int, ...]:
        return (packed_len(numel, 1),) + ((self.n_scales,) if self.n_scales else ())

    def table(self, payload: Payload) -> Any:
        """float32[2]: the decoded value of bit 0 (non-negative) and bit 1 (negative)."""
        raise NotImplementedError


class SignCodecTorch(SignCodec):
    backend = "torch"

    def decode(self, payload: Payload, ctx: Ctx) -> torch.Tensor:
        return decode_lut_torch(payload[0], ctx.numel, 1, self.table(payload))


class SignCodecNumba(SignCodec):
    backend = "numba"

    def decode(self, payload: Payload, ctx: Ctx) -> np.ndarray:
        return _bits.decode(payload[0], ctx.numel, 1, self.table(payload))
