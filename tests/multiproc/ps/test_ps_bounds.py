"""Server resources stay bounded: a round that can never complete is failed after
ESPRESSO_TIMEOUT naming the missing ranks (its pushes freed), and pulls far ahead of the
key's rounds, or beyond a few per pusher, are refused instead of held."""

from __future__ import annotations

import time

import numpy as np
import pytest
import zmq
from byteps_espresso.server import protocol as P
from byteps_espresso.server.client import PSError

OP_TIMEOUT_S = 4.0
NUMEL = 1000


def _pull(address: str, key: int, round_: int) -> dict:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    try:
        sock.send_multipart(P.encode(P.MsgType.PULL, key=key, round=round_, sender=0))
        assert sock.poll(20_000), "no reply"
        reply = P.decode(sock.recv_multipart(), 1 << 20)
        assert reply.header.type is P.MsgType.ERROR
        return P.decode_json(reply)
    finally:
        sock.close()
        ctx.term()


@pytest.mark.timeout(120)
def test_incomplete_rounds_expire_and_far_pulls_are_refused(tmp_path, ps_tools):
    with ps_tools.ps_job(tmp_path, 2, 1, ESPRESSO_TIMEOUT=str(OP_TIMEOUT_S)) as job:
        c0, c1 = job.connect(2)
        for c in (c0, c1):
            c.declare("t", NUMEL, pushers=[0, 1])
        key = c0._tensors["t"].parts[0].key
        x = np.ones(NUMEL, np.float32)
        started = time.monotonic()
        with pytest.raises(PSError, match=r"round_timeout: round 0 of key \d+ \(t\) failed: "
                                          r"no push from rank\(s\) \[1\]|no reply within"):
            c0.push_pull("t", x, 0)  # rank 1 never pushes round 0
        assert time.monotonic() - started < 3 * OP_TIMEOUT_S
        deadline = time.monotonic() + 10
        while c0.server_stats()[0]["rejected"].get("round_timeout", 0) < 1:
            assert time.monotonic() < deadline, "the server never expired round 0"
            time.sleep(0.2)
        # A late push of the expired round gets the same reason; the next round is normal.
        with pytest.raises(PSError, match=r"round_timeout: .*no push from rank\(s\) \[1\]"):
            c1.push_pull("t", x, 0)
        handles = [c.push_pull_async("t", x, 1) for c in (c0, c1)]
        for h in handles:
            assert np.array_equal(h.wait(), x * 2)
        body = _pull(c0.servers[0], key, 1000)
        assert body["code"] == "future_round" and "too far ahead" in body["message"]


@pytest.mark.timeout(120)
def test_replies_to_a_peer_that_never_reads_are_capped(tmp_path, ps_tools):
    # over TCP: the server keeps a round's frames for later pulls only when a pusher did not
    # receive the sum in shared memory
    with ps_tools.ps_job(tmp_path, 1, 1, BYTEPS_ENABLE_IPC="0") as job:
        (c0,) = job.connect(1)
        c0.declare("r", NUMEL, pushers=[0])
        key = c0._tensors["r"].parts[0].key
        c0.push_pull("r", np.ones(NUMEL, np.float32), 0)
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 1)  # takes one reply, then lets them back up
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.connect(c0.servers[0])
        try:
            # Each pull of the kept round 0 is answered with its 4 KB result, never read:
            # beyond the kernel's socket buffers and the server's cap, replies are dropped.
            pull = P.encode(P.MsgType.PULL, key=key, round=0, sender=0)
            for _ in range(8000):
                sock.send_multipart(pull)
            deadline = time.monotonic() + 60
            while c0.server_stats()[0]["rejected"].get("reply_cap", 0) < 1:
                assert time.monotonic() < deadline, "replies to a peer that does not read " \
                    "were queued without a cap"
                time.sleep(0.5)
        finally:
            sock.close()
            ctx.term()
        # The server goes on serving the job, and said why it dropped replies.
        x = np.full(NUMEL, 2.0, np.float32)
        assert np.array_equal(c0.push_pull("r", x, 1), x)
        assert "reply_cap" in ps_tools.read_log(tmp_path, "server0")
