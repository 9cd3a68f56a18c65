"""The scheduler: rendezvous, key placement, barriers, liveness and shutdown of a PS job.

Lifecycle:
    1. Start-up: every server and worker sends REGISTER. Servers get ranks in registration
       order; workers bring their global rank. When every expected node is in, each gets
       ACCEPT (its rank and the server addresses). If that does not happen within
       ``ESPRESSO_START_TIMEOUT``, every registered node gets ABORT listing the missing roles
       and ranks; nodes that register during another ESPRESSO_START_TIMEOUT get the same
       ABORT; then the scheduler exits with status 1.
    2. Running: PLACE assigns a tensor's partitions to servers, balanced by bytes (first
       declarer decides; later declarers of the same name must describe it identically and
       get the same answer); BARRIER releases once every worker arrived; HEARTBEAT keeps nodes
       alive. A node is lost when it is silent for ``ESPRESSO_TIMEOUT``, or when a connection
       drops (its process exited, or it was stopped or unreachable for
       ``ESPRESSO_HEARTBEAT_TIMEOUT``: ZMTP heartbeats, see :mod:`.link`) and the node has
       been silent since before the drop, for about ``ESPRESSO_HEARTBEAT_TIMEOUT``. Any
       connection's drop counts (a drop names no peer), and one need not be a node's: a TCP
       health check or a port scan closes one too, so a node silent for less (busy in code
       that holds the GIL) is never blamed for it. Everyone gets ABORT naming it (also in
       ``ESPRESSO_FAULT_FILE``), and the scheduler exits 1. Registered nodes beat during
       start-up too, so this holds before every node is in.
    3. Shutdown: when every worker sent DONE, servers get SHUTDOWN, and the scheduler exits 0
       once each acknowledged it (1 if one did not). A worker whose PS client saw a lost
       server reports it with DONE; the scheduler then aborts the job for everyone.

The scheduler also hosts the job's ``torch.distributed`` TCPStore on ``cfg.store_port``,
bound to the same interface as everything else; with a job secret that port is an
authenticated gate (``server/store_gate.py``) and the store itself listens on loopback.
"""

from __future__ import annotations

import collections
import datetime
import logging
import secrets
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import zmq
from byteps_espresso.server import faults
from byteps_espresso.server import protocol as P
from byteps_espresso.server.auth import (
    Authenticator,
    AuthError,
    store_key,
    warn_if_unauthenticated,
)
from byteps_espresso.server.keys import MAX_PUSHERS, KeySpec
from byteps_espresso.server.link import (
    HEARTBEAT_INTERVAL_S,
    REGISTER_GRACE_S,
    heartbeats,
    stop_monitor,
)
from byteps_espresso.server.store_gate import StoreGate, loopback_listener
from zmq.utils.monitor import recv_monitor_message

from byteps_espresso.config import Config

__all__ = ["DISCONNECT_GRACE_S", "Scheduler", "SchedulerError", "run_scheduler"]

log = logging.getLogger(__name__)

# After a connection drops, a node silent since before the drop is declared lost once it has
# been silent for ESPRESSO_HEARTBEAT_TIMEOUT and at least this long (6 heartbeat intervals:
# tolerates a busy machine, still fails fast).
DISCONNECT_GRACE_S = 6 * HEARTBEAT_INTERVAL_S
# The least silence, in heartbeat intervals, for which a node is blamed at once for a drop.
SILENT_AT_DROP_INTERVALS = 4
# Seconds the scheduler waits for servers to acknowledge SHUTDOWN before exiting anyway.
SHUTDOWN_WAIT_S = 5.0
# Poll period of the event loop, in seconds.
_POLL_S = 0.1
# Most partitions of one tensor: 65536 x the 4 MB default partition is a 256 GiB tensor.
MAX_PARTS = 1 << 16
# Most keys of a job; the same bound as a server's (server.MAX_KEYS).
MAX_KEYS = 1 << 20
# A server's host identity (server/shm.py: a boot id, two inode numbers and a device
# number, about 70 characters) is at most this long.
_MAX_HOST_CHARS = 256
# Log the first N rejections of each error code, then every LOG_EVERY-th, with its count.
_LOG_FIRST, _LOG_EVERY = 20, 1000
# Replies queued for one peer that has not taken them (ZeroMQ messages). A node has one
# control call in flight at a time plus ABORT/ACCEPT/BARRIER_OK, so only a peer that stops
# reading reaches it; later replies to that peer are dropped and counted (`reply_cap`).
REPLY_CAP = 1024
# Messages received from one peer and not yet handled; beyond it ZeroMQ stops reading that
# connection (TCP back-pressure), so a flooding peer cannot grow the scheduler's memory.
RECEIVE_CAP = 16


class SchedulerError(RuntimeError):
    """The job cannot go on: start-up timed out or a node was lost."""


@dataclass
class _Node:
    role: str
    rank: int
    identity: bytes
    address: str = ""
    host: str = ""  # a server's host_identity() when it takes shared memory, else ""
    last_seen: float = field(default_factory=time.monotonic)
    done: bool = False

    @property
    def name(self) -> str:
        """As the launcher names the process: ``server 0``, ``worker 3``."""
        return f"{self.role} {self.rank}"

    def describe(self) -> str:
        where = f" at {self.address}" if self.address else ""
        return f"{self.name}{where}"


class Scheduler:
    """One scheduler process. Build it, then :meth:`run` until the job ends."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        # The start-up deadline runs from here, when the socket starts accepting nodes (their
        # own registration clocks start then, too), so ABORT reaches them before they give up.
        self.created = time.monotonic()
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.MAXMSGSIZE, cfg.max_message_bytes)
        self.sock.setsockopt(zmq.SNDHWM, REPLY_CAP)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a full queue raises, not drops
        self.sock.setsockopt(zmq.RCVHWM, RECEIVE_CAP)
        self.sock.setsockopt(zmq.LINGER, 2000)
        heartbeats(self.sock, cfg)
        endpoint = f"tcp://{cfg.bind_host()}:{cfg.root_port}"
        try:
            self.sock.bind(endpoint)
        except zmq.ZMQError as exc:
            self.close()
            raise SchedulerError(f"cannot listen on {endpoint} ({exc}); is DMLC_PS_ROOT_PORT "
                                 "free and DMLC_NODE_HOST/DMLC_INTERFACE an address of this "
                                 "machine?") from None
        self.monitor = self.sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self.store = None
        self.store_gate: StoreGate | None = None
        self.store_error: str | None = None
        self._store_socket: socket.socket | None = None
        self.workers: dict[int, _Node] = {}
        self.servers: list[_Node] = []
        self.by_identity: dict[bytes, _Node] = {}
        # Worker processes expected: known when BYTEPS_LOCAL_SIZE is set here, else learned
        # from the first worker's registration (every worker must then agree).
        self.expected_workers: int | None = (
            cfg.world_size if "BYTEPS_LOCAL_SIZE" in cfg.explicit else None)
        self.started = False
        self.barrier: set[int] = set()
        self.placements: dict[str, tuple[dict[str, Any], list[dict[str, Any]]]] = {}
        self.server_bytes: list[int] = []
        self.next_key = 1
        self.dropped_at: float | None = None
        self.rejected: collections.Counter[str] = collections.Counter()
        # Authentication (server/auth.py): the boot key until a node got ACCEPT, then the
        # key of this job, bound to a job id drawn here.
        secret = cfg.secret()
        warn_if_unauthenticated(secret, "scheduler", log)
        self.boot = Authenticator.boot(secret)
        self.job_id = secrets.token_hex(16)
        self.job_auth = self.boot.for_job(secret, self.job_id)
        self.accepted: set[bytes] = set()

    # ---- life cycle ---------------------------------------------------------------------------
    def start_store(self) -> None:
        """Host the torch.distributed TCPStore on ``cfg.store_port`` (configured interface).

        The port is bound here, at once (a taken port fails the start); importing torch and
        serving the store happen on a background thread, so a slow torch import never
        delays the rendezvous. Clients that connect earlier wait in the listen backlog.

        Raises:
            SchedulerError: the store port cannot be bound.
        """
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self.cfg.bind_host(), self.cfg.store_port))
        except OSError as exc:
            sock.close()
            raise SchedulerError(f"cannot listen on {self.cfg.bind_host()}:"
                                 f"{self.cfg.store_port} for the torch.distributed store "
                                 f"({exc.strerror}); DMLC_PS_ROOT_PORT + 1 must be free") from None
        sock.listen(1024)
        self._store_socket = sock
        secret = self.cfg.secret()
        if secret is not None:  # the public port is a gate; the store listens on loopback
            inner = loopback_listener()
            self.store_gate = StoreGate(sock, inner, store_key(secret))
            self._store_socket = inner
        threading.Thread(target=self._serve_store, name="tcpstore", daemon=True).start()

    def _serve_store(self) -> None:
        try:
            import torch.distributed as dist

            host, port = self._store_socket.getsockname()[:2]
            self.store = dist.TCPStore(host, port, None, True,
                                       datetime.timedelta(seconds=self.cfg.op_timeout_s),
                                       wait_for_workers=False,
                                       master_listen_fd=self._store_socket.fileno())
        except Exception as exc:  # reported by the event loop, which aborts the job
            self.store_error = f"the torch.distributed store did not start: {exc!r}"

    def run(self) -> int:
        """Serve until every worker is done (returns 0).

        Raises:
            SchedulerError: start-up timed out or a node was lost (everyone got ABORT).
        """
        deadline = self.created + self.cfg.start_timeout_s
        log.info("scheduler listening on %s:%d for %d server(s) and %s worker(s)",
                 self.cfg.bind_host(), self.cfg.root_port, self.cfg.num_servers,
                 self.expected_workers or f"DMLC_NUM_WORKER={self.cfg.num_machines} machines of")
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self.monitor, zmq.POLLIN)
        while True:
            events = dict(poller.poll(_POLL_S * 1000))
            if self.sock in events:
                while self.sock.poll(0):
                    self._handle(self.sock.recv_multipart())
            if self.monitor in events:
                while self.monitor.poll(0):
                    recv_monitor_message(self.monitor)
                    self.dropped_at = time.monotonic()
                    self._check_drop(self.dropped_at)
            now = time.monotonic()
            if self.store_error:
                self._abort(self.store_error)
            if not self.started and now > deadline:
                missing = self._missing()
                self._abort(f"start-up timed out after ESPRESSO_START_TIMEOUT="
                            f"{self.cfg.start_timeout_s:g} s; missing: {missing}",
                            linger_s=max(REGISTER_GRACE_S, self.cfg.start_timeout_s),
                            culprit=self._first_missing())
            self._check_liveness(now)
            if self.started:
                if self.workers and all(w.done for w in self.workers.values()):
                    self._shutdown_servers()
                    return 0

    def _missing(self) -> str:
        parts = []
        missing_servers = self.cfg.num_servers - len(self.servers)
        if missing_servers > 0:
            ranks = list(range(len(self.servers), self.cfg.num_servers))
            parts.append(f"{missing_servers} of {self.cfg.num_servers} server(s) never "
                         f"registered (server ranks {ranks} unassigned)")
        if self.expected_workers is None:
            parts.append(f"no worker registered (DMLC_NUM_WORKER={self.cfg.num_machines})")
        else:
            absent = sorted(set(range(self.expected_workers)) - set(self.workers))
            if absent:
                parts.append(f"worker ranks {absent} of {self.expected_workers} never "
                             "registered")
        return "; ".join(parts) or "nothing"

    def _first_missing(self) -> str | None:
        """The first node that never registered, named as the launcher names it."""
        if len(self.servers) < self.cfg.num_servers:
            return f"server {len(self.servers)}"
        if self.expected_workers is None:
            return "worker 0"
        absent = sorted(set(range(self.expected_workers)) - set(self.workers))
        return f"worker {absent[0]}" if absent else None

    def _live_nodes(self) -> list[_Node]:
        return [n for n in self.by_identity.values() if not n.done and n.role != "late"]

    def _lost_after_drop_s(self) -> float:
        """Silence after which a node is lost once some connection has dropped."""
        return max(self.cfg.heartbeat_timeout_s, DISCONNECT_GRACE_S)

    def _check_drop(self, now: float) -> None:
        """A connection dropped. When ZeroMQ's heartbeat time-out closed it, its node has
        sent nothing (no HEARTBEAT, no ZMTP pong) for ESPRESSO_HEARTBEAT_TIMEOUT: the most
        silent node, if silent about that long, is lost at once. Otherwise the drop was a
        process that exited (``_check_liveness`` finds it) or a connection that was no
        node's, and the most silent node is only busy."""
        # The scheduler notes a message when it handles it, up to a poll period late; one
        # heartbeat interval of slack covers that. Never under 4 intervals: a short time-out
        # still leaves a loaded machine's live nodes (they beat every interval) that long.
        threshold = max(self.cfg.heartbeat_timeout_s - HEARTBEAT_INTERVAL_S,
                        SILENT_AT_DROP_INTERVALS * HEARTBEAT_INTERVAL_S)
        silent = sorted(self._live_nodes(), key=lambda n: n.last_seen)
        if silent and now - silent[0].last_seen > threshold:
            node = silent[0]
            self._abort(f"{node.describe()} is lost: its connection dropped after "
                        f"{now - node.last_seen:.1f} s without a heartbeat (stopped, hung "
                        f"outside Python, or unreachable; ESPRESSO_HEARTBEAT_TIMEOUT="
                        f"{self.cfg.heartbeat_timeout_s:g} s)", culprit=node.name)

    def _check_liveness(self, now: float) -> None:
        lost_after_s = self._lost_after_drop_s()
        for node in self._live_nodes():
            silent = now - node.last_seen
            if silent > self.cfg.op_timeout_s:
                self._abort(f"{node.describe()} is lost: no heartbeat for {silent:.1f} s "
                            f"(ESPRESSO_TIMEOUT={self.cfg.op_timeout_s:g})", culprit=node.name)
            if (self.dropped_at is not None and node.last_seen < self.dropped_at
                    and silent > lost_after_s):
                self._abort(f"{node.describe()} is lost: its connection dropped and it has "
                            f"been silent for {silent:.1f} s", culprit=node.name)
        # A node silent since before the drop passes lost_after_s before the drop is this old.
        if self.dropped_at is not None and now - self.dropped_at > lost_after_s:
            self.dropped_at = None

    def _abort(self, reason: str, linger_s: float = REGISTER_GRACE_S,
               culprit: str | None = None) -> None:
        """Report ``culprit`` (a process name, as the launcher names it) to
        ``ESPRESSO_FAULT_FILE``, send ABORT naming it to every node, answer late comers
        with ABORT for ``linger_s``, raise."""
        log.error("aborting the job: %s", reason)
        body: dict[str, Any] = {"reason": reason}
        if culprit is not None:
            faults.report(self.cfg.fault_file, culprit, reason, "scheduler")
            body["culprit"] = culprit
        abort = P.encode_json(P.MsgType.ABORT, body)
        for identity in self.by_identity:
            self._send(identity, abort)
        linger_until = time.monotonic() + linger_s
        while time.monotonic() < linger_until:
            if self.sock.poll(_POLL_S * 1000):
                identity = self.sock.recv_multipart()[0]
                if identity not in self.by_identity:
                    self._send(identity, abort)
                    self.by_identity[identity] = _Node("late", -1, identity)
        raise SchedulerError(reason)

    def _shutdown_servers(self) -> None:
        for node in self.servers:
            self._send(node.identity, P.encode(P.MsgType.SHUTDOWN))
        pending = {n.identity for n in self.servers}
        deadline = time.monotonic() + SHUTDOWN_WAIT_S
        while pending and time.monotonic() < deadline:
            if not self.sock.poll(_POLL_S * 1000):
                continue
            identity, *frames = self.sock.recv_multipart()
            try:
                verified = self._verify(identity, frames)
                if (verified is not None and P.decode(verified, self.cfg.max_message_bytes)
                        .header.type is P.MsgType.BYE):
                    pending.discard(identity)
            except P.ProtocolError:
                continue
        if pending:
            lost = ", ".join(n.describe() for n in self.servers if n.identity in pending)
            raise SchedulerError(f"every worker is done, but {lost} did not acknowledge "
                                 f"SHUTDOWN within {SHUTDOWN_WAIT_S:g} s: lost")
        log.info("every worker is done; job finished")

    def close(self) -> None:
        monitor, sock = getattr(self, "monitor", None), getattr(self, "sock", None)
        if monitor is not None:
            stop_monitor(sock, monitor)
        if sock is not None:
            sock.close()
        self.ctx.term()
        for attr in ("store_gate", "_store_socket"):  # absent when the bind above failed
            part = getattr(self, attr, None)
            if part is not None:
                part.close()
        self.store = None

    # ---- messages -----------------------------------------------------------------------------
    def _auth(self, identity: bytes) -> Authenticator:
        return self.job_auth if identity in self.accepted else self.boot

    def _send(self, identity: bytes, frames: list[Any]) -> None:
        """Send to a peer, never blocking: a reply to a peer that does not read (its queue
        is full) is dropped and counted; one to a peer that is gone is dropped."""
        try:
            self.sock.send_multipart([identity, *self._auth(identity).sign(frames)],
                                     flags=zmq.NOBLOCK)
        except zmq.Again:
            self._count("reply_cap", f"{REPLY_CAP} replies are queued for peer "
                        f"{identity.hex()}, which does not read them; dropped one")
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EHOSTUNREACH:
                raise

    def _verify(self, identity: bytes, frames: list[bytes]) -> list[bytes] | None:
        """The frames without their MAC, or None (counted) when they fail authentication;
        raises ProtocolError for a MAC in an unauthenticated job."""
        try:
            return list(self._auth(identity).verify(frames))
        except AuthError as exc:
            self._count("unauthenticated", str(exc))
            return None

    def _count(self, code: str, detail: str) -> None:
        """Count a rejected message; log the first few per code, then every
        ``_LOG_EVERY``-th with the running count."""
        count = self.rejected[code] = self.rejected[code] + 1
        if count <= _LOG_FIRST or count % _LOG_EVERY == 0:
            log.warning("rejected a message (#%d %s): %s", count, code, detail)

    def _handle(self, raw: list[bytes]) -> None:
        identity, *frames = raw
        header = None
        try:
            verified = self._verify(identity, frames)
            if verified is None:  # dropped without a reply
                return
            msg = P.decode(verified, self.cfg.max_message_bytes)
            header = msg.header
            node = self.by_identity.get(identity)
            if (node is not None and node.role == "worker" and self.boot.enabled
                    and header.sender != node.rank):
                raise P.ProtocolError(P.ErrorCode.BAD_FIELD,
                                      f"this connection registered as worker {node.rank}; it "
                                      f"cannot speak as rank {header.sender}")
            if node is not None:
                node.last_seen = time.monotonic()
            handler = _HANDLERS.get(header.type)
            if handler is None:
                raise P.ProtocolError(P.ErrorCode.UNEXPECTED,
                                      f"the scheduler does not handle {header.type.name}")
            handler(self, identity, node, msg)
        except P.ProtocolError as exc:
            self._count(exc.code.value, str(exc))
            self._send(identity, P.encode_error(exc.code, exc.detail, request=header))

    def _on_register(self, identity: bytes, node: _Node | None, msg: P.Message) -> None:
        body = P.decode_json(msg)
        if node is not None or self.started:
            raise P.ProtocolError(P.ErrorCode.UNEXPECTED, "registration is closed or this "
                                  "connection is already registered")
        role = body.get("role")
        if role == "server":
            node = self._register_server(identity, body)
        elif role == "worker":
            node = self._register_worker(identity, body)
        else:
            raise P.ProtocolError(P.ErrorCode.BAD_FIELD, f"unknown role {role!r}")
        self.by_identity[identity] = node
        log.info("registered %s", node.describe())
        if (len(self.servers) == self.cfg.num_servers and self.expected_workers is not None
                and len(self.workers) == self.expected_workers):
            self._accept_all()

    def _register_server(self, identity: bytes, body: dict[str, Any]) -> _Node:
        address = body.get("address")
        if not isinstance(address, str) or not address.startswith("tcp://"):
            raise P.ProtocolError(P.ErrorCode.BAD_FIELD, f"bad server address {address!r}")
        if len(self.servers) >= self.cfg.num_servers:
            raise P.ProtocolError(P.ErrorCode.UNEXPECTED,
                                  f"DMLC_NUM_SERVER={self.cfg.num_servers} servers are "
                                  "already registered")
        host = body.get("host", "")
        if not isinstance(host, str) or len(host) > _MAX_HOST_CHARS:
            raise P.ProtocolError(P.ErrorCode.BAD_FIELD,
                                  f"server host must be a string of at most {_MAX_HOST_CHARS} "
                                  "characters")
        node = _Node("server", len(self.servers), identity, address, host)
        self.servers.append(node)
        self.server_bytes.append(0)
        return node

    def _register_worker(self, identity: bytes, body: dict[str, Any]) -> _Node:
        rank, world = body.get("rank"), body.get("world_size")
        if type(world) is not int or not 1 <= world <= MAX_PUSHERS:
            raise P.ProtocolError(P.ErrorCode.BAD_FIELD,
                                  f"world_size must be an integer in [1, {MAX_PUSHERS}], got "
                                  f"{str(world)[:40]}")
        if self.expected_workers is None:
            self.expected_workers = world
        if world != self.expected_workers:
            raise P.ProtocolError(P.ErrorCode.BAD_FIELD,
                                  f"worker says world_size={world}, the job has "
                                  f"{self.expected_workers}; every process needs the same "
                                  "DMLC_NUM_WORKER and BYTEPS_LOCAL_SIZE")
        if type(rank) is not int or not 0 <= rank < world:
            raise P.ProtocolError(P.ErrorCode.BAD_FIELD,
                                  f"worker rank {rank!r} is not in [0, {world})")
        if rank in self.workers:
            raise P.ProtocolError(P.ErrorCode.BAD_FIELD,
                                  f"worker rank {rank} is registered twice; check "
                                  "DMLC_WORKER_ID and BYTEPS_LOCAL_RANK")
        node = _Node("worker", rank, identity)
        self.workers[rank] = node
        return node

    def _accept_all(self) -> None:
        self.started = True
        addresses = [s.address for s in self.servers]
        now = time.monotonic()
        for node in self.by_identity.values():
            node.last_seen = now
            body = {"rank": node.rank, "servers": addresses, "num_workers": len(self.workers),
                    "job": self.job_id, "server_hosts": [s.host for s in self.servers]}
            self._send(node.identity, P.encode_json(P.MsgType.ACCEPT, body))
            self.accepted.add(node.identity)  # from now on: the job key
        log.info("all %d server(s) and %d worker(s) registered", len(self.servers),
                 len(self.workers))

    def _require_worker(self, node: _Node | None, what: str) -> _Node:
        if node is None or node.role != "worker" or not self.started:
            raise P.ProtocolError(P.ErrorCode.UNEXPECTED,
                                  f"{what} is only accepted from registered workers after "
                                  "start-up")
        return node

    def _on_heartbeat(self, identity: bytes, node: _Node | None, msg: P.Message) -> None:
        """Liveness only: ``last_seen`` was refreshed on receipt."""

    def _on_barrier(self, identity: bytes, node: _Node | None, msg: P.Message) -> None:
        node = self._require_worker(node, "BARRIER")
        self.barrier.add(node.rank)
        if len(self.barrier) == len(self.workers):
            for rank in sorted(self.barrier):
                self._send(self.workers[rank].identity, P.encode(P.MsgType.BARRIER_OK))
            self.barrier.clear()

    def _on_place(self, identity: bytes, node: _Node | None, msg: P.Message) -> None:
        self._require_worker(node, "PLACE")
        body = P.decode_json(msg)
        spec = KeySpec.from_json(body.get("spec"), len(self.workers))
        parts = body.get("parts")
        if (not isinstance(parts, list) or not 0 < len(parts) <= MAX_PARTS
                or not all(isinstance(p, list) and len(p) == 2
                           and all(type(v) is int and 0 < v <= self.cfg.max_message_bytes
                                   for v in p) for p in parts)
                or sum(p[0] for p in parts) != spec.numel):
            raise P.ProtocolError(P.ErrorCode.BAD_DECLARE,
                                  f"{spec.name}: parts must be a list of 1..{MAX_PARTS} "
                                  "[numel, bytes] pairs (each at most ESPRESSO_MAX_MESSAGE_BYTES)"
                                  " whose numels add up to the tensor's")
        if spec.name not in self.placements and self.next_key - 1 + len(parts) > MAX_KEYS:
            raise P.ProtocolError(P.ErrorCode.BAD_DECLARE,
                                  f"{spec.name}: the job already has {self.next_key - 1} keys; "
                                  f"at most {MAX_KEYS}")
        described = {"spec": spec.to_json(), "parts": parts}
        known = self.placements.get(spec.name)
        if known is not None:
            if known[0] != described:
                raise P.ProtocolError(P.ErrorCode.BAD_DECLARE,
                                      f"{spec.name} was declared as {known[0]} by another "
                                      f"worker; rank {msg.header.sender} declares {described}")
            keys = known[1]
        else:
            keys = []
            for _numel, nbytes in parts:
                server = min(range(len(self.servers)), key=lambda s: (self.server_bytes[s], s))
                self.server_bytes[server] += nbytes
                keys.append({"key": self.next_key, "server": server})
                self.next_key += 1
            self.placements[spec.name] = (described, keys)
        self._send(identity, P.encode_json(P.MsgType.PLACE_OK, {"keys": keys}))

    def _on_done(self, identity: bytes, node: _Node | None, msg: P.Message) -> None:
        node = self._require_worker(node, "DONE")
        body = P.decode_json(msg) if msg.frames else {}
        failed = body.get("failed")
        if failed is not None and not isinstance(failed, str):
            raise P.ProtocolError(P.ErrorCode.BAD_FIELD, "DONE's failed must be null or a "
                                  f"string, not {type(failed).__name__}")
        node.done = True
        self._send(identity, P.encode(P.MsgType.DONE_OK))
        if failed:
            # A worker that lost a server is its victim: the report names the server.
            blamed = body.get("culprit")
            if blamed in {s.name for s in self.servers}:
                self._abort(f"{blamed} is lost: {node.describe()} reports: {failed}",
                            culprit=blamed)
            self._abort(f"{node.describe()} failed: {failed}", culprit=node.name)


_HANDLERS = {
    P.MsgType.REGISTER: Scheduler._on_register,
    P.MsgType.HEARTBEAT: Scheduler._on_heartbeat,
    P.MsgType.BARRIER: Scheduler._on_barrier,
    P.MsgType.PLACE: Scheduler._on_place,
    P.MsgType.DONE: Scheduler._on_done,
}


def run_scheduler(cfg: Config) -> int:
    """Run the scheduler role until the job ends.

    Returns:
        0 when every worker finished.

    Raises:
        SchedulerError: start-up timed out, a node was lost, or a port is taken.
    """
    if cfg.num_servers < 1:
        raise SchedulerError("DMLC_NUM_SERVER=0: the parameter-server scheduler needs at "
                             "least one server; set DMLC_NUM_SERVER")
    scheduler = Scheduler(cfg)
    try:
        scheduler.start_store()
        return scheduler.run()
    finally:
        scheduler.close()
