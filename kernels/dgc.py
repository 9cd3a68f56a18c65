"""dgc: Deep Gradient Compression's sampled-threshold top-k (Lin et al., ICLR 2018).

DGC estimates the top-k threshold from a random sample (``sample_ratio`` of the entries,
drawn from ``key_seed(seed, name, step)``) instead of selecting over the whole tensor, then
selects among the few candidates at or above it. Because the wire needs exactly ``k``
entries, the candidates are cut to the exact top-k with the topk tie rule, and when the
sampled threshold admits fewer than ``k`` candidates the selection falls back to a full
top-k. The payload is therefore identical to ``topk``'s for the same input (deterministic,
identical on both backends); the sample only changes how fast it is found.

DGC as its paper runs it is this codec with its sparsity warm-up (``warmup_steps``,
``warmup_ratio``: the kept fraction falls exponentially from 25% to ``ratio``, see
:func:`~byteps_espresso.kernels._sparse.warmup_ratio`) inside
:class:`~byteps_espresso.kernels.momentum.MomentumCorrection` (momentum correction, local
gradient clipping, momentum factor masking); :func:`recipe` builds that combination.

Payload: ``(float32[k] values, int32[k] indices)``. NaN/Inf raise :class:`NonFiniteError`.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import numpy as np
import torch
from byteps_espresso.kernels import _exact
from byteps_espresso.kernels._random import hash_positions, hash_positions_torch, split_seed
from byteps_espresso.kernels._select import topk_positions, topk_positions_torch
from byteps_espresso.kernels._sparse import Sparse, SparseNumba, SparseTorch
from byteps_espresso.kernels.base import Ctx, Payload, check_int, key_seed
from byteps_espresso.kernels.momentum import MomentumCorrection
from byteps_espresso.kernels.registry import create, register
from numba import njit, prange

__all__ = ["DGC_WARMUP_RATIO", "recipe", "sample_plan"]

WIRE_ID = 6
# DGC's warm-up starts at 75% sparsity (Lin et al., ICLR 2018, section 3.3): kept fraction.
DGC_WARMUP_RATIO = 0.25
# Below this many sampled entries the estimate is too noisy and the sample too costly
# relative to the tensor: select over the whole tensor (DGC samples 0.1%-1% of large layers).
MIN_SAMPLE = 256
_MAG = np.uint32(0x7FFFFFFF)
_INF_BITS = np.uint32(0x7F800000)


def sample_plan(numel: int, k: int, sample_ratio: float) -> tuple[int, int]:
    """(sample size, rank of the threshold in the sample), or (0, 0) for a full selection.

    The rank sits three binomial standard deviations above the expected rank of the k-th
    largest entry, so the threshold admits at least k candidates with high probability.
    """
    size = math.ceil(numel * sample_ratio)
    if size < MIN_SAMPLE or size * 4 > numel:
        return 0, 0
    expected = size * k / numel
    rank = min(size, math.ceil(expected + 3 * math.sqrt(expected) + 2))
    return size, rank


@njit(parallel=True, cache=True)
def _count_at_least(u, thr, nc):  # pragma: no cover - compiled
    n = u.size
    counts = np.zeros(nc, np.int64)
    bad = 0
    for c in prange(nc):
        uc = u[c * n // nc: (c + 1) * n // nc]  # a slice: no negative-index checks
        cnt = 0
        nf = 0
        for i in range(uc.size):
            a = uc[i] & _MAG
            cnt += a >= thr
            nf += a >= _INF_BITS
        counts[c] = cnt
        bad += nf
    return counts, bad


@njit(parallel=True, cache=True)
def _gather_at_least(u, thr, offsets, nc, out_pos, out_mag):  # noqa: PLR0917  # pragma: no cover
    n = u.size
    for c in prange(nc):
        lo = c * n // nc
        uc = u[lo: (c + 1) * n // nc]
        p = offsets[c]
        for i in range(uc.size):
            a = uc[i] & _MAG
            if a >= thr:
                out_pos[p] = lo + i
                out_mag[p] = a
                p += 1


class _Dgc(Sparse):
    name = "dgc"
    wire_id = WIRE_ID
    # warmup_steps 0: no warm-up (the codec alone); recipe() turns it on.
    defaults: ClassVar[dict[str, Any]] = {"ratio": 0.01, "seed": 0, "sample_ratio": 0.01,
                                          "warmup_steps": 0, "warmup_ratio": DGC_WARMUP_RATIO}

    def validate_params(self) -> None:
        super().validate_params()
        self.seed = check_int(self.name, "seed", self.params["seed"], 0, 2**63 - 1)
        sr = self.params["sample_ratio"]
        if isinstance(sr, bool) or not isinstance(sr, int | float) or not 0 < sr <= 1:
            raise ValueError(f"{self.name}: sample_ratio must be a number in (0, 1], got {sr!r}")
        self.sample_ratio = float(sr)


@register
class DgcTorch(_Dgc, SparseTorch):
    def encode(self, flat: torch.Tensor, ctx: Ctx) -> Payload:
        if not bool(torch.isfinite(flat).all()):
            raise self.non_finite(ctx)
        n = flat.numel()
        k = self.keep(n, ctx.step)
        mag = flat.abs()
        size, rank = sample_plan(n, k, self.sample_ratio)
        pos = None
        if size:
            seed = key_seed(self.seed, ctx.name, ctx.step)
            sample = mag[hash_positions_torch(size, n, seed, flat.device)]
            thr = torch.topk(sample, rank, sorted=False).values.min()
            cand = torch.nonzero(mag >= thr).reshape(-1)
            if cand.numel() >= k:
                pos = cand[topk_positions_torch(mag[cand], k)]
        if pos is None:
            pos = topk_positions_torch(mag, k)
        return flat[pos], pos.to(torch.int32)


@register
class DgcNumba(_Dgc, SparseNumba):
    def encode(self, flat: np.ndarray, ctx: Ctx) -> Payload:
        u = flat.view(np.uint32)
        n = flat.size
        k = self.keep(n, ctx.step)
        size, rank = sample_plan(n, k, self.sample_ratio)
        if size:
            s0, s1 = split_seed(key_seed(self.seed, ctx.name, ctx.step))
            sample = u[hash_positions(size, n, np.uint64(s0), np.uint64(s1))] & _MAG
            thr = np.partition(sample, size - rank)[size - rank]
            nc = _exact.nchunks(n)
            counts, bad = _count_at_least(u, thr, nc)
            if bad:
                raise self.non_finite(ctx)
            total = int(counts.sum())
            if total >= k:
                offsets = np.concatenate(([0], np.cumsum(counts)[:-1])).astype(np.int64)
                cand = np.empty(total, np.int32)
                cand_mag = np.empty(total, np.uint32)
                _gather_at_least(u, thr, offsets, nc, cand, cand_mag)
                local, _ = topk_positions(cand_mag, k)
                pos = cand[local]
                return flat[pos], pos
        pos, bad = topk_positions(u, k)
        if bad:
            raise self.non_finite(ctx)
        return flat[pos], pos


def recipe(backend: str = "torch", *, ratio: float = 0.001, warmup_steps: int = 0,
           momentum: float = 0.9, clip_norm: float | None = None, workers: int = 1,
           seed: int = 0, sample_ratio: float = 0.01) -> MomentumCorrection:
    """DGC as its paper runs it (Lin et al., ICLR 2018): one wrapped codec, no copy.

    Momentum correction and local accumulation, local gradient clipping (the global
    threshold ``clip_norm`` scaled by ``workers ** -0.5``), momentum factor masking, and the
    sparsity warm-up from 75% to ``1 - ratio`` over ``warmup_steps`` iterations. The
    optimizer then runs without momentum of its own (the velocity is accumulated here).

    Args:
        backend: ``torch`` or ``numba``.
        ratio: the kept fraction after the warm-up (the paper: 0.001, 99.9% sparsity).
        warmup_steps: iterations of the warm-up (the paper: 4 epochs); 0: none.
        momentum: the momentum coefficient the optimizer would have used.
        clip_norm: the global gradient-norm threshold; None: no clipping.
        workers: the number of workers (scales the local clipping threshold).
        seed, sample_ratio: dgc's threshold sampling.

    Example:
        >>> from byteps_espresso.kernels.dgc import recipe
        >>> dgc = recipe("numba", ratio=0.001, warmup_steps=1000, clip_norm=5.0, workers=4)
    """
    inner = create("dgc", backend=backend, ratio=ratio, seed=seed, sample_ratio=sample_ratio,
                   warmup_steps=warmup_steps)
    return MomentumCorrection(inner, momentum=momentum, masking=True, clip_norm=clip_norm,
                              workers=workers)
