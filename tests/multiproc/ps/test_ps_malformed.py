"""Bad messages against a live server: each is rejected with an error reply, counted, and the
server goes on answering valid rounds."""

from __future__ import annotations

import os
import socket

import numpy as np
import pytest
from byteps_espresso.server import protocol as P

NUMEL = 1000


@pytest.mark.timeout(120)
def test_malformed_messages_are_rejected_counted_and_serving_goes_on(ps_job_factory, ps_tools):
    raw_peer, max_message_bytes = ps_tools.RawPeer, ps_tools.max_message_bytes
    job = ps_job_factory(1)
    c0, c1 = job.clients[:2]
    for c in (c0, c1):
        c.declare("m", NUMEL, pushers=[0, 1])
    key = c0._tensors["m"].parts[0].key
    before = c0.server_stats()[0]["rejected"]
    x = np.arange(NUMEL, dtype=np.float32)
    raw = raw_peer(c0.servers[0])
    sent: dict[str, int] = {}

    def expect(frames: list, code: P.ErrorCode) -> None:
        raw.rejected(frames, code)
        sent[code.value] = sent.get(code.value, 0) + 1

    try:
        # Round 0: rank 0's push arrives by hand, twice; rank 1 pushes through its client.
        assert raw.request(raw.push(key, 0, 0, x)).header.type is P.MsgType.PUSH_OK
        expect(raw.push(key, 0, 0, x), P.ErrorCode.DUPLICATE_PUSH)
        assert np.array_equal(c1.push_pull("m", x, 0), x + x)
        pulled = raw.request(P.encode(P.MsgType.PULL, key=key, round=0, sender=0))
        assert pulled.header.type is P.MsgType.PULL_REPLY
        assert bytes(pulled.frames[0]) == (x + x).tobytes()  # counted once, not three times
        expect(raw.push(key, 0, 1, x), P.ErrorCode.STALE_ROUND)
        # Round 1 opens with rank 0; a push for round 2 is in the future.
        assert raw.request(raw.push(key, 1, 0, x)).header.type is P.MsgType.PUSH_OK
        expect(raw.push(key, 2, 1, x), P.ErrorCode.FUTURE_ROUND)
        expect(raw.push(key, 1, 3, x), P.ErrorCode.NOT_A_PUSHER)
        expect(raw.push(999_999, 1, 1, x), P.ErrorCode.UNKNOWN_KEY)
        expect(raw.push(key, 1, 1, x[:-1]), P.ErrorCode.BAD_LENGTH)
        expect(raw.push(key, 1, 1, x.astype(np.float16), dtype=P.DType.FLOAT16),
               P.ErrorCode.UNKNOWN_DTYPE)
        bad_codec = raw.push(key, 1, 1, x)
        bad_codec[0] = bad_codec[0][:28] + (60_000).to_bytes(2, "little") + bad_codec[0][30:]
        expect(bad_codec, P.ErrorCode.UNKNOWN_CODEC)
        bad_dtype = raw.push(key, 1, 1, x)
        bad_dtype[0] = bad_dtype[0][:30] + bytes([9]) + bad_dtype[0][31:]
        expect(bad_dtype, P.ErrorCode.UNKNOWN_DTYPE)
        truncated = raw.push(key, 1, 1, x)
        truncated[1] = x.tobytes()[:-4]
        expect(truncated, P.ErrorCode.TRUNCATED)
        expect([raw.push(key, 1, 1, x)[0]], P.ErrorCode.TRUNCATED)  # frame missing
        expect([b"garbage bytes, not a header at all........."], P.ErrorCode.BAD_MAGIC)
        expect([os.urandom(7)], P.ErrorCode.TRUNCATED)
        # Oversized: announced in the header, and real frames that add up past the limit.
        huge = raw.push(key, 1, 1, x)
        huge[0] = huge[0][:40] + (max_message_bytes + 1).to_bytes(8, "little")
        expect(huge, P.ErrorCode.TOO_LARGE)
        half = np.zeros(max_message_bytes // 8 + 1, np.float32)  # 4 frames of half the limit
        expect(P.encode(P.MsgType.PUSH, key=key, round=1, sender=1, dtype=P.DType.FLOAT32,
                        numel=NUMEL, frames=[half] * 4), P.ErrorCode.TOO_LARGE)
        expect(P.encode_json(P.MsgType.DECLARE, {"name": "bad", "numel": -3, "pushers": [0]},
                             key=77, sender=0), P.ErrorCode.BAD_DECLARE)
        expect(P.encode(P.MsgType.DECLARE, key=78, sender=0, frames=[b"{not json"]),
               P.ErrorCode.BAD_JSON)
        expect(P.encode_json(P.MsgType.DECLARE, {"name": "anon", "numel": 4, "pushers": [0]},
                             key=79), P.ErrorCode.BAD_FIELD)  # not from a worker rank
        # A single frame above the limit: ZeroMQ drops that connection before allocating.
        blob = raw_peer(c0.servers[0])
        blob.sock.send_multipart([np.zeros(max_message_bytes // 4 + 16, np.float32)])
        assert not blob.sock.poll(500)
        blob.close()
        counted = c0.server_stats()[0]["rejected"]
        # Bytes that are not even ZeroMQ (libzmq may parse them as legacy ZMTP/1.0 frames,
        # which the server then rejects too; they are not counted here).
        host, port = c0.servers[0].removeprefix("tcp://").rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=5) as junk:
            junk.sendall(os.urandom(4096))
    finally:
        raw.close()
    # The server still answers: rank 1 completes round 1, then a clean round 2.
    assert np.array_equal(c1.push_pull("m", x, 1), x + x)
    for round_ in (2, 3):
        handles = [c.push_pull_async("m", x * (r + 1), round_) for r, c in enumerate((c0, c1))]
        for h in handles:
            assert np.array_equal(h.wait(), x * 3)
    for code, n in sent.items():
        assert counted.get(code, 0) - before.get(code, 0) == n, (code, before, counted)


@pytest.mark.timeout(60)
def test_client_errors_name_key_round_and_server(ps_job_factory):
    from byteps_espresso.server.client import PSError

    job = ps_job_factory(1)
    c0, c1 = job.clients[:2]
    for c in (c0, c1):
        c.declare("e", NUMEL, pushers=[0, 1])
    x = np.ones(NUMEL, np.float32)
    handles = [c.push_pull_async("e", x, 5) for c in (c0, c1)]
    for h in handles:
        h.wait()
    with pytest.raises(PSError, match=r"'e' \(key \d+\) round 4 on server 0.*stale_round"):
        c0.push_pull("e", x, 4)
    with pytest.raises(PSError, match="not declared"):
        c0.push_pull("nope", x, 0)
    with pytest.raises(PSError, match=r"float32\[1000\], got float64\[1000\]"):
        c0.push_pull("e", x.astype(np.float64), 6)
    with pytest.raises(PSError, match="declared as"):
        c1.declare("e2", NUMEL, pushers=[0, 1])
        c0.declare("e2", NUMEL + 1, pushers=[0, 1])


@pytest.mark.timeout(90)
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_non_finite_push_fails_the_round_naming_the_sender(ps_job_factory, dtype):
    from byteps_espresso.server.client import PSError

    job = ps_job_factory(1)
    c0, c1, c2 = job.clients[:3]
    name = f"nf-{dtype}"
    for c in (c0, c1, c2):
        c.declare(name, NUMEL, pushers=[0, 1, 2], dtype=dtype)
    x = np.ones(NUMEL, dtype)
    bad = x.copy()
    bad[NUMEL // 2] = np.inf if dtype == "float16" else np.nan
    handles = [c.push_pull_async(name, v, 0) for c, v in zip((c0, c1, c2), (x, bad, x),
                                                               strict=True)]
    key = c0._tensors[name].parts[0].key
    for h in handles:  # every pusher, the culprit included, learns who and where
        with pytest.raises(PSError, match=rf"non_finite: round 0 of key {key} \({name}\) "
                                          r"failed: rank\(s\) \[1\] pushed non-finite"):
            h.wait()
    # The next round is clean and correct.
    handles = [c.push_pull_async(name, x, 1) for c in (c0, c1, c2)]
    for h in handles:
        assert np.array_equal(h.wait(), x * 3)
    assert c0.server_stats()[0]["rejected"].get("non_finite", 0) >= 3


@pytest.mark.timeout(90)
def test_non_finite_compressed_push_is_rejected_naming_the_sender(ps_job_factory):
    from byteps_espresso.kernels import create, names
    from byteps_espresso.server.client import PSError

    if "onebit" not in names():
        pytest.skip("onebit is not registered")
    job = ps_job_factory(1)
    c0, c1 = job.clients[:2]
    for c in (c0, c1):
        c.declare("nf-onebit", NUMEL, pushers=[0, 1], compressor="onebit")
    comp = create("onebit", backend="numba")
    x = np.ones(NUMEL, np.float32)
    good = [comp.compress(x, name=n, step=0)[0] for n in c0.key_names("nf-onebit")]
    poisoned = [tuple(np.full_like(a, np.nan) if a.dtype.kind == "f" else a for a in p)
                for p in good]
    with pytest.raises(PSError, match=r"rejected PUSH: non_finite: round 0 of key \d+ "
                                      r"\(nf-onebit\) failed: rank 1 pushed non-finite"):
        c1.push_pull("nf-onebit", poisoned, 0)
    with pytest.raises(PSError, match=r"non_finite: .*rank 1 pushed non-finite"):
        c0.push_pull("nf-onebit", good, 0)
