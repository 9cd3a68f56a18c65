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
- A payload is a list of *pieces*: one per compressed range. :func:`pieces` lists them for
  an extent and the step that produced them (``program.Origin``): one piece named by
  :func:`codec_name` after a ``Comp``, or one per PS partition (named and split as the PS
  does, ``server.keys``) after a ``Comp`` that feeds ``PushPullC`` and after ``PushPullC``
  itself. Every member of a group can list the pieces of any member's extent, so payloads of
  known lengths travel without any header. The ctx step of every piece is the tensor's
  iteration, which is also the PS round of its keys.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from byteps_espresso.strategy.options import Step
from byteps_espresso.strategy.program import Op, Origin

__all__ = ["At", "Extent", "Piece", "codec_name", "piece_names", "pieces", "ps_key", "split"]


@dataclass(frozen=True)
class At:
    """Where an interpreter is in an Option: step index, step, tensor name, iteration, all
    the Option's steps and the step's compiled :class:`~byteps_espresso.strategy.program.Op`."""

    i: int
    st: Step
    name: str
    step: int
    steps: Sequence[Step] = ()
    op: Op | None = None


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


def ps_key(tensor: str, step_index: int, extent: Extent, compressed: bool = False) -> str:
    """The PS key of ``tensor``'s range ``extent`` pushed at step ``step_index``."""
    return f"{tensor}#{step_index}{'c' if compressed else ''}{extent}"


@dataclass(frozen=True)
class Piece:
    """One compressed range: its extent and the ctx (name, step) it is encoded with."""

    extent: Extent
    name: str
    step: int


def piece_names(tensor: str, origin: Origin, extent: Extent,
                partition_bytes: int) -> list[tuple[Extent, str]]:
    """(extent, ctx name) of each piece of ``tensor``'s range ``extent`` made by ``origin``
    (none when empty): what :func:`pieces` stamps with the iteration."""
    if extent.numel == 0:
        return []
    if not origin.ps:
        return [(extent, codec_name(tensor, origin.index, extent))]
    from byteps_espresso.server.keys import part_names
    from byteps_espresso.server.keys import split as ps_split

    key = ps_key(tensor, origin.index, extent, compressed=True)
    parts = ps_split(extent.numel, 4, partition_bytes)  # float32 partitions, as the PS splits
    return [(Extent(extent.offset + o, n), part)
            for (o, n), part in zip(parts, part_names(key, len(parts)), strict=True)]


def pieces(tensor: str, origin: Origin, extent: Extent, partition_bytes: int,
           step: int) -> list[Piece]:
    """The pieces of ``tensor``'s range ``extent`` made by ``origin`` in iteration ``step``."""
    return [Piece(e, name, step) for e, name in piece_names(tensor, origin, extent,
                                                            partition_bytes)]
