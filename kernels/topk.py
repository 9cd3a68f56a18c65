"""topk: keep the ``k = max(1, int(numel * ratio))`` entries of largest magnitude.

Payload: ``(float32[k] values, int32[k] indices)``, indices ascending. Deterministic with the
tie rule "larger |x| first, then lower index" (see ``_select``), so both backends produce
identical payloads. NaN/Inf input raises :class:`NonFiniteError` (magnitudes would not order).
Biased; pair it with :class:`~byteps_espresso.kernels.error_feedback.ErrorFeedback`.
"""

from __future__ import annotations

import numpy as np
import torch
from byteps_espresso.kernels._select import topk_positions, topk_positions_torch
from byteps_espresso.kernels._sparse import Sparse, SparseNumba, SparseTorch
from byteps_espresso.kernels.base import Ctx, Payload
from byteps_espresso.kernels.registry import register

WIRE_ID = 4


class _TopK(Sparse):
    name = "topk"
    wire_id = WIRE_ID


def topk_torch(flat: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, int32 indices) of the top-k magnitudes; caller checked finiteness."""
    pos = topk_positions_torch(flat.abs(), k)
    return flat[pos], pos.to(torch.int32)


@register
class TopKTorch(_TopK, SparseTorch):
    def encode(self, flat: torch.Tensor, ctx: Ctx) -> Payload:
        if not bool(torch.isfinite(flat).all()):
            raise self.non_finite(ctx)
        return topk_torch(flat, self.keep(flat.numel()))


@register
class TopKNumba(_TopK, SparseNumba):
    def encode(self, flat: np.ndarray, ctx: Ctx) -> Payload:
        pos, bad = topk_positions(flat.view(np.uint32), self.keep(flat.size))
        if bad:
            raise self.non_finite(ctx)
        return flat[pos], pos
