"""qsgd: stochastic uniform quantization to ``levels`` levels (Alistarh et al., NeurIPS 2017).

Each entry becomes ``sign(x) * l * norm / levels`` with ``l`` in ``[0, levels]`` drawn so
that ``E[l] = |x| / norm * levels`` (stochastic rounding): the codec is unbiased. ``norm`` is
the L2 norm, computed exactly and order-independently (``_exact``). Codes ``levels + sign*l``
in ``[0, 2*levels]`` are bit-packed at 2 bits (levels = 1), 4 bits (levels <= 7) or 8 bits
(levels <= 127) per entry. Payload: ``(uint8[packed], float32[1] norm)``.

Random draws come from ``key_seed(seed, name, step)`` through the counter hash of
``_random``, identical on both backends, so both produce identical payloads. NaN/Inf input
raises :class:`NonFiniteError` (the norm would be poisoned).
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np
import torch
from byteps_espresso.kernels import _bits, _exact
from byteps_espresso.kernels._bits import (
    constant_codes,
    decode_lut_torch,
    pack_codes_torch,
    packed_len,
)
from byteps_espresso.kernels._random import split_seed, uniform, uniform_torch
from byteps_espresso.kernels.base import Compressor, Ctx, Payload, check_int, key_seed
from byteps_espresso.kernels.registry import register
from numba import njit, prange

WIRE_ID = 11
MAX_LEVELS = 127


def code_bits(levels: int) -> int:
    """Bits per packed code for codes in [0, 2 * levels]."""
    return 2 if levels == 1 else 4 if levels <= 7 else 8


@njit(parallel=True, cache=True)
def level_codes(x, norm, levels, s0, s1, out):  # noqa: PLR0917  # pragma: no cover
    """Stochastically rounded codes ``levels + sign * level`` of ``x`` (norm > 0) into uint8.

    Branch-free per entry so the loop vectorizes: r = |x| / norm * levels, level =
    floor(r) + (u < r - floor(r)) clipped to ``levels``, u the entry's counter-hash uniform.
    """
    u = x.view(np.uint32)
    sf = np.float32(levels)
    for i in prange(x.size):
        r = (abs(x[i]) / norm) * sf
        fl = np.floor(r)
        up = np.int64(uniform(np.uint64(i), s0, s1) < r - fl)
        level = min(np.int64(fl) + up, levels)
        neg = np.int64(u[i] >> np.uint32(31))
        out[i] = np.uint8(levels + level - 2 * neg * level)


def quantize_torch(flat: torch.Tensor, norm: np.float32, levels: int, bits: int,
                   seed: int) -> torch.Tensor:
    """The torch twin of :func:`level_codes` followed by packing."""
    norm_t = torch.tensor(norm, device=flat.device)
    r = (flat.abs() / norm_t) * torch.tensor(np.float32(levels), device=flat.device)
    fl = torch.floor(r)
    up = uniform_torch(flat.numel(), seed, flat.device) < (r - fl)
    level = (fl.to(torch.int64) + up).clamp_(max=levels)
    codes = torch.where(flat.view(torch.int32) < 0, levels - level, levels + level)
    return pack_codes_torch(codes, bits)


def level_table(norm: float, levels: int, bits: int) -> np.ndarray:
    """float32[2**bits]: the decoded value of every code (unused codes decode to 0)."""
    unit = np.float32(norm) / np.float32(levels)
    table = np.zeros(1 << bits, np.float32)
    codes = np.arange(2 * levels + 1)
    table[codes] = (codes - levels).astype(np.float32) * unit
    return table


class _Qsgd(Compressor):
    name = "qsgd"
    wire_id = WIRE_ID
    scale_signs = (1,)
    deterministic = False
    unbiased = True
    payload_dtypes: ClassVar = (np.dtype(np.uint8), np.dtype(np.float32))
    defaults: ClassVar[dict[str, Any]] = {"levels": MAX_LEVELS, "seed": 0}
    # Which norm scales the levels: "l2" (QSGD) or "max" (TernGrad).
    norm_kind: ClassVar[str] = "l2"

    def validate_params(self) -> None:
        self.levels = check_int(self.name, "levels", self.params.get("levels", 1), 1, MAX_LEVELS)
        self.seed = check_int(self.name, "seed", self.params["seed"], 0, 2**63 - 1)
        self.bits = code_bits(self.levels)

    def compressed_nbytes(self, numel: int, step: int | None = None) -> int:
        return packed_len(numel, self.bits) + 4

    def payload_lengths(self, numel: int, step: int | None = None) -> tuple[int, ...]:
        return (packed_len(numel, self.bits), 1)

    def _norm_value(self, reduced: Any, ctx: Ctx) -> np.float32:
        if self.norm_kind == "max":
            if reduced >= 0x7F800000:
                raise self.non_finite(ctx)
            return _exact.bits_to_float(reduced)
        if _exact.square_non_finite(reduced):
            raise self.non_finite(ctx)
        return np.float32(_exact.sqrt_sum(reduced))

    def table(self, norm: float) -> np.ndarray:
        return level_table(norm, self.levels, self.bits)


@register
class QsgdTorch(_Qsgd):
    backend = "torch"

    def encode(self, flat: torch.Tensor, ctx: Ctx) -> Payload:
        if self.norm_kind == "max":
            reduced: Any = _exact.abs_max_bits_torch(flat)
        else:
            reduced = _exact.square_bins_torch(flat)
        norm = self._norm_value(reduced, ctx)
        norm_t = torch.tensor([norm], dtype=torch.float32, device=flat.device)
        if norm == 0:
            zero = constant_codes(flat.numel(), self.bits, self.levels)
            return torch.from_numpy(zero).to(flat.device), norm_t
        seed = key_seed(self.seed, ctx.name, ctx.step)
        return quantize_torch(flat, norm, self.levels, self.bits, seed), norm_t

    def decode(self, payload: Payload, ctx: Ctx) -> torch.Tensor:
        table = torch.from_numpy(self.table(float(payload[1][0]))).to(payload[0].device)
        return decode_lut_torch(payload[0], ctx.numel, self.bits, table)


@register
class QsgdNumba(_Qsgd):
    backend = "numba"

    def encode(self, flat: np.ndarray, ctx: Ctx) -> Payload:
        u = flat.view(np.uint32)
        nc = _exact.nchunks(flat.size)
        if self.norm_kind == "max":
            reduced: Any = int(_exact.abs_max_bits(u))
        else:
            reduced = _exact.square_bins(u, nc)
        norm = self._norm_value(reduced, ctx)
        norm_a = np.array([norm], np.float32)
        if norm == 0:
            return constant_codes(flat.size, self.bits, self.levels), norm_a
        s0, s1 = split_seed(key_seed(self.seed, ctx.name, ctx.step))
        codes = np.empty(flat.size, np.uint8)
        level_codes(flat, norm, self.levels, np.uint64(s0), np.uint64(s1), codes)
        if self.bits == 8:
            return codes, norm_a
        packed = np.empty(packed_len(flat.size, self.bits), np.uint8)
        _bits.pack_codes(codes, self.bits, packed)
        return packed, norm_a

    def decode(self, payload: Payload, ctx: Ctx) -> np.ndarray:
        return _bits.decode(payload[0], ctx.numel, self.bits, self.table(float(payload[1][0])))
