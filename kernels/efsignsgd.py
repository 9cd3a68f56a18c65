"""efsignsgd: scaled sign (Karimireddy et al., ICML 2019): ``sign(x) * mean(|x|)``.

Payload: ``(uint8[ceil(numel / 8)] sign bits, float32[1] scale)`` with ``scale =
||x||_1 / numel``. The scale comes from an exact, order-independent sum (``_exact``), so both
backends produce identical payloads. Meant to be wrapped in
:class:`~byteps_espresso.kernels.error_feedback.ErrorFeedback` (the "EF" of EF-SignSGD).
NaN/Inf input raises :class:`NonFiniteError` (the scale would be poisoned).
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

WIRE_ID = 7


class _EfSignSgd(ScaledSignCodec):
    name = "efsignsgd"
    wire_id = WIRE_ID
    scale_signs = (1,)
    n_scales = 1
    payload_dtypes: ClassVar = (np.dtype(np.uint8), np.dtype(np.float32))

    def scales(self, sums: SignSums, numel: int) -> np.ndarray:
        emax, pos, neg, _ = sums
        total = _exact.block_total(emax, pos) + _exact.block_total(emax, neg)
        return np.array([_exact.block_mean(total, numel)], np.float32)


@register
class EfSignSgdTorch(_EfSignSgd, SignCodecTorch):
    def encode(self, flat: torch.Tensor, ctx: Ctx) -> Payload:
        packed = signs_torch(flat, self, ctx)
        scale = self.checked_scales(sign_sums_torch(flat), flat.numel(), ctx)
        return packed, torch.from_numpy(scale).to(flat.device)

    def table(self, payload: Payload) -> torch.Tensor:
        return torch.cat((payload[1], -payload[1]))


@register
class EfSignSgdNumba(_EfSignSgd, SignCodecNumba):
    def encode(self, flat: np.ndarray, ctx: Ctx) -> Payload:
        packed, sums = sign_sums_numba(flat)
        return packed, self.checked_scales(sums, flat.size, ctx)

    def table(self, payload: Payload) -> np.ndarray:
        return np.array([payload[1][0], -payload[1][0]], np.float32)
