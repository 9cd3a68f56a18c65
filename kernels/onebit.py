"""onebit: 1-bit quantization with two reconstruction values (Seide et al., Interspeech 2014).

Each entry keeps its sign bit; the decoder returns the mean of the non-negative entries for
bit 0 and the mean of the negative entries for bit 1, which preserves the sum of each group.
Payload: ``(uint8[ceil(numel / 8)] sign bits, float32[2] (mean of x >= 0, mean of x < 0))``
(a missing group has mean 0). Both means come from exact, order-independent sums, so both
backends produce identical payloads. Use with ErrorFeedback, as 1-bit SGD does.
NaN/Inf input raises :class:`NonFiniteError`.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np
import torch
from byteps_espresso.kernels import _exact
from byteps_espresso.kernels._bits import packed_len
from byteps_espresso.kernels._signs import SignCodec, SignCodecNumba, SignCodecTorch
from byteps_espresso.kernels.base import Ctx, Payload
from byteps_espresso.kernels.registry import register
from byteps_espresso.kernels.signsgd import signs_torch

WIRE_ID = 10


class _OneBit(SignCodec):
    name = "onebit"
    wire_id = WIRE_ID
    scale_signs = (1, -1)
    n_scales = 2
    payload_dtypes: ClassVar = (np.dtype(np.uint8), np.dtype(np.float32))

    def means(self, bins: list[list[int]] | np.ndarray, negatives: int, numel: int,
              ctx: Ctx) -> np.ndarray:
        """float32[2] (mean of the non-negative group, mean of the negative group)."""
        if _exact.abs_non_finite(bins[0]) or _exact.abs_non_finite(bins[1]):
            raise self.non_finite(ctx)
        return np.array([_exact.abs_mean(bins[0], numel - negatives),
                         -_exact.abs_mean(bins[1], negatives)], np.float32)


@register
class OneBitTorch(_OneBit, SignCodecTorch):
    def encode(self, flat: torch.Tensor, ctx: Ctx) -> Payload:
        bins, negatives = _exact.signed_abs_bins_torch(flat)
        means = self.means(bins, negatives, flat.numel(), ctx)
        return signs_torch(flat, self, ctx), torch.from_numpy(means).to(flat.device)

    def table(self, payload: Payload) -> torch.Tensor:
        return payload[1]


@register
class OneBitNumba(_OneBit, SignCodecNumba):
    def encode(self, flat: np.ndarray, ctx: Ctx) -> Payload:
        packed = np.empty(packed_len(flat.size, 1), np.uint8)
        bins, negatives = _exact.signs_and_bins(flat.view(np.uint32), packed,
                                                _exact.nchunks(flat.size))
        return packed, self.means(bins, int(negatives), flat.size, ctx)

    def table(self, payload: Payload) -> np.ndarray:
        return payload[1]
