"""signum: sign of a per-tensor momentum (Bernstein et al., ICML 2018).

``m <- momentum * m + (1 - momentum) * x`` (float32, kept per tensor name in the compressor),
then the sign bits of ``m`` are sent exactly like :mod:`signsgd` (decodes to +-1).
The update is two separately rounded float32 products and a sum on both backends, so they
keep identical momenta and payloads. NaN/Inf input raises :class:`NonFiniteError` and leaves
the momentum untouched.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np
import torch
from byteps_espresso.kernels.base import Ctx, Payload
from byteps_espresso.kernels.registry import register
from byteps_espresso.kernels.signsgd import (
    SignSgdNumba,
    SignSgdTorch,
    signs_numba,
    signs_torch,
)
from numba import njit, prange

WIRE_ID = 9


@njit(parallel=True, cache=True)
def momentum_update(m, x, beta, one_minus_beta, out):  # pragma: no cover
    """out = beta * m + (1 - beta) * x (each product rounded to float32); returns NaN/Inf count.

    ``m`` is left untouched so that a refused input does not poison the state.
    """
    u = x.view(np.uint32)
    bad = 0
    for i in prange(m.size):
        out[i] = beta * m[i] + one_minus_beta * x[i]
        bad += (u[i] & np.uint32(0x7F800000)) == np.uint32(0x7F800000)
    return bad


class _Signum:
    name = "signum"
    wire_id = WIRE_ID
    defaults: ClassVar[dict[str, Any]] = {"momentum": 0.9}

    def validate_params(self) -> None:
        beta = self.params["momentum"]
        if isinstance(beta, bool) or not isinstance(beta, int | float) or not 0 <= beta < 1:
            raise ValueError(f"signum: momentum must be a number in [0, 1), got {beta!r}")
        self.beta = np.float32(beta)
        self.one_minus_beta = np.float32(1.0 - beta)
        self.momenta: dict[str, Any] = {}

    state_slots = ("momentum",)

    def export_state(self) -> dict[str, dict[str, Any]]:
        return {name: {"momentum": m} for name, m in self.momenta.items()}

    def import_state(self, state: dict[str, dict[str, Any]]) -> None:
        super().import_state(state)  # type: ignore[misc]  # checks the slots
        self.momenta = {name: slots["momentum"] for name, slots in state.items()
                        if "momentum" in slots}

    def _momentum(self, flat: Any, ctx: Ctx, zeros: Any) -> Any:
        m = self.momenta.get(ctx.name)
        return zeros if m is None or m.shape != flat.shape else m


@register
class SignumTorch(_Signum, SignSgdTorch):
    def encode(self, flat: torch.Tensor, ctx: Ctx) -> Payload:
        if not bool(torch.isfinite(flat).all()):
            raise self.non_finite(ctx)
        m = self._momentum(flat, ctx, torch.zeros_like(flat))
        m = m * float(self.beta) + flat * float(self.one_minus_beta)
        self.momenta[ctx.name] = m
        return (signs_torch(m, self, ctx),)


@register
class SignumNumba(_Signum, SignSgdNumba):
    def encode(self, flat: np.ndarray, ctx: Ctx) -> Payload:
        m = np.empty_like(flat)
        bad = momentum_update(self._momentum(flat, ctx, np.zeros_like(flat)), flat, self.beta,
                              self.one_minus_beta, m)
        if bad:
            raise self.non_finite(ctx)
        self.momenta[ctx.name] = m
        return (signs_numba(m, self, ctx),)
