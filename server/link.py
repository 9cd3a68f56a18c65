"""A node's connection to the scheduler: registration, heartbeats and loss detection.

Servers and workers hold one :class:`SchedulerLink`. ``register`` blocks until the scheduler
has heard from every expected node (it answers ACCEPT with this node's rank and the server
addresses) or aborts the start-up; afterwards the owner's loop calls :meth:`tick` to send
heartbeats and polls :attr:`sock` and :attr:`watch` for control messages and a dropped
connection.

Liveness has two layers. HEARTBEAT messages, sent by the owner's Python loop every
``HEARTBEAT_INTERVAL_S``, tell the scheduler that the node's code is making progress (silence
for ``ESPRESSO_TIMEOUT`` loses the node). Under them, every scheduler and server connection
runs ZeroMQ (ZMTP) heartbeats: libzmq's I/O thread pings the peer every
``HEARTBEAT_INTERVAL_S`` and answers its pings, without the GIL, so a worker busy in Python or
in a native call that holds the GIL keeps its connections, while a stopped process (SIGSTOP),
a frozen machine or a cut network drops them after ``ESPRESSO_HEARTBEAT_TIMEOUT``. The
scheduler then finds the node that went silent; a node whose scheduler or server connection
drops fails at once, and reports it (:mod:`byteps_espresso.server.faults`).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import zmq
from byteps_espresso.server import faults
from byteps_espresso.server import protocol as P
from byteps_espresso.server.auth import Authenticator, AuthError, warn_if_unauthenticated
from zmq.utils.monitor import recv_monitor_message

from byteps_espresso.config import Config

__all__ = [
    "HEARTBEAT_INTERVAL_S",
    "REGISTER_GRACE_S",
    "ConnectionWatch",
    "RendezvousError",
    "SchedulerLink",
    "dealer",
    "heartbeats",
    "readable",
    "recv_frames",
    "send_frames",
    "stop_monitor",
]

log = logging.getLogger(__name__)

# Seconds between heartbeats (HEARTBEAT messages to the scheduler and ZMTP pings on every
# connection). Chosen so a lost node is noticed within a few seconds after its TCP connection
# drops (see scheduler.DISCONNECT_GRACE_S), at a cost of a few bytes per second.
HEARTBEAT_INTERVAL_S = 0.5
# Seconds a node waits for ACCEPT beyond ESPRESSO_START_TIMEOUT: the scheduler's own deadline
# fires first and sends ABORT; this only matters when the scheduler is unreachable.
REGISTER_GRACE_S = 5.0


class RendezvousError(RuntimeError):
    """Start-up failed: the scheduler aborted it or could not be reached."""


# ---- frames on a socket --------------------------------------------------------------------
# What pyzmq's send_multipart / recv_multipart / Socket.poll(0) do, without their per-call
# type checks, per-frame RCVMORE queries and throw-away Poller: a PS message crosses these
# once per key and round on each side, where that overhead was a visible share of a 1 MB
# round's interpreter time (benchmarks/ps.py).
# Plain ints: zmq's flag constants are enum.IntFlag members, and every `|` or `&` on one
# builds a new member through the enum machinery.
_SNDMORE = int(zmq.SNDMORE)
_EVENTS = int(zmq.EVENTS)
_POLLIN = int(zmq.POLLIN)


def send_frames(sock: zmq.Socket, frames: list[Any], flags: int = 0) -> None:
    """Send one multipart message. ``bytes`` frames (headers, identities, tags) are copied
    into the message; arrays, memoryviews and ``zmq.Frame`` are sent without copying (an
    array must then stay unchanged until the message is sent).

    Raises:
        zmq.Again: ``flags`` has NOBLOCK and the message cannot be queued now (nothing of it
            was sent: ZeroMQ checks the high-water mark at the first frame).
    """
    flags = int(flags)
    more = flags | _SNDMORE
    last = len(frames) - 1
    for i, frame in enumerate(frames):
        sock.send(frame, more if i < last else flags, copy=type(frame) is bytes)


def recv_frames(sock: zmq.Socket, flags: int = 0) -> list[zmq.Frame]:
    """Receive one multipart message as ``zmq.Frame`` objects (no copy).

    Raises:
        zmq.Again: ``flags`` has NOBLOCK and no message is waiting.
    """
    flags = int(flags)
    frame = sock.recv(flags, copy=False)
    frames = [frame]
    while frame.more:  # the rest of a multipart message is already there
        frame = sock.recv(flags, copy=False)
        frames.append(frame)
    return frames


def readable(sock: zmq.Socket) -> bool:
    """A message is waiting on ``sock`` (a non-blocking check)."""
    return bool(sock.getsockopt(_EVENTS) & _POLLIN)


def heartbeats(sock: zmq.Socket, cfg: Config) -> None:
    """Turn on ZMTP heartbeats (set before ``bind``/``connect``): ping the peer every
    ``HEARTBEAT_INTERVAL_S`` and drop a connection that carried nothing for
    ``ESPRESSO_HEARTBEAT_TIMEOUT``. libzmq's I/O thread does both, never holding the GIL."""
    sock.setsockopt(zmq.HEARTBEAT_IVL, round(HEARTBEAT_INTERVAL_S * 1000))
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, round(cfg.heartbeat_timeout_s * 1000))


def dealer(ctx: zmq.Context, endpoint: str, cfg: Config, identity: bytes | None = None
           ) -> tuple[zmq.Socket, ConnectionWatch]:
    """A DEALER connected to ``endpoint`` with the job's limits, and the watch on its
    connection: frames above ``cfg.max_message_bytes`` are refused by ZeroMQ before
    allocation, nothing is dropped at a high-water mark, unsent messages are discarded at
    close, and a peer silent for ``ESPRESSO_HEARTBEAT_TIMEOUT`` (stopped, or unreachable)
    drops the connection.

    The watch is attached before ``connect``: a watch attached after it misses the
    connection's CONNECTED event whenever ZeroMQ's I/O thread connects first, and then
    ignores its DISCONNECTED (a node must have been connected to lose its peer). On a busy
    host that happened: a server whose scheduler was killed, and workers whose scheduler was
    stopped, served on without noticing until ESPRESSO_TIMEOUT or for ever.
    """
    sock = ctx.socket(zmq.DEALER)
    heartbeats(sock, cfg)
    sock.setsockopt(zmq.MAXMSGSIZE, cfg.max_message_bytes)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.LINGER, 0)
    if identity is not None:
        sock.setsockopt(zmq.ROUTING_ID, identity)
    watch = ConnectionWatch(sock)
    sock.connect(endpoint)
    return sock, watch


class ConnectionWatch:
    """Reports when a connected DEALER's only peer goes away (its TCP connection drops)."""

    def __init__(self, sock: zmq.Socket) -> None:
        self._watched = sock
        self.socket = sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        self.connected_at: float | None = None

    def lost(self) -> bool:
        """Drain pending events; True when the peer disconnected after having connected."""
        lost = False
        while self.socket.poll(0):
            event = recv_monitor_message(self.socket)["event"]
            if event == zmq.EVENT_CONNECTED:
                if self.connected_at is None:
                    self.connected_at = time.monotonic()
            elif event == zmq.EVENT_DISCONNECTED and self.connected_at is not None:
                lost = True
        return lost

    def close(self) -> None:
        """Stop monitoring, then close the monitor; before the watched socket closes."""
        stop_monitor(self._watched, self.socket)


def stop_monitor(watched: zmq.Socket, monitor: zmq.Socket) -> None:
    """Detach ``monitor`` from ``watched`` and close it, in the only safe order.

    Closing the monitor's PAIR alone can leave libzmq sending ``watched``'s next events
    (its connection dropping as it closes, say) to a peer that is gone, a send that blocks
    for ever and ``Context.term`` with it (zeromq/libzmq#3575); ``disable_monitor`` must
    come first (zeromq/pyzmq#1554).
    """
    watched.disable_monitor()
    monitor.close(linger=0)


class SchedulerLink:
    """Registration with the scheduler, then heartbeats and control messages."""

    def __init__(self, ctx: zmq.Context, cfg: Config, role: str, body: dict[str, Any]) -> None:
        self.cfg = cfg
        self.role = role
        self.endpoint = f"tcp://{cfg.root_uri}:{cfg.root_port}"
        self.sock, self.watch = dealer(ctx, self.endpoint, cfg)
        self._body = {"role": role, **body}
        self._sender = int(body.get("rank", -1))
        # How this node is named in fault reports (a server learns its rank at ACCEPT).
        self.name = f"{role} {self._sender}" if self._sender >= 0 else role
        self._next_beat = 0.0
        self.secret = cfg.secret()
        warn_if_unauthenticated(self.secret, role, log)
        # The boot key until ACCEPT, then the job key (see server/auth.py).
        self.auth = Authenticator.boot(self.secret)
        self.dropped = 0  # messages that failed authentication

    def register(self) -> dict[str, Any]:
        """Send REGISTER and wait for ACCEPT.

        Returns:
            The ACCEPT body: ``rank``, ``servers`` (addresses by server rank), ``num_workers``.

        Raises:
            RendezvousError: ABORT from the scheduler (its reason lists missing nodes), an
                ERROR reply, or no answer within ESPRESSO_START_TIMEOUT plus a grace period.
        """
        self.send(P.encode_json(P.MsgType.REGISTER, self._body, sender=self._sender))
        # The wait runs from the moment the scheduler's socket accepted the connection (its
        # own start-up deadline began before it listened), or from now while unreachable.
        wait_s = self.cfg.start_timeout_s + REGISTER_GRACE_S
        since = time.monotonic()
        while True:
            # Registered nodes beat while they wait for the others, so that the scheduler
            # can tell a node stopped during start-up from one that is waiting.
            self.tick()
            self.watch.lost()
            started = self.watch.connected_at or since
            left = started + wait_s - time.monotonic()
            if left <= 0:
                state = ("it accepted the connection but never answered"
                         if self.watch.connected_at else "it could not be reached")
                raise RendezvousError(
                    f"{self.role}: no answer from the scheduler at {self.endpoint} within "
                    f"{wait_s:.1f} s (ESPRESSO_START_TIMEOUT={self.cfg.start_timeout_s:g} + "
                    f"{REGISTER_GRACE_S:g}): {state}; is DMLC_PS_ROOT_URI/DMLC_PS_ROOT_PORT "
                    "right and the scheduler running?")
            if not self.sock.poll(min(left, self.tick()) * 1000):
                continue
            msg = self.recv()
            if msg is None:
                continue
            body = P.decode_json(msg)
            if msg.header.type is P.MsgType.ACCEPT:
                job = body.get("job")
                if not isinstance(job, str):
                    raise RendezvousError(f"{self.role}: ACCEPT without a job id")
                self.auth = self.auth.for_job(self.secret, job)
                self._next_beat = time.monotonic() + HEARTBEAT_INTERVAL_S
                if self.role == "server":
                    self.name = f"server {body.get('rank')}"
                return body
            if msg.header.type is P.MsgType.ABORT:
                raise RendezvousError(f"{self.role}: start-up aborted by the scheduler: "
                                      f"{body.get('reason')}")
            if msg.header.type is P.MsgType.ERROR:
                raise RendezvousError(f"{self.role}: the scheduler refused the registration: "
                                      f"{body.get('message')}")
            log.warning("ignoring %s from the scheduler during registration",
                        msg.header.type.name)

    def send(self, frames: list[Any]) -> None:
        self.sock.send_multipart(self.auth.sign(frames), copy=True)

    def recv(self) -> P.Message | None:
        """The next message from the scheduler, or None when it failed authentication
        (dropped and counted). An ABORT's culprit is relayed to ``ESPRESSO_FAULT_FILE``."""
        frames = self.sock.recv_multipart()
        try:
            frames = self.auth.verify(frames)
        except AuthError as exc:
            self.dropped += 1
            log.warning("%s: dropped an unauthenticated message from %s (#%d): %s",
                        self.role, self.endpoint, self.dropped, exc)
            return None
        msg = P.decode(frames, self.cfg.max_message_bytes)
        if msg.header.type is P.MsgType.ABORT:
            body = P.decode_json(msg)
            culprit, reason = body.get("culprit"), body.get("reason")
            if isinstance(culprit, str) and isinstance(reason, str):
                faults.report(self.cfg.fault_file, culprit, reason,
                              f"{self.name} (relaying the scheduler's ABORT)")
        return msg

    def report_lost(self, culprit: str, reason: str) -> None:
        """Report that this node lost ``culprit`` (``scheduler`` or ``server N``)."""
        faults.report(self.cfg.fault_file, culprit, reason, self.name)

    def lost_reason(self) -> str:
        """Why a dropped scheduler connection is lost, for messages and reports."""
        return (f"lost the connection to the scheduler at {self.endpoint}: it exited, was "
                f"stopped or became unreachable (no heartbeat answer within "
                f"ESPRESSO_HEARTBEAT_TIMEOUT={self.cfg.heartbeat_timeout_s:g} s)")

    def tick(self, now: float | None = None) -> float:
        """Send a heartbeat when one is due; returns seconds until the next one."""
        now = time.monotonic() if now is None else now
        if now >= self._next_beat:
            self.send(P.encode(P.MsgType.HEARTBEAT, sender=self._sender))
            self._next_beat = now + HEARTBEAT_INTERVAL_S
        return max(0.0, self._next_beat - now)

    def close(self, linger_ms: int = 0) -> None:
        """Close; ``linger_ms`` lets a last message (BYE) leave first."""
        self.watch.close()
        self.sock.close(linger=linger_ms)
