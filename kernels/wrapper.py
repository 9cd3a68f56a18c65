"""Base of the stateful wrappers (error feedback, momentum correction).

A wrapper has the interface of the compressor it wraps: the same name, wire id, payload
layout and decoder, so a receiver never knows a wrapper was used. Only ``compress`` differs:
it transforms the input with per-tensor state (keyed by ``name``) before compressing.
Wrappers work on either backend: the state has the array type of the input.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from byteps_espresso.kernels.base import Compressor, Ctx, Payload, check_input

__all__ = ["Wrapper"]


class Wrapper(Compressor):
    """Delegates the whole contract to ``inner``; subclasses override :meth:`compress`."""

    def __init__(self, inner: Compressor) -> None:
        if not isinstance(inner, Compressor):
            raise TypeError(f"{type(self).__name__} wraps a Compressor, got "
                            f"{type(inner).__name__}; build one with kernels.create(...)")
        self.inner = inner
        self.name = inner.name
        self.wire_id = inner.wire_id
        self.backend = inner.backend
        self.payload_dtypes = inner.payload_dtypes
        self.defaults = inner.defaults
        self.deterministic = inner.deterministic
        self.capabilities = inner.capabilities
        self.unbiased = False
        self.params = inner.params
        self.state: dict[str, Any] = {}

    def export_state(self) -> dict[str, dict[str, Any]]:
        """This wrapper's slots and the wrapped compressor's, per tensor name."""
        out = {name: dict(slots) for name, slots in self.state.items()}
        for name, slots in self.inner.export_state().items():
            out.setdefault(name, {}).update(slots)
        return out

    def import_state(self, state: dict[str, dict[str, Any]]) -> None:
        """Replace this wrapper's state and the wrapped compressor's (each takes its slots).

        Raises:
            ValueError: a slot neither this wrapper nor the wrapped compressor keeps.
        """
        mine = {name: {s: a for s, a in slots.items() if s in self.state_slots}
                for name, slots in state.items()}
        rest = {name: {s: a for s, a in slots.items() if s not in self.state_slots}
                for name, slots in state.items()}
        self.inner.import_state({n: slots for n, slots in rest.items() if slots})
        self.state = {n: slots for n, slots in mine.items() if slots}

    def reset(self, name: str | None = None) -> None:
        """Forget the state of tensor ``name`` (of every tensor when None)."""
        if name is None:
            self.state.clear()
        else:
            self.state.pop(name, None)

    def checked(self, x: Any, name: str) -> Any:
        """Validate ``x`` like the inner compressor would (before any state is touched)."""
        self.inner._check_array_type(x, "input")
        check_input(x, f"{self.name}: tensor {name!r}")
        return x

    def saved(self, name: str, x: Any, key: str = "") -> Any:
        """The state ``key`` of tensor ``name``, or zeros like ``x`` when there is none.

        Raises:
            ValueError: the saved state has another shape (the name was reused).
        """
        slot = self.state.get(name, {}).get(key)
        if slot is None:
            return torch.zeros_like(x) if isinstance(x, torch.Tensor) else np.zeros_like(x)
        if tuple(slot.shape) != tuple(x.shape):
            raise ValueError(f"{type(self).__name__}: tensor {name!r} has shape "
                             f"{tuple(x.shape)} but its saved state has {tuple(slot.shape)}; "
                             f"call reset({name!r}) when a name is reused for another shape")
        return slot

    def save(self, name: str, **slots: Any) -> None:
        """Store state arrays of tensor ``name``."""
        self.state.setdefault(name, {}).update(slots)

    # ---- delegation ---------------------------------------------------------------------------
    def encode(self, flat: Any, ctx: Ctx) -> Payload:
        return self.inner.encode(flat, ctx)

    def decode(self, payload: Payload, ctx: Ctx) -> Any:
        return self.inner.decode(payload, ctx)

    def decompress(self, payload: Payload, ctx: Ctx) -> Any:
        return self.inner.decompress(payload, ctx)

    def aggregate(self, payloads: Sequence[Payload], ctx: Ctx) -> Any:
        return self.inner.aggregate(payloads, ctx)

    def decompress_into(self, payload: Payload, ctx: Ctx, out: torch.Tensor) -> None:
        self.inner.decompress_into(payload, ctx, out)

    def subtract_decoded(self, payload: Payload, ctx: Ctx, out: Any) -> None:
        self.inner.subtract_decoded(payload, ctx, out)

    def compressed_nbytes(self, numel: int, step: int | None = None) -> int:
        return self.inner.compressed_nbytes(numel, step)

    def payload_lengths(self, numel: int, step: int | None = None) -> tuple[int, ...]:
        return self.inner.payload_lengths(numel, step)

    def stage(self, step: int | None) -> int | None:
        return self.inner.stage(step)

    @property
    def steady_step(self) -> int:
        return self.inner.steady_step

    def check_payload(self, payload: Payload, ctx: Ctx) -> None:
        self.inner.check_payload(payload, ctx)

    def context(self, shape: Sequence[int], dtype: str = "float32", *, name: str = "",
                step: int = 0) -> Ctx:
        return self.inner.context(shape, dtype, name=name, step=step)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.inner!r})"
