"""Seeded draws that both backends reproduce bit for bit.

A counter-based hash PRNG: draw ``i`` of key ``seed`` is ``hash32(i, seed)``, a 32-bit value
from two rounds of Chris Wellons' ``lowbias32`` integer hash (constants 0x21f0aaad and
0xd35a2d97, https://nullprogram.com/blog/2018/07/31/) keyed by the two halves of the 63-bit
seed from :func:`byteps_espresso.kernels.base.key_seed`. The numba version works on uint64
scalars; the torch version on int64 tensors with the 32x32-bit multiply split into 16-bit
halves so that no intermediate exceeds 2**48 (no reliance on signed overflow). Both give the
same bits, so stochastic codecs produce identical payloads on both backends.

``sample_indices`` draws ``k`` distinct indices of ``range(n)`` with Robert Floyd's algorithm
(Bentley, "Programming Pearls", column 11) over a bitmap and returns them sorted. It runs on
the host for both backends (the torch backend moves the O(k) result to the tensor's device).
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit, prange

__all__ = ["hash32_torch", "sample_indices", "split_seed", "uniform_torch"]

_M32 = 0xFFFFFFFF
_C1 = 0x21F0AAAD
_C2 = 0xD35A2D97
# Scale of a 24-bit integer to a float32 uniform in [0, 1).
UNIT24 = 2.0**-24

_U_MASK = np.uint64(_M32)
_U_C1 = np.uint64(_C1)
_U_C2 = np.uint64(_C2)
_U_15 = np.uint64(15)
_U_16 = np.uint64(16)
_U_8 = np.uint64(8)
_U_32 = np.uint64(32)
_U_ONE = np.uint64(1)
_U_58 = np.uint64(58)
_U_63 = np.uint64(63)
_U_6 = np.uint64(6)

# De Bruijn sequence for the index of the lowest set bit of a 64-bit word.
_DEBRUIJN = 0x03F79D71B4CB0A89
_U_DEBRUIJN = np.uint64(_DEBRUIJN)
_DB_TABLE = np.zeros(64, np.int64)
for _b in range(64):
    _DB_TABLE[(((1 << _b) * _DEBRUIJN) & 0xFFFFFFFFFFFFFFFF) >> 58] = _b


def split_seed(seed: int) -> tuple[int, int]:
    """The two 32-bit halves of a 63-bit seed (low, high)."""
    return seed & _M32, (seed >> 32) & _M32


@njit(cache=True, inline="always")
def _mix32(x):  # pragma: no cover - compiled
    x ^= x >> _U_16
    x = (x * _U_C1) & _U_MASK
    x ^= x >> _U_15
    x = (x * _U_C2) & _U_MASK
    x ^= x >> _U_15
    return x


@njit(cache=True, inline="always")
def hash32(i, s0, s1):  # pragma: no cover - compiled
    """32-bit hash of counter ``i`` under key (s0, s1); all arguments uint64."""
    return _mix32(_mix32((i & _U_MASK) ^ s0) ^ s1)


@njit(cache=True, inline="always")
def uniform(i, s0, s1):  # pragma: no cover - compiled
    """float32 uniform in [0, 1) with 24 random bits, for counter ``i``."""
    return np.float32(hash32(i, s0, s1) >> _U_8) * np.float32(UNIT24)


def _mul32_torch_(x: torch.Tensor, c: int, tmp: torch.Tensor) -> None:
    # In place: x = (x * c) mod 2**32 for 0 <= x, c < 2**32, no intermediate above 2**48.
    torch.mul(x, c >> 16, out=tmp)
    tmp.bitwise_and_(0xFFFF).bitwise_left_shift_(16)
    x.mul_(c & 0xFFFF).add_(tmp).bitwise_and_(_M32)


def _xorshift_torch_(x: torch.Tensor, shift: int, tmp: torch.Tensor) -> None:
    torch.bitwise_right_shift(x, shift, out=tmp)
    x.bitwise_xor_(tmp)


def _mix32_torch_(x: torch.Tensor, tmp: torch.Tensor) -> None:
    _xorshift_torch_(x, 16, tmp)
    _mul32_torch_(x, _C1, tmp)
    _xorshift_torch_(x, 15, tmp)
    _mul32_torch_(x, _C2, tmp)
    _xorshift_torch_(x, 15, tmp)


def hash32_torch(counters: torch.Tensor, seed: int) -> torch.Tensor:
    """The torch twin of :func:`hash32`: int64 tensor of counters -> int64 hashes < 2**32.

    Works in place on one copy of the counters and one scratch tensor (every step of the
    hash is an in-place op, so no tensor is allocated per step).
    """
    s0, s1 = split_seed(seed)
    x = counters.bitwise_and(_M32).bitwise_xor_(s0)
    tmp = torch.empty_like(x)
    _mix32_torch_(x, tmp)
    x.bitwise_xor_(s1)
    _mix32_torch_(x, tmp)
    return x


def uniform_torch(n: int, seed: int, device: torch.device) -> torch.Tensor:
    """float32 uniforms for counters 0..n-1, equal to numba's :func:`uniform` draws."""
    h = hash32_torch(torch.arange(n, dtype=torch.int64, device=device), seed)
    return h.bitwise_right_shift_(8).to(torch.float32).mul_(UNIT24)


@njit(cache=True)
def _floyd_sorted(n, k, s0, s1):  # pragma: no cover - compiled
    words = np.zeros((n + 63) // 64, np.uint64)
    for j in range(n - k, n):
        h = hash32(np.uint64(j), s0, s1)
        t = (h * np.uint64(j + 1)) >> _U_32  # uniform in [0, j]
        word = t >> _U_6
        bit = _U_ONE << (t & _U_63)
        if words[word] & bit:
            t = np.uint64(j)
            word = t >> _U_6
            bit = _U_ONE << (t & _U_63)
        words[word] |= bit
    out = np.empty(k, np.int32)
    p = 0
    for w in range(words.size):
        v = words[w]
        while v != 0:
            low = v & (~v + _U_ONE)
            out[p] = w * 64 + _DB_TABLE[(low * _U_DEBRUIJN) >> _U_58]
            p += 1
            v ^= low
    return out


def sample_indices(n: int, k: int, seed: int) -> np.ndarray:
    """``k`` distinct indices of ``range(n)``, sorted ascending, as int32.

    Args:
        n: population size (< 2**31).
        k: sample size, 1 <= k <= n.
        seed: a 63-bit key (from ``key_seed``); the same key gives the same sample.
    """
    s0, s1 = split_seed(seed)
    return _floyd_sorted(n, k, np.uint64(s0), np.uint64(s1))


@njit(parallel=True, cache=True)
def hash_positions(count, n, s0, s1):  # pragma: no cover - compiled
    """``count`` positions in [0, n) drawn with replacement (counters 0..count-1)."""
    out = np.empty(count, np.int64)
    for j in prange(count):
        out[j] = np.int64((hash32(np.uint64(j), s0, s1) * np.uint64(n)) >> _U_32)
    return out


def hash_positions_torch(count: int, n: int, seed: int, device: torch.device) -> torch.Tensor:
    """The torch twin of :func:`hash_positions` (exact: 32-bit hash times n < 2**63)."""
    h = hash32_torch(torch.arange(count, dtype=torch.int64, device=device), seed)
    return (h * n) >> 32
