"""Error feedback (Seide et al. 2014; Karimireddy et al. 2019) as a wrapper of any compressor.

``compress(x)`` sends ``c = x + r`` through the wrapped compressor and keeps the residual
``r <- c - decompress(payload)`` per tensor name. Over any number of steps,
``sum(decompressed) + r_final == sum(inputs)`` (exactly in real arithmetic, within float32
rounding in practice). The same wrapper serves a parameter server that re-compresses an
aggregate (key the residual by the server key).

Example:
    >>> import numpy as np
    >>> from byteps_espresso.kernels import ErrorFeedback, create
    >>> ef = ErrorFeedback(create("topk", backend="numba", ratio=0.5))
    >>> payload, ctx = ef.compress(np.ones(4, np.float32), name="w", step=0)
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from byteps_espresso.kernels.base import Ctx, Payload
from byteps_espresso.kernels.wrapper import Wrapper

__all__ = ["ErrorFeedback"]


class ErrorFeedback(Wrapper):
    """Keeps the compression error of each tensor and adds it to the next input.

    Args:
        inner: the compressor to wrap (any algorithm, either backend).
    """

    state_slots = ("residual",)

    def compress(self, x: Any, *, name: str = "", step: int = 0) -> tuple[Payload, Ctx]:
        """Compress ``x + residual[name]`` and keep the new residual.

        Raises:
            ValueError / TypeError: as the wrapped compressor; the residual is unchanged.
        """
        self.checked(x, name)
        corrected = x + self.saved(name, x, "residual")
        payload, ctx = self.inner.compress(corrected, name=name, step=step)
        if any(_overlaps(a, corrected) for a in payload):  # the payload holds the input
            self.save(name, residual=corrected - self.inner.decompress(payload, ctx))
        else:  # a new array each time: an exported state is never written again
            self.inner.subtract_decoded(payload, ctx, corrected)
            self.save(name, residual=corrected)
        return payload, ctx

    def residual(self, name: str) -> Any:
        """The current residual of tensor ``name`` (None before its first compression)."""
        return self.state.get(name, {}).get("residual")


def _overlaps(a: Any, b: Any) -> bool:
    """Whether payload array ``a`` may share memory with ``b`` (same array type)."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    if isinstance(a, np.ndarray) and isinstance(b, np.ndarray):
        return bool(np.may_share_memory(a, b))
    return False
