"""terngrad: unbiased ternary quantization (Wen et al., NeurIPS 2017).

Each entry becomes ``s * sign(x) * b`` with ``s = max|x|`` and ``b ~ Bernoulli(|x| / s)``,
so ``E = x`` (unbiased). This is QSGD with one level scaled by the max norm, so it reuses
:mod:`qsgd`'s kernels: 2-bit codes (0: -s, 1: 0, 2: +s), 4 per byte.
Payload: ``(uint8[ceil(numel / 4)], float32[1] s)``. Draws from ``key_seed(seed, name,
step)``, identical on both backends. NaN/Inf input raises :class:`NonFiniteError`.
(TernGrad's optional gradient clipping is left to the training loop.)
"""

from __future__ import annotations

from typing import Any, ClassVar

from byteps_espresso.kernels.qsgd import QsgdNumba, QsgdTorch
from byteps_espresso.kernels.registry import register

WIRE_ID = 12


class _TernGrad:
    name = "terngrad"
    wire_id = WIRE_ID
    defaults: ClassVar[dict[str, Any]] = {"seed": 0}
    norm_kind: ClassVar[str] = "max"


@register
class TernGradTorch(_TernGrad, QsgdTorch):
    pass


@register
class TernGradNumba(_TernGrad, QsgdNumba):
    pass
