"""Dense keys through shared memory (BYTEPS_ENABLE_IPC) against live servers: the same sums
as over TCP, bit for bit, with every mix of transports; bad ATTACH and FLAG_SHM messages are
refused and the server goes on; a failed round takes its key back to TCP."""

from __future__ import annotations

import dataclasses
import glob
import os
import random
import threading

import numpy as np
import pytest
from byteps_espresso.server import protocol as P
from byteps_espresso.server.client import PSClient, PSError
from byteps_espresso.server.shm import SHM_DIR, Segment, host_identity

pytestmark = pytest.mark.skipif(not os.path.isdir(SHM_DIR), reason="no /dev/shm")

NUMEL = 50_001  # 200 KB: four partitions at the tests' BYTEPS_PARTITION_BYTES=64 KiB


def _connect(job, ipc: list[bool]) -> list[PSClient]:
    """One client per rank, each with its own BYTEPS_ENABLE_IPC (registration blocks until
    every worker is there, so they start in threads)."""
    out: list = [None] * len(ipc)

    def make(rank: int) -> None:
        try:
            out[rank] = PSClient(dataclasses.replace(job.config(rank), enable_ipc=ipc[rank]))
        except BaseException as exc:
            out[rank] = exc

    threads = [threading.Thread(target=make, args=(r,)) for r in range(len(ipc))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert all(isinstance(c, PSClient) for c in out), (out, job.logs())
    job.clients = out
    return out


def _together(clients: list[PSClient], fn, *, errors: bool = False) -> list:
    """``fn(rank, client)`` on every client at once, started in a random order; with
    ``errors`` the exceptions are returned in place of results, else the first is raised."""
    results: list = [None] * len(clients)

    def run(rank: int) -> None:
        try:
            results[rank] = fn(rank, clients[rank])
        except BaseException as exc:
            results[rank] = exc

    order = list(range(len(clients)))
    random.shuffle(order)
    threads = [threading.Thread(target=run, args=(r,)) for r in order]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    if not errors:
        for result in results:
            if isinstance(result, BaseException):
                raise result
    return results


def _data(rank: int, round_: int) -> np.ndarray:
    return np.random.default_rng([rank, round_, 11]).standard_normal(NUMEL, np.float32)


def _reference(n: int, round_: int) -> np.ndarray:
    total = _data(0, round_).copy()
    for rank in range(1, n):
        total = total + _data(rank, round_)  # rank order, as the server sums
    return total


@pytest.mark.timeout(180)
@pytest.mark.parametrize("servers,ipc", [(1, [True, True]), (2, [True] * 4),
                                         (1, [True, False, True]), (2, [False, True, True])])
def test_sums_in_shared_memory_equal_the_rank_ordered_reference(tmp_path, ps_tools, servers,
                                                                ipc):
    with ps_tools.ps_job(tmp_path, len(ipc), servers) as job:
        clients = _connect(job, ipc)
        ranks = list(range(len(ipc)))
        _together(clients, lambda r, c: c.declare("w", NUMEL, pushers=ranks))
        parts = len(clients[0].partitions("w"))
        assert parts == 4
        for client, on in zip(clients, ipc, strict=True):
            assert len(client._shm) == (parts if on else 0)
        assert not glob.glob(os.path.join(SHM_DIR, f"espresso-{os.getpid()}-*"))
        for round_ in range(4):
            into = [np.full(NUMEL, np.nan, np.float32) for _ in ipc]

            def step(r: int, c: PSClient, round_: int = round_, into: list = into):
                return c.push_pull("w", _data(r, round_), round_,
                                   **({"out": into[r]} if round_ % 2 else {}))

            got = _together(clients, step)
            want = _reference(len(ipc), round_)
            for g in got:
                assert isinstance(g, np.ndarray), g
                assert np.array_equal(g, want)
        stats = clients[0].server_stats()
        assert sum(s["shm_keys"] for s in stats) == parts * sum(ipc)
        assert sum(s["shm_replies"] for s in stats) == 4 * parts * sum(ipc)


@pytest.mark.timeout(120)
def test_a_failed_round_takes_its_key_back_to_tcp(tmp_path, ps_tools):
    with ps_tools.ps_job(tmp_path, 2, 1) as job:
        clients = _connect(job, [True, True])
        _together(clients, lambda r, c: c.declare("f", NUMEL, pushers=[0, 1]))
        ok = _together(clients, lambda r, c: c.push_pull("f", _data(r, 0), 0))
        assert all(np.array_equal(g, _reference(2, 0)) for g in ok)
        replies = sum(s["shm_replies"] for s in clients[0].server_stats())
        assert replies == 2 * 4
        bad = _data(0, 1)
        bad[::1000] = np.nan  # every partition's round fails on the server
        failed = _together(clients, lambda r, c: c.push_pull(
            "f", bad if r == 0 else _data(1, 1), 1), errors=True)
        for err in failed:
            assert isinstance(err, PSError) and "non_finite" in str(err), err
        for client in clients:
            assert not client._shm  # both left the segments their failed rounds used
        again = _together(clients, lambda r, c: c.push_pull("f", _data(r, 2), 2))
        assert all(np.array_equal(g, _reference(2, 2)) for g in again)
        assert sum(s["shm_replies"] for s in clients[0].server_stats()) == replies


@pytest.mark.timeout(120)
def test_servers_without_ipc_keep_every_key_on_tcp(tmp_path, ps_tools):
    with ps_tools.ps_job(tmp_path, 2, 1, BYTEPS_ENABLE_IPC="0") as job:
        clients = _connect(job, [True, True])
        _together(clients, lambda r, c: c.declare("t", NUMEL, pushers=[0, 1]))
        assert not clients[0]._shm and not clients[1]._shm
        got = _together(clients, lambda r, c: c.push_pull("t", _data(r, 0), 0))
        assert all(np.array_equal(g, _reference(2, 0)) for g in got)
        raw = ps_tools.RawPeer(clients[0].servers[0])
        seg = Segment.create(4 * NUMEL, "test")
        try:
            key = clients[0]._tensors["t"].parts[0].key
            body = raw.rejected(_attach(key, 0, seg.path), P.ErrorCode.BAD_FIELD)
            assert "without BYTEPS_ENABLE_IPC" in body["message"]
        finally:
            seg.close()
            raw.close()
        assert clients[0].server_stats()[0]["shm_keys"] == 0


@pytest.mark.timeout(120)
def test_bad_attach_and_shared_pushes_are_refused_and_serving_goes_on(tmp_path, ps_tools):
    with ps_tools.ps_job(tmp_path, 3, 1) as job:
        clients = _connect(job, [False, True, True])
        c0, c1, c2 = clients
        numel = 1000
        for c in clients:
            c.declare("d", numel, pushers=[0, 1])
            c.declare("c", numel, pushers=[0, 1], compressor="onebit")
        key = c0._tensors["d"].parts[0].key
        ckey = c0._tensors["c"].parts[0].key
        before = c2.server_stats()[0]["rejected"]
        raw = ps_tools.RawPeer(c0.servers[0])
        seg = Segment.create(4 * numel, "test")
        small = Segment.create(4 * (numel - 1), "test")
        x = np.arange(numel, dtype=np.float32)
        try:
            def refused(frames: list, code: P.ErrorCode, words: str) -> None:
                assert words in raw.rejected(frames, code)["message"]

            refused(_attach(key, 0, seg.path, host="another-host"), P.ErrorCode.BAD_FIELD,
                    "another host")
            refused(_attach(key, 0, "/tmp/not-shm"), P.ErrorCode.BAD_FIELD,
                    "not a file directly in /dev/shm")
            refused(_attach(key, 0, small.path), P.ErrorCode.BAD_FIELD, "the key needs 4000")
            refused(_attach(ckey, 0, seg.path), P.ErrorCode.BAD_FIELD, "only dense float32")
            refused(_attach(key, 2, seg.path), P.ErrorCode.BAD_FIELD, "not a pusher")
            refused(_shm_push(key, 0, 0, numel), P.ErrorCode.BAD_FIELD, "without attaching")
            reply = raw.request(_attach(key, 0, seg.path))
            assert reply.header.type is P.MsgType.ATTACH_OK
            refused(_shm_push(key, 0, 0, numel, flags=P.FLAG_SHM), P.ErrorCode.BAD_FIELD,
                    "must also pull")
            with_frames = P.encode(P.MsgType.PUSH, key=key, round=0, sender=0,
                                   dtype=P.DType.FLOAT32, numel=numel, frames=[x],
                                   flags=P.FLAG_PULL | P.FLAG_SHM)
            refused(with_frames, P.ErrorCode.BAD_LENGTH, "no payload frames")
            refused(_shm_push(key, 0, 0, numel - 1), P.ErrorCode.BAD_LENGTH, "1000 elements")
            # A valid round: rank 0 by hand in its segment, rank 1 through its client (in its
            # own segment); each finds the sum in its segment.
            seg.array[:numel] = x
            raw.sock.send_multipart(_shm_push(key, 0, 0, numel))
            assert np.array_equal(c1.push_pull("d", x * 2, 0), x * 3)
            assert raw.sock.poll(20_000)
            got = P.decode(raw.sock.recv_multipart(), ps_tools.max_message_bytes)
            assert got.header.type is P.MsgType.PULL_REPLY
            assert got.header.flags & P.FLAG_SHM and not got.frames
            assert np.array_equal(seg.array[:numel], x * 3)
            # Every pusher had the sum in shared memory: a later pull is told why it gets none.
            late = raw.rejected(P.encode(P.MsgType.PULL, key=key, round=0, sender=2),
                                P.ErrorCode.STALE_ROUND)
            assert "shared memory" in late["message"]
        finally:
            for s in (seg, small):
                s.close()
            raw.close()
        # Clients go on, over TCP (rank 0) and shared memory (rank 1) alike.
        got = _together(clients[:2], lambda r, c: c.push_pull("d", x * (r + 1), 1))
        assert all(np.array_equal(g, x * 3) for g in got)
        after = c2.server_stats()[0]["rejected"]
        for code, n in (("bad_field", 7), ("bad_length", 2), ("stale_round", 1)):
            assert after.get(code, 0) - before.get(code, 0) == n, (code, before, after)


def _attach(key: int, sender: int, path: str, *, host: str | None = None) -> list:
    return P.encode_json(P.MsgType.ATTACH, {"path": path, "host": host or host_identity()},
                         key=key, sender=sender)


def _shm_push(key: int, round_: int, sender: int, numel: int,
              flags: int = P.FLAG_PULL | P.FLAG_SHM) -> list:
    return P.encode(P.MsgType.PUSH, key=key, round=round_, sender=sender,
                    dtype=P.DType.FLOAT32, numel=numel, flags=flags)
