"""A PS server process: CPU aggregation of dense and compressed pushes, per key and round.

Per key and round the server accepts exactly one PUSH from each declared pusher (a duplicate,
a stale round or a future round gets an ERROR reply and is counted, never summed), then sums
the pushes in pusher-rank order (compressed payloads are decompressed and summed by the
key's numba compressor; dense float32/float16 pushes are added on the event loop as they
arrive, as far as the rank-ordered prefix reaches, straight from the received frames),
re-compresses the aggregate when the key is compressed (optionally with error feedback), and
answers every PULL of that round. Summing in rank order makes the result bit-identical
whatever order the pushes arrived in. A push or aggregate with NaN or infinity fails its
round: every waiter, and any later push or pull of it, gets a ``non_finite`` error naming
the key, the round and the pushing rank(s).

Rounds of one key strictly increase: while round ``r`` collects pushes, pushes for ``< r``
are stale and ``> r`` are in the future; once it is complete, any round ``> r`` may start.
The results of the last :data:`RESULT_HISTORY` rounds stay available to late pulls.

Malformed messages (bad magic, truncated, inconsistent lengths, unknown codec, dtype or key,
oversized) get an ERROR reply and a log line; the server keeps serving everyone else.
Compressed aggregations of large keys run on ``BYTEPS_SERVER_ENGINE_THREAD`` threads (numba
kernels release the GIL), one at a time per key so rounds and error-feedback residuals stay
ordered; the event loop itself never blocks on them.
"""

from __future__ import annotations

import collections
import logging
import os
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import zmq
from byteps_espresso.server import protocol as P
from byteps_espresso.server.auth import Authenticator, AuthError
from byteps_espresso.server.keys import KeySpec
from byteps_espresso.server.link import (
    REGISTER_GRACE_S,
    SchedulerLink,
    readable,
    recv_frames,
    send_frames,
)
from byteps_espresso.server.shm import Segment, boot_id, host_identity
from numba import njit

from byteps_espresso.config import Config

__all__ = [
    "REPLY_CAP_BASE", "REPLY_CAP_PER_KEY", "RESULT_HISTORY", "NumbaGuard", "Server",
    "ServerError", "add_finite", "aggregate", "keep_freed_memory",
    "run_server", "warm_kernels",
]

log = logging.getLogger(__name__)

# Completed rounds per key whose results are kept for late pulls (the current and previous).
RESULT_HISTORY = 2
# Compressed aggregations of keys of at most this many payload bytes run inline on the event
# loop: decoding and summing 1 MiB takes ~0.1-1 ms, about the hand-off to a thread and back
# (benchmarks/ps.py, 1 MB rounds). Dense keys are always summed inline, as pushes arrive.
INLINE_MAX_BYTES = 1 << 20
# Most keys one server holds; bounds memory against a flood of DECLAREs.
MAX_KEYS = 1 << 20
# Seconds between sweeps for rounds open longer than ESPRESSO_TIMEOUT.
_SWEEP_S = 1.0
# Pulls that may wait per key, per pusher (a pusher has at most a round or two in flight).
_WAITERS_PER_PUSHER = 4
# Key ids per STATE "list" reply: about 8 bytes of JSON each, well inside MAX_CONTROL_BYTES.
_STATE_PAGE = 4096
# Log the first N rejections of each error code, then every LOG_EVERY-th.
_LOG_FIRST, _LOG_EVERY = 20, 1000
# Replies queued for one peer (ZeroMQ messages its connection has not taken yet), at most
# REPLY_CAP_BASE + REPLY_CAP_PER_KEY x the keys of this server. An honest worker has a round
# or two in flight per key and pulls at most _WAITERS_PER_PUSHER rounds of one, plus a few
# control calls, so it never reaches the cap; a peer that stops reading its replies does,
# and further replies to it are dropped (counted as `reply_cap`) instead of queued.
REPLY_CAP_BASE = 1024
REPLY_CAP_PER_KEY = _WAITERS_PER_PUSHER
# Messages received from one peer and not yet handled; beyond it ZeroMQ stops reading that
# connection (TCP back-pressure, nothing is dropped), so a flooding peer slows itself down
# instead of growing the server's memory. An honest worker pushes one message per partition.
RECEIVE_CAP = 16


class ServerError(RuntimeError):
    """The server cannot go on: the scheduler aborted the job or was lost."""


class NumbaGuard:
    """Runs compressor kernels from several engine threads safely and without oversubscribing.

    Each engine thread gives its numba kernels ``cpu_count // BYTEPS_SERVER_ENGINE_THREAD``
    threads (the server's parallelism is across keys). numba's ``workqueue`` threading layer
    aborts the process when two threads launch parallel kernels at once, so kernels are
    serialized until the layer in use is known to be thread-safe (``omp`` or ``tbb``).
    """

    def __init__(self, engine_threads: int) -> None:
        self.numba_threads = max(1, (os.cpu_count() or 1) // engine_threads)
        self._lock = threading.Lock()
        self._safe = False

    def configure_thread(self) -> None:
        """Set this thread's numba thread count (engine-thread initializer)."""
        import numba

        numba.set_num_threads(min(self.numba_threads, numba.config.NUMBA_NUM_THREADS))

    def run(self, fn: Any, *args: Any) -> Any:
        if self._safe:
            return fn(*args)
        with self._lock:
            result = fn(*args)
            import numba

            try:
                self._safe = numba.threading_layer() in ("omp", "tbb")
            except ValueError:  # no parallel kernel ran yet
                pass
            return result


def aggregate(spec: KeySpec, compressor: Any, ef: Any, round_: int,
              payloads: list[tuple[np.ndarray, ...]]) -> list[np.ndarray]:
    """Decompress and sum one round of compressed pushes in list (pusher-rank) order, then
    re-compress; the server's pure kernel for compressed keys (dense keys are summed as
    their pushes arrive, see ``Server._fold``).

    Args:
        spec: the key.
        compressor: the key's numba compressor.
        ef: the key's ErrorFeedback wrapper when the key asks for it, else None.
        round_: the round, the ``step`` of the compression ctx.
        payloads: one payload per pusher, in rank order.

    Returns:
        The reply frames: the re-compressed aggregate's payload arrays, or the dense float32
        sum when the key has ``server_recompress=False``.
    """
    ctx = compressor.context((spec.numel,), "float32", name=spec.name, step=round_)
    total = np.ascontiguousarray(compressor.aggregate(list(payloads), ctx), dtype=np.float32)
    if not spec.recompress:
        return [total.reshape(-1)]
    payload, _ = (ef or compressor).compress(total.reshape(-1), name=spec.name, step=round_)
    return [np.ascontiguousarray(a) for a in payload]


@dataclass
class _Key:
    """State of one key on this server."""

    key: int
    spec: KeySpec
    compressor: Any
    ef: Any
    push_layout: P.Layout
    reply_layout: P.Layout
    open_round: int | None = None
    last_closed: int | None = None
    pushes: dict[int, tuple[np.ndarray, ...]] = field(default_factory=dict)
    queued: collections.deque = field(default_factory=collections.deque)
    busy: bool = False
    results: collections.OrderedDict = field(default_factory=collections.OrderedDict)
    waiters: dict[int, list[bytes]] = field(default_factory=dict)
    warm: bool = False  # an aggregation of this key ran (its kernels are compiled)
    # Dense keys sum as pushes arrive, in pusher-rank order: acc holds pushers[:folded]. For
    # float32 it lives in the first pusher's received frame (acc_frame), summed in place.
    acc: np.ndarray | None = None
    acc_frame: Any = None
    folded: int = 0
    acc_finite: bool | None = None  # known by the last float32 add; None: check at the end
    frames: dict[int, Any] = field(default_factory=dict)  # dense: pusher -> received frame
    # Shared memory (BYTEPS_ENABLE_IPC): pusher -> its attached segment; the open round's
    # pushers that pushed through theirs (-> the connection their sum is announced on).
    shm: dict[int, Segment] = field(default_factory=dict)
    shm_pushed: dict[int, bytes] = field(default_factory=dict)
    # Rounds that failed (a non-finite push or aggregate), with the reason; the last few.
    failed: collections.OrderedDict = field(default_factory=collections.OrderedDict)

    def clear_open(self) -> None:
        """Drop the open round's pushes and running sum (it completed or failed)."""
        self.acc, self.acc_frame, self.folded, self.pushes = None, None, 0, {}
        self.acc_finite = None
        self.frames = {}
        self.shm_pushed = {}
        self.open_round = None

    @property
    def push_nbytes(self) -> int:
        return sum(self.push_layout.frame_nbytes)

    def pending(self, round_: int) -> bool:
        """Round will produce a result: it collects pushes or waits for aggregation."""
        return round_ == self.open_round or any(r == round_ for r, _ in self.queued)


class Server:
    """One server process: bind, register, then :meth:`serve` until SHUTDOWN or ABORT."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.ctx = zmq.Context()
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.MAXMSGSIZE, cfg.max_message_bytes)
        self.router.setsockopt(zmq.SNDHWM, REPLY_CAP_BASE)  # raised as keys are declared
        self.router.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a full queue raises, not drops
        self.router.setsockopt(zmq.RCVHWM, RECEIVE_CAP)
        self.router.setsockopt(zmq.LINGER, 0)
        port = cfg.server_port
        if port:
            try:
                self.router.bind(f"tcp://{cfg.bind_host()}:{port}")
            except zmq.ZMQError as exc:
                raise ServerError(f"cannot listen on {cfg.bind_host()}:{port} "
                                  f"(ESPRESSO_SERVER_PORT): {exc}") from None
        else:
            port = self.router.bind_to_random_port(f"tcp://{cfg.bind_host()}")
        self.address = f"tcp://{cfg.advertise_host()}:{port}"
        # workers on this host (the same identity) push dense keys through shared memory
        self.link = SchedulerLink(self.ctx, cfg, "server", {
            "address": self.address, "host": host_identity() if cfg.enable_ipc else ""})
        self.rank = -1
        self.num_workers = 0
        self.keys: dict[int, _Key] = {}
        self.names: dict[str, int] = {}  # key name -> key id
        # Compressor state restored (STATE put) for keys not declared yet, by key name.
        self.restored: dict[str, dict[str, dict[str, np.ndarray]]] = {}
        self.rejected: collections.Counter[str] = collections.Counter()
        self.auth = Authenticator(None)  # the job key once registered (link.auth)
        self.bound: dict[bytes, int] = {}  # connection -> the rank it speaks for
        self.open_keys: dict[int, float] = {}  # key -> when its open round started
        self._next_sweep = 0.0
        self.bound_rank: dict[int, bytes] = {}
        self.rounds = 0
        self.agg_seconds = 0.0
        self.shm_replies = 0  # PULL_REPLYs answered in shared memory
        self.guard = NumbaGuard(cfg.server_threads)
        self.pool = (ThreadPoolExecutor(cfg.server_threads, thread_name_prefix="ps-agg",
                                        initializer=self.guard.configure_thread)
                     if cfg.server_threads > 1 else None)
        self._done: queue.SimpleQueue = queue.SimpleQueue()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)

    # ---- life cycle ---------------------------------------------------------------------------
    def serve(self) -> int:
        """Register, then serve until SHUTDOWN (returns 0).

        Raises:
            ServerError: ABORT from the scheduler, or the scheduler was lost.
            RendezvousError: start-up failed.
        """
        warm_kernels()
        accept = self.link.register()
        self.rank, self.num_workers = int(accept["rank"]), int(accept["num_workers"])
        self.auth = self.link.auth
        self.guard.configure_thread()  # for keys aggregated inline on this thread
        log.info("server %d serving on %s", self.rank, self.address)
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        poller.register(self.link.sock, zmq.POLLIN)
        poller.register(self.link.watch.socket, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        while True:
            events = dict(poller.poll(min(self.link.tick(), _SWEEP_S) * 1000))
            if time.monotonic() >= self._next_sweep:
                self._expire_rounds()
            if self._wake_r in events:
                self._drain_completions()
            if self.router in events:
                for _ in range(256):  # bounded so heartbeats and completions interleave
                    try:
                        raw = recv_frames(self.router, zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._handle(raw)
                    if not readable(self.router):
                        break
            if self.link.sock in events and self._control():
                return 0
            if self.link.watch.socket in events and self.link.watch.lost():
                if self.link.sock.poll(REGISTER_GRACE_S * 100) and self._control():
                    return 0
                why = self.link.lost_reason()
                self.link.report_lost("scheduler", f"server {self.rank} {why}")
                raise ServerError(f"server {self.rank}: {why}; exiting")

    def _control(self) -> bool:
        """Handle scheduler messages; True when told to shut down."""
        while self.link.sock.poll(0):
            msg = self.link.recv()
            if msg is None:
                continue
            if msg.header.type is P.MsgType.SHUTDOWN:
                self.link.send(P.encode(P.MsgType.BYE, sender=self.rank))
                log.info("server %d: shutdown after %d rounds, rejected %s", self.rank,
                         self.rounds, dict(self.rejected))
                return True
            if msg.header.type is P.MsgType.ABORT:
                reason = P.decode_json(msg).get("reason")
                raise ServerError(f"server {self.rank}: the scheduler aborted the job: {reason}")
        return False

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)
        self.link.close(linger_ms=1000)  # BYE must reach the scheduler
        self.router.close(linger=0)
        self.ctx.term()
        for state in self.keys.values():
            for segment in state.shm.values():
                segment.close()
        os.close(self._wake_r)
        os.close(self._wake_w)

    # ---- dispatch -----------------------------------------------------------------------------
    def _handle(self, raw: list[zmq.Frame]) -> None:
        identity, frames = raw[0].bytes, raw[1:]
        header = None
        try:
            frames = self.auth.verify(frames)
        except AuthError as exc:  # dropped without a reply: an outsider learns nothing
            self._count_rejection("unauthenticated", "a message", str(exc))
            return
        except P.ProtocolError as exc:  # a MAC in an unauthenticated job
            self._reject(identity, exc, None)
            return
        try:
            msg = P.decode(frames, self.cfg.max_message_bytes)
            header = msg.header
            if self.auth.enabled:
                self._check_binding(identity, header)
            handler = _HANDLERS.get(header.type)
            if handler is None:
                raise P.ProtocolError(P.ErrorCode.UNEXPECTED,
                                      f"a server does not handle {header.type.name}")
            handler(self, identity, msg)
        except P.ProtocolError as exc:
            self._reject(identity, exc, header)
        except Exception as exc:  # a bug must not take the server down for everyone
            log.exception("internal error on %s", header.describe() if header else "a message")
            self._reject(identity, P.ProtocolError(P.ErrorCode.INTERNAL, repr(exc)), header)

    def _check_binding(self, identity: bytes, h: P.Header) -> None:
        """In an authenticated job a connection speaks for one worker rank, and a rank on
        one connection: the first authenticated message binds them."""
        if h.sender < 0:
            return
        if h.sender >= self.num_workers:
            raise P.ProtocolError(P.ErrorCode.BAD_FIELD,
                                  f"sender {h.sender} is not a worker rank (0.."
                                  f"{self.num_workers - 1})")
        rank, owner = self.bound.get(identity), self.bound_rank.get(h.sender)
        if rank is None and owner is None:
            self.bound[identity], self.bound_rank[h.sender] = h.sender, identity
        elif rank != h.sender or owner != identity:
            raise P.ProtocolError(P.ErrorCode.BAD_FIELD,
                                  f"rank {h.sender} speaks on another connection, or this "
                                  f"connection speaks for rank {rank}; a connection cannot "
                                  "act for another rank")

    def _count_rejection(self, code: str, what: str, detail: str) -> int:
        """Count a rejection per code; log the first few of each code, then every
        ``_LOG_EVERY``-th with the running count (a flood cannot flood the log)."""
        count = self.rejected[code] = self.rejected[code] + 1
        if count <= _LOG_FIRST or count % _LOG_EVERY == 0:
            log.warning("server %d rejected %s (#%d %s): %s", self.rank, what, count, code,
                        detail)
        return count

    def _reject(self, identity: bytes, exc: P.ProtocolError, header: P.Header | None) -> None:
        self._count_rejection(exc.code.value,
                              header.describe() if header else "an unparsable message",
                              exc.detail)
        self._send(identity, P.encode_error(exc.code, exc.detail, request=header,
                                            sender=self.rank))

    def _send(self, identity: bytes, frames: list[Any], *, signed: bool = False) -> None:
        """Send to a peer; ``signed``: the frames already carry their MAC (cached replies).
        A reply to a peer whose queue is full (it does not read) or that is gone is dropped;
        the first is counted and logged, never blocks the loop."""
        try:
            send_frames(self.router, [identity, *(frames if signed else self.auth.sign(frames))],
                        zmq.NOBLOCK)
        except zmq.Again:
            cap = self.router.getsockopt(zmq.SNDHWM)
            self._count_rejection("reply_cap", f"a reply to peer {identity.hex()}",
                                  f"{cap} replies are already queued for it (it does not read "
                                  "them); this one is dropped")
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EHOSTUNREACH:
                raise  # EHOSTUNREACH: the peer disconnected; nobody is left to answer

    def _key(self, header: P.Header) -> _Key:
        state = self.keys.get(header.key)
        if state is None:
            raise P.ProtocolError(P.ErrorCode.UNKNOWN_KEY,
                                  f"key {header.key} is not declared on server {self.rank}")
        return state

    # ---- handlers -----------------------------------------------------------------------------
    def _on_declare(self, identity: bytes, msg: P.Message) -> None:
        if not 0 <= msg.header.sender < self.num_workers:
            raise P.ProtocolError(P.ErrorCode.BAD_FIELD,
                                  f"DECLARE comes from a worker rank (0..{self.num_workers - 1}"
                                  f"), not sender {msg.header.sender}")
        spec = KeySpec.from_json(P.decode_json(msg), self.num_workers)
        key = msg.header.key
        known = self.keys.get(key)
        if known is not None:
            if known.spec != spec:
                raise P.ProtocolError(P.ErrorCode.BAD_DECLARE,
                                      f"key {key} is declared as {known.spec.to_json()}, not "
                                      f"{spec.to_json()}")
        else:
            if len(self.keys) >= MAX_KEYS:
                raise P.ProtocolError(P.ErrorCode.BAD_DECLARE,
                                      f"server {self.rank} already holds {MAX_KEYS} keys")
            self.keys[key] = self._new_key(key, spec)
            self.names[spec.name] = key
            self.router.setsockopt(zmq.SNDHWM,
                                   REPLY_CAP_BASE + REPLY_CAP_PER_KEY * len(self.keys))
        self._send(identity, P.encode(P.MsgType.DECLARE_OK, key=key, sender=self.rank))

    def _new_key(self, key: int, spec: KeySpec) -> _Key:
        try:
            compressor = spec.create_compressor()
            ef = None
            if compressor is not None and spec.error_feedback:
                from byteps_espresso.kernels import ErrorFeedback

                ef = ErrorFeedback(compressor)
            push, reply = spec.push_layout(compressor), spec.reply_layout(compressor)
        except (ValueError, TypeError, ImportError) as exc:
            raise P.ProtocolError(P.ErrorCode.BAD_DECLARE, f"{spec.name}: {exc}") from None
        for layout in (push, reply):
            need = sum(layout.frame_nbytes) + P.HEADER.size + 8 * len(layout.frame_nbytes)
            if need > self.cfg.max_message_bytes:
                raise P.ProtocolError(
                    P.ErrorCode.BAD_DECLARE,
                    f"{spec.name}: a message of this key needs {need} bytes, more than "
                    f"ESPRESSO_MAX_MESSAGE_BYTES={self.cfg.max_message_bytes}; lower "
                    "BYTEPS_PARTITION_BYTES or raise the limit")
        state = _Key(key, spec, compressor, ef, push, reply)
        restored = self.restored.pop(spec.name, None)
        if restored is not None:
            self._import_state(state, restored)
        return state

    def _on_push(self, identity: bytes, msg: P.Message) -> None:
        h = msg.header
        state = self._key(h)
        if h.sender not in state.spec.pushers:
            raise P.ProtocolError(P.ErrorCode.NOT_A_PUSHER,
                                  f"rank {h.sender} is not a pusher of key {h.key} "
                                  f"({state.spec.name}); pushers are {list(state.spec.pushers)}")
        shared = h.flags & P.FLAG_SHM
        if shared:
            payload = self._shared_push(state, msg)
        else:
            payload = P.decode_payload(msg, state.push_layout)
        self._check_round(state, h)
        if state.compressor is not None and not _finite(*payload):
            self._fail_round(state, h.round, f"rank {h.sender} pushed non-finite values")
            raise P.ProtocolError(*state.failed[h.round])
        if state.open_round is None:
            state.open_round = h.round
            self.open_keys[state.key] = time.monotonic()
            self._fail_stale_pulls(state, h.round)
        state.pushes[h.sender] = payload
        if state.compressor is None and msg.raw:
            state.frames[h.sender] = msg.raw[0]
        if h.flags & P.FLAG_PULL:  # answered by the round's PULL_REPLY
            state.waiters.setdefault(h.round, []).append(identity)
            if shared:
                state.shm_pushed[h.sender] = identity
        else:
            self._send(identity, P.encode(P.MsgType.PUSH_OK, key=h.key, round=h.round,
                                          sender=self.rank))
        if state.compressor is None:
            self._fold(state)
        if len(state.pushes) < len(state.spec.pushers):
            return
        if state.compressor is None:  # summed already: answer inline, no thread hand-off
            self._finish_dense(state, h.round)
            return
        ordered = [state.pushes[r] for r in state.spec.pushers]
        state.queued.append((h.round, ordered))
        state.last_closed, state.open_round = h.round, None
        self.open_keys.pop(state.key, None)
        state.pushes = {}
        self._start_next(state)

    def _fold(self, state: _Key) -> None:
        """Add the pushes that extend the rank-ordered prefix into the running sum, so only
        the last arrival's share remains at completion. float32 sums in place into the
        first pusher's received frame (then sent on as the reply); float16 accumulates in
        float32 and is cast into that frame at the end."""
        pushers, pushes = state.spec.pushers, state.pushes
        while state.folded < len(pushers) and pushers[state.folded] in pushes:
            rank = pushers[state.folded]
            x = pushes[rank][0]
            if state.folded == 0:  # nothing to add yet: the first push becomes the sum
                state.acc_frame = _backing_frame(x, state.frames.get(rank))
                state.acc = x
                # a push in shared memory is summed in place: its pusher waits for the sum
                if (state.acc_frame is None and len(pushers) > 1 and rank not in state.shm_pushed
                        and x.dtype == np.float32):
                    state.acc = x.copy()  # a misaligned frame was copied; sum in our copy
            else:
                start = time.thread_time()
                if state.acc.dtype != np.float32:  # float16: accumulate in float32
                    state.acc = np.add(state.acc, x, dtype=np.float32)
                elif x.dtype == np.float32:  # one pass: add, and learn if the sum is finite
                    state.acc_finite = add_finite(state.acc, x)
                else:  # a float16 push into its float32 sum
                    np.add(state.acc, x, out=state.acc)
                self.agg_seconds += time.thread_time() - start
            state.folded += 1

    def _finish_dense(self, state: _Key, round_: int) -> None:
        acc, frame = state.acc, state.acc_frame
        assert acc is not None and state.folded == len(state.spec.pushers)
        pushers, pushes = state.spec.pushers, state.pushes
        # A non-finite partial sum stays non-finite (inf + x, NaN + x), so the last add's
        # answer is the whole sum's.
        finite = state.acc_finite if state.acc_finite is not None else _finite(acc)
        shared = state.shm_pushed
        state.clear_open()
        state.last_closed = round_
        self.open_keys.pop(state.key, None)
        self.rounds += 1
        if not finite:
            bad = [r for r in pushers[1:] if not _finite(*pushes[r])]
            why = (f"rank(s) {bad} pushed non-finite values" if bad else
                   f"rank {pushers[0]} pushed non-finite values, or the sum of finite pushes "
                   "overflowed")
            self._fail_round(state, round_, why)
            return
        out: Any = acc
        if acc.dtype.itemsize != state.reply_layout.frame_dtypes[0].itemsize:  # float16 sum
            first = pushes[pushers[0]][0]
            if frame is not None:
                np.copyto(first, acc, casting="same_kind")
                out = frame
            else:
                out = acc.astype(np.float16)
            if not _finite(first if frame is not None else out):
                self._fail_round(state, round_, "the float16 sum overflowed")
                return
        elif frame is not None:
            out = frame
        waiters = state.waiters.pop(round_, [])
        if shared:
            self._reply_shared(state, round_, acc, shared)
            announced = set(shared.values())
            waiters = [w for w in waiters if w not in announced]
            if not waiters and len(shared) == len(pushers):
                return  # every pusher has the sum: no frames to build for later pulls
        self._reply(state, round_, [out], waiters)

    def _fail_round(self, state: _Key, round_: int, why: str,
                    code: P.ErrorCode = P.ErrorCode.NON_FINITE) -> None:
        """Close ``round_`` without a result: every waiter, and every later push or pull of
        it, gets a ``code`` error naming the key, the round and ``why``."""
        text = f"round {round_} of key {state.key} ({state.spec.name}) failed: {why}"
        state.failed[round_] = (code, text)
        while len(state.failed) > RESULT_HISTORY:
            state.failed.popitem(last=False)
        if state.open_round == round_:
            state.clear_open()
            self.open_keys.pop(state.key, None)
        state.last_closed = max(round_, state.last_closed or 0)
        exc = P.ProtocolError(code, text)
        header = P.Header(P.MsgType.PUSH, state.key, round_)
        for identity in state.waiters.pop(round_, []):
            self._reject(identity, exc, header)

    def _expire_rounds(self) -> None:
        """Fail rounds open longer than ESPRESSO_TIMEOUT: their missing pushers will not
        come (a worker's own wait has expired by then), and their pushes are freed."""
        now = time.monotonic()
        self._next_sweep = now + _SWEEP_S
        limit = self.cfg.op_timeout_s
        for key in [k for k, t in self.open_keys.items() if now - t > limit]:
            state = self.keys[key]
            missing = [r for r in state.spec.pushers if r not in state.pushes]
            self._fail_round(state, state.open_round, f"no push from rank(s) {missing} within "
                             f"ESPRESSO_TIMEOUT={limit:g} s", P.ErrorCode.ROUND_TIMEOUT)

    def _check_round(self, state: _Key, h: P.Header) -> None:
        name = state.spec.name
        if h.round in state.failed:
            raise P.ProtocolError(*state.failed[h.round])
        if state.open_round is not None:
            if h.round == state.open_round and h.sender in state.pushes:
                raise P.ProtocolError(P.ErrorCode.DUPLICATE_PUSH,
                                      f"rank {h.sender} already pushed round {h.round} of key "
                                      f"{h.key} ({name})")
            if h.round < state.open_round:
                raise P.ProtocolError(P.ErrorCode.STALE_ROUND,
                                      f"key {h.key} ({name}) is collecting round "
                                      f"{state.open_round}; round {h.round} is over")
            if h.round > state.open_round:
                raise P.ProtocolError(P.ErrorCode.FUTURE_ROUND,
                                      f"key {h.key} ({name}) is still collecting round "
                                      f"{state.open_round}; push round {h.round} after it")
        elif state.last_closed is not None and h.round <= state.last_closed:
            raise P.ProtocolError(P.ErrorCode.STALE_ROUND,
                                  f"round {h.round} of key {h.key} ({name}) is not after the "
                                  f"last complete round {state.last_closed}")

    def _on_pull(self, identity: bytes, msg: P.Message) -> None:
        h = msg.header
        state = self._key(h)
        result = state.results.get(h.round)
        if result is not None:
            self._send(identity, result, signed=True)
            return
        if h.round in state.failed:
            raise P.ProtocolError(*state.failed[h.round])
        waiting_ok = state.pending(h.round) or (
            state.open_round is None and (state.last_closed is None
                                          or h.round > state.last_closed))
        if not waiting_ok:
            code = (P.ErrorCode.FUTURE_ROUND if state.open_round is not None
                    and h.round > state.open_round else P.ErrorCode.STALE_ROUND)
            raise P.ProtocolError(code, f"round {h.round} of key {h.key} ({state.spec.name}) "
                                  "has no result to pull (kept: "
                                  f"{list(state.results)}, collecting: {state.open_round}; a "
                                  "round every pusher pushed in shared memory is answered "
                                  "there only)")
        if (state.last_closed is not None and h.round > state.last_closed + 2) or (
                state.open_round is not None and h.round > state.open_round + 1):
            raise P.ProtocolError(P.ErrorCode.FUTURE_ROUND,
                                  f"round {h.round} of key {h.key} ({state.spec.name}) is too "
                                  "far ahead to wait for; pull it once the round before ran")
        if sum(map(len, state.waiters.values())) >= _WAITERS_PER_PUSHER * len(
                state.spec.pushers):
            raise P.ProtocolError(P.ErrorCode.UNEXPECTED,
                                  f"key {h.key} ({state.spec.name}) already has "
                                  f"{_WAITERS_PER_PUSHER} waiting pulls per pusher")
        state.waiters.setdefault(h.round, []).append(identity)

    def _fail_stale_pulls(self, state: _Key, opened: int) -> None:
        """A new round started: pulls waiting for an earlier, never-started round fail."""
        for round_ in [r for r in state.waiters if r < opened and not state.pending(r)]:
            exc = P.ProtocolError(P.ErrorCode.STALE_ROUND,
                                  f"round {round_} of key {state.key} never ran; round "
                                  f"{opened} started")
            header = P.Header(P.MsgType.PULL, state.key, round_)
            for identity in state.waiters.pop(round_):
                self._reject(identity, exc, header)

    def _on_stats(self, identity: bytes, msg: P.Message) -> None:
        body = {"rank": self.rank, "keys": len(self.keys), "rounds": self.rounds,
                "rejected": dict(self.rejected), "cpu_s": time.process_time(),
                "aggregate_s": self.agg_seconds, "threads": self.cfg.server_threads,
                "shm_keys": sum(len(k.shm) for k in self.keys.values()),
                "shm_replies": self.shm_replies, "boot_id": boot_id()}
        self._send(identity, P.encode_json(P.MsgType.STATS_REPLY, body, sender=self.rank))

    # ---- compressor state (checkpoints) -------------------------------------------------------
    def _on_state(self, identity: bytes, msg: P.Message) -> None:
        """Rank 0 lists, reads or restores the keys' compressor state (server-side error
        feedback residuals, codec momenta) to checkpoint a job or resume one."""
        h = msg.header
        if h.sender != 0:
            raise P.ProtocolError(P.ErrorCode.UNEXPECTED, f"only worker rank 0 reads or "
                                  f"restores server state; sender is {h.sender}")
        body, frames = P.decode_control(msg)
        op = body.get("op")
        if op == "list":
            start = body.get("start", 0)
            if type(start) is not int or start < 0:
                raise P.ProtocolError(P.ErrorCode.BAD_FIELD, f"list start {start!r} is not "
                                      "an integer >= 0")
            ids = sorted(k for k, st in self.keys.items() if _stateful(st).export_state())
            page = ids[start:start + _STATE_PAGE]
            end = start + len(page)
            reply = P.encode_json(P.MsgType.STATE_REPLY, {
                "op": "list", "keys": page, "next": end if end < len(ids) else None},
                sender=self.rank)
        elif op == "get":
            state = self._key(h)
            self._check_idle(state, "read")
            entries, arrays = P.pack_state(_stateful(state).export_state())
            need = sum(a.nbytes for a in arrays) + P.MAX_CONTROL_BYTES
            if need > self.cfg.max_message_bytes:
                raise P.ProtocolError(P.ErrorCode.TOO_LARGE, f"the state of {state.spec.name} "
                                      f"needs up to {need} bytes; raise "
                                      "ESPRESSO_MAX_MESSAGE_BYTES")
            reply = P.encode_control(P.MsgType.STATE_REPLY, {
                "op": "get", "name": state.spec.name, "round": state.last_closed,
                "state": entries}, arrays, key=h.key, sender=self.rank)
        elif op == "put":
            name = body.get("name")
            if not isinstance(name, str):
                raise P.ProtocolError(P.ErrorCode.BAD_FIELD, "put needs the key's name")
            restored = P.unpack_state(body.get("state"), frames)
            key = self.names.get(name)
            if key is None:
                if len(self.restored) >= MAX_KEYS and name not in self.restored:
                    raise P.ProtocolError(P.ErrorCode.BAD_FIELD, f"server {self.rank} "
                                          f"already holds state of {MAX_KEYS} keys")
                self.restored[name] = restored  # applied when the key is declared
            else:
                state = self.keys[key]
                self._check_idle(state, "restore", fresh=True)
                self._import_state(state, restored)
            reply = P.encode_json(P.MsgType.STATE_REPLY, {
                "op": "put", "name": name, "applied": key is not None}, sender=self.rank)
        else:
            raise P.ProtocolError(P.ErrorCode.BAD_FIELD, f"STATE op {op!r} is not one of "
                                  "list, get, put")
        self._send(identity, reply)

    @staticmethod
    def _check_idle(state: _Key, what: str, fresh: bool = False) -> None:
        """State is read while no aggregation runs and restored before the first one.

        A round collecting pushes stops neither: only an aggregation reads or changes the
        state. Around rank 0's checkpoint or restore, pushers that do not wait for rank 0
        (another machine's workers) may already have pushed the next round, which cannot
        complete before rank 0 goes on: every aggregate sums rank 0's gradient too."""
        if state.busy or state.queued:
            raise P.ProtocolError(P.ErrorCode.UNEXPECTED, f"key {state.key} "
                                  f"({state.spec.name}) is aggregating round(s) "
                                  f"{[r for r, _ in state.queued]}; {what} server state "
                                  "between iterations")
        if fresh and state.last_closed is not None:
            raise P.ProtocolError(P.ErrorCode.UNEXPECTED, f"key {state.key} "
                                  f"({state.spec.name}) already ran round "
                                  f"{state.last_closed}; restore server state before the "
                                  "first step")

    @staticmethod
    def _import_state(state: _Key, restored: dict[str, dict[str, np.ndarray]]) -> None:
        for name, slots in restored.items():
            for slot, array in slots.items():
                if array.size != state.spec.numel:
                    raise P.ProtocolError(P.ErrorCode.BAD_FIELD, f"restored state "
                                          f"{name!r}/{slot!r} has {array.size} elements; key "
                                          f"{state.spec.name} has {state.spec.numel}")
        try:
            _stateful(state).import_state(restored)
        except ValueError as exc:
            raise P.ProtocolError(P.ErrorCode.BAD_FIELD, f"{state.spec.name}: {exc}") from None

    # ---- aggregation --------------------------------------------------------------------------
    def _start_next(self, state: _Key) -> None:
        if state.busy or not state.queued:
            return
        round_, payloads = state.queued[0]
        state.busy = True
        # A key's first aggregation may compile its numba kernels (seconds): never inline,
        # so the event loop keeps answering and heartbeating meanwhile.
        if self.pool is None or (state.warm and state.push_nbytes <= INLINE_MAX_BYTES):
            self._complete(state.key, round_, *self._run(state, round_, payloads))
        else:
            self.pool.submit(self._run_async, state, round_, payloads)

    def _run(self, state: _Key, round_: int, payloads: list) -> tuple[Any, float]:
        start = time.thread_time()
        try:
            result: Any = self.guard.run(aggregate, state.spec, state.compressor, state.ef,
                                         round_, payloads)
        except Exception as exc:  # reported to every puller of this round
            log.exception("aggregation of key %d round %d failed", state.key, round_)
            result = exc
        return result, time.thread_time() - start

    def _run_async(self, state: _Key, round_: int, payloads: list) -> None:
        self._done.put((state.key, round_, *self._run(state, round_, payloads)))
        os.write(self._wake_w, b"x")

    def _drain_completions(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass
        while not self._done.empty():
            self._complete(*self._done.get())

    def _complete(self, key: int, round_: int, result: Any, seconds: float) -> None:
        state = self.keys[key]
        state.queued.popleft()
        state.busy = False
        state.warm = True
        self.agg_seconds += seconds
        self.rounds += 1
        waiters = state.waiters.pop(round_, [])
        if isinstance(result, Exception):
            exc = P.ProtocolError(P.ErrorCode.INTERNAL, f"aggregation failed: {result!r}")
            for identity in waiters:
                self._reject(identity, exc, P.Header(P.MsgType.PULL, key, round_))
        elif not _finite(*result):
            state.waiters[round_] = waiters
            self._fail_round(state, round_, "its aggregate is not finite")
        else:
            self._reply(state, round_, result, waiters)
        self._start_next(state)

    def _reply(self, state: _Key, round_: int, result: list[Any], waiters: list[bytes]
               ) -> None:
        """Encode the round's PULL_REPLY once, keep it for late pulls, answer the waiters.

        Payload frames go out as ``zmq.Frame`` objects, re-sent by reference to every waiter:
        an array is copied into one frame here rather than sent zero-copy, whose release
        would wake pyzmq's garbage-collection thread once per waiter."""
        sizes = tuple(P.nbytes(a) for a in result)
        if sizes != state.reply_layout.frame_nbytes:
            exc = P.ProtocolError(P.ErrorCode.INTERNAL,
                                  f"aggregate of {state.spec.name} has frames of "
                                  f"{list(sizes)} bytes, the key's layout says "
                                  f"{list(state.reply_layout.frame_nbytes)}")
            for identity in waiters:
                self._reject(identity, exc, P.Header(P.MsgType.PULL, state.key, round_))
            return
        frames = [f if isinstance(f, zmq.Frame) else zmq.Frame(f, copy=True) for f in result]
        layout = state.reply_layout
        reply = self.auth.sign(P.encode(
            P.MsgType.PULL_REPLY, key=state.key, round=round_, sender=self.rank,
            codec=layout.codec, dtype=layout.dtype, numel=layout.numel, frames=frames))
        state.results[round_] = reply  # signed once, sent to every puller
        while len(state.results) > RESULT_HISTORY:
            state.results.popitem(last=False)
        for identity in waiters:
            self._send(identity, reply, signed=True)

    def _reply_shared(self, state: _Key, round_: int, acc: np.ndarray,
                      waiters: dict[int, bytes]) -> None:
        """Write the round's sum into each waiting pusher's segment (the first pusher's
        already holds it when it pushed in shared memory) and answer each with a frameless
        PULL_REPLY; ``waiters``: rank -> connection."""
        self.shm_replies += len(waiters)
        for rank in waiters:
            into = state.shm[rank].array
            if into.ctypes.data != acc.ctypes.data:
                np.copyto(into[:acc.size], acc)
        layout = state.reply_layout
        reply = self.auth.sign(P.encode(
            P.MsgType.PULL_REPLY, key=state.key, round=round_, sender=self.rank,
            codec=layout.codec, dtype=layout.dtype, numel=layout.numel, flags=P.FLAG_SHM))
        for identity in waiters.values():
            self._send(identity, reply, signed=True)

    @staticmethod
    def _shared_push(state: _Key, msg: P.Message) -> tuple[np.ndarray]:
        """The push of a ``FLAG_SHM`` message: a view of its sender's segment."""
        h = msg.header
        segment = state.shm.get(h.sender)
        if segment is None:
            raise P.ProtocolError(P.ErrorCode.BAD_FIELD,
                                  f"rank {h.sender} pushed key {h.key} ({state.spec.name}) in "
                                  "shared memory without attaching a segment (ATTACH) first")
        if not h.flags & P.FLAG_PULL:
            raise P.ProtocolError(P.ErrorCode.BAD_FIELD,
                                  "a push in shared memory must also pull (FLAG_PULL): its "
                                  "segment receives the sum")
        P.check_shared(msg, state.push_layout)
        return (segment.array[:state.push_layout.numel],)

    def _on_attach(self, identity: bytes, msg: P.Message) -> None:
        h = msg.header
        state = self._key(h)
        body = P.decode_json(msg)
        refused = None
        if not self.cfg.enable_ipc:
            refused = "this server runs without BYTEPS_ENABLE_IPC"
        elif h.sender not in state.spec.pushers:
            refused = f"rank {h.sender} is not a pusher of it"
        elif state.compressor is not None or state.push_layout.dtype is not P.DType.FLOAT32:
            refused = "only dense float32 keys are exchanged in shared memory"
        elif not host_identity() or body.get("host") != host_identity():
            refused = "the worker is on another host (boot, network namespace or /dev/shm)"
        elif h.sender in state.shm_pushed:
            refused = "its open round is in the segment it has; attach after that round"
        if refused is None:
            path = body.get("path")
            try:
                if not isinstance(path, str):
                    raise ValueError("the body has no segment path")
                segment = Segment.attach(path, state.push_nbytes)
            except (ValueError, OSError) as exc:
                refused = str(exc)
        if refused is not None:
            raise P.ProtocolError(P.ErrorCode.BAD_FIELD,
                                  f"key {h.key} ({state.spec.name}) stays on TCP: {refused}")
        old = state.shm.pop(h.sender, None)
        if old is not None:
            old.close()
        state.shm[h.sender] = segment
        self._send(identity, P.encode(P.MsgType.ATTACH_OK, key=h.key, sender=self.rank))


def _backing_frame(array: np.ndarray, frame: Any) -> Any:
    """``frame`` when it is a ``zmq.Frame`` that ``array`` views writably, else None.

    ``array`` is what :func:`protocol.decode_payload` made of ``frame``: a view of its whole
    buffer, or a copy (owning its data) when the buffer was misaligned; a read-only buffer
    gives a read-only view."""
    if not isinstance(frame, zmq.Frame) or array.flags.owndata or not array.flags.writeable:
        return None
    return frame


class _Stateless:
    """Dense keys keep no compressor state."""

    @staticmethod
    def export_state() -> dict:
        return {}

    @staticmethod
    def import_state(state: dict) -> None:
        if state:
            raise ValueError("a dense key keeps no compressor state")


def _stateful(state: _Key) -> Any:
    """What holds a key's state between rounds: its error feedback (which holds the
    compressor's too), its compressor, or nothing for a dense key."""
    return state.ef or state.compressor or _Stateless


@njit(cache=True, nogil=True)
def add_finite(acc: np.ndarray, x: np.ndarray) -> bool:
    """``acc += x`` (float32, elementwise, exactly as ``np.add``) in one pass that also
    tells whether every element of the new ``acc`` is finite: the dense sum and its
    NaN/infinity check without a second and third pass over the sum (``_finite``'s min and
    max), which halved the server's arithmetic per 1 MB round of two pushers (22 us vs 46
    us on the development machine).

    Args:
        acc: 1-D float32 array, updated in place.
        x: 1-D float32 array of the same size.

    Returns:
        True when no element of ``acc`` is NaN or infinite afterwards.
    """
    finite = True
    for i in range(acc.size):
        v = acc[i] + x[i]
        acc[i] = v
        finite &= abs(v) < np.inf  # False for NaN and +-inf; vectorizes (no early exit)
    return finite


def warm_kernels() -> None:
    """Compile (or load from numba's cache) the dense-sum kernel, so that no round waits
    for it: the server calls this before it registers."""
    x = np.zeros(4, np.float32)
    add_finite(x, x)
    x.flags.writeable = False  # a push decoded from a read-only buffer
    add_finite(np.zeros(4, np.float32), x)


def _finite(*arrays: np.ndarray) -> bool:
    """No NaN or infinity in the floating-point arrays (integer arrays always pass). Two
    reductions per array, no temporary: min and max propagate NaN and reach +-inf."""
    for a in arrays:
        if a.dtype.kind == "f" and a.size and not (np.isfinite(a.min())
                                                   and np.isfinite(a.max())):
            return False
    return True


_HANDLERS = {
    P.MsgType.DECLARE: Server._on_declare,
    P.MsgType.PUSH: Server._on_push,
    P.MsgType.PULL: Server._on_pull,
    P.MsgType.STATS: Server._on_stats,
    P.MsgType.STATE: Server._on_state,
    P.MsgType.ATTACH: Server._on_attach,
}


def keep_freed_memory() -> bool:
    """Ask glibc to keep freed buffers in the heap rather than unmapping them.

    Every round allocates aggregates and ZeroMQ receive buffers of the same few sizes; with
    glibc's defaults each large one is a fresh mmap whose pages fault in on first touch,
    which made summing a 4 MB key ~4x slower on the development machine (12.3 ms vs 3.0 ms
    for 16 keys). The server is a dedicated process, so its heap may stay at its peak.

    Returns:
        True when the allocator accepted the settings (glibc on Linux), else False.
    """
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if not name:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    # <malloc.h>: M_TRIM_THRESHOLD = -1, M_MMAP_THRESHOLD = -3 (bytes). Buffers up to
    # 256 MiB (far above BYTEPS_PARTITION_BYTES) come from the heap; the heap is not trimmed.
    ok = mallopt(-3, 256 << 20) == 1
    return bool(mallopt(-1, 2**31 - 1) == 1 and ok)


def run_server(cfg: Config) -> int:
    """Run the server role until the scheduler shuts the job down.

    Returns:
        0 after SHUTDOWN.

    Raises:
        ServerError: the job was aborted or the scheduler lost.
        RendezvousError: start-up failed.
    """
    if not keep_freed_memory():
        log.debug("allocator tuning unavailable; large buffers are mmapped per round")
    server = Server(cfg)
    try:
        return server.serve()
    finally:
        server.close()
