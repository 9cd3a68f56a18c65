"""Shared parts of the sparsifiers (topk, randomk, dgc): payload layout, checks, decoding.

Payload: ``(float32[k] values, int32[k] indices)`` with indices strictly ascending in
``[0, numel)`` and ``k = max(1, int(numel * ratio))``. Decoding scatters the values into
zeros; aggregation scatter-adds every payload into one buffer in list order.

A sparsifier that declares the parameters ``warmup_steps`` and ``warmup_ratio`` (dgc) keeps
a larger fraction in its first iterations (:func:`warmup_ratio`), so its ``k``, and hence its
payload lengths, depend on the step as well.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np
import torch
from byteps_espresso.kernels.base import (
    Compressor,
    Ctx,
    Payload,
    PayloadError,
    check_int,
    check_ratio,
)
from numba import njit

__all__ = ["WARMUP_STAGE_FACTOR", "Sparse", "SparseNumba", "SparseTorch", "keep_count",
           "warmup_ratio", "warmup_stage", "warmup_stages"]


def keep_count(numel: int, ratio: float) -> int:
    """Elements kept by a sparsifier: ``max(1, int(numel * ratio))``."""
    return max(1, min(numel, int(numel * ratio)))


#: Largest fall of the kept fraction between two warm-up stages: DGC's factor 4 per epoch
#: (Lin et al., ICLR 2018, 3.3: kept 25%, 6.25%, 1.5625%, 0.4%, 0.1%).
WARMUP_STAGE_FACTOR = 4.0


def warmup_stages(ratio: float, start: float) -> int:
    """Stages of the warm-up from ``start`` down to ``ratio``: the fewest with each stage at
    most :data:`WARMUP_STAGE_FACTOR` sparser than the one before (0: no warm-up)."""
    stages, kept = 0, start
    while kept > ratio * (1 + 1e-12):  # 1e-12: 0.25 / 4**4 is the final ratio, not a stage
        kept /= WARMUP_STAGE_FACTOR
        stages += 1
    return stages


def warmup_stage(step: int | None, ratio: float, start: float, steps: int) -> int | None:
    """The warm-up stage of iteration ``step`` (0, 1, ...), None after it (or without one)."""
    if step is None or steps <= 0 or step >= steps:  # the common case: no loop below
        return None
    stages = warmup_stages(ratio, start)
    return max(step, 0) * stages // steps if stages else None


def warmup_ratio(step: int | None, ratio: float, start: float, steps: int) -> float:
    """The kept fraction at ``step`` under DGC's sparsity warm-up (Lin et al., ICLR 2018, 3.3).

    DGC raises the sparsity exponentially from 75% to 99.9% over the first epochs, one level
    per epoch (kept fraction 0.25, 0.0625, 0.015625, 0.004, 0.001: a factor 4 per epoch).
    Here the ``steps`` iterations are cut into :func:`warmup_stages` equal stages ``s``
    (``S`` of them), and the kept fraction falls exponentially from stage to stage::

        ratio(t) = start * (ratio / start) ** (s / S),  s = t * S // steps   for t < steps
        ratio(t) = ratio                                                      for t >= steps

    computed in float64 on the host, so every worker and backend gets the same ``k``. Each
    stage keeps one payload length per tensor size, so the runtime binds one layout per
    stage (:meth:`Sparse.stage`).
    """
    stage = warmup_stage(step, ratio, start, steps)
    if stage is None:
        return ratio
    return start * (ratio / start) ** (stage / warmup_stages(ratio, start))


@njit(cache=True)
def _ascending_in_range(idx, n):  # pragma: no cover - compiled
    prev = -1
    for i in range(idx.size):
        v = idx[i]
        if v <= prev or v >= n:
            return False
        prev = v
    return True


@njit(cache=True)
def _scatter_add(out, values, idx):  # pragma: no cover - compiled
    for i in range(idx.size):
        out[idx[i]] += values[i]


class Sparse(Compressor):
    """Base of the sparsifiers; subclasses set name, wire_id and select the indices."""

    payload_dtypes: ClassVar = (np.dtype(np.float32), np.dtype(np.int32))
    defaults: ClassVar[dict[str, Any]] = {"ratio": 0.01}

    def validate_params(self) -> None:
        self.ratio = check_ratio(self.name, self.params["ratio"])
        self.warmup_steps = check_int(self.name, "warmup_steps",
                                      self.params.get("warmup_steps", 0), 0, 2**31 - 1)
        self.warmup_start = check_ratio(f"{self.name} warmup_ratio",
                                        self.params.get("warmup_ratio", 1.0))

    def ratio_at(self, step: int | None) -> float:
        """The kept fraction at iteration ``step`` (None: after the warm-up)."""
        return warmup_ratio(step, self.ratio, self.warmup_start, self.warmup_steps)

    def stage(self, step: int | None) -> int | None:
        """The warm-up stage of ``step``: payload lengths change only from stage to stage."""
        return warmup_stage(step, self.ratio, self.warmup_start, self.warmup_steps)

    @property
    def steady_step(self) -> int:
        """The first iteration after the warm-up."""
        return self.warmup_steps

    def keep(self, numel: int, step: int | None = None) -> int:
        """Elements kept for a tensor of ``numel`` elements at iteration ``step``."""
        return keep_count(numel, self.ratio_at(step))

    def compressed_nbytes(self, numel: int, step: int | None = None) -> int:
        return 8 * self.keep(numel, step)

    def payload_lengths(self, numel: int, step: int | None = None) -> tuple[int, ...]:
        k = self.keep(numel, step)
        return (k, k)


class SparseTorch(Sparse):
    backend = "torch"

    def check_payload_content(self, payload: Payload, ctx: Ctx) -> None:
        idx = payload[1]
        ok = bool(idx[0] >= 0) and bool(idx[-1] < ctx.numel)
        if ok and idx.numel() > 1:
            ok = bool((idx[1:] > idx[:-1]).all())
        if not ok:
            raise PayloadError(f"{self.name}: indices must be strictly ascending in "
                               f"[0, {ctx.numel})")

    def decode(self, payload: Payload, ctx: Ctx) -> torch.Tensor:
        values, idx = payload
        out = torch.zeros(ctx.numel, dtype=torch.float32, device=values.device)
        out[idx.long()] = values
        return out

    def aggregate(self, payloads: Sequence[Payload], ctx: Ctx) -> torch.Tensor:
        if not payloads:
            raise PayloadError(f"{self.name}: aggregate needs at least one payload")
        out = None
        for payload in payloads:
            self.check_payload(payload, ctx)
            values, idx = payload
            if out is None:
                out = torch.zeros(ctx.numel, dtype=torch.float32, device=values.device)
            out.index_add_(0, idx.long(), values)
        return out.reshape(ctx.shape)


class SparseNumba(Sparse):
    backend = "numba"

    def check_payload_content(self, payload: Payload, ctx: Ctx) -> None:
        if not _ascending_in_range(payload[1], ctx.numel):
            raise PayloadError(f"{self.name}: indices must be strictly ascending in "
                               f"[0, {ctx.numel})")

    def decode(self, payload: Payload, ctx: Ctx) -> np.ndarray:
        values, idx = payload
        out = np.zeros(ctx.numel, np.float32)
        out[idx] = values
        return out

    def aggregate(self, payloads: Sequence[Payload], ctx: Ctx) -> np.ndarray:
        if not payloads:
            raise PayloadError(f"{self.name}: aggregate needs at least one payload")
        out = np.zeros(ctx.numel, np.float32)
        for payload in payloads:
            self.check_payload(payload, ctx)
            _scatter_add(out, payload[0], payload[1])
        return out.reshape(ctx.shape)
