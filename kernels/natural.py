"""natural: natural compression, stochastic rounding to powers of two (Horváth et al., 2019).

An entry with ``2**e <= |x| < 2**(e+1)`` becomes ``2**(e+1)`` with probability
``(|x| - 2**e) / 2**e`` and ``2**e`` otherwise, keeping its sign: unbiased. The probability
is exact: it is the float's 23-bit significand compared with 23 random bits.

Wire format (8 bits per entry instead of the paper's 9): the tensor's top exponent ``T``
(one above the exponent of max|x|) is sent once; entry codes are ``sign << 7 | m`` with
``m`` in [1, 127] meaning ``2**(T - 127 + m - 127)`` in float32 biased-exponent terms (the
127 powers of two below and including 2**T) and ``m = 0`` meaning zero. Entries smaller
than the lowest power ``t`` are rounded to ``t`` with probability ``|x| / t`` and to 0
otherwise (still unbiased, up to the 2**-24 resolution of that draw). Tensors whose largest
magnitude is subnormal decode to zeros; a top power above float32 range decodes to +-inf.

Payload: ``(uint8[numel] codes, int32[1] lowest biased exponent L = T - 126)``.
Draws from ``key_seed(seed, name, step)``, identical on both backends.
NaN/Inf input raises :class:`NonFiniteError`.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import numpy as np
import torch
from byteps_espresso.kernels import _bits, _exact
from byteps_espresso.kernels._bits import decode_lut_torch
from byteps_espresso.kernels._random import UNIT24, hash32, hash32_torch, split_seed
from byteps_espresso.kernels.base import (
    Compressor,
    Ctx,
    Payload,
    PayloadError,
    check_int,
    key_seed,
)
from byteps_espresso.kernels.registry import register
from numba import njit, prange

WIRE_ID = 13
# Range of the lowest biased exponent L = (biased exponent of max|x|) + 1 - 126.
L_MIN, L_MAX = -125, 129


def lowest_exponent(amax_bits: int) -> int:
    """L for a largest magnitude given as float32 bits."""
    return ((amax_bits >> 23) & 255) + 1 - 126


@njit(parallel=True, cache=True)
def encode_codes(x, low, s0, s1, out):  # pragma: no cover - compiled
    """Sign-and-power codes of ``x`` for lowest biased exponent ``low``, into ``out``."""
    n = x.size
    u = x.view(np.uint32)
    emin = max(low, 1)
    tiny_scale = 2.0 ** (127 - low)
    for i in prange(n):  # branch-free: both roundings are computed, one is selected
        v = u[i]
        e = np.int64((v >> np.uint32(23)) & np.uint32(255))
        h = hash32(np.uint64(i), s0, s1)
        up = np.int64((h >> np.uint64(9)) < np.uint64(v & np.uint32(0x7FFFFF)))
        p = abs(np.float64(x[i])) * tiny_scale
        tiny = np.int64(np.float64(h >> np.uint64(8)) * UNIT24 < p)
        m = e + up - low + 1 if e >= emin else tiny
        out[i] = np.uint8((np.int64(v >> np.uint32(31)) << 7) | m)


def encode_torch(flat: torch.Tensor, low: int, seed: int) -> torch.Tensor:
    """The torch twin of :func:`encode_codes`."""
    u = flat.view(torch.int32)
    e = ((u >> 23) & 255).long()
    h = hash32_torch(torch.arange(flat.numel(), dtype=torch.int64, device=flat.device), seed)
    up = ((h >> 9) < (u & 0x7FFFFF).long()).long()
    p = flat.abs().double() * 2.0 ** (127 - low)
    tiny = ((h >> 8).double() * UNIT24 < p).long()
    m = torch.where(e >= max(low, 1), e + up - low + 1, tiny)
    return (((u < 0).long() << 7) | m).to(torch.uint8)


def power_table(low: int) -> np.ndarray:
    """float32[256]: the decoded value of every code for lowest biased exponent ``low``."""
    table = np.zeros(256, np.float64)
    for m in range(1, 128):
        table[m] = math.ldexp(1.0, low - 1 + m - 127)
    table[128:] = -table[:128]
    with np.errstate(over="ignore"):
        return table.astype(np.float32)


class _Natural(Compressor):
    name = "natural"
    wire_id = WIRE_ID
    deterministic = False
    unbiased = True
    payload_dtypes: ClassVar = (np.dtype(np.uint8), np.dtype(np.int32))
    defaults: ClassVar[dict[str, Any]] = {"seed": 0}

    def validate_params(self) -> None:
        self.seed = check_int(self.name, "seed", self.params["seed"], 0, 2**63 - 1)

    def compressed_nbytes(self, numel: int, step: int | None = None) -> int:
        return numel + 4

    def payload_lengths(self, numel: int, step: int | None = None) -> tuple[int, ...]:
        return (numel, 1)

    def check_payload_content(self, payload: Payload, ctx: Ctx) -> None:
        low = int(payload[1][0])
        if not L_MIN <= low <= L_MAX:
            raise PayloadError(f"natural: lowest exponent {low} outside [{L_MIN}, {L_MAX}]")

    def _low(self, amax_bits: int, ctx: Ctx) -> int:
        if amax_bits >= 0x7F800000:
            raise self.non_finite(ctx)
        return lowest_exponent(amax_bits)


@register
class NaturalTorch(_Natural):
    backend = "torch"

    def encode(self, flat: torch.Tensor, ctx: Ctx) -> Payload:
        low = self._low(_exact.abs_max_bits_torch(flat), ctx)
        codes = encode_torch(flat, low, key_seed(self.seed, ctx.name, ctx.step))
        return codes, torch.tensor([low], dtype=torch.int32, device=flat.device)

    def decode(self, payload: Payload, ctx: Ctx) -> torch.Tensor:
        table = torch.from_numpy(power_table(int(payload[1][0]))).to(payload[0].device)
        return decode_lut_torch(payload[0], ctx.numel, 8, table)


@register
class NaturalNumba(_Natural):
    backend = "numba"

    def encode(self, flat: np.ndarray, ctx: Ctx) -> Payload:
        low = self._low(int(_exact.abs_max_bits(flat.view(np.uint32))), ctx)
        s0, s1 = split_seed(key_seed(self.seed, ctx.name, ctx.step))
        codes = np.empty(flat.size, np.uint8)
        encode_codes(flat, low, np.uint64(s0), np.uint64(s1), codes)
        return codes, np.array([low], np.int32)

    def decode(self, payload: Payload, ctx: Ctx) -> np.ndarray:
        return _bits.decode(payload[0], ctx.numel, 8, power_table(int(payload[1][0])))
