"""randomk: keep ``k = max(1, int(numel * ratio))`` entries chosen uniformly at random.

The indices are a function of ``key_seed(seed, name, step)`` only (Floyd's sampler in
``_random``, run on the host for both backends), so every worker and both backends select the
same entries for the same tensor and step, and compressed values of different workers line
up. With ``scale=True`` the values are multiplied by ``numel / k`` (in float32), which makes
the codec unbiased. Payload: ``(float32[k] values, int32[k] indices)``, indices ascending.

NaN/Inf: only the k selected entries are read (that is the point of random-k); a selected
NaN/Inf raises :class:`NonFiniteError`, unselected ones are never looked at.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np
import torch
from byteps_espresso.kernels._random import sample_indices
from byteps_espresso.kernels._sparse import Sparse, SparseNumba, SparseTorch
from byteps_espresso.kernels.base import Ctx, Payload, check_int, key_seed
from byteps_espresso.kernels.registry import register

WIRE_ID = 5


class _RandomK(Sparse):
    name = "randomk"
    wire_id = WIRE_ID
    deterministic = False
    defaults: ClassVar[dict[str, Any]] = {"ratio": 0.01, "seed": 0, "scale": False}

    def validate_params(self) -> None:
        super().validate_params()
        self.seed = check_int(self.name, "seed", self.params["seed"], 0, 2**63 - 1)
        if not isinstance(self.params["scale"], bool):
            raise ValueError(f"{self.name}: scale must be true or false, "
                             f"got {self.params['scale']!r}")
        self.scale = self.params["scale"]

    @property
    def unbiased(self) -> bool:  # type: ignore[override]
        return self.scale

    def indices(self, numel: int, ctx: Ctx) -> np.ndarray:
        """The sorted int32 indices every worker draws for (seed, ctx.name, ctx.step)."""
        return sample_indices(numel, self.keep(numel), key_seed(self.seed, ctx.name, ctx.step))

    def factor(self, numel: int) -> np.float32:
        """The float32 factor applied to the values (numel / k when scaling, else 1)."""
        return np.float32(numel / self.keep(numel)) if self.scale else np.float32(1.0)


@register
class RandomKTorch(_RandomK, SparseTorch):
    def encode(self, flat: torch.Tensor, ctx: Ctx) -> Payload:
        idx = torch.from_numpy(self.indices(flat.numel(), ctx)).to(flat.device)
        values = flat[idx.long()]
        if not bool(torch.isfinite(values).all()):
            raise self.non_finite(ctx)
        if self.scale:
            values = values * torch.tensor(self.factor(flat.numel()), device=flat.device)
        return values, idx


@register
class RandomKNumba(_RandomK, SparseNumba):
    def encode(self, flat: np.ndarray, ctx: Ctx) -> Payload:
        idx = self.indices(flat.size, ctx)
        values = flat[idx]
        if not np.isfinite(values).all():
            raise self.non_finite(ctx)
        if self.scale:
            values *= self.factor(flat.size)
        return values, idx
