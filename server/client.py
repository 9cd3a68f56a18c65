"""The worker side of the parameter server: declare keys, push and pull them asynchronously.

Example:
    >>> client = PSClient(cfg, rank=cfg.rank)                     # doctest: +SKIP
    >>> client.declare("fc.weight", 1 << 20, pushers=[0, 1])      # dense float32
    >>> h = client.push_pull_async("fc.weight", grad, round=0)    # grad: float32 ndarray
    >>> total = h.wait()                                          # sum over the pushers
    >>> client.declare("conv.weight", 4096, pushers=[0, 1], compressor="onebit")
    >>> names = client.key_names("conv.weight")   # compress partition i with name=names[i]
    >>> aggregated = client.push_pull("conv.weight", [payload], round=0)  # list of payloads
    >>> client.close()

Tensors larger than ``BYTEPS_PARTITION_BYTES`` are split into several keys (see
:func:`byteps_espresso.server.keys.split`); the scheduler places keys on servers balanced by
bytes and gives every worker the same answer. For a compressed tensor, partition ``i`` is
compressed on its slice ``data[offset:offset + numel]`` with ``name=key_names(name)[i]`` and
``step=round``, because the server rebuilds the same ctx to decode it.

Threads: the thread that waits for a result drives the server sockets itself (sends, polls,
receives and completes whatever arrived), so a synchronous push_pull crosses no thread
hand-off; when several threads wait at once, one drives and the others sleep until their
result is in or the sockets are free. A background thread owns only the scheduler link and
the connection monitors (heartbeats, ABORT, lost connections). Any number of keys can be in
flight. Every wait is bounded by ``ESPRESSO_TIMEOUT`` and its error names the key, round and
server. A lost server
or scheduler (connection dropped, or ABORT from the scheduler) fails every pending and later
operation with :class:`PSError` at once. The arrays handed to :meth:`PSClient.push_pull_async`
are sent without copying: do not modify them until the handle is done.
"""

from __future__ import annotations

import collections
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import zmq
from byteps_espresso.server import protocol as P
from byteps_espresso.server.auth import AuthError
from byteps_espresso.server.keys import KeySpec, part_names, split
from byteps_espresso.server.link import (
    RendezvousError,
    SchedulerLink,
    dealer,
    readable,
    recv_frames,
    send_frames,
)
from byteps_espresso.server.shm import Segment, host_identity

from byteps_espresso.config import Config

__all__ = ["Handle", "PSClient", "PSError", "PSTimeout", "address_host"]

log = logging.getLogger(__name__)

# Period of deadline checks in the I/O thread, in seconds.
_TICK_S = 0.05
# Control replies matched by request type.
_REPLY_OF = {
    P.MsgType.PLACE: P.MsgType.PLACE_OK,
    P.MsgType.BARRIER: P.MsgType.BARRIER_OK,
    P.MsgType.DONE: P.MsgType.DONE_OK,
    P.MsgType.DECLARE: P.MsgType.DECLARE_OK,
    P.MsgType.STATS: P.MsgType.STATS_REPLY,
    P.MsgType.STATE: P.MsgType.STATE_REPLY,
    P.MsgType.ATTACH: P.MsgType.ATTACH_OK,
}
_SCHEDULER = -1  # target index of the scheduler in control calls


class PSError(RuntimeError):
    """A PS operation failed; the message names the key, round and server when it has them."""


class PSTimeout(PSError, TimeoutError):
    """A PS operation did not complete within ``ESPRESSO_TIMEOUT``."""


@dataclass(frozen=True)
class _Part:
    key: int
    server: int
    spec: KeySpec
    offset: int
    push_layout: P.Layout
    reply_layout: P.Layout


@dataclass(frozen=True)
class _Tensor:
    name: str
    numel: int
    dtype: str
    compressed: bool
    parts: tuple[_Part, ...]


class _Flag:
    """Set once, read by anyone: what a :class:`Handle` needs of ``threading.Event``, at a
    fraction of its cost (one per push_pull). Nobody blocks on it: a thread waiting for a
    handle sleeps on the client's condition, which the driving thread notifies after it
    completed handles (``PSClient._release``)."""

    __slots__ = ("_set",)

    def __init__(self) -> None:
        self._set = False

    def is_set(self) -> bool:
        return self._set

    def set(self) -> None:
        self._set = True


class Handle:
    """An in-flight push_pull; :meth:`wait` returns its result."""

    def __init__(self, tensor: _Tensor, round_: int, deadline: float, timeout_s: float,
                 drive: Callable[[Any, float], bool], *,
                 out: np.ndarray | None = None) -> None:
        self.tensor = tensor
        self._drive = drive
        self.round = round_
        self.deadline = deadline
        self._timeout_s = timeout_s
        self._event = _Flag()
        self._error: PSError | None = None
        self._missing = set(range(len(tensor.parts)))  # partitions without a PULL_REPLY
        if tensor.compressed:
            self._out: Any = [None] * len(tensor.parts)
        elif out is None and len(tensor.parts) == 1:
            self._out = None  # the reply's received frame becomes the result, uncopied
        else:
            self._out = np.empty(tensor.numel, dtype=tensor.dtype) if out is None else out

    def done(self) -> bool:
        """True once the result (or an error) is there."""
        return self._event.is_set()

    def wait(self, timeout: float | None = None) -> Any:
        """Block until the aggregate is back.

        Args:
            timeout: seconds to wait at most; default: until the operation's own deadline
                (``ESPRESSO_TIMEOUT`` after it started).

        Returns:
            Dense key: the float32 (or float16) sum over the pushers, a new array of the
            tensor's numel. Compressed key: one aggregated payload (tuple of numpy arrays) per
            partition, or one dense float32 array per partition if the key was declared
            with ``server_recompress=False``.

        Raises:
            PSTimeout: no result in time (names key, round and server).
            PSError: the server rejected the push/pull or a server/scheduler was lost.
        """
        limit = self.deadline - time.monotonic() + 1.0 if timeout is None else timeout
        if not self._drive(self._event, time.monotonic() + max(0.0, limit)):
            raise PSTimeout(self._describe_pending(f"no result after waiting {limit:.1f} s"))
        if self._error is not None:
            raise self._error
        return self._out

    # ---- called by the driving thread ------------------------------------------------------
    def _describe_pending(self, why: str, server: int | None = None) -> str:
        pending = [self.tensor.parts[i] for i in sorted(self._missing)]
        on_server = [p for p in pending if p.server == server]
        part = (on_server or pending or list(self.tensor.parts))[0]
        return (f"push_pull of {part.spec.name!r} (key {part.key}) round {self.round} on server "
                f"{part.server}: {why}; {len(pending)} of {len(self.tensor.parts)} "
                "partition(s) incomplete")

    def _fail(self, error: PSError) -> None:
        if not self._event.is_set():
            self._error = error
            self._event.set()

    def _part_done(self, index: int) -> None:
        self._missing.discard(index)
        if not self._missing:
            self._event.set()


@dataclass
class _Call:
    """A synchronous control request (PLACE, BARRIER, DONE, DECLARE, STATS)."""

    target: int
    frames: list[Any]
    reply: P.MsgType
    key: int
    deadline: float
    what: str
    wait_s: float
    event: threading.Event = field(default_factory=threading.Event)
    body: Any = None
    error: PSError | None = None

    def finish(self, body: Any = None, error: PSError | None = None) -> None:
        if not self.event.is_set():
            self.body, self.error = body, error
            self.event.set()


def address_host(address: str) -> str:
    """The host of a node's ``tcp://host:port`` address."""
    return address.removeprefix("tcp://").rpartition(":")[0]


def _describe(layout: P.Layout) -> list[str]:
    return [f"{d}:{n}B" for d, n in zip(layout.frame_dtypes, layout.frame_nbytes, strict=True)]


class PSClient:
    """A worker's connection to the PS job. Registers with the scheduler on construction.

    Args:
        cfg: the parsed environment (scheduler address, timeouts, partition size, limits).
        rank: this worker's global rank; default ``cfg.rank``.

    Raises:
        PSError: start-up failed (the message lists missing nodes, or says the scheduler
            could not be reached).
    """

    def __init__(self, cfg: Config, rank: int | None = None) -> None:
        self.cfg = cfg
        self.rank = cfg.rank if rank is None else int(rank)
        self._ctx = zmq.Context()
        self._link = SchedulerLink(self._ctx, cfg, "worker",
                                   {"rank": self.rank, "world_size": cfg.world_size})
        try:
            accept = self._link.register()
        except (RendezvousError, P.ProtocolError) as exc:
            self._link.close()
            self._ctx.term()
            raise PSError(f"worker {self.rank}: {exc}") from None
        self._auth = self._link.auth  # the job key (server/auth.py)
        self.servers: list[str] = list(accept["servers"])
        here = host_identity() if cfg.enable_ipc else ""
        # per server: whether it is on this host and takes shared memory (BYTEPS_ENABLE_IPC)
        hosts = accept.get("server_hosts")
        if not isinstance(hosts, list) or len(hosts) != len(self.servers):
            hosts = [""] * len(self.servers)
        self._local = [bool(here) and h == here for h in hosts]
        # The servers on this worker's machine (they advertise this process's address): a
        # machine's push/pulls to them stay off its link (strategy.Cluster.local_server_share).
        me = cfg.advertise_host()
        self.local_servers = sum(address_host(a) == me for a in self.servers)
        self.num_workers = int(accept["num_workers"])
        connected = [dealer(self._ctx, addr, cfg) for addr in self.servers]
        self._socks = [sock for sock, _ in connected]
        self._watches = [watch for _, watch in connected]
        self._tensors: dict[str, _Tensor] = {}
        self._dead: dict[int, str] = {}  # target -> why it is unusable
        self._closed = False
        self._closing = False
        # Guarded by _mu: pending operations and calls, the driving token, the outbox.
        self._mu = threading.Lock()
        self._turn = threading.Condition(self._mu)  # notified whenever the token is released
        self._driving = False  # a thread owns the server sockets (self._socks)
        self._outbox: list[tuple[int, list[Any]]] = []  # sends queued while a thread drives
        self._inflight: dict[tuple[int, int, int], tuple[Handle, int]] = {}
        self._calls: dict[tuple[int, P.MsgType, int], collections.deque[_Call]] = {}
        # BYTEPS_ENABLE_IPC: key -> the segment its pushes and sums go through (one round at
        # a time: a key whose round is in flight there is busy, and its next round, if
        # issued meanwhile, goes over TCP); a round that fails there takes the key off it.
        self._shm: dict[int, Segment] = {}
        self._shm_busy: set[int] = set()
        # Scheduler calls and "stop" go to the background thread, which owns the link.
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        # Wakes the driving thread's poll when another thread queued a send.
        self._io_wake_r, self._io_wake_w = os.pipe()
        os.set_blocking(self._io_wake_r, False)
        self._poller = zmq.Poller()
        for sock in (self._io_wake_r, *self._socks):
            self._poller.register(sock, zmq.POLLIN)
        self._thread = threading.Thread(target=self._io_loop, name=f"ps-client-{self.rank}",
                                        daemon=True)
        self._thread.start()

    # ---- public API ---------------------------------------------------------------------------
    def declare(self, name: str, numel: int, pushers: Sequence[int], *,
                compressor: str | None = None, params: dict[str, Any] | None = None,
                dtype: str = "float32") -> list[tuple[int, int]]:
        """Declare a tensor; every pusher declares it identically before pushing it.

        Args:
            name: the tensor name (unique in the job).
            numel: its element count.
            pushers: global ranks that push it every round.
            compressor: registry name, or None for a dense key.
            params: compressor parameters, plus ``server_error_feedback`` /
                ``server_recompress`` (see :mod:`byteps_espresso.server.keys`).
            dtype: ``"float32"``, or ``"float16"`` for a dense key.

        Returns:
            The partitions as (offset, numel).

        Raises:
            PSError: the scheduler or a server refused the declaration (another worker
                declared it differently, unknown compressor, bad params, too large).
            PSTimeout: no answer within ESPRESSO_TIMEOUT.
        """
        if name in self._tensors:
            raise PSError(f"{name!r} is already declared by worker {self.rank}")
        itemsize = np.dtype(dtype).itemsize if dtype in ("float32", "float16") else 4
        try:
            chunks = split(int(numel), itemsize, self.cfg.partition_bytes)
        except ValueError as exc:
            raise PSError(f"cannot declare {name!r}: {exc}") from None
        names = part_names(name, len(chunks))
        specs = []
        for part_name, (_, part_numel) in zip(names, chunks, strict=True):
            body = {"name": part_name, "numel": part_numel, "dtype": dtype,
                    "compressor": compressor, "params": dict(params or {}),
                    "pushers": list(pushers)}
            try:
                specs.append(KeySpec.from_json(body, self.num_workers))
            except P.ProtocolError as exc:
                raise PSError(f"cannot declare {name!r}: {exc.detail}") from None
        try:
            codec = specs[0].create_compressor()
            layouts = [(s.push_layout(codec), s.reply_layout(codec)) for s in specs]
        except (ValueError, TypeError) as exc:
            raise PSError(f"cannot declare {name!r}: {exc}") from None
        whole = {**specs[0].to_json(), "name": name, "numel": int(numel)}
        parts_desc = [[s.numel, sum(lay[0].frame_nbytes)] for s, lay in
                      zip(specs, layouts, strict=True)]
        placed = self._call(_SCHEDULER, P.encode_json(P.MsgType.PLACE,
                                                      {"spec": whole, "parts": parts_desc},
                                                      sender=self.rank),
                            P.MsgType.PLACE, 0, f"declare {name!r}")
        keys = placed["keys"]
        parts = []
        for spec, (offset, _), (push, reply), slot in zip(specs, chunks, layouts, keys,
                                                          strict=True):
            key, server = int(slot["key"]), int(slot["server"])
            parts.append(_Part(key, server, spec, offset, push, reply))
        calls = [self._start_call(p.server, P.encode_json(P.MsgType.DECLARE, p.spec.to_json(),
                                                          key=p.key, sender=self.rank),
                                  P.MsgType.DECLARE, p.key, f"declare {p.spec.name!r}")
                 for p in parts]
        for call in calls:
            self._finish_call(call)
        if compressor is None and dtype == "float32":
            self._attach([p for p in parts if self._local[p.server]])
        self._tensors[name] = _Tensor(name, int(numel), dtype, compressor is not None,
                                      tuple(parts))
        return [(p.offset, p.spec.numel) for p in parts]

    def _attach(self, parts: list[_Part]) -> None:
        """Offer each partition's server a shared-memory segment (BYTEPS_ENABLE_IPC); a server
        on another host, or one that refuses, keeps the partition on TCP."""
        for part in parts:
            try:
                segment = Segment.create(sum(part.push_layout.frame_nbytes), f"{self.rank}")
            except OSError as exc:  # e.g. a container's small /dev/shm: say it once
                log.warning("worker %d: dense keys stay on TCP from %s on: no shared-memory "
                            "segment of %d bytes (%s); give /dev/shm more space or set "
                            "BYTEPS_ENABLE_IPC=0", self.rank, part.spec.name,
                            sum(part.push_layout.frame_nbytes), exc)
                self._local = [False] * len(self._local)
                return
            try:
                self._call(part.server, P.encode_json(
                    P.MsgType.ATTACH, {"path": segment.path, "host": host_identity()},
                    key=part.key, sender=self.rank), P.MsgType.ATTACH, part.key,
                    f"attach {part.spec.name!r}")
            except PSError as exc:
                log.warning("worker %d: %s", self.rank, exc)
                segment.close()
                continue
            finally:
                segment.unlink()  # mapped on both sides: the name is no longer needed
            self._shm[part.key] = segment

    def partitions(self, name: str) -> list[tuple[int, int]]:
        """The (offset, numel) of each key of tensor ``name``."""
        return [(p.offset, p.spec.numel) for p in self._tensor(name).parts]

    def key_names(self, name: str) -> list[str]:
        """The ctx name to compress each partition of ``name`` with."""
        return [p.spec.name for p in self._tensor(name).parts]

    def servers_of(self, name: str) -> list[int]:
        """The server rank holding each partition of ``name``."""
        return [p.server for p in self._tensor(name).parts]

    def push_pull_async(self, name: str, data: Any, round: int, *,
                        out: np.ndarray | None = None) -> Handle:
        """Push this worker's contribution for ``round`` and pull the aggregate.

        Args:
            name: a declared tensor.
            data: dense key: the full tensor as a C-contiguous numpy array of the declared
                dtype; compressed key: a list with one payload (sequence of numpy arrays)
                per partition.
            round: the round (iteration) number; strictly increasing per key.
            out: dense keys only: a C-contiguous array of the tensor's dtype and numel that
                receives the sum (may be ``data`` itself: a pull is answered only after the
                server received every push); default: a new array.

        Returns:
            A :class:`Handle`; ``wait()`` gives the result.

        Raises:
            PSError: unknown tensor, data that does not fit the declaration, a round already
                in flight, or a lost server/scheduler.
        """
        tensor = self._tensor(name)
        if (type(round) is not int and not isinstance(round, np.integer)) or round < 0:
            raise PSError(f"round of {name!r} must be a non-negative integer, got {round!r}")
        frames = (self._dense_frames(tensor, data) if not tensor.compressed
                  else self._payload_frames(tensor, data))
        if out is not None:
            if tensor.compressed:
                raise PSError(f"out= is for dense keys; {name!r} is compressed")
            out = self._check_dense(tensor, out)
        now = time.monotonic()
        handle = Handle(tensor, int(round), now + self.cfg.op_timeout_s, self.cfg.op_timeout_s,
                        self._await, out=out)
        with self._mu:
            sends, copies = self._register_op(handle, frames)
        for into, src in copies:  # outside the lock: the busy key's segment is this thread's
            np.copyto(into, src)
        self._submit(sends)
        return handle

    def push_pull(self, name: str, data: Any, round: int, *, out: np.ndarray | None = None
                  ) -> Any:
        """``push_pull_async(name, data, round, out=out).wait()``."""
        return self.push_pull_async(name, data, round, out=out).wait()

    def barrier(self, timeout: float | None = None) -> None:
        """Block until every worker of the job called barrier.

        Raises:
            PSTimeout: not every worker arrived within ``timeout`` (default ESPRESSO_TIMEOUT).
            PSError: the scheduler is lost or aborted the job.
        """
        self._call(_SCHEDULER, P.encode(P.MsgType.BARRIER, sender=self.rank),
                   P.MsgType.BARRIER, 0, "barrier", timeout=timeout)

    def server_stats(self) -> list[dict[str, Any]]:
        """Counters of every server: rounds, rejections by code, CPU seconds."""
        calls = [self._start_call(s, P.encode(P.MsgType.STATS, sender=self.rank),
                                  P.MsgType.STATS, 0, "stats") for s in range(len(self.servers))]
        return [self._finish_call(c) for c in calls]

    def server_state(self) -> dict[str, dict[str, dict[str, np.ndarray]]]:
        """The compressor state every server keeps between rounds (server-side error-feedback
        residuals, codec momenta), for a checkpoint: ``{key name: {tensor: {slot: array}}}``.
        Rank 0 only; call it between iterations, when no round is in flight.

        Raises:
            PSError: a server refused (not rank 0, a round in flight) or was lost.
        """
        out: dict[str, dict[str, dict[str, np.ndarray]]] = {}
        for server in range(len(self.servers)):
            keys: list[int] = []
            start: int | None = 0
            while start is not None:
                page, _ = self._call(server, P.encode_control(
                    P.MsgType.STATE, {"op": "list", "start": start}, sender=self.rank),
                    P.MsgType.STATE, 0, "list server state")
                keys += [int(k) for k in page["keys"]]
                start = page["next"]
            calls = [self._start_call(server, P.encode_control(
                P.MsgType.STATE, {"op": "get"}, key=k, sender=self.rank), P.MsgType.STATE, k,
                f"read server state of key {k}") for k in keys]
            for call in calls:
                body, frames = self._finish_call(call)
                try:
                    out[str(body["name"])] = P.unpack_state(body.get("state"), frames)
                except P.ProtocolError as exc:
                    raise PSError(f"server {server} sent bad state: {exc}") from None
        return out

    def restore_server_state(self, state: dict[str, dict[str, dict[str, np.ndarray]]]
                             ) -> None:
        """Give every server the state :meth:`server_state` read (in a resumed job, before
        its first step). Each server applies a key's state when the key is declared on it,
        since the new job may place keys on other servers. Rank 0 only.

        Raises:
            PSError: a server refused (not rank 0, a key that already ran a round, state
                that does not fit the key) or was lost.
        """
        calls = []
        for name, slots in state.items():
            try:
                entries, arrays = P.pack_state(slots)
            except P.ProtocolError as exc:
                raise PSError(f"cannot restore the server state of {name!r}: {exc}") from None
            for server in range(len(self.servers)):
                calls.append(self._start_call(server, P.encode_control(
                    P.MsgType.STATE, {"op": "put", "name": name, "state": entries}, arrays,
                    sender=self.rank), P.MsgType.STATE, 0, f"restore server state of {name!r}"))
        for call in calls:
            self._finish_call(call)

    def close(self) -> None:
        """Tell the scheduler this worker is done, then close every socket (idempotent).

        A client that lost a server reports it, and the scheduler aborts the job."""
        if self._closed:
            return
        self._closing = True
        if _SCHEDULER not in self._dead:
            lost = next(iter(self._dead), None)
            body = {"failed": self._dead.get(lost),
                    "culprit": None if lost is None else f"server {lost}"}
            try:
                self._call(_SCHEDULER, P.encode_json(P.MsgType.DONE, body, sender=self.rank),
                           P.MsgType.DONE, 0, "close")
            except PSError as exc:
                log.warning("worker %d: closing without the scheduler's acknowledgement: %s",
                            self.rank, exc)
        self._closed = True
        self._command(("stop",))
        self._thread.join(timeout=5.0)
        for watch in self._watches:
            watch.close()
        for sock in self._socks:
            sock.close(linger=0)
        self._link.close()
        self._ctx.term()
        for fd in (self._wake_r, self._wake_w, self._io_wake_r, self._io_wake_w):
            os.close(fd)
        for segment in self._shm.values():
            segment.close()

    def __enter__(self) -> PSClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- input checks -------------------------------------------------------------------------
    def _tensor(self, name: str) -> _Tensor:
        if self._closed:
            raise PSError(f"worker {self.rank}: the PS client is closed")
        tensor = self._tensors.get(name)
        if tensor is None:
            raise PSError(f"{name!r} is not declared; call declare({name!r}, numel, pushers) "
                          "first")
        return tensor

    @staticmethod
    def _check_dense(tensor: _Tensor, data: Any) -> np.ndarray:
        """``data`` as a flat array, once it is a C-contiguous array of the tensor's dtype
        and numel."""
        if not isinstance(data, np.ndarray):
            raise PSError(f"{tensor.name!r} is dense: pass a numpy array, got "
                          f"{type(data).__name__}")
        if data.dtype != tensor.dtype or data.size != tensor.numel:
            raise PSError(f"{tensor.name!r} is declared {tensor.dtype}[{tensor.numel}], got "
                          f"{data.dtype}[{data.size}]")
        if not data.flags.c_contiguous:
            raise PSError(f"{tensor.name!r}: the array is not C-contiguous; use "
                          "np.ascontiguousarray")
        return data.reshape(-1)

    @classmethod
    def _dense_frames(cls, tensor: _Tensor, data: Any) -> list[list[np.ndarray]]:
        flat = cls._check_dense(tensor, data)
        if len(tensor.parts) == 1:
            return [[flat]]
        return [[flat[p.offset:p.offset + p.spec.numel]] for p in tensor.parts]

    @staticmethod
    def _payload_frames(tensor: _Tensor, data: Any) -> list[list[np.ndarray]]:
        if not isinstance(data, (list, tuple)) or len(data) != len(tensor.parts):
            raise PSError(f"{tensor.name!r} is compressed into {len(tensor.parts)} "
                          f"partition(s): pass a list of that many payloads")
        out = []
        for part, payload in zip(tensor.parts, data, strict=True):
            from byteps_espresso.kernels.base import to_numpy

            arrays = [np.ascontiguousarray(a) for a in to_numpy(tuple(payload))]
            got = tuple(a.nbytes for a in arrays)
            dtypes = tuple(a.dtype for a in arrays)
            if got != part.push_layout.frame_nbytes or dtypes != part.push_layout.frame_dtypes:
                raise PSError(f"payload of {part.spec.name!r} has arrays "
                              f"{[f'{d}:{n}B' for d, n in zip(dtypes, got, strict=True)]}, "
                              f"{part.spec.compressor} for {part.spec.numel} elements needs "
                              f"{_describe(part.push_layout)}")
            out.append(arrays)
        return out

    # ---- control calls (user thread side) -----------------------------------------------------
    def _start_call(self, target: int, frames: list[Any], request: P.MsgType, key: int,
                    what: str, *, timeout: float | None = None) -> _Call:
        if self._closed:
            raise PSError(f"worker {self.rank}: the PS client is closed")
        wait_s = self.cfg.op_timeout_s if timeout is None else timeout
        call = _Call(target, frames, _REPLY_OF[request], key, time.monotonic() + wait_s, what,
                     wait_s)
        if target == _SCHEDULER:
            self._command(("call", call))
            return call
        with self._mu:
            registered = self._register_call(call)
        if registered:
            self._submit([(target, frames)])
        return call

    def _finish_call(self, call: _Call) -> Any:
        # The background thread answers scheduler calls; server calls need a driver.
        deadline = call.deadline + 1.0
        if not (call.event.wait(max(0.0, deadline - time.monotonic()))
                if call.target == _SCHEDULER else self._await(call.event, deadline)):
            call.finish(error=PSTimeout(f"{call.what}: no answer from {self._where(call.target)}"))
        if call.error is not None:
            raise call.error
        return call.body

    def _call(self, target: int, frames: list[Any], request: P.MsgType, key: int, what: str,
              *, timeout: float | None = None) -> Any:
        return self._finish_call(self._start_call(target, frames, request, key, what,
                                                  timeout=timeout))

    def _where(self, target: int) -> str:
        if target == _SCHEDULER:
            return f"the scheduler at {self._link.endpoint}"
        return f"server {target} at {self.servers[target]}"

    def _command(self, cmd: tuple) -> None:
        self._cmds.put(cmd)
        os.write(self._wake_w, b"x")

    # ---- driving the server sockets (any waiting thread) --------------------------------------
    def _submit(self, sends: list[tuple[int, list[Any]]]) -> None:
        """Send ``(server, frames)`` from this thread when no thread drives the sockets, else
        queue them for the driving thread and wake its poll."""
        if not sends:
            return
        with self._mu:
            if self._driving:
                self._outbox.extend(sends)
                os.write(self._io_wake_w, b"x")
                return
            self._driving = True
        try:
            self._send_all(sends)
        finally:
            self._release()

    def _send_all(self, sends: list[tuple[int, list[Any]]]) -> None:
        """Send on the server sockets (the caller holds the driving token, not ``_mu``)."""
        for server, frames in sends:  # signed here, outside _mu: hashing takes a while
            send_frames(self._socks[server], self._auth.sign(frames))

    def _take_outbox(self) -> list[tuple[int, list[Any]]]:
        if not self._outbox:  # read without _mu: a send queued after it also wakes the poll
            return []
        with self._mu:
            sends, self._outbox = self._outbox, []
        return sends

    def _release(self) -> None:
        """Give the driving token back, after sending what other threads queued meanwhile,
        and wake the threads waiting for it or for their results."""
        while True:
            with self._mu:
                sends, self._outbox = self._outbox, []
                if not sends:
                    self._driving = False
                    self._turn.notify_all()
                    return
            self._send_all(sends)

    def _await(self, event: _Flag | threading.Event, deadline: float) -> bool:
        """Wait for ``event`` until ``deadline`` (monotonic), driving the server sockets
        whenever no other thread does. Returns whether the event is set."""
        while not event.is_set():
            with self._mu:
                while self._driving and not event.is_set():
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return False
                    self._turn.wait(min(left, _TICK_S))
                if event.is_set():
                    return True
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._driving = True
            try:
                self._drive(min(left, _TICK_S))
            finally:
                self._release()
        return True

    def _drive(self, timeout_s: float) -> None:
        """One poll of the server sockets: receive and complete everything that arrived."""
        events = dict(self._poller.poll(timeout_s * 1000))
        if self._io_wake_r in events:
            try:
                while os.read(self._io_wake_r, 4096):
                    pass
            except BlockingIOError:
                pass
        for i, sock in enumerate(self._socks):
            if sock not in events:
                continue
            while True:
                try:
                    raw = recv_frames(sock, zmq.NOBLOCK)
                except zmq.Again:
                    break
                with self._mu:
                    self._on_server_message(i, raw)
                if not readable(sock):
                    break
        self._send_all(self._take_outbox())

    # ---- background thread: scheduler link and connection monitors ---------------------------
    def _io_loop(self) -> None:
        poller = zmq.Poller()
        for sock in (self._wake_r, self._link.sock, self._link.watch.socket,
                     *(w.socket for w in self._watches)):
            poller.register(sock, zmq.POLLIN)
        next_check = 0.0
        try:
            while True:
                wait_s = min(self._link.tick() if _SCHEDULER not in self._dead else _TICK_S,
                             _TICK_S)
                events = dict(poller.poll(wait_s * 1000))
                if self._wake_r in events and self._drain_commands():
                    return
                with self._mu:
                    self._receive(events)
                    now = time.monotonic()
                    if now >= next_check:
                        self._check_deadlines(now)
                        next_check = now + _TICK_S
        except Exception as exc:  # never leave waiters hanging on a dead thread
            log.exception("worker %d: PS client I/O thread failed", self.rank)
            with self._mu:
                self._lose_all(PSError(f"worker {self.rank}: PS client I/O thread failed: "
                                       f"{exc!r}"))

    def _receive(self, events: dict[Any, int]) -> None:
        if self._link.sock in events:
            while self._link.sock.poll(0):
                self._on_scheduler_message()
        for i, watch in enumerate(self._watches):
            if watch.socket in events and watch.lost():
                self._lose(i, f"lost the connection to server {i} at {self.servers[i]}: it "
                              "exited, was stopped or became unreachable (no heartbeat answer "
                              "within ESPRESSO_HEARTBEAT_TIMEOUT="
                              f"{self.cfg.heartbeat_timeout_s:g} s)", report=f"server {i}")
        if self._link.watch.socket in events and self._link.watch.lost():
            self._lose(_SCHEDULER, self._link.lost_reason(), report="scheduler")

    def _drain_commands(self) -> bool:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass
        while not self._cmds.empty():
            cmd = self._cmds.get()
            with self._mu:
                if cmd[0] == "stop":
                    self._lose_all(PSError(f"worker {self.rank}: the PS client was closed"))
                    return True
                if self._register_call(cmd[1]):
                    self._link.send(cmd[1].frames)
        return False

    # ---- state changes (hold _mu) -------------------------------------------------------------
    def _register_op(self, handle: Handle, frames: list[list[np.ndarray]]
                     ) -> tuple[list[tuple[int, list[Any]]], list[tuple[np.ndarray, np.ndarray]]]:
        """Record the pushes of ``handle`` as in flight; returns what to send and the
        (segment, push) copies to make before it is sent (nothing when the handle failed at
        once: a lost server, or that round already in flight)."""
        tensor = handle.tensor
        for part in tensor.parts:
            dead = self._dead.get(_SCHEDULER) or self._dead.get(part.server)
            if dead:  # an ABORT's reason names the root cause; prefer it
                handle._fail(PSError(handle._describe_pending(dead, part.server)))
                return [], []
            if (part.server, part.key, handle.round) in self._inflight:
                handle._fail(PSError(f"round {handle.round} of {part.spec.name!r} is already "
                                     f"in flight on worker {self.rank}"))
                return [], []
        sends, copies = [], []
        for i, (part, arrays) in enumerate(zip(tensor.parts, frames, strict=True)):
            lay = part.push_layout
            flags, payload = P.FLAG_PULL, arrays
            segment = self._shm.get(part.key)
            if segment is not None and part.key not in self._shm_busy:
                into = segment.array[:lay.numel]
                if into.ctypes.data != arrays[0].ctypes.data:
                    copies.append((into, arrays[0]))
                self._shm_busy.add(part.key)
                flags, payload = P.FLAG_PULL | P.FLAG_SHM, []
            push = P.encode(P.MsgType.PUSH, key=part.key, round=handle.round, sender=self.rank,
                            codec=lay.codec, dtype=lay.dtype, numel=lay.numel, frames=payload,
                            flags=flags)
            self._inflight[(part.server, part.key, handle.round)] = (handle, i)
            sends.append((part.server, push))
        return sends, copies

    def _register_call(self, call: _Call) -> bool:
        """Record ``call`` as waiting for its reply; False (and the call failed) when its
        target is lost."""
        dead = self._dead.get(_SCHEDULER) or self._dead.get(call.target)
        if dead:
            call.finish(error=PSError(f"{call.what}: {dead}"))
            return False
        self._calls.setdefault((call.target, call.reply, call.key),
                               collections.deque()).append(call)
        return True

    def _on_server_message(self, server: int, raw: list[zmq.Frame]) -> None:
        try:
            raw = self._auth.verify(raw)
        except AuthError as exc:
            log.error("worker %d: dropped an unauthenticated message from server %d: %s",
                      self.rank, server, exc)
            return
        except P.ProtocolError as exc:
            log.error("worker %d: message from server %d ignored: %s", self.rank, server, exc)
            return
        try:
            msg = P.decode(raw, self.cfg.max_message_bytes)
        except P.ProtocolError as exc:
            log.error("worker %d: malformed message from server %d ignored: %s", self.rank,
                      server, exc)
            return
        h = msg.header
        if h.type is P.MsgType.PULL_REPLY:
            entry = self._inflight.get((server, h.key, h.round))
            if entry is None:
                return  # the handle already failed or timed out
            handle, i = entry
            try:
                self._store_reply(handle, i, msg)
            except P.ProtocolError as exc:
                self._fail_handle(handle, f"server {server} sent a bad reply: {exc}")
                return
            handle._part_done(i)
            if handle.done():
                self._forget(handle)
        elif h.type is P.MsgType.ERROR:
            self._on_error(server, msg)
        else:
            self._answer_call(server, msg)

    def _store_reply(self, handle: Handle, i: int, msg: P.Message) -> None:
        part = handle.tensor.parts[i]
        if msg.header.flags & P.FLAG_SHM:
            if part.key not in self._shm_busy:
                raise P.ProtocolError(P.ErrorCode.BAD_FIELD,
                                      f"a shared-memory reply for key {part.key}, which this "
                                      "round pushed over TCP")
            P.check_shared(msg, part.reply_layout)
            self._shm_busy.discard(part.key)
            got = self._shm[part.key].array[:part.reply_layout.numel]
            if handle._out is None:  # the segment takes the next round: copy the sum out
                handle._out = got.copy()
            else:
                handle._out[part.offset:part.offset + part.spec.numel] = got
            return
        arrays = P.decode_payload(msg, part.reply_layout)
        if not handle.tensor.compressed:
            if handle._out is None:  # a writable view of the reply frame, which we own
                handle._out = arrays[0]
            else:
                handle._out[part.offset:part.offset + part.spec.numel] = arrays[0]
        elif part.reply_layout.codec == P.DENSE_CODEC:
            handle._out[i] = np.array(arrays[0])
        else:
            handle._out[i] = tuple(np.array(a) for a in arrays)

    def _on_error(self, target: int, msg: P.Message) -> None:
        try:
            body = P.decode_json(msg)
        except P.ProtocolError:
            body = {}
        h = msg.header
        text = f"{body.get('code')}: {body.get('message')}"
        request = body.get("request")
        if request in ("PUSH", "PULL") and target != _SCHEDULER:
            entry = self._inflight.get((target, h.key, h.round))
            if entry is not None:
                self._fail_handle(entry[0], f"server {target} ({self.servers[target]}) "
                                            f"rejected {request}: {text}", target)
                return
        try:
            reply = _REPLY_OF[P.MsgType[request]]
        except KeyError:
            log.error("worker %d: unmatched error from %s: %s", self.rank,
                      self._where(target), text)
            return
        waiting = self._calls.get((target, reply, h.key))
        if waiting:
            call = waiting.popleft()
            call.finish(error=PSError(f"{call.what}: {self._where(target)} refused: {text}"))
        else:
            log.error("worker %d: unmatched error from %s: %s", self.rank,
                      self._where(target), text)

    def _answer_call(self, target: int, msg: P.Message) -> None:
        h = msg.header
        waiting = self._calls.get((target, h.type, h.key))
        if not waiting:
            log.warning("worker %d: unexpected %s from %s", self.rank, h.type.name,
                        self._where(target))
            return
        call = waiting.popleft()
        try:
            if h.type is P.MsgType.STATE_REPLY:  # JSON, then raw arrays (copied: kept)
                body, frames = P.decode_control(msg)
                call.finish(body=(body, tuple(memoryview(bytes(f)) for f in frames)))
            else:
                call.finish(body=P.decode_json(msg) if msg.frames else None)
        except P.ProtocolError as exc:
            call.finish(error=PSError(f"{call.what}: bad reply from {self._where(target)}: "
                                      f"{exc}"))

    def _on_scheduler_message(self) -> None:
        try:
            msg = self._link.recv()
        except P.ProtocolError as exc:
            log.error("worker %d: malformed message from the scheduler: %s", self.rank, exc)
            return
        if msg is None:  # failed authentication; dropped (the link logs it)
            return
        if msg.header.type is P.MsgType.ABORT:
            reason = P.decode_json(msg).get("reason")
            self._lose(_SCHEDULER, f"the scheduler aborted the job: {reason}")
        elif msg.header.type is P.MsgType.ERROR:
            self._on_error(_SCHEDULER, msg)
        else:
            self._answer_call(_SCHEDULER, msg)

    def _fail_handle(self, handle: Handle, why: str, server: int | None = None) -> None:
        handle._fail(PSError(handle._describe_pending(why, server)))
        self._forget(handle)

    def _forget(self, handle: Handle) -> None:
        for part in handle.tensor.parts:
            slot = (part.server, part.key, handle.round)
            if self._inflight.get(slot, (None,))[0] is handle:
                del self._inflight[slot]
                if part.key in self._shm_busy:
                    self._leave_shm(part.key)

    def _leave_shm(self, key: int) -> None:
        """Take ``key`` off shared memory: its round there failed or was given up, and the
        server may still write that round's sum into the segment."""
        self._shm_busy.discard(key)
        segment = self._shm.pop(key, None)
        if segment is not None:
            segment.close()

    def _check_deadlines(self, now: float) -> None:
        expired = {id(h): h for h, _ in self._inflight.values() if now > h.deadline}
        for handle in expired.values():
            handle._fail(PSTimeout(handle._describe_pending(
                f"no reply within ESPRESSO_TIMEOUT={self.cfg.op_timeout_s:g} s")))
            self._forget(handle)
        for calls in self._calls.values():
            while calls and now > calls[0].deadline:
                call = calls.popleft()
                call.finish(error=PSTimeout(f"{call.what}: no answer from "
                                            f"{self._where(call.target)} within "
                                            f"{call.wait_s:g} s"))

    def _lose(self, target: int, why: str, report: str | None = None) -> None:
        """Fail everything waiting on ``target``; ``report``: the process to name in
        ESPRESSO_FAULT_FILE as lost."""
        if target in self._dead:
            return
        if self._closing:  # servers and the scheduler exit once every worker is done
            why = f"{why} after this worker closed"
        else:
            log.error("worker %d: %s", self.rank, why)
            if report is not None:
                self._link.report_lost(report, f"worker {self.rank} {why}")
        self._dead[target] = why
        if target == _SCHEDULER:
            self._lose_all(PSError(f"worker {self.rank}: {why}"))
            return
        for handle in {id(h): h for (s, _, _), (h, _) in self._inflight.items()
                       if s == target}.values():
            self._fail_handle(handle, why, target)
        for (t, _, _), calls in self._calls.items():
            while t == target and calls:
                calls.popleft().finish(error=PSError(why))

    def _lose_all(self, error: PSError) -> None:
        for handle, _ in list(self._inflight.values()):
            handle._fail(PSError(handle._describe_pending(str(error))))
        self._inflight.clear()
        for key in list(self._shm_busy):
            self._leave_shm(key)
        for calls in self._calls.values():
            while calls:
                calls.popleft().finish(error=error)
