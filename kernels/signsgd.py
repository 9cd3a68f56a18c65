"""signsgd: one sign bit per entry (Bernstein et al., ICML 2018); decodes to +-1.

Payload: ``(uint8[ceil(numel / 8)],)``, bit set = IEEE sign bit set (negative, including
-0.0), little-endian bit order (``_bits``). Deterministic and identical on both backends.
The aggregate of several payloads is the sum of +-1 votes (a majority vote is its sign).
NaN/Inf input raises :class:`NonFiniteError` (their sign carries no information).
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np
import torch
from byteps_espresso.kernels._bits import pack_signs_torch, signs
from byteps_espresso.kernels._signs import SignCodec, SignCodecNumba, SignCodecTorch
from byteps_espresso.kernels.base import Ctx, Payload
from byteps_espresso.kernels.registry import register

WIRE_ID = 8
_UNIT = np.array([1.0, -1.0], np.float32)


def signs_torch(flat: torch.Tensor, codec: SignCodec, ctx: Ctx) -> torch.Tensor:
    """Packed sign bits of finite input (raises the codec's NonFiniteError otherwise)."""
    if not bool(torch.isfinite(flat).all()):
        raise codec.non_finite(ctx)
    return pack_signs_torch(flat)


def signs_numba(flat: np.ndarray, codec: SignCodec, ctx: Ctx) -> np.ndarray:
    """Packed sign bits of finite input (raises the codec's NonFiniteError otherwise)."""
    packed, bad = signs(flat.view(np.uint32))
    if bad:
        raise codec.non_finite(ctx)
    return packed


class _SignSgd(SignCodec):
    name = "signsgd"
    wire_id = WIRE_ID
    payload_dtypes: ClassVar = (np.dtype(np.uint8),)


@register
class SignSgdTorch(_SignSgd, SignCodecTorch):
    def encode(self, flat: torch.Tensor, ctx: Ctx) -> Payload:
        return (signs_torch(flat, self, ctx),)

    def table(self, payload: Payload) -> torch.Tensor:
        return torch.from_numpy(_UNIT).to(payload[0].device)


@register
class SignSgdNumba(_SignSgd, SignCodecNumba):
    def encode(self, flat: np.ndarray, ctx: Ctx) -> Payload:
        return (signs_numba(flat, self, ctx),)

    def table(self, payload: Payload) -> np.ndarray:
        return _UNIT
