"""fp16: cast to IEEE half precision (round to nearest even); the sum is taken in float32.

Payload: ``(float16[numel],)``. Deterministic; both backends give identical bits, because
numpy's and torch's float32->float16 casts both round to nearest even. NaN/Inf pass through;
values beyond the float16 range (65504) become +-inf (documented in CONTRACT.md).
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np
import torch
from byteps_espresso.kernels.base import Compressor, Ctx, Payload
from byteps_espresso.kernels.registry import register

WIRE_ID = 1


class _Fp16(Compressor):
    name = "fp16"
    wire_id = WIRE_ID
    payload_dtypes: ClassVar = (np.dtype(np.float16),)

    def compressed_nbytes(self, numel: int) -> int:
        return 2 * numel


@register
class Fp16Torch(_Fp16):
    backend = "torch"

    def encode(self, flat: torch.Tensor, ctx: Ctx) -> Payload:
        return (flat.to(torch.float16),)

    def decode(self, payload: Payload, ctx: Ctx) -> torch.Tensor:
        return payload[0].to(torch.float32)


@register
class Fp16Numba(_Fp16):
    backend = "numba"

    def encode(self, flat: np.ndarray, ctx: Ctx) -> Payload:
        with np.errstate(over="ignore"):  # out-of-range values become +-inf, as in torch
            return (flat.astype(np.float16),)

    def decode(self, payload: Payload, ctx: Ctx) -> np.ndarray:
        return payload[0].astype(np.float32)
