"""Single-process reference interpreter of an Option: the oracle of the executor's tests.

It runs one Option over a list of per-worker tensors (index = global rank) and returns each
worker's result, following the step semantics of :mod:`byteps_espresso.strategy.options`
literally: every group is visited explicitly, every sum is taken in group-rank order, and the
servers are modelled by :class:`ServerModel` (sum in pusher-rank order; decompress, sum and
re-compress for compressed keys). It shares with the executor only the pure layout helpers
(:mod:`.layout`) and the compressors themselves.

Decisions where the Option docstring leaves room (the executor makes the same ones):

- A payload is a list of pieces (:func:`~byteps_espresso.worker.layout.pieces`): ``Comp``
  before ``PushPullC`` compresses the extent partition by partition, as the PS splits the key,
  each partition with its key name and the iteration (= PS round) as ctx; the servers'
  aggregate keeps that layout, may travel on (``AllgatherC``/``BroadcastC``) and is decoded
  piece by piece by ``Decomp``.
- ``AllreduceC(s)`` sums the members' payloads piece by piece and array by array in the
  arrays' own dtype, in group-rank order (gloo's ring sums in ring order: the executor's sums
  equal these bit for bit where every partial sum is exact, as for dense float32 sums).
- ``AllgatherC(s)`` that follows a divisible step of scope ``s`` (``ReduceScatter`` or
  ``AlltoallC``) gathers *shards*: the next ``Decomp`` decodes each and concatenates them
  (undoing the split), exactly as ``Allgather`` does for dense shards. Otherwise every member
  compressed the same extent and ``Decomp`` sums the payloads in group-rank order.
- A summing ``AllgatherC``, a ``GatherC`` or a ``BroadcastC`` that finds the list of payloads
  an earlier gather left (SUM) forwards it undecoded: the gatherers collect every member's
  list (in group-rank order, each list in its own order), the broadcast hands the root's list
  to every member; the ``Decomp`` at the end sums all of them in that order.
- After ``Reduce(s)``/``GatherC(s)`` the non-root members sleep through every step until the
  ``Broadcast(s)``/``BroadcastC(s)`` that closes it; communication steps in between run only
  in groups whose members are awake (after an intra reduce: the inter group of local rank 0).
- Empty shards (fewer elements than members) are not compressed; their payload is ``()``.

Example:
    >>> ref = Reference(machines=2, local_size=2, codecs=[CodecPair("fp16") for _ in range(4)])
    >>> outs = ref.run(Option.parse("Comp(gpu) -> AllgatherC(flat) -> Decomp(gpu)"),
    ...                [torch.ones(5)] * 4, name="w", step=0)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from byteps_espresso.worker.codecs import CodecPair
from byteps_espresso.worker.layout import At, Extent, pieces, split
from byteps_espresso.worker.topology import Topology

from byteps_espresso.strategy.options import Kind, Option, OptionError, Scope, Step
from byteps_espresso.strategy.program import Form, Origin, compile_option

__all__ = ["Reference", "ServerModel"]


# Forms a worker's value can take between steps (program.Form).
DENSE, PAYLOAD, CHUNKS, SUM, CONCAT, NONE = (Form.DENSE, Form.PAYLOAD, Form.CHUNKS, Form.SUM,
                                             Form.CONCAT, Form.NONE)
Trace = Callable[[int, int, Form, Extent], None]


class ServerModel:
    """What the PS servers compute for one key and round.

    Dense keys: the float32 sum of the pushes in pusher-rank order. Compressed keys: each
    pushed payload decoded with the numba backend, summed in pusher-rank order, and the sum
    re-compressed with ``codec`` (the server-side compressor, error feedback included if it
    has it) under the partition's key name and the round, as ``server.server.aggregate`` does.
    """

    def __init__(self, codec: CodecPair | None = None) -> None:
        self.codec = codec

    def dense(self, pushes: Sequence[torch.Tensor]) -> torch.Tensor:
        total = pushes[0].detach().cpu().clone()
        for x in pushes[1:]:
            total += x.detach().cpu()
        return total

    def compressed(self, payloads: Sequence[tuple], numel: int, cname: str, step: int) -> tuple:
        if self.codec is None:
            raise OptionError("PushPullC needs a server codec in the reference interpreter")
        from byteps_espresso.strategy.options import Device

        total = self.codec.aggregate(Device.CPU, payloads, numel, cname, step)
        return self.codec.compress(Device.CPU, total, cname, step)


@dataclass
class _Worker:
    form: Form
    value: Any
    extent: Extent
    extents: list[Extent] = field(default_factory=list)  # one per payload (chunks/parts/concat)
    stack: list[tuple[str, Scope, Extent]] = field(default_factory=list)
    origin: Origin | None = None  # the step that made the current payload pieces
    asleep: Scope | None = None  # the Reduce/GatherC scope, until its Broadcast(C)
    who: frozenset[int] = frozenset()  # ranks whose values are summed into every element


class Reference:
    """Runs Options over per-worker tensors in one process.

    Args:
        machines: worker machines; ``local_size``: workers per machine.
        codecs: one :class:`CodecPair` per worker (each keeps its own error-feedback state),
            or None for uncompressed Options only.
        partners: per partner compressor that mixed Options name (``Comp(gpu,fp16)``), one
            :class:`CodecPair` per worker.
        server: the PS model for PushPull/PushPullC steps.
        partition_bytes: the PS's largest key (``BYTEPS_PARTITION_BYTES``); keys split as
            ``server.keys.split`` does, partitions named by ``server.keys.part_names``.
    """

    def __init__(self, machines: int, local_size: int, codecs: Sequence[CodecPair] | None = None,
                 server: ServerModel | None = None, partition_bytes: int = 4_096_000, *,
                 partners: Mapping[str, Sequence[CodecPair]] | None = None) -> None:
        self.topo = Topology(machines, local_size)
        self.codecs = list(codecs) if codecs is not None else None
        self.partners = {k: list(v) for k, v in (partners or {}).items()}
        self.server = server or ServerModel()
        self.partition_bytes = partition_bytes

    def _codec(self, rank: int, partner: str | None) -> CodecPair:
        if partner is not None:
            if partner not in self.partners:
                raise OptionError(f"this Option compresses with {partner}; give the reference "
                                  f"partners={{{partner!r}: one CodecPair per worker}}")
            return self.partners[partner][rank]
        if self.codecs is None:
            raise OptionError("this Option compresses; give the reference one CodecPair per worker")
        return self.codecs[rank]

    def run(self, option: Option, inputs: Sequence[torch.Tensor], *, name: str,
            step: int, trace: Trace | None = None) -> list[torch.Tensor]:
        """Run ``option`` on ``inputs`` (one tensor per global rank).

        ``trace(step index, rank, form, extent)`` is called for every worker after every
        step (tests compare it with the compiled program and the other interpreters).

        Returns:
            Each worker's final dense tensor (the sum over workers), shaped like its input.

        Raises:
            OptionError: the Option cannot be interpreted (a step finds the wrong form).
        """
        n = self.topo.world_size
        if len(inputs) != n:
            raise ValueError(f"need {n} inputs (one per worker), got {len(inputs)}")
        numel = inputs[0].numel()
        ws = [_Worker(DENSE, x.detach().reshape(-1).float().clone(), Extent(0, numel),
                      who=frozenset({r})) for r, x in enumerate(inputs)]
        prog = compile_option(option)
        steps = option.steps
        for i, st in enumerate(steps):
            at = At(i, st, name, step, steps, prog.ops[i])
            if st.kind.is_compute:
                for r, w in enumerate(ws):
                    if w.asleep is None:
                        self._compute(self._codec(r, st.codec), w, at)
            else:
                for members in self.topo.all_groups(st.scope):  # type: ignore[arg-type]
                    self._communicate([ws[r] for r in members], at)
            if trace is not None:
                for r, w in enumerate(ws):
                    trace(i, r, w.form, w.extent)
        for r, w in enumerate(ws):
            if w.form != DENSE or w.extent != Extent(0, numel) or w.stack or w.asleep:
                raise OptionError(f"{option} does not end with the full dense sum on rank {r}")
            if w.who != frozenset(range(n)):
                raise OptionError(f"{option} leaves rank {r} with the sum over ranks "
                                  f"{sorted(w.who)} only, not over all {n} workers")
        return [w.value.reshape(inputs[0].shape) for w in ws]

    # ---- compute steps -----------------------------------------------------------------------
    def _compute(self, codec: CodecPair, w: _Worker, at: At) -> None:
        st, i, name, step, op = at.st, at.i, at.name, at.step, at.op
        assert op is not None
        dev = st.device

        def parts(extent: Extent) -> list:
            return pieces(name, w.origin, extent, self.partition_bytes, step)  # type: ignore[arg-type]

        if st.kind is Kind.COMP:
            if w.form != DENSE:
                raise OptionError(f"step {i} {st}: needs dense values, holds {w.form}")
            w.origin = op.origin
            if op.chunks is not None:  # one payload per member of the next AlltoallC
                w.extents = split(w.extent, self.topo.size(op.chunks))
                base = w.extent.offset
                w.value = [codec.compress_pieces(dev, w.value[e.offset - base:e.end - base], e,
                                                 parts(e)) for e in w.extents]
                w.form = CHUNKS
                return
            w.value = codec.compress_pieces(dev, w.value, w.extent, parts(w.extent))
            w.form = PAYLOAD
            return
        if w.form == PAYLOAD:
            w.value = codec.decode_pieces(dev, w.value, parts(w.extent))
        elif w.form == SUM:
            w.value = codec.aggregate_pieces(dev, w.value, parts(w.extent))
        elif w.form == CONCAT:
            w.value = torch.cat([codec.decode_pieces(dev, m, parts(e))
                                 for m, e in zip(w.value, w.extents, strict=True)])
        else:
            raise OptionError(f"step {i} {st}: nothing to decompress (holds {w.form})")
        w.form = DENSE

    # ---- communication steps -----------------------------------------------------------------
    def _communicate(self, ws: list[_Worker], at: At) -> None:
        st, i = at.st, at.i
        scope, kind = st.scope, st.kind
        closes = kind in (Kind.BROADCAST, Kind.BROADCAST_C)
        awake = [w.asleep is None for w in ws]
        if closes and awake[0]:
            for w in ws[1:]:
                if w.asleep is scope:
                    w.asleep = None
            awake = [w.asleep is None for w in ws]
        if not all(awake):
            if any(awake):
                raise OptionError(f"step {i} {st}: some members of a {scope.value} group "
                                  "hold nothing (after a Reduce/GatherC of another scope)")
            return
        union = frozenset().union(*(w.who for w in ws if w.asleep is None))
        common = frozenset.intersection(*(w.who for w in ws if w.asleep is None))
        root_who = ws[0].who
        _COMM[kind](self, ws, at)
        for w in ws:
            if kind in (Kind.BROADCAST, Kind.BROADCAST_C):
                w.who = root_who
            elif w.form == CONCAT or kind is Kind.ALLGATHER:
                w.who = common
            else:
                w.who = union

    def _same_extent(self, ws: list[_Worker], st: Step, i: int) -> Extent:
        ext = ws[0].extent
        if any(w.extent != ext for w in ws):
            raise OptionError(f"step {i} {st}: members hold different extents")
        return ext

    def _need(self, ws: list[_Worker], form: str, st: Step, i: int) -> None:
        for w in ws:
            if w.form != form:
                raise OptionError(f"step {i} {st}: needs {form}, a member holds {w.form}")

    def _pop(self, ws: list[_Worker], what: str, st: Step, i: int) -> Extent:
        for w in ws:
            if not w.stack or w.stack[-1][:2] != (what, st.scope):
                raise OptionError(f"step {i} {st}: no open {what} of scope {st.scope.value} "
                                  "to close")
        parent = ws[0].stack[-1][2]
        for w in ws:
            w.stack.pop()
        return parent

    def _allreduce(self, ws: list[_Worker], at: At) -> None:
        st, i = at.st, at.i
        self._need(ws, DENSE, st, i)
        self._same_extent(ws, st, i)
        total = _rank_sum([w.value for w in ws])
        for w in ws:
            w.value = total.clone()

    def _reduce_scatter(self, ws: list[_Worker], at: At) -> None:
        st, i, k = at.st, at.i, len(ws)
        self._need(ws, DENSE, st, i)
        ext = self._same_extent(ws, st, i)
        shards = split(ext, k)
        sums = [_rank_sum([w.value[s.offset - ext.offset:s.end - ext.offset] for w in ws])
                for s in shards]
        for j, w in enumerate(ws):
            w.stack.append(("split", st.scope, ext))
            w.value, w.extent = sums[j], shards[j]

    def _allgather(self, ws: list[_Worker], at: At) -> None:
        st, i = at.st, at.i
        self._need(ws, DENSE, st, i)
        parent = self._pop(ws, "split", st, i)
        full = torch.cat([w.value for w in ws])
        for w in ws:
            w.value, w.extent = full.clone(), parent

    def _reduce(self, ws: list[_Worker], at: At) -> None:
        st, i = at.st, at.i
        self._need(ws, DENSE, st, i)
        ext = self._same_extent(ws, st, i)
        total = _rank_sum([w.value for w in ws])
        for j, w in enumerate(ws):
            w.stack.append(("root", st.scope, ext))
            if j == 0:
                w.value = total
            else:
                w.value, w.form, w.asleep = None, NONE, st.scope

    def _broadcast(self, ws: list[_Worker], at: At) -> None:
        st, i = at.st, at.i
        root = ws[0]
        if root.form not in ((DENSE,) if st.kind is Kind.BROADCAST else (PAYLOAD, SUM)):
            raise OptionError(f"step {i} {st}: the root holds {root.form}")
        parent = self._pop(ws, "root", st, i)
        if parent != root.extent:
            raise OptionError(f"step {i} {st}: root extent differs from the reduced one")
        for w in ws[1:]:
            w.form, w.extent, w.origin = root.form, root.extent, root.origin
            w.value = root.value.clone() if root.form == DENSE else list(root.value)

    def _allreduce_c(self, ws: list[_Worker], at: At) -> None:
        st, i = at.st, at.i
        self._need(ws, PAYLOAD, st, i)
        self._same_extent(ws, st, i)
        # piece by piece, array by array, in the payload's dtype and group-rank order
        total = [tuple(_rank_sum([_as_tensor(w.value[j][a]) for w in ws])
                       for a in range(len(piece)))
                 for j, piece in enumerate(ws[0].value)]
        for w in ws:
            w.value = [tuple(a.clone() for a in piece) for piece in total]

    def _allgather_c(self, ws: list[_Worker], at: At) -> None:
        st, i = at.st, at.i
        undo = at.op is not None and at.op.closes is not None
        if undo != all(w.stack and w.stack[-1][:2] == ("split", st.scope) for w in ws):
            raise OptionError(f"step {i} {st}: the program and the open splits disagree")
        payloads = self._payloads(ws, st, i, forward=not undo)
        if undo:
            parent = self._pop(ws, "split", st, i)
            extents = [w.extent for w in ws]
            for w in ws:
                w.form, w.value, w.extents, w.extent = CONCAT, list(payloads), extents, parent
        else:
            self._same_extent(ws, st, i)
            for w in ws:
                w.form, w.value = SUM, list(payloads)

    def _alltoall_c(self, ws: list[_Worker], at: At) -> None:
        st, i, k = at.st, at.i, len(ws)
        self._need(ws, CHUNKS, st, i)
        ext = self._same_extent(ws, st, i)
        chunks = [w.value for w in ws]
        for j, w in enumerate(ws):
            w.stack.append(("split", st.scope, ext))
            w.extent = w.extents[j]
            w.form, w.value = SUM, [chunks[src][j] for src in range(k)]

    def _payloads(self, ws: list[_Worker], st: Step, i: int, forward: bool) -> list:
        """Every member's payload in group-rank order; with ``forward``, members that hold
        gathered payloads (SUM) contribute each of them, in their list's order."""
        if forward and ws[0].form == SUM:
            self._need(ws, SUM, st, i)
            return [p for w in ws for p in w.value]
        self._need(ws, PAYLOAD, st, i)
        return [w.value for w in ws]

    def _gather_c(self, ws: list[_Worker], at: At) -> None:
        st, i = at.st, at.i
        payloads = self._payloads(ws, st, i, forward=True)
        ext = self._same_extent(ws, st, i)
        for j, w in enumerate(ws):
            w.stack.append(("root", st.scope, ext))
            if j == 0:
                w.form, w.value = SUM, payloads
            else:
                w.value, w.form, w.asleep = None, NONE, st.scope

    def _push_pull(self, ws: list[_Worker], at: At) -> None:
        st, i = at.st, at.i
        self._need(ws, DENSE, st, i)
        self._same_extent(ws, st, i)
        total = self.server.dense([w.value for w in ws]).to(ws[0].value.device)
        for w in ws:
            w.value = total.clone()

    def _push_pull_c(self, ws: list[_Worker], at: At) -> None:
        st, i = at.st, at.i
        self._need(ws, PAYLOAD, st, i)
        ext = self._same_extent(ws, st, i)
        lead = ws[0]
        if lead.origin is None or lead.origin != Origin(i, True):
            raise OptionError(f"step {i} {st}: needs the payload of the Comp just before it")
        out = [self.server.compressed([w.value[j] for w in ws], p.extent.numel, p.name, p.step)
               for j, p in enumerate(pieces(at.name, lead.origin, ext, self.partition_bytes,
                                            at.step))]
        for w in ws:
            w.value = list(out)


def _as_tensor(array: Any) -> torch.Tensor:
    return array if isinstance(array, torch.Tensor) else torch.from_numpy(array)


def _rank_sum(values: Sequence[torch.Tensor]) -> torch.Tensor:
    total = values[0].clone()
    for v in values[1:]:
        total += v
    return total


_COMM: dict[Kind, Callable[..., None]] = {
    Kind.ALLREDUCE: Reference._allreduce,
    Kind.REDUCE_SCATTER: Reference._reduce_scatter,
    Kind.ALLGATHER: Reference._allgather,
    Kind.REDUCE: Reference._reduce,
    Kind.BROADCAST: Reference._broadcast,
    Kind.BROADCAST_C: Reference._broadcast,
    Kind.ALLREDUCE_C: Reference._allreduce_c,
    Kind.ALLGATHER_C: Reference._allgather_c,
    Kind.ALLTOALL_C: Reference._alltoall_c,
    Kind.GATHER_C: Reference._gather_c,
    Kind.PUSH_PULL: Reference._push_pull,
    Kind.PUSH_PULL_C: Reference._push_pull_c,
}
