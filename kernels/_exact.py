"""Order-independent exact reductions of float32 data (sum |x|, sum x**2, max |x|), both backends.

A scale such as mean(|x|) computed by a parallel float reduction depends on the summation
order, so a GPU and a CPU would disagree in the last bit. Here every float32 is split into
its biased exponent ``e`` and integer significand ``m`` (``|x| = m * 2**(max(e, 1) - 150)``)
and the significands are summed *per exponent* in int64 bins. Integer addition is exact and
associative, so the bins are identical whatever the order or the backend; the final scale is
computed from them on the host with Python integers (one correctly rounded division). An
int64 bin cannot overflow below 2**39 elements (m < 2**24).

Squares use ``m*m < 2**48`` split into two 24-bit halves binned at ``2*e'`` and ``2*e' + 24``.
Bins with e = 255 (NaN/Inf) are reported so callers can refuse such input.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence

import numba
import numpy as np
import torch
from numba import njit, prange

__all__ = [
    "ABS_BINS",
    "SQUARE_BINS",
    "abs_bins_torch",
    "abs_max_bits",
    "abs_max_bits_torch",
    "abs_mean",
    "abs_non_finite",
    "bits_to_float",
    "nchunks",
    "signed_abs_bins_torch",
    "signs_and_bins",
    "sqrt_sum",
    "square_bins",
    "square_bins_torch",
    "square_non_finite",
    "threads_for",
]

ABS_BINS = 256
SQUARE_BINS = 2 * 255 + 24 + 1
# Elements per parallel chunk below which extra chunks only add scheduling overhead.
_MIN_CHUNK = 1 << 16


def nchunks(n: int) -> int:
    """Number of parallel chunks for ``n`` elements (results never depend on it)."""
    return max(1, min(numba.get_num_threads() * 4, n // _MIN_CHUNK))


@njit(cache=True, inline="always")
def _split(v):  # pragma: no cover - compiled
    e = np.int64((v >> np.uint32(23)) & np.uint32(255))
    m = np.int64(v & np.uint32(0x7FFFFF))
    if e != 0:
        m |= 0x800000
    return e, m


@njit(parallel=True, cache=True)
def signs_and_bins(u, out, nc):  # pragma: no cover - compiled
    """One pass for the scaled sign codecs: pack sign bits into ``out`` and bin |x| by sign.

    Args:
        u: uint32 view of float32 data.
        out: uint8[ceil(n / 8)] for the packed sign bits (layout of ``_bits``).
        nc: number of parallel chunks (whole bytes each).

    Returns:
        (int64[2, 256] significand sums per sign and exponent, count of negatives). Four
        interleaved bin sets per chunk break the store-to-load chain of equal exponents.
    """
    n = u.size
    full = n // 8
    part = np.zeros((nc, 4, 2 * ABS_BINS), np.int64)
    negs = np.zeros(nc, np.int64)
    for c in prange(nc):
        lo = c * full // nc
        hi = (c + 1) * full // nc
        neg = 0
        for j in range(lo, hi):
            b = np.uint32(0)
            for t in range(8):
                v = u[8 * j + t]
                s = v >> np.uint32(31)
                e, m = _split(v)
                part[c, t & 3, (np.int64(s) << 8) | e] += m
                b |= s << np.uint32(t)
                neg += np.int64(s)
            out[j] = np.uint8(b)
        negs[c] = neg
    b = np.uint32(0)
    tail = 0
    for i in range(8 * full, n):
        v = u[i]
        s = v >> np.uint32(31)
        e, m = _split(v)
        part[0, 0, (np.int64(s) << 8) | e] += m
        b |= s << np.uint32(i - 8 * full)
        tail += np.int64(s)
    if 8 * full < n:
        out[full] = np.uint8(b)
    bins = np.zeros((2, ABS_BINS), np.int64)
    for c in range(nc):
        for r in range(4):
            for k in range(2 * ABS_BINS):
                bins[k >> 8, k & 255] += part[c, r, k]
    return bins, negs.sum() + tail


@njit(parallel=True, cache=True)
def square_bins(u, nc):  # pragma: no cover - compiled
    """Exact binned sum of x**2 -> int64[SQUARE_BINS] (bin j weighs 2**(j - 300))."""
    n = u.size
    part = np.zeros((nc, 4, SQUARE_BINS), np.int64)
    for c in prange(nc):
        lo = c * n // nc
        hi = (c + 1) * n // nc
        for i in range(lo, hi):
            e, m = _split(u[i])
            e2 = 2 * max(e, 1)
            m2 = m * m
            part[c, i & 3, e2] += m2 & 0xFFFFFF
            part[c, i & 3, e2 + 24] += m2 >> 24
    bins = np.zeros(SQUARE_BINS, np.int64)
    for c in range(nc):
        for r in range(4):
            bins += part[c, r]
    return bins


def _split_torch(flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    u = flat.view(torch.int32)
    e = (u >> 23) & 255
    m = (u & 0x7FFFFF) | ((e != 0).to(torch.int32) << 23)
    return e.long(), m.long()


def abs_bins_torch(flat: torch.Tensor) -> list[int]:
    """Per-exponent significand sums of |x| -> 256 ints (int64 index_add: exact in any order)."""
    e, m = _split_torch(flat)
    bins = torch.zeros(ABS_BINS, dtype=torch.int64, device=flat.device)
    return bins.index_add_(0, e, m).tolist()


def signed_abs_bins_torch(flat: torch.Tensor) -> tuple[list[list[int]], int]:
    """The bins of :func:`signs_and_bins` with torch ops."""
    e, m = _split_torch(flat)
    s = (flat.view(torch.int32) < 0).long()
    bins = torch.zeros(2 * ABS_BINS, dtype=torch.int64, device=flat.device)
    bins.index_add_(0, e + ABS_BINS * s, m)
    return bins.view(2, ABS_BINS).tolist(), int(s.sum())


def square_bins_torch(flat: torch.Tensor) -> list[int]:
    """The torch twin of :func:`square_bins`."""
    e, m = _split_torch(flat)
    e2 = 2 * e.clamp_(min=1)
    m2 = m * m
    bins = torch.zeros(SQUARE_BINS, dtype=torch.int64, device=flat.device)
    bins.index_add_(0, e2, m2 & 0xFFFFFF)
    bins.index_add_(0, e2 + 24, m2 >> 24)
    return bins.tolist()


def abs_non_finite(bins: Sequence[int]) -> bool:
    """Whether abs bins saw a NaN/Inf (exponent 255)."""
    return bins[255] != 0


def square_non_finite(bins: Sequence[int]) -> bool:
    """Whether square bins saw a NaN/Inf (exponent 255)."""
    return bins[510] != 0 or bins[534] != 0


def abs_mean(bins: Sequence[int], count: int) -> float:
    """sum(|x|) / count from abs bins, correctly rounded to float64 (0.0 when count is 0)."""
    if count == 0:
        return 0.0
    total = 0
    for e, b in enumerate(bins):
        if b:
            total += int(b) << max(e, 1)
    return total / (count << 150)


def sqrt_sum(bins: Sequence[int]) -> float:
    """sqrt(sum(x**2)) from square bins (one correctly rounded division, then sqrt)."""
    total = 0
    for j, b in enumerate(bins):
        if b:
            total += int(b) << j
    return math.sqrt(total / (1 << 300))


@njit(parallel=True, cache=True)
def abs_max_bits(u):  # pragma: no cover - compiled
    """Largest magnitude as float32 bits with the sign cleared (>= 0x7F800000: NaN/Inf seen).

    Unsigned bit patterns of non-negative floats order like the floats, and NaN patterns sort
    above Inf, so the integer maximum is exact and flags non-finite input.
    """
    m = np.uint32(0)
    for i in prange(u.size):
        m = max(m, u[i] & np.uint32(0x7FFFFFFF))
    return m


def abs_max_bits_torch(flat: torch.Tensor) -> int:
    """The torch twin of :func:`abs_max_bits`."""
    return int((flat.view(torch.int32) & 0x7FFFFFFF).max())


def bits_to_float(bits: int) -> np.float32:
    """The float32 whose bit pattern is ``bits``."""
    return np.array([bits], np.uint32).view(np.float32)[0]


# Below this many elements (1 MiB of float32) a numba kernel runs on the calling thread only:
# waking the thread pool costs more than the work (measured tens of microseconds on an idle
# 2-core host and up to milliseconds on a loaded one, against ~1 ns per element of work).
SERIAL_BELOW = 1 << 18


@contextlib.contextmanager
def threads_for(numel: int) -> Iterator[None]:
    """Run the numba kernels of this block single-threaded when ``numel`` is small."""
    if numel >= SERIAL_BELOW:
        yield
        return
    before = numba.get_num_threads()
    numba.set_num_threads(1)
    try:
        yield
    finally:
        numba.set_num_threads(before)
