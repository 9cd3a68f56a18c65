"""fp16: cast to IEEE half precision (round to nearest even); the sum is taken in float32.

Payload: ``(float16[numel],)``. Deterministic; both backends give identical bits, because
numpy's and torch's float32->float16 casts both round to nearest even. Values beyond the
float16 range become +-inf (documented in CONTRACT.md).
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np
import torch
from byteps_espresso.kernels.base import Compressor, Ctx, Payload, check_input
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

    def compress(self, x: torch.Tensor, *, name: str = "", step: int = 0) -> tuple[Payload, Ctx]:
        check_input(x, "fp16")
        return (x.reshape(-1).to(torch.float16),), Ctx(tuple(x.shape), "float32", name, step)

    def decompress(self, payload: Payload, ctx: Ctx) -> torch.Tensor:
        self.check_payload(payload, ctx)
        return payload[0].to(torch.float32).reshape(ctx.shape)


@register
class Fp16Numba(_Fp16):
    backend = "numba"

    def compress(self, x: np.ndarray, *, name: str = "", step: int = 0) -> tuple[Payload, Ctx]:
        check_input(x, "fp16")
        return (x.reshape(-1).astype(np.float16),), Ctx(tuple(x.shape), "float32", name, step)

    def decompress(self, payload: Payload, ctx: Ctx) -> Any:
        self.check_payload(payload, ctx)
        return payload[0].astype(np.float32).reshape(ctx.shape)
