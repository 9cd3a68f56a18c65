"""Extents, shards and names shared by the executor and the reference interpreter.

These are the few pure facts both interpreters of an Option must agree on bit for bit; the
step semantics themselves are written twice on purpose (``executor.py`` over real transports,
``reference.py`` over a list of per-worker tensors) so that one is the other's oracle.

- An :class:`Extent` is a contiguous range ``[offset, offset + numel)`` of the flattened tensor.
- :func:`split` cuts an extent into ``n`` shards as ``torch.tensor_split`` does: the first
  ``numel % n`` shards are one element longer. Member ``i`` of a group owns shard ``i``.
- :func:`codec_name` names one compression (its error-feedback residual and its random draws):
  tensor name, step index in the Option, and the absolute extent, so the same value on every
  worker that compresses the same range at the same step (random-k draws agree) and distinct
  for two compressions of one tensor in one Option.
- :func:`ps_key` names the parameter-server key of one PushPull/PushPullC step.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Extent", "codec_name", "ps_key", "split"]


@dataclass(frozen=True, order=True)
class Extent:
    """The range ``[offset, offset + numel)`` of a flattened tensor."""

    offset: int
    numel: int

    @property
    def end(self) -> int:
        return self.offset + self.numel

    def __str__(self) -> str:
        return f"[{self.offset}:{self.end}]"


def split(extent: Extent, parts: int) -> list[Extent]:
    """Cut ``extent`` into ``parts`` shards the way ``torch.tensor_split`` does.

    Args:
        extent: the range to cut.
        parts: number of shards (the group size), >= 1.

    Returns:
        ``parts`` extents in order; the first ``numel % parts`` are one element longer.
        Shards may be empty when ``numel < parts``.

    Raises:
        ValueError: ``parts`` < 1.
    """
    if parts < 1:
        raise ValueError(f"cannot split into {parts} shards; need at least 1")
    base, extra = divmod(extent.numel, parts)
    out = []
    offset = extent.offset
    for i in range(parts):
        n = base + (1 if i < extra else 0)
        out.append(Extent(offset, n))
        offset += n
    return out


def codec_name(tensor: str, step_index: int, extent: Extent) -> str:
    """The compression name (ctx name) of ``tensor``'s range ``extent`` at step ``step_index``."""
    return f"{tensor}#{step_index}{extent}"


def ps_key(tensor: str, step_index: int, extent: Extent) -> str:
    """The PS key of ``tensor``'s range ``extent`` pushed at step ``step_index``."""
    return f"{tensor}#{step_index}{extent}"
