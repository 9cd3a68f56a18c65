"""The executor: runs one tensor's Option on this rank, step by step, over injected transports.

Every step follows the semantics in the docstring of
:mod:`byteps_espresso.strategy.options`, with the decisions documented in
:mod:`byteps_espresso.worker.reference` (the single-process oracle these results are tested
against). Per rank the executor holds the tensor in one *form* (dense values, one payload,
per-destination chunks, per-partition payloads, or a list of received payloads to sum or to
concatenate) over one *extent* of the flattened tensor, plus a stack of open divisible steps
(``ReduceScatter``/``AlltoallC``, closed by ``Allgather``/``AllgatherC`` of the same scope) and
rooted steps (``Reduce``/``GatherC``, closed by ``Broadcast``/``BroadcastC``).

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
``PushPull(s)``       ``P.push_pull`` of the dense extent (pushers: this rank's group)
``PushPullC(s)``      ``P.push_pull`` of one payload per PS partition
====================  =====================================================================

:class:`Engine` makes it asynchronous: each lane (an independent set of process groups) has
one thread that runs the Options handed to it in submission order, so collectives on every
lane are issued in the same order on every rank as long as every rank submits in the same
order (the optimizer submits in a fixed gradient order; ``push_pull`` callers submit in
program order).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from byteps_espresso.worker.codecs import CodecPair
from byteps_espresso.worker.layout import At, Extent, Origin, pieces, ps_key, split
from byteps_espresso.worker.topology import Topology
from byteps_espresso.worker.transport import PSPath, Transport

from byteps_espresso.strategy.cluster import lane_of
from byteps_espresso.strategy.options import Device, Kind, Option, OptionError, Scope, Step

__all__ = ["Engine", "ExecutionError", "Executor", "Handle"]

log = logging.getLogger(__name__)

DENSE, PAYLOAD, CHUNKS, SUM, CONCAT, NONE = (
    "dense", "payload", "chunks", "sum", "concat", "none")
# BYTEPS_PARTITION_BYTES default (config.py); only used to name pieces when no PS exists.
_DEFAULT_PARTITION_BYTES = 4_096_000


class ExecutionError(RuntimeError):
    """An Option failed on this rank; the message names the tensor, step and cause."""


@dataclass
class _State:
    form: str
    value: Any
    extent: Extent
    extents: list[Extent] = field(default_factory=list)  # chunk / member extents
    stack: list[tuple[str, Scope, Extent]] = field(default_factory=list)
    origin: Origin | None = None  # the step that made the current payload pieces
    asleep: Scope | None = None
    tensor: str = ""


class Executor:
    """Runs Options for one rank over one lane's transport.

    Args:
        transport: collectives per scope for this rank.
        codec: the job's compressor on both devices (None: uncompressed Options only).
        ps: the PS path (None: Options with PushPull/PushPullC are refused).
        device: the training device; dense results land there.
        cpu_pool: host threads for ``cpu`` compute steps (None: run them inline).
    """

    def __init__(self, transport: Transport, codec: CodecPair | None = None,
                 ps: PSPath | None = None, device: torch.device | str = "cpu",
                 cpu_pool: ThreadPoolExecutor | None = None) -> None:
        self.transport = transport
        self.topo: Topology = transport.topology
        self.codec = codec
        self.ps = ps
        self.device = torch.device(device)
        self.cpu_pool = cpu_pool
        # When a list: every step's wall time, appended as (tensor, iteration, step index,
        # seconds); the start-up profile prices the links from them (worker/profiler.py).
        self.timings: list[tuple[str, int, int, float]] | None = None

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
        flat = tensor.detach().reshape(-1).to(self.device, torch.float32)
        st = _State(DENSE, flat, Extent(0, flat.numel()), tensor=name)
        logged = log.isEnabledFor(logging.DEBUG)
        record = self.timings
        times: list[str] = []
        for i, s in enumerate(option.steps):
            t0 = time.perf_counter() if logged or record is not None else 0.0
            try:
                self._step(st, At(i, s, name, step, option.steps))
                if record is not None:
                    record.append((name, step, i, time.perf_counter() - t0))
                if logged:
                    times.append(f"{s} {(time.perf_counter() - t0) * 1e3:.2f}")
            except (OptionError, ExecutionError) as exc:
                raise ExecutionError(f"tensor {name!r}, step {i} {s} of [{option}]: {exc}") \
                    from None
            except Exception as exc:
                raise ExecutionError(f"tensor {name!r}, step {i} {s} of [{option}] failed: "
                                     f"{type(exc).__name__}: {exc}") from exc
        if logged:
            log.debug("%s step %d ms: %s", name, step, ", ".join(times))
        if st.form != DENSE or st.extent.numel != flat.numel() or st.stack:
            raise ExecutionError(f"tensor {name!r}: [{option}] does not end with the full dense "
                                 f"sum (holds {st.form} over {st.extent})")
        return st.value.reshape(tensor.shape)

    def _step(self, st: _State, at: At) -> None:
        s = at.st
        if s.kind.is_compute:
            if st.asleep is None:
                if s.device is Device.CPU and self.cpu_pool is not None:
                    self.cpu_pool.submit(self._compute, st, at).result()
                else:
                    self._compute(st, at)
            return
        if st.asleep is not None:
            closes = s.kind in (Kind.BROADCAST, Kind.BROADCAST_C) and s.scope is st.asleep
            if not closes:
                return
        _COMM[s.kind](self, st, at)

    def _need_codec(self) -> CodecPair:
        if self.codec is None:
            raise ExecutionError("this Option compresses but no compressor is configured")
        return self.codec

    def _need_ps(self) -> PSPath:
        if self.ps is None:
            raise ExecutionError("this Option uses the PS but no servers are configured "
                                 "(DMLC_NUM_SERVER=0)")
        return self.ps

    # ---- compute -----------------------------------------------------------------------------
    def _pieces(self, st: _State, extent: Extent) -> list:
        assert st.origin is not None
        return pieces(st.tensor, st.origin, extent, self._partition_bytes())

    def _partition_bytes(self) -> int:
        return self.ps.partition_bytes if self.ps is not None else _DEFAULT_PARTITION_BYTES

    def _compute(self, st: _State, at: At) -> None:
        s, i, steps, name, step = at.st, at.i, at.steps, at.name, at.step
        codec = self._need_codec()
        dev = s.device
        assert dev is not None
        if s.kind is not Kind.COMP:
            self._decomp(st, at, codec)
            return
        if st.form != DENSE:
            raise ExecutionError(f"needs dense values, holds {st.form}")
        nxt = next((x for x in steps[i + 1:] if not x.kind.is_compute), None)
        if nxt is None:
            raise ExecutionError("no communication step follows this Comp")
        if nxt.kind is Kind.ALLTOALL_C:
            st.origin = Origin(i, False, step)
            st.extents = split(st.extent, self.topo.size(nxt.scope))  # type: ignore[arg-type]
            base = st.extent.offset
            st.value = [codec.compress_pieces(dev, st.value[e.offset - base:e.end - base], e,
                                              self._pieces(st, e)) for e in st.extents]
            st.form = CHUNKS
            return
        if nxt.kind is Kind.PUSH_PULL_C:
            j = steps.index(nxt, i + 1)
            st.origin = Origin(j, True, step)
            if st.extent.numel:
                key = ps_key(name, j, st.extent, compressed=True)
                ps = self._need_ps()
                ps.declare(key, st.extent.numel, self.topo.group(nxt.scope), codec)
                expected = [(p.extent.offset - st.extent.offset, p.extent.numel)
                            for p in self._pieces(st, st.extent)]
                if ps.partitions(key) != expected:
                    raise ExecutionError(f"PS partitions of {key} {ps.partitions(key)} differ "
                                         f"from the expected {expected}")
        else:
            st.origin = Origin(i, False, step)
        st.value = codec.compress_pieces(dev, st.value, st.extent, self._pieces(st, st.extent))
        st.form = PAYLOAD

    def _decomp(self, st: _State, at: At, codec: CodecPair) -> None:
        dev = at.st.device
        assert dev is not None
        if st.form == PAYLOAD:
            st.value = codec.decode_pieces(dev, st.value, self._pieces(st, st.extent))
        elif st.form == SUM:
            st.value = codec.aggregate_pieces(dev, st.value, self._pieces(st, st.extent))
        elif st.form == CONCAT:
            st.value = torch.cat([codec.decode_pieces(dev, m, self._pieces(st, e))
                                  for m, e in zip(st.value, st.extents, strict=True)])
        else:
            raise ExecutionError(f"nothing to decompress (holds {st.form})")
        st.form = DENSE

    # ---- communication -----------------------------------------------------------------------
    def _need(self, st: _State, form: str) -> None:
        if st.form != form:
            raise ExecutionError(f"needs {form}, holds {st.form}")

    def _pop(self, st: _State, what: str, scope: Scope) -> Extent:
        if not st.stack or st.stack[-1][:2] != (what, scope):
            raise ExecutionError(f"no open {what} of scope {scope.value} to close")
        return st.stack.pop()[2]

    def _allreduce(self, st: _State, at: At) -> None:
        s = at.st
        self._need(st, DENSE)
        st.value = self.transport.allreduce(s.scope, st.value).to(self.device)

    def _reduce_scatter(self, st: _State, at: At) -> None:
        s = at.st
        self._need(st, DENSE)
        shards = split(st.extent, self.topo.size(s.scope))
        st.value = self.transport.reduce_scatter(s.scope, st.value,
                                                 [e.numel for e in shards]).to(self.device)
        st.stack.append(("split", s.scope, st.extent))
        st.extent = shards[self.topo.index(s.scope)]

    def _allgather(self, st: _State, at: At) -> None:
        s = at.st
        self._need(st, DENSE)
        parent = self._pop(st, "split", s.scope)
        sizes = [e.numel for e in split(parent, self.topo.size(s.scope))]
        st.value = self.transport.allgather(s.scope, st.value, sizes).to(self.device)
        st.extent = parent

    def _reduce(self, st: _State, at: At) -> None:
        s = at.st
        self._need(st, DENSE)
        out = self.transport.reduce(s.scope, st.value)
        st.stack.append(("root", s.scope, st.extent))
        if self.topo.index(s.scope) == 0:
            st.value = out.to(self.device)  # type: ignore[union-attr]
        else:
            st.value, st.form, st.asleep = None, NONE, s.scope

    def _broadcast(self, st: _State, at: At) -> None:
        s = at.st
        root = self.topo.index(s.scope) == 0
        parent = self._pop(st, "root", s.scope)
        if s.kind is Kind.BROADCAST:
            if root:
                self._need(st, DENSE)
            st.value = self.transport.broadcast(s.scope, st.value if root else None,
                                                parent.numel).to(self.device)
            st.form = DENSE
        else:
            if root:
                self._need(st, PAYLOAD)
            else:  # the root's payload comes from the latest Comp or PushPullC before this
                st.origin = _last_origin(at.steps, at.i, at.step)
            codec = self._need_codec()
            parts = self._pieces(st, parent)
            got = self.transport.broadcast_payload(
                s.scope, codec.flatten(st.value) if root else None, codec.flat_spec(parts))
            st.value = codec.unflatten(got, parts)
            st.form = PAYLOAD
        if not root:
            st.asleep = None
        st.extent = parent

    def _allgather_c(self, st: _State, at: At) -> None:
        s = at.st
        self._need(st, PAYLOAD)
        codec = self._need_codec()
        k = self.topo.size(s.scope)
        undo = bool(st.stack) and st.stack[-1][:2] == ("split", s.scope)
        extents = split(st.stack[-1][2], k) if undo else [st.extent] * k
        member_parts = [self._pieces(st, e) for e in extents]
        got = self.transport.allgather_payloads(s.scope, codec.flatten(st.value),
                                                [codec.flat_spec(p) for p in member_parts])
        st.value = [codec.unflatten(g, p) for g, p in zip(got, member_parts, strict=True)]
        if undo:
            st.form, st.extents, st.extent = CONCAT, extents, st.stack.pop()[2]
        else:
            st.form = SUM

    def _alltoall_c(self, st: _State, at: At) -> None:
        s = at.st
        self._need(st, CHUNKS)
        codec = self._need_codec()
        k = self.topo.size(s.scope)
        me = self.topo.index(s.scope)
        send_specs = [codec.flat_spec(self._pieces(st, e)) for e in st.extents]
        mine = self._pieces(st, st.extents[me])
        got = self.transport.alltoall_payloads(s.scope, [codec.flatten(c) for c in st.value],
                                               send_specs, [send_specs[me]] * k)
        st.stack.append(("split", s.scope, st.extent))
        st.extent = st.extents[me]
        st.form, st.value = SUM, [codec.unflatten(g, mine) for g in got]

    def _gather_c(self, st: _State, at: At) -> None:
        s = at.st
        self._need(st, PAYLOAD)
        codec = self._need_codec()
        parts = self._pieces(st, st.extent)
        spec = codec.flat_spec(parts)
        got = self.transport.gather_payloads(s.scope, codec.flatten(st.value),
                                             [spec] * self.topo.size(s.scope))
        st.stack.append(("root", s.scope, st.extent))
        if self.topo.index(s.scope) == 0:
            st.form, st.value = SUM, [codec.unflatten(g, parts) for g in got]  # type: ignore[union-attr]
        else:
            st.value, st.form, st.asleep = None, NONE, s.scope

    def _push_pull(self, st: _State, at: At) -> None:
        s = at.st
        self._need(st, DENSE)
        ps = self._need_ps()
        if st.extent.numel == 0:  # an empty shard: no key, nothing to push
            return
        key = ps_key(at.name, at.i, st.extent)
        ps.declare(key, st.extent.numel, self.topo.group(s.scope))
        host = np.ascontiguousarray(st.value.detach().cpu().numpy(), dtype=np.float32)
        out = ps.push_pull(key, host, at.step)
        st.value = torch.as_tensor(np.asarray(out, dtype=np.float32)).reshape(-1).to(self.device)

    def _push_pull_c(self, st: _State, at: At) -> None:
        self._need(st, PAYLOAD)
        ps = self._need_ps()
        if st.origin is None or not st.origin.ps or st.origin.index != at.i:
            raise ExecutionError("PushPullC needs the payload of the Comp just before it")
        if st.extent.numel == 0:
            return
        key = ps_key(at.name, at.i, st.extent, compressed=True)
        pushed = [tuple(a.detach().cpu().numpy() if isinstance(a, torch.Tensor) else a
                        for a in p) for p in st.value]
        st.value = [tuple(p) for p in ps.push_pull(key, pushed, at.step)]


def _last_origin(steps: Sequence[Step], before: int, step: int) -> Origin:
    """The producer of the payload a BroadcastC receiver gets: the latest Comp or PushPullC."""
    for j in range(before - 1, -1, -1):
        if steps[j].kind is Kind.PUSH_PULL_C:
            return Origin(j, True, step)
        if steps[j].kind is Kind.COMP:
            return Origin(j, False, step)
    raise ExecutionError("BroadcastC without a Comp before it")


_COMM: dict[Kind, Callable[..., None]] = {
    Kind.ALLREDUCE: Executor._allreduce,
    Kind.REDUCE_SCATTER: Executor._reduce_scatter,
    Kind.ALLGATHER: Executor._allgather,
    Kind.REDUCE: Executor._reduce,
    Kind.BROADCAST: Executor._broadcast,
    Kind.BROADCAST_C: Executor._broadcast,
    Kind.ALLGATHER_C: Executor._allgather_c,
    Kind.ALLTOALL_C: Executor._alltoall_c,
    Kind.GATHER_C: Executor._gather_c,
    Kind.PUSH_PULL: Executor._push_pull,
    Kind.PUSH_PULL_C: Executor._push_pull_c,
}


class Handle:
    """An Option in flight: ``done()`` polls, ``wait()`` returns the dense sum or raises."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._future: Future[torch.Tensor] = Future()

    def done(self) -> bool:
        return self._future.done()

    def wait(self, timeout: float | None = None) -> torch.Tensor:
        """The result; re-raises the lane's :class:`ExecutionError`.

        Raises:
            ExecutionError: the Option failed, or ``timeout`` seconds passed first.
        """
        try:
            return self._future.result(timeout)
        except TimeoutError:
            raise ExecutionError(f"tensor {self.name!r} not synchronized within {timeout} s; "
                                 "another rank may have failed or submitted tensors in a "
                                 "different order") from None


_STOP = object()


class Engine:
    """Runs Options asynchronously: one thread per lane, each in submission order.

    Args:
        executors: one :class:`Executor` per lane (each over its own process groups).
        timeout_s: how long :meth:`Handle.wait` callers should wait (``ESPRESSO_TIMEOUT``).
        counters: iteration counters per tensor name to share with other engines.
    """

    def __init__(self, executors: Sequence[Executor], timeout_s: float = 60.0,
                 counters: dict[str, int] | None = None) -> None:
        if not executors:
            raise ValueError("the engine needs at least one executor (lane)")
        self.executors = list(executors)
        self.timeout_s = timeout_s
        # Iterations per tensor name; shared by a process's engines, so a tensor keeps counting
        # (PS rounds and random draws move on) when its Options change engine after planning.
        self._steps: dict[str, int] = counters if counters is not None else {}
        self._queues: list[queue.Queue[Any]] = [queue.Queue() for _ in self.executors]
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
               lane: int | None = None) -> Handle:
        """Start ``option`` on ``tensor``; every rank must submit in the same order per lane.

        Args:
            name: the tensor's name (its iteration counter and PS keys hang off it).
            tensor: this rank's values; not modified.
            option: the program to run.
            lane: force a lane (default: :meth:`lane_of`).

        Returns:
            A :class:`Handle` for the dense sum over all workers.
        """
        step = self._steps.get(name, 0)
        self._steps[name] = step + 1
        lane = self.lane_of(name) if lane is None else lane
        return self.call(lane, lambda ex: ex.run(option, tensor, name=name, step=step), name)

    def run(self, name: str, tensor: torch.Tensor, option: Option) -> torch.Tensor:
        """Synchronous :meth:`submit` + wait."""
        return self.submit(name, tensor, option).wait(self.timeout_s)

    def call(self, lane: int, fn: Callable[[Executor], Any], name: str = "call") -> Handle:
        """Run ``fn(executor of lane)`` on the lane's thread, after the work already queued.

        Used to measure costs inside the lanes while training runs (the start-up profile); a
        ``fn`` that issues collectives must be queued at the same point on every rank.
        """
        handle = Handle(name)
        self._queues[lane % self.lanes].put((handle, fn))
        return handle

    def _loop(self, lane: int) -> None:
        executor = self.executors[lane]
        while True:
            item = self._queues[lane].get()
            if item is _STOP:
                return
            handle, fn = item
            if not handle._future.set_running_or_notify_cancel():
                continue
            try:
                handle._future.set_result(fn(executor))
            except BaseException as exc:
                log.error("%s", exc)
                handle._future.set_exception(exc)

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
