"""Shared parts of the sparsifiers (topk, randomk, dgc): payload layout, checks, decoding.

Payload: ``(float32[k] values, int32[k] indices)`` with indices strictly ascending in
``[0, numel)`` and ``k = max(1, int(numel * ratio))``. Decoding scatters the values into
zeros; aggregation scatter-adds every payload into one buffer in list order.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np
import torch
from byteps_espresso.kernels.base import Compressor, Ctx, Payload, PayloadError, check_ratio
from numba import njit

__all__ = ["Sparse", "SparseNumba", "SparseTorch", "keep_count"]


def keep_count(numel: int, ratio: float) -> int:
    """Elements kept by a sparsifier: ``max(1, int(numel * ratio))``."""
    return max(1, min(numel, int(numel * ratio)))


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

    def keep(self, numel: int) -> int:
        """Elements kept for a tensor of ``numel`` elements."""
        return keep_count(numel, self.ratio)

    def compressed_nbytes(self, numel: int) -> int:
        return 8 * self.keep(numel)

    def payload_lengths(self, numel: int) -> tuple[int, ...]:
        k = self.keep(numel)
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
