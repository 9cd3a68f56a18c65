"""DGC momentum correction (Lin et al., ICLR 2018, section 3.2) as a wrapper.

Per tensor name it keeps a velocity ``u`` and an accumulation ``v``::

    u <- momentum * u + x          # momentum correction: accumulate velocity, not gradients
    v <- v + u                     # local accumulation (error feedback of the velocity)
    payload = inner.compress(v); d = inner.decompress(payload)
    v <- v - d                     # what was sent leaves the accumulation
    u <- 0 where d != 0            # momentum factor masking (when masking=True)

It wraps any compressor (meant for the sparsifiers topk/dgc/randomk) and already contains
error feedback: do not stack it with :class:`ErrorFeedback`. The optimizer then runs without
its own momentum on the aggregated update.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from byteps_espresso.kernels.base import Compressor, Ctx, Payload
from byteps_espresso.kernels.wrapper import Wrapper

__all__ = ["MomentumCorrection"]


class MomentumCorrection(Wrapper):
    """Momentum correction and factor masking around a compressor.

    Args:
        inner: the compressor to wrap.
        momentum: the momentum coefficient in [0, 1).
        masking: zero the velocity where a value was sent (DGC's momentum factor masking).
    """

    def __init__(self, inner: Compressor, momentum: float = 0.9, masking: bool = True) -> None:
        super().__init__(inner)
        if isinstance(momentum, bool) or not isinstance(momentum, int | float) \
                or not 0 <= momentum < 1:
            raise ValueError(f"MomentumCorrection: momentum must be in [0, 1), got {momentum!r}")
        self.momentum = float(momentum)
        self.masking = bool(masking)

    def compress(self, x: Any, *, name: str = "", step: int = 0) -> tuple[Payload, Ctx]:
        """Compress the accumulated, momentum-corrected update of tensor ``name``."""
        self.checked(x, name)
        u = self.saved(name, x, "velocity") * self.momentum + x
        v = self.saved(name, x, "accumulated") + u
        payload, ctx = self.inner.compress(v, name=name, step=step)
        sent = self.inner.decompress(payload, ctx)
        if self.masking:
            u = torch.where(sent != 0, 0.0, u) if isinstance(u, torch.Tensor) \
                else np.where(sent != 0, np.float32(0), u)
        self.save(name, velocity=u, accumulated=v - sent)
        return payload, ctx
