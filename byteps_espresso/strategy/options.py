"""Options: the per-tensor program that the planner prices and the executor runs.

An :class:`Option` is a short sequence of :class:`Step` values, written like

    Comp(gpu) -> AlltoallC(intra) -> Decomp(gpu) -> Comp(cpu) -> PushPullC(inter)
              -> Decomp(cpu) -> Allgather(intra)

The same value is enumerated by the decision tree (``tree.py``), priced by the cost model and
timeline, serialized into strategy files by its step names, and interpreted by the worker's
executor. Which step may follow which lives in the decision tree only; this module defines
the vocabulary and what each step does to the tensor, which every interpreter follows.

What each step does, on every worker of the step's scope group
-----------------------------------------------------------------
The tensor is always in one *form* (dense values or a compressed payload) and covers one
*extent* (the full tensor, this worker's shard, or nothing on non-root members).

Scopes: ``flat`` = all workers; ``intra`` = the workers of one machine; ``inter`` = one
worker per machine with the same local rank (after a divisible intra step each local rank
owns one shard and its inter group exchanges that shard; after ``Reduce``/``GatherC`` only
local rank 0 holds data and only its inter group communicates).

Shards: a divisible step splits the current extent into ``group size`` contiguous chunks as
``torch.tensor_split`` does (the first ``numel % n`` chunks one element longer); member ``i``
of the group owns chunk ``i``.

- ``Comp(d)``       dense -> payload, on device ``d``, with the job's compressor. If the next
  communication step is ``AlltoallC`` the extent is compressed chunk by chunk (one payload
  per destination). ``Comp(d,fp16)`` compresses with the named compressor instead (a
  *partner*: mixed compressors in one Option, e.g. fp16 inside the machine and the job's
  compressor between machines); ``Decomp(d,fp16)`` decodes its payloads.
- ``Decomp(d)``     payload(s) -> dense, on device ``d``; after a gather-like step
  (``AllgatherC``, ``AlltoallC``, ``GatherC``) it decompresses each received payload and sums
  them in group-rank order.
- ``Allreduce(s)``      dense -> dense sum over the group.
- ``ReduceScatter(s)``  dense -> this member's shard of the group sum.
- ``Allgather(s)``      dense shard -> concatenation of every member's shard (undoes a
  ``ReduceScatter`` or ``AlltoallC`` of the same scope).
- ``Reduce(s)``         dense -> group sum on the group root (rank 0 of the group); other
  members hold nothing until the matching ``Broadcast``/``BroadcastC``.
- ``Broadcast(s)``      the root's dense -> every member.
- ``AllreduceC(s)``     payload -> the sum of the members' payloads, as a payload, summed
  inside the collective in the payload's own dtype (each addition rounded to it). Only for a
  compressor whose payloads sum (``Capabilities.linear``: fp16, the cast DDP's
  ``fp16_compress_hook`` all-reduces); ``Decomp`` then decodes one payload.
- ``AllgatherC(s)``     payload -> every member's payload (a list, in group-rank order).
  When it closes a ``ReduceScatter(s)``/``AlltoallC(s)`` of the same scope (the second half
  of a divisible scheme) the payloads are *shards*: the next ``Decomp`` decodes each and
  concatenates them, as ``Allgather`` does for dense shards; otherwise ``Decomp`` sums them.
- ``AlltoallC(s)``      per-destination payloads -> the payloads of this member's shard from
  every member (a list).
- ``GatherC(s)``        payload -> the list of every member's payload, on the root only.
- ``BroadcastC(s)``     the root's payload -> every member; ``Decomp`` then decodes it.
- Forwarding: a summing ``AllgatherC``, a ``GatherC`` or a ``BroadcastC`` may find the list of
  payloads an earlier gathering step left instead of one payload; it moves the whole list
  undecoded (the gatherers concatenate every member's list in group-rank order, the broadcast
  hands the root's list on), and the ``Decomp`` at the end decodes and sums all of them.
- ``PushPull(s)``       dense -> dense sum over the pushing workers, through the PS servers.
- ``PushPullC(s)``      payload -> the servers' aggregate (decompressed, summed in rank
  order, re-compressed), as a payload.

At the end of an Option every worker holds the dense sum over all workers of the full
tensor; averaging, if asked for, is the caller's division by the world size.
"""

from __future__ import annotations

import enum
import functools
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

__all__ = ["COLLECTIVES", "ROUNDING", "Device", "Kind", "Option", "OptionError", "Scope", "Step"]


class OptionError(ValueError):
    """A step or option string cannot be parsed, or an option is not valid."""


class Device(str, enum.Enum):
    GPU = "gpu"  # the training device (the CPU in tests without CUDA); torch backend
    CPU = "cpu"  # host threads running numba kernels


class Scope(str, enum.Enum):
    FLAT = "flat"
    INTRA = "intra"
    INTER = "inter"


class Kind(str, enum.Enum):
    COMP = "Comp"
    DECOMP = "Decomp"
    ALLREDUCE = "Allreduce"
    ALLREDUCE_C = "AllreduceC"
    REDUCE_SCATTER = "ReduceScatter"
    ALLGATHER = "Allgather"
    REDUCE = "Reduce"
    BROADCAST = "Broadcast"
    ALLGATHER_C = "AllgatherC"
    ALLTOALL_C = "AlltoallC"
    GATHER_C = "GatherC"
    BROADCAST_C = "BroadcastC"
    PUSH_PULL = "PushPull"
    PUSH_PULL_C = "PushPullC"

    @property
    def is_compute(self) -> bool:
        return self in (Kind.COMP, Kind.DECOMP)

    @functools.cached_property
    def is_compressed(self) -> bool:
        """A communication step that moves payloads rather than dense values."""
        return self in _COMPRESSED

    @property
    def gathers(self) -> bool:
        """A step after which ``Decomp`` has several payloads to decode and sum."""
        return self in (Kind.ALLGATHER_C, Kind.ALLTOALL_C, Kind.GATHER_C)


_COMPRESSED = frozenset({Kind.ALLREDUCE_C, Kind.ALLGATHER_C, Kind.ALLTOALL_C, Kind.GATHER_C,
                         Kind.BROADCAST_C, Kind.PUSH_PULL_C})
COLLECTIVES = tuple(k for k in Kind if not k.is_compute)

_STEP_RE = re.compile(r"^\s*([A-Za-z]+)\(\s*([a-z]+)\s*(?:,\s*([a-z][a-z0-9_]*)\s*)?\)\s*$")

# Partner compressors whose error is a rounding of each element, not a loss of information
# (fp16: 11 significant bits, relative error at most 2^-11 = 4.9e-4 per element; DDP's
# fp16_compress_hook runs whole trainings on it): they do not count under ``max_lossy``.
ROUNDING = frozenset({"fp16"})


@dataclass(frozen=True, order=True)
class Step:
    """One step: a compute step on a device, or a communication step in a scope."""

    kind: Kind
    device: Device | None = None
    scope: Scope | None = None
    # Comp/Decomp only: the compressor, when not the job's (None); see ``Comp(d,fp16)``.
    codec: str | None = None
    _hash: int = field(default=0, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # Steps key the planner's tables thousands of times: hash once.
        object.__setattr__(self, "_hash", hash((self.kind, self.device, self.scope,
                                                self.codec)))
        if self.kind.is_compute:
            if self.device is None or self.scope is not None:
                raise OptionError(f"{self.kind.value} needs a device (gpu or cpu) and no scope")
        elif self.scope is None or self.device is not None or self.codec is not None:
            raise OptionError(f"{self.kind.value} needs a scope (flat, intra or inter) "
                              "and no device or compressor")

    def __hash__(self) -> int:
        return self._hash

    @property
    def arg(self) -> str:
        return (self.device or self.scope).value  # type: ignore[union-attr]

    def __str__(self) -> str:
        codec = f",{self.codec}" if self.codec is not None else ""
        return f"{self.kind.value}({self.arg}{codec})"

    def on(self, device: Device) -> Step:
        """This compute step on ``device`` (its compressor kept)."""
        return Step(self.kind, device=device, codec=self.codec)

    def with_codec(self, codec: str | None) -> Step:
        """This compute step with compressor ``codec`` (None: the job's), on its device."""
        return Step(self.kind, device=self.device, codec=codec)

    @classmethod
    def parse(cls, text: str) -> Step:
        """Parse ``"Comp(gpu)"``, ``"Decomp(cpu,fp16)"`` or ``"AlltoallC(intra)"``.

        Raises:
            OptionError: unknown step kind, device or scope (the message lists valid ones).
        """
        match = _STEP_RE.match(text)
        if not match:
            raise OptionError(f"cannot parse step {text!r}; write it like 'Comp(gpu)' or "
                              "'Allreduce(flat)'")
        kind_name, arg, codec = match.groups()
        try:
            kind = Kind(kind_name)
        except ValueError:
            raise OptionError(f"unknown step {kind_name!r}; known steps: "
                              f"{', '.join(k.value for k in Kind)}") from None
        if kind.is_compute:
            try:
                device = Device(arg)
            except ValueError:
                raise OptionError(f"unknown device {arg!r} in {text!r}; use gpu or cpu") from None
            return cls(kind, device=device, codec=codec)
        if codec is not None:
            raise OptionError(f"{text!r}: only Comp and Decomp name a compressor")
        try:
            return cls(kind, scope=Scope(arg))
        except ValueError:
            raise OptionError(f"unknown scope {arg!r} in {text!r}; use flat, intra or inter") \
                from None


@dataclass(frozen=True, order=True)
class Option:
    """A per-tensor program: a tuple of steps."""

    steps: tuple[Step, ...]
    _hash: int = field(default=0, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_hash", hash(self.steps))

    def __hash__(self) -> int:
        return self._hash

    @classmethod
    def of(cls, *steps: Step | str) -> Option:
        return cls(tuple(s if isinstance(s, Step) else Step.parse(s) for s in steps))

    @classmethod
    def parse(cls, text: str | Sequence[str]) -> Option:
        """Parse ``"Comp(gpu) -> Allreduce(flat)"`` or a list of step names."""
        parts: Iterable[str] = text.split("->") if isinstance(text, str) else text
        steps = tuple(Step.parse(p) for p in parts)
        if not steps:
            raise OptionError("an option needs at least one step")
        return cls(steps)

    def names(self) -> list[str]:
        """The step names, as stored in strategy files."""
        return [str(s) for s in self.steps]

    def __str__(self) -> str:
        return " -> ".join(self.names())

    def __len__(self) -> int:
        return len(self.steps)

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(self.steps)

    @functools.cached_property
    def compressions(self) -> int:
        return sum(1 for s in self.steps if s.kind is Kind.COMP)

    @functools.cached_property
    def lossy_compressions(self) -> int:
        """Lossy compressions a gradient goes through per iteration: every ``Comp`` but a
        partner's rounding (:data:`ROUNDING`), plus the servers' re-compression of the sum
        for each ``PushPullC``."""
        return sum(1 for s in self.steps if (s.kind is Kind.COMP and s.codec not in ROUNDING)
                   or s.kind is Kind.PUSH_PULL_C)

    @functools.cached_property
    def partners(self) -> frozenset[str]:
        """The partner compressors its steps name (empty: the job's compressor only)."""
        return frozenset(s.codec for s in self.steps if s.codec is not None)

    @functools.cached_property
    def is_compressed(self) -> bool:
        return self.compressions > 0

    @functools.cached_property
    def devices(self) -> frozenset[Device]:
        return frozenset(s.device for s in self.steps if s.device is not None)

    @functools.cached_property
    def uses_cpu(self) -> bool:
        return Device.CPU in self.devices

    @functools.cached_property
    def uses_servers(self) -> bool:
        return any(s.kind in (Kind.PUSH_PULL, Kind.PUSH_PULL_C) for s in self.steps)

    @functools.cached_property
    def is_hierarchical(self) -> bool:
        return any(s.scope is Scope.INTRA for s in self.steps)
