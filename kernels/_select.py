"""Exact top-k selection by magnitude with a fixed tie rule, on both backends.

Rule: the k elements of largest |x| are selected; among equal magnitudes the lower index wins.
The selected positions are returned in ascending order, so the result is a pure function of
the input and both backends produce identical indices (and therefore identical payloads).

numba: a two-pass radix select over the magnitude bits (the float32 bits with the sign
cleared order like the magnitudes): a histogram of the upper 16 bits finds the bin holding
the k-th largest, a histogram of the lower 16 bits inside that bin finds the exact threshold
T and how many elements equal to T are needed; a final pass writes the positions in index
order from per-chunk offsets. torch: ``torch.topk`` finds T, then the same rule is applied
with masks.
"""

from __future__ import annotations

import numpy as np
import torch
from byteps_espresso.kernels._exact import nchunks
from numba import njit, prange

__all__ = ["topk_positions", "topk_positions_torch"]

_BINS = 1 << 16
_MAG = np.uint32(0x7FFFFFFF)
_INF_BITS = 0x7F800000


@njit(parallel=True, cache=True)
def _hist_high(u, nc):  # pragma: no cover - compiled
    n = u.size
    hist = np.zeros((nc, _BINS), np.int64)
    for c in prange(nc):
        uc = u[c * n // nc: (c + 1) * n // nc]  # a slice: no negative-index checks
        row = hist[c]
        for i in range(uc.size):
            row[(uc[i] & _MAG) >> np.uint32(16)] += 1
    return hist.sum(axis=0)


@njit(parallel=True, cache=True)
def _hist_low(u, high, nc):  # pragma: no cover - compiled
    n = u.size
    hist = np.zeros((nc, _BINS), np.int64)
    above = np.zeros(nc, np.int64)
    for c in prange(nc):
        uc = u[c * n // nc: (c + 1) * n // nc]
        row = hist[c]
        cnt = 0
        for i in range(uc.size):
            a = uc[i] & _MAG
            h = np.int64(a >> np.uint32(16))
            cnt += h > high
            if h == high:
                row[a & np.uint32(0xFFFF)] += 1
        above[c] = cnt
    return hist, above


@njit(parallel=True, cache=True)
def _write(u, thr, eq_take, offsets, nc, out):  # noqa: PLR0917  # pragma: no cover - compiled
    n = u.size
    for c in prange(nc):
        lo = c * n // nc
        uc = u[lo: (c + 1) * n // nc]
        p = offsets[c]
        take = eq_take[c]
        for i in range(uc.size):
            a = np.int64(uc[i] & _MAG)
            if a > thr:
                out[p] = lo + i
                p += 1
            elif a == thr and take > 0:
                out[p] = lo + i
                p += 1
                take -= 1


@njit(cache=True)
def _find(hist, k):  # pragma: no cover - compiled
    # Highest bin b with count(bins > b) < k <= count(bins >= b); returns (b, count above b).
    above = 0
    for b in range(hist.size - 1, -1, -1):
        if above + hist[b] >= k:
            return b, above
        above += hist[b]
    return 0, above


def topk_positions(u: np.ndarray, k: int) -> tuple[np.ndarray, bool]:
    """Positions of the k largest magnitudes of a uint32 view of float32 data, ascending.

    Args:
        u: ``x.view(np.uint32)`` of a 1-D float32 array.
        k: 1 <= k <= u.size.

    Returns:
        (int32[k] positions, whether a NaN/Inf was seen).
    """
    n = u.size
    nc = nchunks(n)
    high_hist = _hist_high(u, nc)
    bad = bool(high_hist[_INF_BITS >> 16:].any())
    if k == n:
        return np.arange(n, dtype=np.int32), bad
    high, above_high = _find(high_hist, k)
    low_hist, above = _hist_low(u, high, nc)
    low, _ = _find(low_hist.sum(axis=0), k - above_high)
    thr = (high << 16) | low
    gt = above + low_hist[:, low + 1:].sum(axis=1)
    eq = low_hist[:, low]
    need_eq = k - int(gt.sum())
    eq_before = np.concatenate(([0], np.cumsum(eq)[:-1]))
    eq_take = np.clip(need_eq - eq_before, 0, eq)
    counts = gt + eq_take
    offsets = np.concatenate(([0], np.cumsum(counts)[:-1])).astype(np.int64)
    out = np.empty(k, np.int32)
    _write(u, thr, eq_take.astype(np.int64), offsets, nc, out)
    return out, bad


def topk_positions_torch(mag: torch.Tensor, k: int) -> torch.Tensor:
    """The torch twin of :func:`topk_positions` on a magnitude tensor (finite, >= 0).

    Returns:
        int64 positions, ascending.
    """
    n = mag.numel()
    if k == n:
        return torch.arange(n, device=mag.device)
    thr = torch.topk(mag, k, sorted=False).values.min()
    greater = mag > thr
    need_eq = k - int(greater.sum())
    equal = torch.nonzero(mag == thr).reshape(-1)[:need_eq]
    pos = torch.cat((torch.nonzero(greater).reshape(-1), equal))
    return torch.sort(pos).values
