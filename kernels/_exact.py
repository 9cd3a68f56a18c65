"""Order-independent reductions of float32 data (sum |x|, sum x**2, max |x|), both backends.

A scale such as mean(|x|) computed by a parallel float reduction depends on the summation
order, so a GPU and a CPU would disagree in the last bit. Here every reduction is integer
arithmetic on the float bits, which is associative, so both backends get identical results;
the final scale is formed on the host with Python integers (one correctly rounded division).
Every float32 is split into its biased exponent ``e`` and integer significand ``m``
(``|x| = m * 2**(max(e, 1) - 150)``).

* max |x|: the integer maximum of the bits with the sign cleared.
* sum |x| by sign (scaled sign codecs): block-relative fixed point, see ``BLOCK``.
* sum x**2 (QSGD's norm): exact; ``m*m < 2**48`` split into two 24-bit halves summed in
  int64 bins per exponent at ``2*e'`` and ``2*e' + 24`` (no overflow below 2**39 entries).

NaN/Inf (exponent 255) are reported so callers can refuse such input.
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
    "BLOCK",
    "SQUARE_BINS",
    "abs_max_bits",
    "abs_max_bits_torch",
    "bits_to_float",
    "block_mean",
    "block_total",
    "blocks_non_finite",
    "l2_norm",
    "nchunks",
    "sign_block_sums",
    "sign_block_sums_torch",
    "sqrt_sum",
    "square_bins",
    "square_bins_torch",
    "square_non_finite",
    "threads_for",
]

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
def square_bins(u, nc):  # pragma: no cover - compiled
    """Exact binned sum of x**2 -> int64[SQUARE_BINS] (bin j weighs 2**(j - 300))."""
    n = u.size
    part = np.zeros((nc, 4, SQUARE_BINS), np.int64)
    for c in prange(nc):
        uc = u[c * n // nc: (c + 1) * n // nc]  # a slice: no negative-index checks
        for i in range(uc.size):
            e, m = _split(uc[i])
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


def square_bins_torch(flat: torch.Tensor) -> list[int]:
    """The torch twin of :func:`square_bins`."""
    e, m = _split_torch(flat)
    e2 = 2 * e.clamp_(min=1)
    m2 = m * m
    bins = torch.zeros(SQUARE_BINS, dtype=torch.int64, device=flat.device)
    bins.index_add_(0, e2, m2 & 0xFFFFFF)
    bins.index_add_(0, e2 + 24, m2 >> 24)
    return bins.tolist()


def square_non_finite(bins: Sequence[int]) -> bool:
    """Whether square bins saw a NaN/Inf (exponent 255)."""
    return bins[510] != 0 or bins[534] != 0


def sqrt_sum(bins: Sequence[int]) -> float:
    """sqrt(sum(x**2)) from square bins (one correctly rounded division, then sqrt)."""
    total = 0
    for j, b in enumerate(bins):
        if b:
            total += int(b) << j
    return math.sqrt(total / (1 << 300))


def l2_norm(flat: torch.Tensor | np.ndarray) -> float:
    """The exact L2 norm of a 1-D float32 tensor or array, identical on both backends.

    Returns:
        the norm as a Python float (``inf`` when the input holds NaN/Inf).
    """
    if isinstance(flat, torch.Tensor):
        bins = square_bins_torch(flat)
    else:
        bins = square_bins(flat.view(np.uint32), nchunks(flat.size))
    return math.inf if square_non_finite(bins) else sqrt_sum(bins)


# ---- sums of |x| split by sign: block-relative fixed point --------------------------------------
# Entries are summed in blocks of BLOCK: each entry becomes the integer c = (m << 24) >> d with
# d = (largest exponent of its block) - (its exponent), i.e. |x| in units of 2**(emax - 174).
# c is a function of the entry and its block only (blocks are fixed index ranges), so the
# int64 block sums, and the total formed from them with Python integers, are identical on both
# backends whatever the order or device. The truncation drops less than 2**-47 of the block's
# largest magnitude per entry, far below float32 rounding of the result. The loop has no
# scatter, so it vectorizes (a per-exponent histogram of the same sums ran 4x slower).
BLOCK = 1024  # entries per block; block sums stay below 1024 * 2**48 < 2**63


@njit(parallel=True, cache=True)
def sign_block_sums(u, tmp, emax, pos, neg, negs):  # noqa: PLR0917  # pragma: no cover
    """One pass for the scaled sign codecs over a uint32 view of float32 data.

    Writes tmp[i] = sign bit (0/1) for :func:`~byteps_espresso.kernels._bits.gather_bits`,
    and per block: its largest biased exponent (at least 1; 255 means NaN/Inf seen), the
    fixed-point sums of the non-negative and negative entries' magnitudes, and the count of
    negative entries.
    """
    n = u.size
    for b in prange(emax.size):
        # Slices index from 0, which spares the per-access negative-index check of a
        # range(lo, hi) loop and lets the loops vectorize (6x faster, measured).
        ub = u[b * BLOCK: min(n, (b + 1) * BLOCK)]
        tb = tmp[b * BLOCK: min(n, (b + 1) * BLOCK)]
        em = np.int64(1)
        for i in range(ub.size):
            em = max(em, np.int64((ub[i] >> np.uint32(23)) & np.uint32(255)))
        total = np.int64(0)
        ng = np.int64(0)
        cnt = np.int64(0)
        for i in range(ub.size):
            v = ub[i]
            s = np.int64(v >> np.uint32(31))
            raw = np.int64((v >> np.uint32(23)) & np.uint32(255))
            m = np.int64(v & np.uint32(0x7FFFFF)) | (np.int64(raw != 0) << 23)
            c = (m << 24) >> min(em - max(raw, 1), 63)
            total += c
            ng += c & -s
            cnt += s
            tb[i] = np.uint8(s)
        emax[b] = em
        pos[b] = total - ng
        neg[b] = ng
        negs[b] = cnt


def sign_block_sums_torch(flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The torch twin of :func:`sign_block_sums` (without the sign bytes).

    Returns:
        int64 tensors (emax, pos, neg) per block and the count of negatives (0-dim).
    """
    nblocks = -(-flat.numel() // BLOCK)
    u = torch.zeros(nblocks * BLOCK, dtype=torch.int32, device=flat.device)
    u[: flat.numel()] = flat.view(torch.int32)
    u = u.view(nblocks, BLOCK)
    raw = ((u >> 23) & 255).long()
    e = raw.clamp(min=1)
    m = (u & 0x7FFFFF).long() | ((raw != 0).long() << 23)
    em = e.amax(dim=1, keepdim=True)
    c = torch.bitwise_right_shift(m << 24, (em - e).clamp_(max=63))
    s = (u < 0).long()
    return em.squeeze(1), (c * (1 - s)).sum(dim=1), (c * s).sum(dim=1), s.sum()


def block_total(emax: Sequence[int] | np.ndarray, sums: Sequence[int] | np.ndarray) -> int:
    """The exact total of block sums in units of 2**-174: sum(sums[b] << emax[b])."""
    emax = np.asarray(emax, np.int64)
    sums = np.asarray(sums, np.int64)
    # Split each sum in 30-bit halves so per-exponent float64 bincounts stay exact (< 2**53).
    lo = np.bincount(emax, weights=sums & ((1 << 30) - 1), minlength=256)
    hi = np.bincount(emax, weights=sums >> 30, minlength=256)
    total = 0
    for e in np.nonzero(lo + hi)[0]:
        total += ((int(hi[e]) << 30) + int(lo[e])) << int(e)
    return total


def block_mean(total: int, count: int) -> float:
    """total (from :func:`block_total`) / count as a float (0.0 when count is 0)."""
    return total / (count << 174) if count else 0.0


def blocks_non_finite(emax: Sequence[int] | np.ndarray) -> bool:
    """Whether any block saw a NaN/Inf (exponent 255)."""
    return bool(np.any(np.asarray(emax) == 255))



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
