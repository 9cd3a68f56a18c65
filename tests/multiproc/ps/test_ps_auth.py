"""An authenticated PS job (ESPRESSO_JOB_SECRET) against outsiders on loopback: messages
without the job's MAC are dropped without a reply and counted, a process with another secret
cannot join, a connection cannot act for another rank, bad control bodies are refused, and
the job's own rounds stay correct throughout."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import zmq
from byteps_espresso.server import protocol as P
from byteps_espresso.server.auth import Authenticator
from byteps_espresso.server.client import PSClient, PSError

SECRET = "test-job-secret-0123456789abcdef"
NUMEL = 1000
MAX_MESSAGE_BYTES = 8 << 20  # conftest's ESPRESSO_MAX_MESSAGE_BYTES


class Peer:
    """A bare DEALER that signs with ``auth`` (or not at all)."""

    def __init__(self, address: str, auth: Authenticator) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)
        self.auth = auth

    def send(self, frames: list) -> None:
        self.sock.send_multipart(self.auth.sign(frames))

    def reply(self, wait_ms: int) -> P.Message | None:
        if not self.sock.poll(wait_ms):
            return None
        return P.decode(self.auth.verify(self.sock.recv_multipart()), MAX_MESSAGE_BYTES)

    def close(self) -> None:
        self.sock.close()
        self.ctx.term()


def _push(key: int, round_: int, sender: int, x: np.ndarray) -> list:
    return P.encode(P.MsgType.PUSH, key=key, round=round_, sender=sender,
                    dtype=P.DType.FLOAT32, numel=x.size, frames=[x], flags=P.FLAG_PULL)


@pytest.mark.timeout(150)
def test_outsiders_are_dropped_and_ranks_stay_bound(tmp_path, ps_tools):
    with ps_tools.ps_job(tmp_path, 2, 1, ESPRESSO_JOB_SECRET=SECRET) as job:
        c0, c1 = job.connect(2)
        for c in (c0, c1):
            c.declare("a", NUMEL, pushers=[0, 1])
        key = c0._tensors["a"].parts[0].key
        x = np.arange(NUMEL, dtype=np.float32)
        handles = [c.push_pull_async("a", x * (r + 1), 0) for r, c in enumerate((c0, c1))]
        for h in handles:
            assert np.array_equal(h.wait(), x * 3)
        server, scheduler = c0.servers[0], c0._link.endpoint
        outsiders = [Authenticator(None), Authenticator.boot(b"another job's secret!!")
                     .for_job(b"another job's secret!!", "some-job")]
        for auth in outsiders:
            # A forged rank-1 push for the next round, and a pull of the last one: dropped.
            peer = Peer(server, auth)
            peer.send(_push(key, 1, 1, np.full(NUMEL, 1e6, np.float32)))
            peer.send(P.encode(P.MsgType.PULL, key=key, round=0, sender=1))
            peer.send(P.encode(P.MsgType.STATS, sender=0))
            assert peer.reply(1000) is None
            peer.close()
            # The scheduler neither registers nor answers an outsider.
            peer = Peer(scheduler, auth)
            peer.send(P.encode_json(P.MsgType.REGISTER, {"role": "server",
                                                         "address": "tcp://127.0.0.1:1"}))
            peer.send(P.encode_json(P.MsgType.PLACE, {"spec": []}, sender=0))
            peer.send(P.encode_json(P.MsgType.DONE, {"failed": "forged"}, sender=0))
            assert peer.reply(1000) is None
            peer.close()
        # The forged push was never summed: round 1 is the job's own.
        handles = [c.push_pull_async("a", x, 1) for c in (c0, c1)]
        for h in handles:
            assert np.array_equal(h.wait(), x * 2)
        assert c0.server_stats()[0]["rejected"]["unauthenticated"] == 3 * len(outsiders)
        # A connection holding the job key still cannot push as a rank bound elsewhere.
        insider = Peer(server, c0._auth)
        insider.send(_push(key, 2, 1, x))
        reply = insider.reply(10_000)
        assert reply is not None and reply.header.type is P.MsgType.ERROR
        assert "cannot act for another rank" in P.decode_json(reply)["message"]
        insider.close()
        # A registered worker's malformed PLACE is refused, and the scheduler goes on.
        with pytest.raises(PSError, match="a key spec must be a JSON object"):
            c0._call(-1, P.encode_json(P.MsgType.PLACE, {"spec": []}, sender=0),
                     P.MsgType.PLACE, 0, "place")
        # A DONE whose reason is not a string is refused too, and does not end the job.
        with pytest.raises(PSError, match="must be null or a string"):
            c0._call(-1, P.encode_json(P.MsgType.DONE, {"failed": {"x": 1}}, sender=0),
                     P.MsgType.DONE, 0, "done")
        assert c0.declare("after", NUMEL, pushers=[0]) == [(0, NUMEL)]


@pytest.mark.timeout(120)
def test_a_process_with_another_secret_cannot_join(tmp_path, ps_tools):
    with ps_tools.ps_job(tmp_path, 1, 1, ESPRESSO_JOB_SECRET=SECRET,
                         ESPRESSO_START_TIMEOUT="60") as job:
        cfg = job.config(0)
        wrong = dataclasses.replace(cfg, job_secret=type(cfg.job_secret)("x" * 32),
                                    start_timeout_s=2.0)
        with pytest.raises(PSError, match="accepted the connection but never answered"):
            PSClient(wrong)
        (c0,) = job.connect(1)  # the right secret still joins
        c0.declare("b", NUMEL, pushers=[0])
        x = np.ones(NUMEL, np.float32)
        assert np.array_equal(c0.push_pull("b", x, 0), x)
