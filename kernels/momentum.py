"""DGC momentum correction (Lin et al., ICLR 2018, sections 3.2 and 3.3) as a wrapper.

Per tensor name it keeps a velocity ``u`` and an accumulation ``v``::

    x <- x * min(1, c / |x|)       # local gradient clipping (c = clip_norm / sqrt(workers))
    u <- momentum * u + x          # momentum correction: accumulate velocity, not gradients
    v <- v + u                     # local accumulation (error feedback of the velocity)
    payload = inner.compress(v); d = inner.decompress(payload)
    v <- v - d                     # what was sent leaves the accumulation
    u <- 0 where d != 0            # momentum factor masking (when masking=True)

It wraps any compressor (meant for the sparsifiers topk/dgc/randomk) and already contains
error feedback: do not stack it with :class:`ErrorFeedback`. The optimizer then runs without
its own momentum on the aggregated update.

Clipping happens before the gradient enters the velocity, with the paper's local threshold:
the global threshold scaled by ``workers ** -0.5`` (each worker's share if all had the same
gradient distribution). The norm is exact (``_exact.l2_norm``) and the factor is applied
with one float32 multiplication, so both backends clip identically.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from byteps_espresso.kernels._exact import l2_norm
from byteps_espresso.kernels.base import Compressor, Ctx, Payload
from byteps_espresso.kernels.wrapper import Wrapper

__all__ = ["MomentumCorrection", "clip_factor"]


def clip_factor(norm: float, clip_norm: float | None, workers: int = 1) -> np.float32:
    """The float32 factor DGC's local clipping applies to a gradient of L2 norm ``norm``.

    ``min(1, clip_norm / sqrt(workers) / norm)``; 1 when ``clip_norm`` is None.
    """
    if clip_norm is None:
        return np.float32(1.0)
    local = clip_norm / workers**0.5
    return np.float32(local / norm) if norm > local else np.float32(1.0)


class MomentumCorrection(Wrapper):
    """Momentum correction and factor masking around a compressor.

    Args:
        inner: the compressor to wrap.
        momentum: the momentum coefficient in [0, 1).
        masking: zero the velocity where a value was sent (DGC's momentum factor masking).
        clip_norm: the global gradient-norm threshold of local clipping; None: no clipping.
        workers: the number of workers (the local threshold is ``clip_norm / sqrt(workers)``).
    """

    state_slots = ("velocity", "accumulated")

    def __init__(self, inner: Compressor, momentum: float = 0.9, masking: bool = True,
                 clip_norm: float | None = None, workers: int = 1) -> None:
        super().__init__(inner)
        if isinstance(momentum, bool) or not isinstance(momentum, int | float) \
                or not 0 <= momentum < 1:
            raise ValueError(f"MomentumCorrection: momentum must be in [0, 1), got {momentum!r}")
        if clip_norm is not None and (isinstance(clip_norm, bool) or not isinstance(
                clip_norm, int | float) or not clip_norm > 0):
            raise ValueError(f"MomentumCorrection: clip_norm must be a positive number or "
                             f"None (no clipping), got {clip_norm!r}")
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise ValueError(f"MomentumCorrection: workers must be an integer >= 1, "
                             f"got {workers!r}")
        self.momentum = float(momentum)
        self.masking = bool(masking)
        self.clip_norm = None if clip_norm is None else float(clip_norm)
        self.workers = workers

    def compress(self, x: Any, *, name: str = "", step: int = 0) -> tuple[Payload, Ctx]:
        """Compress the accumulated, momentum-corrected update of tensor ``name``."""
        self.checked(x, name)
        if self.clip_norm is not None:
            factor = clip_factor(l2_norm(x.reshape(-1)), self.clip_norm, self.workers)
            if factor != 1:
                x = x * (torch.tensor(factor, device=x.device) if isinstance(x, torch.Tensor)
                         else factor)
        u = self.saved(name, x, "velocity") * self.momentum + x
        v = self.saved(name, x, "accumulated") + u
        payload, ctx = self.inner.compress(v, name=name, step=step)
        sent = self.inner.decompress(payload, ctx)
        if self.masking:
            u = torch.where(sent != 0, 0.0, u) if isinstance(u, torch.Tensor) \
                else np.where(sent != 0, np.float32(0), u)
        self.save(name, velocity=u, accumulated=v - sent)
        return payload, ctx
