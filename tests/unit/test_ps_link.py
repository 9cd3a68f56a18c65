"""A node's watch on its connections: a lost peer is seen only if the connection was seen;
and the frame helpers every PS message goes through.

Real ZeroMQ sockets over loopback TCP in one process: a ROUTER as the peer, the node's DEALER
and its :class:`ConnectionWatch`.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import zmq
from byteps_espresso.server.link import (
    ConnectionWatch,
    dealer,
    readable,
    recv_frames,
    send_frames,
    stop_monitor,
)

from byteps_espresso.config import Config

# Seconds to wait for ZeroMQ's I/O thread to connect or drop a loopback connection.
SETTLE_S = 0.5
LOST_WITHIN_S = 5.0
# The environment of a worker of a 2-machine job (the DEALER's limits come from its Config).
ENV = {"DMLC_ROLE": "worker", "DMLC_NUM_WORKER": "2", "DMLC_NUM_SERVER": "1",
       "DMLC_PS_ROOT_URI": "127.0.0.1", "DMLC_PS_ROOT_PORT": "9100"}


@pytest.fixture
def ctx():
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


def _peer(ctx: zmq.Context) -> tuple[zmq.Socket, str]:
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    return router, f"tcp://127.0.0.1:{port}"


def _lost_within(watch: ConnectionWatch, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if watch.socket.poll(50) and watch.lost():
            return True
    return False


def test_the_watch_of_a_dealer_sees_its_peer_go(ctx):
    router, endpoint = _peer(ctx)
    sock, watch = dealer(ctx, endpoint, Config.from_env(ENV))
    time.sleep(SETTLE_S)  # connected long before anyone looks at the watch
    assert not watch.lost() and watch.connected_at is not None
    router.close(linger=0)
    assert _lost_within(watch, LOST_WITHIN_S)
    stop_monitor(sock, watch.socket)
    sock.close(linger=0)


def test_a_watch_attached_after_the_connection_never_sees_it_drop(ctx):
    # Why dealer() attaches the watch before connect: a CONNECTED event that happened
    # before the monitor existed is never delivered, and without it a DISCONNECTED does not
    # count as a loss.
    router, endpoint = _peer(ctx)
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    time.sleep(SETTLE_S)
    late = ConnectionWatch(sock)
    router.close(linger=0)
    assert not _lost_within(late, 2 * SETTLE_S)
    assert late.connected_at is None
    stop_monitor(sock, late.socket)
    sock.close(linger=0)


def test_frames_arrive_whole_in_order_and_zero_copy_arrays_unchanged(ctx):
    router, endpoint = _peer(ctx)
    sock, watch = dealer(ctx, endpoint, Config.from_env(ENV), identity=b"w0")
    x = np.arange(1 << 18, dtype=np.float32)  # above pyzmq's copy threshold: sent uncopied
    frames = [b"head", x, memoryview(b"view"), zmq.Frame(b"frame"), b""]
    send_frames(sock, frames)
    assert router.poll(int(LOST_WITHIN_S * 1000))
    got = recv_frames(router)
    assert [f.bytes for f in got[:2]] == [b"w0", b"head"]
    assert np.array_equal(np.frombuffer(got[2].buffer, np.float32), x)
    assert [f.bytes for f in got[3:]] == [b"view", b"frame", b""]
    assert not readable(router)
    send_frames(router, [b"w0", b"reply"], zmq.NOBLOCK)
    assert sock.poll(int(LOST_WITHIN_S * 1000)) and readable(sock)
    assert [f.bytes for f in recv_frames(sock, zmq.NOBLOCK)] == [b"reply"]
    with pytest.raises(zmq.Again):
        recv_frames(sock, zmq.NOBLOCK)
    stop_monitor(sock, watch.socket)
    sock.close(linger=0)


def test_a_message_that_cannot_be_queued_is_not_sent_at_all(ctx):
    router, _ = _peer(ctx)
    router.setsockopt(zmq.ROUTER_MANDATORY, 1)
    with pytest.raises(zmq.ZMQError) as err:  # no such peer: refused at the first frame
        send_frames(router, [b"nobody", b"head", b"payload"], zmq.NOBLOCK)
    assert err.value.errno == zmq.EHOSTUNREACH
    assert not readable(router)
