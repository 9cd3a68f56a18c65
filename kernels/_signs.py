"""Shared parts of the sign codecs (signsgd, signum, efsignsgd, onebit).

Payload: ``(uint8[ceil(numel / 8)] packed sign bits, float32[n_scales] scales...)``; the
decoder maps bit 0 / bit 1 through a two-entry table built from the scales
(:meth:`SignCodec.table`), so every sign codec shares one decode kernel per backend.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np
import torch
from byteps_espresso.kernels import _bits, _exact
from byteps_espresso.kernels._bits import decode_lut_torch, packed_len
from byteps_espresso.kernels.base import Compressor, Ctx, Payload, PayloadError

__all__ = [
    "ScaledSignCodec",
    "SignCodec",
    "SignCodecNumba",
    "SignCodecTorch",
    "SignSums",
    "sign_sums_numba",
    "sign_sums_torch",
]

# Per-block (largest exponent, sum of non-negative magnitudes, sum of negative magnitudes)
# as int64 arrays, and the count of negative entries (see _exact.sign_block_sums).
SignSums = tuple[np.ndarray, np.ndarray, np.ndarray, int]


class SignCodec(Compressor):
    """Packed sign bits plus ``n_scales`` float32 scales."""

    n_scales: ClassVar[int] = 0

    def compressed_nbytes(self, numel: int, step: int | None = None) -> int:
        return packed_len(numel, 1) + 4 * self.n_scales

    def payload_lengths(self, numel: int, step: int | None = None) -> tuple[int, ...]:
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

    # A sum of decoded payloads (the servers', an AllgatherC's Decomp) and error feedback's
    # residual add the packed bits through the tables into one array instead of decoding
    # each payload into its own (BENCHMARKS.md, "Signs summed and subtracted in place").
    def aggregate(self, payloads: Sequence[Payload], ctx: Ctx) -> np.ndarray:
        if not payloads:
            raise PayloadError(f"{self.name}: aggregate needs at least one payload")
        for payload in payloads:
            self.check_payload(payload, ctx)
        out = np.empty(ctx.numel, np.float32)
        with self._threads(ctx.numel):
            # in list order, as the dense sum: ((d0 + d1) + d2) + ..., bit for bit
            _bits.decode_lut(payloads[0][0], 1, self.table(payloads[0]), out)
            for payload in payloads[1:]:
                _bits.add_lut_bits(payload[0], self.table(payload), out)
        return out.reshape(ctx.shape)

    def subtract_decoded(self, payload: Payload, ctx: Ctx, out: np.ndarray) -> None:
        if not out.flags.c_contiguous:  # a flat view must be the array itself
            super().subtract_decoded(payload, ctx, out)
            return
        self.check_payload(payload, ctx)
        with self._threads(ctx.numel):
            _bits.add_lut_bits(payload[0], -self.table(payload), out.reshape(-1))


class ScaledSignCodec(SignCodec):
    """A sign codec whose scales are formed from the exact per-sign sums of |x|."""

    def scales(self, sums: SignSums, numel: int) -> np.ndarray:
        """float32[n_scales] from checked sums (subclasses)."""
        raise NotImplementedError

    def checked_scales(self, sums: SignSums, numel: int, ctx: Ctx) -> np.ndarray:
        """:meth:`scales`, refusing NaN/Inf input."""
        if _exact.blocks_non_finite(sums[0]):
            raise self.non_finite(ctx)
        return self.scales(sums, numel)


def sign_sums_numba(flat: np.ndarray) -> tuple[np.ndarray, SignSums]:
    """Packed sign bits and the per-sign block sums of |x| in one pass (numba)."""
    u = flat.view(np.uint32)
    nblocks = -(-u.size // _exact.BLOCK)
    nbytes = packed_len(u.size, 1)
    tmp = np.empty(nbytes * 8, np.uint8)
    tmp[u.size:] = 0  # padding bits of the last byte
    emax, pos, neg, negs = (np.empty(nblocks, np.int64) for _ in range(4))
    _exact.sign_block_sums(u, tmp, emax, pos, neg, negs)
    packed = np.empty(nbytes, np.uint8)
    _bits.gather_bits(tmp.view(np.uint64), packed)
    return packed, (emax, pos, neg, int(negs.sum()))


def sign_sums_torch(flat: torch.Tensor) -> SignSums:
    """The per-sign block sums of |x| with torch ops, as host arrays."""
    emax, pos, neg, negs = _exact.sign_block_sums_torch(flat)
    return emax.cpu().numpy(), pos.cpu().numpy(), neg.cpu().numpy(), int(negs)
