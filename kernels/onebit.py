"""onebit: 1-bit quantization with two reconstruction values (Seide et al., Interspeech 2014).

Each entry keeps its sign bit; the decoder returns the mean of the non-negative entries for
bit 0 and the mean of the negative entries for bit 1, which preserves the sum of each group.
Payload: ``(uint8[ceil(numel / 8)] sign bits, float32[2] (mean of x >= 0, mean of x < 0))``
(a missing group has mean 0). Both means come from order-independent integer sums, so both
backends produce identical payloads. Use with ErrorFeedback, as 1-bit SGD does.
NaN/Inf input raises :class:`NonFiniteError`.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np
import torch
from byteps_espresso.kernels import _exact
from byteps_espresso.kernels._signs import (
    ScaledSignCodec,
    SignCodecNumba,
    SignCodecTorch,
    SignSums,
    sign_sums_numba,
    sign_sums_torch,
)
from byteps_espresso.kernels.base import Ctx, Payload
from byteps_espresso.kernels.registry import register
from byteps_espresso.kernels.signsgd import signs_torch

WIRE_ID = 10


class _OneBit(ScaledSignCodec):
    name = "onebit"
    wire_id = WIRE_ID
    scale_signs = (1, -1)
    n_scales = 2
    payload_dtypes: ClassVar = (np.dtype(np.uint8), np.dtype(np.float32))

    def scales(self, sums: SignSums, numel: int) -> np.ndarray:
        """float32[2] (mean of the non-negative group, mean of the negative group)."""
        emax, pos, neg, negatives = sums
        return np.array([_exact.block_mean(_exact.block_total(emax, pos), numel - negatives),
                         -_exact.block_mean(_exact.block_total(emax, neg), negatives)],
                        np.float32)


@register
class OneBitTorch(_OneBit, SignCodecTorch):
    def encode(self, flat: torch.Tensor, ctx: Ctx) -> Payload:
        packed = signs_torch(flat, self, ctx)
        means = self.checked_scales(sign_sums_torch(flat), flat.numel(), ctx)
        return packed, torch.from_numpy(means).to(flat.device)

    def table(self, payload: Payload) -> torch.Tensor:
        return payload[1]


@register
class OneBitNumba(_OneBit, SignCodecNumba):
    def encode(self, flat: np.ndarray, ctx: Ctx) -> Payload:
        packed, sums = sign_sums_numba(flat)
        return packed, self.checked_scales(sums, flat.size, ctx)

    def table(self, payload: Payload) -> np.ndarray:
        return payload[1]
