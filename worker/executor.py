"""The executor: runs one tensor's Option on this rank, step by step, over injected transports.

Every step follows the semantics in the docstring of
:mod:`byteps_espresso.strategy.options`, with the decisions documented in
:mod:`byteps_espresso.worker.reference` (the single-process oracle these results are tested
against). What each step finds and leaves (the tensor's *form*: dense values, one payload,
per-destination chunks, or a list of received payloads to sum or to concatenate; its
*extent*; the divisible and rooted pairs; where payload pieces come from; which members
sleep) is the Option's compiled program (:mod:`byteps_espresso.strategy.program`). The
first run of an (Option, tensor name, size) binds the program to this rank (extents, shard
sizes, piece names, payload layouts, PS keys); later runs call one handler per step.

How each step maps to calls (``T`` = :class:`~byteps_espresso.worker.transport.Transport`,
``P`` = :class:`~byteps_espresso.worker.transport.PSPath`):

====================  =====================================================================
``Comp(d)``           ``CodecPair.compress`` on the training device (``gpu``) or in the host
                      thread pool with the numba backend (``cpu``); chunk by chunk before
                      ``AlltoallC``, partition by partition before ``PushPullC``
``Decomp(d)``         ``CodecPair.decompress`` / ``aggregate`` (sum in group-rank order) /
                      decode-and-concatenate after shard gathers and PS partitions
``Allreduce(s)``      ``T.allreduce``
``ReduceScatter(s)``  ``T.reduce_scatter`` (this member's shard of the sum)
``Allgather(s)``      ``T.allgather`` (concatenate the shards; closes the split)
``Reduce(s)``         ``T.reduce`` (sum on group rank 0; the others sleep)
``Broadcast(s)``      ``T.broadcast`` (wakes the sleepers; closes the reduce)
``AllgatherC(s)``     ``T.allgather_payloads``
``AlltoallC(s)``      ``T.alltoall_payloads`` (opens a split)
``GatherC(s)``        ``T.gather_payloads`` (the others sleep)
``BroadcastC(s)``     ``T.broadcast_payload``
                      (these three also forward the list of payloads an earlier gather left,
                      packed as one payload of ``q`` times the layout: ``Op.forwards``)
``PushPull(s)``       ``P.push_pull`` of the dense extent (pushers: this rank's group)
``PushPullC(s)``      ``P.push_pull`` of one payload per PS partition
====================  =====================================================================

:class:`Engine` makes it asynchronous: each lane (an independent set of process groups) has
one thread that runs the Options handed to it in submission order, so collectives on every
lane are issued in the same order on every rank as long as every rank submits in the same
order (the optimizer submits in a fixed gradient order; ``push_pull`` callers submit in
program order). An Option's last ``Allreduce``/``Allgather`` is left in flight
(``async_op``) and waited for in :meth:`Handle.wait`, so the lane issues the next Option
meanwhile.
"""

from __future__ import annotations

import functools
import logging
import math
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
from byteps_espresso.worker.codecs import CodecPair
from byteps_espresso.worker.layout import Extent, Piece, piece_names, ps_key, split
from byteps_espresso.worker.topology import Topology
from byteps_espresso.worker.transport import Done, PayloadSpec, PSPath, Transport

from byteps_espresso.strategy.cluster import lane_of
from byteps_espresso.strategy.options import Device, Kind, Option, OptionError, Scope
from byteps_espresso.strategy.program import (
    IN_FLIGHT,
    RULES,
    Form,
    Op,
    compile_option,
    payload_count,
)
from byteps_espresso.strategy.tree import sums_payloads

__all__ = ["Engine", "ExecutionError", "Executor", "Handle"]

log = logging.getLogger(__name__)

# BYTEPS_PARTITION_BYTES default (config.py); only used to name pieces when no PS exists.
_DEFAULT_PARTITION_BYTES = 4_096_000
_EMPTY = Extent(0, 0)


class ExecutionError(RuntimeError):
    """An Option failed on this rank; the message names the tensor, step and cause."""


class _Parts:
    """The pieces of one payload, resolved once: extents and ctx names; the iteration is
    stamped per run (:meth:`at`)."""

    __slots__ = ("arrays", "names", "spec")

    def __init__(self, names: list[tuple[Extent, str]], codec: CodecPair | None,
                 step: int | None = None) -> None:
        self.names = names
        specs = [codec.spec(e.numel, step) for e, _ in names] if codec is not None else []
        self.spec: PayloadSpec = tuple(a for s in specs for a in s)
        self.arrays = [len(s) for s in specs]  # arrays per piece (to unflatten)

    def at(self, step: int) -> list[Piece]:
        return [Piece(e, n, step) for e, n in self.names]

    def unflatten(self, arrays: Sequence[Any]) -> list[tuple]:
        out, i = [], 0
        for n in self.arrays:
            out.append(tuple(arrays[i:i + n]))
            i += n
        return out


@dataclass
class _Bound:
    """One step of one Option, resolved for this rank and one tensor size at first use: the
    extents, shard sizes, piece layouts, payload specs and PS keys it needs, so that a run
    only moves data."""

    op: Op
    fn: Callable[..., Any]
    asleep: bool  # a non-root member of an open Reduce/GatherC: skip the step
    owned: bool  # the value this step finds is the executor's own (not the caller's tensor)
    root: bool = False  # group rank 0 of the step's scope
    k: int = 1  # members of the step's group
    me: int = 0  # this rank's index in it
    # the last communication step, followed by compute steps only: issue it, return a call
    # that waits for it and runs them
    tail: Callable[..., Any] | None = None
    ext: Extent = _EMPTY  # the extent the step finds
    after: Extent = _EMPTY  # the extent it leaves (a closer: the restored parent)
    exts: list[Extent] | None = None  # Comp before AlltoallC: the chunks' extents
    feeds: Scope | None = None  # Comp: the scope of the communication step it feeds
    sizes: list[int] | None = None  # shard sizes of the split opened or closed here
    parts: _Parts | None = None  # pieces of the payload it makes / decodes / moves
    members: list[_Parts] | None = None  # per group member (or chunk) pieces
    fwd: int | None = None  # payloads each member sends on (a forwarded list); None: one
    key: str = ""  # PS key
    step: int | None = None  # an iteration of the codec's schedule stage (None: steady)
    codec: CodecPair | None = None  # the compressor of the payloads it makes / decodes / moves


class Executor:
    """Runs Options for one rank over one lane's transport.

    Each (Option, tensor name, size) is compiled and bound to this rank once, at its first
    run (:func:`~byteps_espresso.strategy.program.compile_option`, then the extents, piece
    layouts, payload specs and PS keys); later runs only move data.

    Args:
        transport: collectives per scope for this rank.
        codec: the job's compressor on both devices (None: uncompressed Options only).
        partners: the compressors mixed Options name on their steps (``Comp(gpu,fp16)``), by
            name.
        ps: the PS path (None: Options with PushPull/PushPullC are refused).
        device: the training device; dense results land there.
        cpu_pool: host threads for ``cpu`` compute steps (None: run them inline).
    """

    def __init__(self, transport: Transport, codec: CodecPair | None = None,
                 ps: PSPath | None = None, device: torch.device | str = "cpu",
                 cpu_pool: ThreadPoolExecutor | None = None, *,
                 partners: Mapping[str, CodecPair] | None = None) -> None:
        self.transport = transport
        self.topo: Topology = transport.topology
        self.codec = codec
        self.partners = dict(partners or {})
        self.ps = ps
        self.device = torch.device(device)
        self.cpu_pool = cpu_pool
        # When a list: every step's wall time, appended as (tensor, iteration, step index,
        # seconds); the start-up profile prices the links from them (worker/profiler.py).
        self.timings: list[tuple[str, int, int, float]] | None = None
        # While ``timings`` is a list: the Option and size each timed name ran (the check of
        # the kept strategy prices its runs from these, worker/check.py).
        self.timed_runs: dict[str, tuple[Option, int]] = {}
        # When set: called with (step index, value held) after every step (tests compare
        # the values' forms and extents with the compiled program).
        self.trace: Callable[[int, Any], None] | None = None
        # (Option, tensor name, size, the codec's schedule stage) -> its bound steps
        self._bound: dict[tuple[Option, str, int, int | None], list[_Bound]] = {}
        self._at_once: dict[Option, bool] = {}  # issues_at_once's answer per Option

    # ---- entry point -------------------------------------------------------------------------
    def run(self, option: Option, tensor: torch.Tensor, *, name: str, step: int) -> torch.Tensor:
        """Run ``option`` on this rank's ``tensor``; returns the sum over all workers.

        Args:
            option: the tensor's program.
            tensor: this rank's values (any shape, float32).
            name: the tensor's name (same on every rank).
            step: the tensor's iteration counter (same on every rank).

        Raises:
            ExecutionError: a step cannot run here (wrong form, missing codec or PS) or a
                transport call failed; the message names the tensor and the step.
        """
        return self.start(option, tensor, name=name, step=step)()

    def start(self, option: Option, tensor: torch.Tensor, *, name: str,
              step: int) -> Callable[[], torch.Tensor]:
        """Run ``option`` up to its last communication step and issue that one; returns the
        call that waits for it and gives the result (as :meth:`run`). An ``Allreduce``,
        ``Allgather``, ``AllreduceC`` or ``AllgatherC`` as the last communication step stays
        in flight (``async_op``) until that call, which then runs the compute steps after it
        (a ``Decomp``), so a lane can issue the next Option's collectives meanwhile; other
        last steps and traced runs (``trace``, debug logs) complete before this returns. A
        timed run (``timings``) runs as an untimed one does: a collective left in flight is
        timed from its issue to its completion (the transport's ``done``), as a blocking
        call would time it, so that the check of a strategy measures the iterations that
        train on (issued on the submitting thread, ``Engine.submit``; on the LSTM at 1
        Gbit/s DDP's fp16-hook plan measured 32-34 ms with every step blocking in a lane,
        23.4 ms as it runs).

        Raises:
            ExecutionError: as :meth:`run` (the returned call raises it for the last step).
        """
        numel = tensor.numel()
        # A compressor with a schedule (dgc's sparsity warm-up) changes its payload lengths
        # from stage to stage: each stage is bound once, with that stage's layouts.
        stage = self.codec.stage(step) if self.codec is not None else None
        bound = self._bound.get((option, name, numel, stage))
        if bound is None:
            bound = self._bound[option, name, numel, stage] = self._bind(
                option, name, numel, None if stage is None else step)
        value: Any = tensor.detach().reshape(-1)
        if value.dtype is not torch.float32 or value.device != self.device:
            value = value.to(self.device, torch.float32)
        record, trace = self.timings, self.trace
        if record is not None:
            self.timed_runs[name] = (option, numel)
        logged = log.isEnabledFor(logging.DEBUG)
        timed = logged or record is not None
        through = self._every_step_here()
        times: list[str] = []
        for i, b in enumerate(bound):
            t0 = time.perf_counter() if timed else 0.0
            if b.tail is not None and not through and not b.asleep:
                done = _Done() if record is not None else None
                wait = _named(option, b, name, b.tail, self, b, value, done)
                return functools.partial(
                    self._finish, option, bound[i:], wait, name=name, step=step,
                    shape=tensor.shape,
                    timed=None if record is None or done is None else (record, done, t0))
            if not b.asleep:
                value = _named(option, b, name, b.fn, self, b, value, name, step)
            if trace is not None:
                trace(b.op.index, value)
            if timed:
                # a step this rank sleeps through took none of its time: NaN, not ~0 s
                sec = time.perf_counter() - t0 if not b.asleep else math.nan
                if record is not None:
                    record.append((name, step, b.op.index, sec))
                if logged:
                    times.append(f"{b.op.step} {sec * 1e3:.2f}")
        if logged:
            log.debug("%s step %d ms: %s", name, step, ", ".join(times))
        out = value.reshape(tensor.shape)
        return lambda: out

    def _finish(self, option: Option, steps: Sequence[_Bound], wait: Callable[[], Any], *,
                name: str, step: int, shape: torch.Size,
                timed: tuple[list[tuple[str, int, int, float]], _Done, float] | None) \
            -> torch.Tensor:
        """Wait for ``steps[0]``, the collective :meth:`start` left in flight, then run the
        compute steps after it on the waiting thread. A timed run (``timed``: its record,
        the collective's completion, its issue time) times each step."""
        tail, *rest = steps
        value = _named(option, tail, name, wait)
        record = None
        if timed is not None:
            record, done, issued = timed
            record.append((name, step, tail.op.index, done.seconds_since(issued)))
        for b in rest:
            t0 = time.perf_counter() if record is not None else 0.0
            if not b.asleep:
                value = _named(option, b, name, b.fn, self, b, value, name, step)
            if record is not None:
                record.append((name, step, b.op.index,
                               time.perf_counter() - t0 if not b.asleep else math.nan))
        return value.reshape(shape)

    def _every_step_here(self) -> bool:
        """Whether :meth:`start` completes every step itself, no collective left in flight:
        ``trace`` sees each step's value, debug logs time each step."""
        return self.trace is not None or log.isEnabledFor(logging.DEBUG)

    def issues_at_once(self, option: Option) -> bool:
        """Whether :meth:`start` of ``option`` returns as soon as its one collective is
        issued: nothing before the collective but compression on the training device (what
        DDP's communication hooks run on the backward thread), ``async_op`` issue, and no
        traced run (``trace``, debug logs) to complete each step through."""
        if self._every_step_here() or not getattr(self.transport, "issues_async", False):
            return False
        got = self._at_once.get(option)
        if got is None:
            prog = compile_option(option)
            t = prog.in_flight
            got = self._at_once[option] = t is not None and all(
                op.kind is Kind.COMP and op.device is Device.GPU for op in prog.ops[:t])
        return got

    # ---- binding: everything a run would otherwise recompute ---------------------------------
    def _bind(self, option: Option, name: str, numel: int,
              step: int | None = None) -> list[_Bound]:
        try:
            prog = compile_option(option)
        except OptionError as exc:
            raise ExecutionError(f"tensor {name!r}: [{option}] cannot run: {exc}") from None
        out = []
        ext = Extent(0, numel)
        for op in prog.ops:
            after = self._extent(numel, op.shards)
            try:
                b = _Bound(op, _HANDLERS[op.kind], self._asleep(op), owned=op.index > 0,
                           ext=ext, after=after, step=step)
                if op.scope is not None:
                    b.k, b.me = self.topo.size(op.scope), self.topo.index(op.scope)
                    b.root = b.me == 0
                if op.feeds is not None:
                    b.feeds = prog.ops[op.feeds].scope
                if not b.asleep:
                    _BINDERS.get(op.kind, Executor._bind_none)(self, b, name)
            except (OptionError, ExecutionError, ValueError) as exc:
                raise ExecutionError(f"tensor {name!r}, step {op.index} {op.step} of "
                                     f"[{option}]: {exc}") from None
            out.append(b)
            ext = after
        t = prog.in_flight
        if t is not None:
            out[t].tail = _TAILS[prog.ops[t].kind]
        return out

    def _asleep(self, op: Op) -> bool:
        return any(self.topo.index(s) != 0 for s in op.sleepers)

    def _extent(self, numel: int, shards: Sequence[Scope]) -> Extent:
        ext = Extent(0, numel)
        for scope in shards:
            ext = split(ext, self.topo.size(scope))[self.topo.index(scope)]
        return ext

    def _parts(self, b: _Bound, name: str, extent: Extent) -> _Parts:
        assert b.op.origin is not None
        return _Parts(piece_names(name, b.op.origin, extent, self._partition_bytes()), b.codec,
                      b.step)

    def _partition_bytes(self) -> int:
        return self.ps.partition_bytes if self.ps is not None else _DEFAULT_PARTITION_BYTES

    def _bind_codec(self, b: _Bound) -> CodecPair:
        """The compressor of ``b``'s payloads, set on it: the job's, or a partner's."""
        partner = b.op.codec
        if partner is None:
            if self.codec is None:
                raise ExecutionError("this Option compresses but no compressor is configured")
            b.codec = self.codec
        else:
            b.codec = self.partners.get(partner)
            if b.codec is None:
                raise ExecutionError(f"this Option compresses with {partner} inside the "
                                     f"machine but no {partner} codec is configured (partners: "
                                     f"{', '.join(sorted(self.partners)) or 'none'})")
        return b.codec

    def _need_ps(self) -> PSPath:
        if self.ps is None:
            raise ExecutionError("this Option uses the PS but no servers are configured "
                                 "(DMLC_NUM_SERVER=0)")
        return self.ps

    def _bind_none(self, b: _Bound, name: str) -> None:
        return None

    def _bind_comp(self, b: _Bound, name: str) -> None:
        codec = self._bind_codec(b)
        op = b.op
        if op.chunks is not None:
            b.exts = split(b.ext, self.topo.size(op.chunks))
            b.members = [self._parts(b, name, e) for e in b.exts]
            return
        b.parts = self._parts(b, name, b.ext)
        if op.origin is not None and op.origin.ps and b.ext.numel:
            assert op.feeds is not None and b.feeds is not None
            if b.step is not None:
                raise ExecutionError(
                    "a PS key keeps one payload layout, and the compressor's schedule "
                    "(dgc's sparsity warm-up) changes it from stage to stage; plan without "
                    "PushPullC (Compression.espresso does for a compressor with warmup_steps) "
                    "or set warmup_steps=0")
            b.key = ps_key(name, op.feeds, b.ext, compressed=True)
            ps = self._need_ps()
            ps.declare(b.key, b.ext.numel, self.topo.group(b.feeds), codec)
            expected = [(e.offset - b.ext.offset, e.numel) for e, _ in b.parts.names]
            if ps.partitions(b.key) != expected:
                raise ExecutionError(f"PS partitions of {b.key} {ps.partitions(b.key)} differ "
                                     f"from the expected {expected}")

    def _bind_decomp(self, b: _Bound, name: str) -> None:
        self._bind_codec(b)
        op = b.op
        if op.takes is Form.CONCAT:
            b.members = [self._parts(b, name, e)
                         for e in split(b.ext, payload_count(op.payloads, self.topo.size))]
        else:
            b.parts = self._parts(b, name, b.ext)

    def _bind_split(self, b: _Bound, name: str) -> None:
        """ReduceScatter opens a split of the extent it finds; Allgather closes one and
        restores the parent extent (the one before the opener)."""
        op = b.op
        assert op.scope is not None
        parent = b.ext if op.opens is not None else b.after
        b.sizes = [e.numel for e in split(parent, self.topo.size(op.scope))]

    def _bind_payload_comm(self, b: _Bound, name: str) -> None:
        self._bind_codec(b)
        op = b.op
        assert op.scope is not None
        k = self.topo.size(op.scope)
        if op.kind is Kind.ALLGATHER_C and op.closes is not None:
            b.members = [self._parts(b, name, e) for e in split(b.after, k)]
        elif op.kind is Kind.ALLTOALL_C:
            b.members = [self._parts(b, name, e) for e in split(b.ext, k)]
        else:  # AllgatherC (summing), GatherC, BroadcastC: every member's pieces are alike
            b.parts = self._parts(b, name, b.after)
            if op.takes is Form.SUM:
                b.fwd = payload_count(op.forwards, self.topo.size)

    def _bind_allreduce_c(self, b: _Bound, name: str) -> None:
        self._bind_payload_comm(b, name)
        assert b.codec is not None
        if not sums_payloads(b.codec.name):
            raise ExecutionError(f"AllreduceC sums payloads inside the collective, and "
                                 f"{b.codec.name}'s payloads do not sum; use AllgatherC "
                                 "(plans for this compressor never hold AllreduceC)")

    def _bind_push_pull(self, b: _Bound, name: str) -> None:
        ps = self._need_ps()
        if b.ext.numel == 0:  # an empty shard: no key, nothing to push
            return
        assert b.op.scope is not None
        if b.op.kind is Kind.PUSH_PULL:
            b.key = ps_key(name, b.op.index, b.ext)
            ps.declare(b.key, b.ext.numel, self.topo.group(b.op.scope))
        else:  # declared by the Comp that feeds it
            self._bind_codec(b)
            b.key = ps_key(name, b.op.index, b.ext, compressed=True)

    # ---- compute -----------------------------------------------------------------------------
    def _compute(self, b: _Bound, value: Any, name: str, step: int) -> Any:
        if b.op.device is Device.CPU and self.cpu_pool is not None:
            return self.cpu_pool.submit(_COMPUTE[b.op.kind], self, b, value, step).result()
        return _COMPUTE[b.op.kind](self, b, value, step)

    def _comp(self, b: _Bound, value: torch.Tensor, step: int) -> list:
        codec, dev = b.codec, b.op.device
        assert codec is not None and dev is not None
        if b.members is not None:  # one payload per chunk (AlltoallC destination)
            assert b.exts is not None
            base = b.ext.offset
            return [codec.compress_pieces(dev, value[e.offset - base:e.end - base], e,
                                          parts.at(step))
                    for e, parts in zip(b.exts, b.members, strict=True)]
        assert b.parts is not None
        return codec.compress_pieces(dev, value, b.ext, b.parts.at(step))

    def _decomp(self, b: _Bound, value: Any, step: int) -> torch.Tensor:
        codec, dev = b.codec, b.op.device
        assert codec is not None and dev is not None
        takes = b.op.takes
        if takes is Form.CONCAT:
            assert b.members is not None
            return codec.decode_concat(dev, value, [p.at(step) for p in b.members])
        assert b.parts is not None
        if takes is Form.SUM:
            return codec.aggregate_pieces(dev, value, b.parts.at(step))
        return codec.decode_pieces(dev, value, b.parts.at(step))

    # ---- communication -----------------------------------------------------------------------
    def _here(self, x: torch.Tensor) -> torch.Tensor:
        return x if x.device == self.device else x.to(self.device)

    def _allreduce(self, b: _Bound, value: torch.Tensor, name: str, step: int) -> torch.Tensor:
        return self._here(self.transport.allreduce(b.op.scope, value, owned=b.owned))

    def _reduce_scatter(self, b: _Bound, value: torch.Tensor, name: str,
                        step: int) -> torch.Tensor:
        return self._here(self.transport.reduce_scatter(b.op.scope, value, b.sizes))

    def _allgather(self, b: _Bound, value: torch.Tensor, name: str, step: int) -> torch.Tensor:
        return self._here(self.transport.allgather(b.op.scope, value, b.sizes))

    # The last step of an Option may be left in flight (Executor.start): issue, then wait later.
    def _allreduce_tail(self, b: _Bound, value: torch.Tensor,
                        done: Done | None = None) -> Callable[[], torch.Tensor]:
        wait = self.transport.allreduce_start(b.op.scope, value, owned=b.owned, done=done)
        return lambda: self._here(wait())

    def _allgather_tail(self, b: _Bound, value: torch.Tensor,
                        done: Done | None = None) -> Callable[[], torch.Tensor]:
        wait = self.transport.allgather_start(b.op.scope, value, b.sizes, done=done)
        return lambda: self._here(wait())

    def _reduce(self, b: _Bound, value: torch.Tensor, name: str, step: int) -> Any:
        out = self.transport.reduce(b.op.scope, value)
        return self._here(out) if b.root else None  # type: ignore[arg-type]

    def _broadcast(self, b: _Bound, value: Any, name: str, step: int) -> torch.Tensor:
        return self._here(self.transport.broadcast(b.op.scope, value if b.root else None,
                                                   b.after.numel))

    # A forwarded list of payloads travels as one payload of the layout repeated (b.fwd times).
    def _send(self, b: _Bound, value: list) -> tuple:
        codec = b.codec
        assert codec is not None
        if b.fwd is None:
            return codec.flatten(value)
        return tuple(a for payload in value for a in codec.flatten(payload))

    def _spec(self, b: _Bound) -> Any:
        assert b.parts is not None
        return b.parts.spec if b.fwd is None else b.parts.spec * b.fwd

    def _received(self, b: _Bound, arrays: Sequence[Any]) -> list:
        """One member's arrays as its payload, or as the list of payloads it forwarded."""
        parts = b.parts
        assert parts is not None
        if b.fwd is None:
            return parts.unflatten(arrays)
        n = len(parts.spec)
        return [parts.unflatten(arrays[j * n:(j + 1) * n]) for j in range(b.fwd)]

    def _broadcast_c(self, b: _Bound, value: Any, name: str, step: int) -> list:
        got = self.transport.broadcast_payload(b.op.scope, self._send(b, value) if b.root
                                               else None, self._spec(b))
        return self._received(b, got)

    def _allreduce_c(self, b: _Bound, value: list, name: str, step: int) -> list:
        return self._allreduce_c_tail(b, value)()

    def _allreduce_c_tail(self, b: _Bound, value: list,
                          done: Done | None = None) -> Callable[[], list]:
        codec, parts = b.codec, b.parts
        assert codec is not None and parts is not None
        wait = self.transport.allreduce_payload_start(b.op.scope, codec.flatten(value),
                                                      done=done)
        return lambda: parts.unflatten(wait())

    def _allgather_c(self, b: _Bound, value: list, name: str, step: int) -> list:
        return self._allgather_c_tail(b, value)()

    def _allgather_c_tail(self, b: _Bound, value: list,
                          done: Done | None = None) -> Callable[[], list]:
        codec = b.codec
        assert codec is not None
        members = b.members
        if members is not None:  # shards of the split: one payload per member
            wait = self.transport.allgather_payloads_start(
                b.op.scope, codec.flatten(value), [p.spec for p in members], done=done)
            return lambda: [p.unflatten(g) for g, p in zip(wait(), members, strict=True)]
        wait = self.transport.allgather_payloads_start(b.op.scope, self._send(b, value),
                                                       [self._spec(b)] * b.k, done=done)
        if b.fwd is not None:
            return lambda: _gathered(self._received(b, g) for g in wait())
        return lambda: [self._received(b, g) for g in wait()]

    def _alltoall_c(self, b: _Bound, value: list, name: str, step: int) -> list:
        codec, members = b.codec, b.members
        assert codec is not None and members is not None
        specs = [p.spec for p in members]
        got = self.transport.alltoall_payloads(b.op.scope, [codec.flatten(c) for c in value],
                                               specs, [specs[b.me]] * b.k)
        return [members[b.me].unflatten(g) for g in got]

    def _gather_c(self, b: _Bound, value: list, name: str, step: int) -> list | None:
        got = self.transport.gather_payloads(b.op.scope, self._send(b, value),
                                             [self._spec(b)] * b.k)
        if not b.root:
            return None
        lists = [self._received(b, g) for g in got]  # type: ignore[union-attr]
        return _gathered(lists) if b.fwd is not None else lists

    def _push_pull(self, b: _Bound, value: torch.Tensor, name: str, step: int) -> torch.Tensor:
        if not b.key:
            return value
        host = value.numpy() if value.device.type == "cpu" else value.cpu().numpy()
        out = self.ps.push_pull(b.key, host, step)  # type: ignore[union-attr]
        return self._here(torch.from_numpy(out).reshape(-1))

    def _push_pull_c(self, b: _Bound, value: list, name: str, step: int) -> list:
        if not b.key:
            return value
        pushed = [tuple(a.detach().cpu().numpy() if isinstance(a, torch.Tensor) else a
                        for a in p) for p in value]
        return [tuple(p) for p in self.ps.push_pull(b.key, pushed, step)]  # type: ignore[union-attr]


def _gathered(lists: Any) -> list:
    """The members' forwarded lists as one list, in group-rank order, then each list's."""
    return [payload for members in lists for payload in members]


def _named(option: Option, b: _Bound, name: str, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` with any failure re-raised as an ExecutionError naming tensor and step."""
    try:
        return fn(*args)
    except ExecutionError as exc:
        raise ExecutionError(f"tensor {name!r}, step {b.op.index} {b.op.step} of "
                             f"[{option}]: {exc}") from None
    except Exception as exc:
        raise ExecutionError(f"tensor {name!r}, step {b.op.index} {b.op.step} of [{option}] "
                             f"failed: {type(exc).__name__}: {exc}") from exc


class _Done:
    """When a collective left in flight completed (the transport's ``done``, called from the
    thread that completed it): a timed run's step time (:meth:`Executor.start`)."""

    __slots__ = ("at",)

    def __init__(self) -> None:
        self.at: float | None = None

    def __call__(self) -> None:
        self.at = time.perf_counter()

    def seconds_since(self, t0: float) -> float:
        """Seconds from ``t0`` to the completion, once waited for (where the completing
        thread has not recorded it yet, now: the wait has just returned)."""
        return (self.at if self.at is not None else time.perf_counter()) - t0


_TAILS: dict[Kind, Callable[..., Any]] = {Kind.ALLREDUCE: Executor._allreduce_tail,
                                          Kind.ALLGATHER: Executor._allgather_tail,
                                          Kind.ALLREDUCE_C: Executor._allreduce_c_tail,
                                          Kind.ALLGATHER_C: Executor._allgather_c_tail}

# the planner's lanes model the same rule (program.Program.in_flight)
assert set(_TAILS) == IN_FLIGHT

_COMPUTE: dict[Kind, Callable[..., Any]] = {Kind.COMP: Executor._comp,
                                            Kind.DECOMP: Executor._decomp}
# One handler per step kind (program.RULES has one row per kind; asserted below).
_HANDLERS: dict[Kind, Callable[..., Any]] = {
    Kind.COMP: Executor._compute,
    Kind.DECOMP: Executor._compute,
    Kind.ALLREDUCE: Executor._allreduce,
    Kind.REDUCE_SCATTER: Executor._reduce_scatter,
    Kind.ALLGATHER: Executor._allgather,
    Kind.REDUCE: Executor._reduce,
    Kind.BROADCAST: Executor._broadcast,
    Kind.BROADCAST_C: Executor._broadcast_c,
    Kind.ALLREDUCE_C: Executor._allreduce_c,
    Kind.ALLGATHER_C: Executor._allgather_c,
    Kind.ALLTOALL_C: Executor._alltoall_c,
    Kind.GATHER_C: Executor._gather_c,
    Kind.PUSH_PULL: Executor._push_pull,
    Kind.PUSH_PULL_C: Executor._push_pull_c,
}
# What each kind resolves at bind time (kinds not listed resolve nothing).
_BINDERS: dict[Kind, Callable[..., None]] = {
    Kind.COMP: Executor._bind_comp,
    Kind.DECOMP: Executor._bind_decomp,
    Kind.REDUCE_SCATTER: Executor._bind_split,
    Kind.ALLGATHER: Executor._bind_split,
    Kind.BROADCAST_C: Executor._bind_payload_comm,
    Kind.ALLREDUCE_C: Executor._bind_allreduce_c,
    Kind.ALLGATHER_C: Executor._bind_payload_comm,
    Kind.ALLTOALL_C: Executor._bind_payload_comm,
    Kind.GATHER_C: Executor._bind_payload_comm,
    Kind.PUSH_PULL: Executor._bind_push_pull,
    Kind.PUSH_PULL_C: Executor._bind_push_pull,
}
assert set(_HANDLERS) == set(RULES) and set(_BINDERS) <= set(RULES)


_UNSET = object()


class Handle:
    """An Option in flight: ``done()`` polls, ``wait()`` returns the dense sum or raises.

    For a submitted Option the lane's result is the call that waits for its last collective
    (:meth:`Executor.start`); ``wait()`` makes it, once, on the waiting thread.
    """

    def __init__(self, name: str, deferred: bool = False) -> None:
        self.name = name
        self._future: Future[Any] = Future()
        self._deferred = deferred
        self._lock = threading.Lock()
        self._result: Any = _UNSET

    def done(self) -> bool:
        """Whether the lane ran the Option (its last collective may still be in flight)."""
        return self._future.done()

    def wait(self, timeout: float | None = None) -> torch.Tensor:
        """The result; re-raises the lane's :class:`ExecutionError`.

        Raises:
            ExecutionError: the Option failed, or ``timeout`` seconds passed first.
        """
        try:
            got = self._future.result(timeout)
        except TimeoutError:
            raise ExecutionError(f"tensor {self.name!r} not synchronized within {timeout} s; "
                                 "another rank may have failed or submitted tensors in a "
                                 "different order") from None
        if not self._deferred:
            return got
        with self._lock:
            if self._result is _UNSET:
                self._result = got()
            return self._result


_STOP = object()


class Engine:
    """Runs Options asynchronously: one thread per lane, each in submission order.

    An Option that only issues one collective (:meth:`Executor.issues_at_once`, e.g.
    ``Allreduce(flat)`` or ``Comp(gpu) -> AllreduceC(flat) -> Decomp(gpu)``) submitted to an
    idle lane is issued on the submitting thread instead, as DDP issues a bucket from its
    gradient hook, and the compute steps after the collective run in the waiting call: on
    4 workers sharing 2 cores, handing each bucket to a lane's thread cost the LSTM 2.3-3.2
    ms an iteration (benchmarks/issue_thread.py), and its hook-like fp16 plan went from 28.3
    to 22.7-24.0 ms (BENCHMARKS.md, "Issued on the submitting thread"). The lane stays in
    order: nothing is queued or running on it when this happens, and its lock is held for
    the issue.

    Args:
        executors: one :class:`Executor` per lane (each over its own process groups).
        timeout_s: how long :meth:`Handle.wait` callers should wait (``ESPRESSO_TIMEOUT``).
        counters: iteration counters per tensor name to share with other engines.
        thread_init: called first in every lane thread (per-thread settings such as numba's
            thread count, which numba keeps per calling thread).
    """

    def __init__(self, executors: Sequence[Executor], timeout_s: float = 60.0,
                 counters: dict[str, int] | None = None,
                 thread_init: Callable[[], None] | None = None) -> None:
        if not executors:
            raise ValueError("the engine needs at least one executor (lane)")
        self.executors = list(executors)
        self.timeout_s = timeout_s
        # Iterations per tensor name; shared by a process's engines, so a tensor keeps counting
        # (PS rounds and random draws move on) when its Options change engine after planning.
        self._steps: dict[str, int] = counters if counters is not None else {}
        self._queues: list[queue.Queue[Any]] = [queue.Queue() for _ in self.executors]
        # Per lane: the items queued or running (under _lock), and the lock held while one
        # runs, on the lane's thread or the submitting one.
        self._lock = threading.Lock()
        self._pending = [0] * len(self.executors)
        self._running = [threading.Lock() for _ in self.executors]
        self._thread_init = thread_init
        self._threads = [threading.Thread(target=self._loop, args=(lane,), daemon=True,
                                          name=f"espresso-lane-{lane}")
                         for lane in range(len(self.executors))]
        for t in self._threads:
            t.start()

    @property
    def lanes(self) -> int:
        return len(self.executors)

    def lane_of(self, name: str) -> int:
        """The lane of tensor ``name``: a hash of the name, equal on every rank (the planner
        uses the same function)."""
        return lane_of(name, self.lanes)

    def submit(self, name: str, tensor: torch.Tensor, option: Option,
               lane: int | None = None, step: int | None = None) -> Handle:
        """Start ``option`` on ``tensor``; every rank must submit in the same order per lane.

        Args:
            name: the tensor's name (its iteration counter and PS keys hang off it).
            tensor: this rank's values; not modified.
            option: the program to run.
            lane: force a lane (default: :meth:`lane_of`).
            step: the iteration to stamp, from :meth:`next_step` (default: the next one of
                ``name``'s counter).

        Returns:
            A :class:`Handle` for the dense sum over all workers.
        """
        if step is None:
            step = self.next_step(name)
        lane = (self.lane_of(name) if lane is None else lane) % self.lanes
        handle = Handle(name, deferred=True)

        def work(ex: Executor) -> Callable[[], torch.Tensor]:
            return ex.start(option, tensor, name=name, step=step)

        if not (self.executors[lane].issues_at_once(option) and self._inline(lane, handle, work)):
            self._put(lane, handle, work)
        return handle

    def _inline(self, lane: int, handle: Handle, fn: Callable[[Executor], Any]) -> bool:
        """Run ``fn`` on this thread if the lane has nothing queued or running."""
        with self._lock:
            if self._pending[lane]:
                return False
            self._pending[lane] += 1
        try:
            self._run(lane, handle, fn)
        finally:
            with self._lock:
                self._pending[lane] -= 1
        return True

    def _put(self, lane: int, handle: Handle, fn: Callable[[Executor], Any]) -> None:
        with self._lock:
            self._pending[lane] += 1
        self._queues[lane].put((handle, fn))

    def _run(self, lane: int, handle: Handle, fn: Callable[[Executor], Any]) -> None:
        with self._running[lane]:
            if not handle._future.set_running_or_notify_cancel():
                return
            try:
                handle._future.set_result(fn(self.executors[lane]))
            except BaseException as exc:
                log.error("%s", exc)
                handle._future.set_exception(exc)

    def next_step(self, name: str, at_least: int = 0) -> int:
        """Tensor ``name``'s iteration counter, raised to ``at_least`` first, then counted one
        on (what :meth:`submit` stamps on each run; PS rounds, random draws and compressor
        schedules follow it). Raising it keeps the counter strictly increasing, as the
        servers' rounds of a key must."""
        step = max(self._steps.get(name, 0), at_least)
        self._steps[name] = step + 1
        return step

    def run(self, name: str, tensor: torch.Tensor, option: Option) -> torch.Tensor:
        """Synchronous :meth:`submit` + wait."""
        return self.submit(name, tensor, option).wait(self.timeout_s)

    def call(self, lane: int, fn: Callable[[Executor], Any], name: str = "call") -> Handle:
        """Run ``fn(executor of lane)`` on the lane's thread, after the work already queued.

        Used to measure costs inside the lanes while training runs (the start-up profile); a
        ``fn`` that issues collectives must be queued at the same point on every rank.
        """
        handle = Handle(name)
        self._put(lane % self.lanes, handle, fn)
        return handle

    def _loop(self, lane: int) -> None:
        if self._thread_init is not None:
            self._thread_init()
        while True:
            item = self._queues[lane].get()
            if item is _STOP:
                return
            try:
                self._run(lane, *item)
            finally:
                with self._lock:
                    self._pending[lane] -= 1

    def close(self) -> None:
        """Stop the lane threads after the work already submitted, waiting at most
        ``timeout_s`` in all (a lane blocked on a failed peer is a daemon thread; it does not
        keep the process alive, and every lane waiting its own timeout would multiply the
        exit delay by the lane count)."""
        for q in self._queues:
            q.put(_STOP)
        deadline = time.monotonic() + self.timeout_s
        for t in self._threads:
            t.join(timeout=max(0.0, deadline - time.monotonic()))
