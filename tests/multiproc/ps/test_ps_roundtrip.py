"""Push/pull through real servers equals a single-process reference, bit for bit.

The reference decompresses each worker's payload, sums in rank order and re-compresses,
with the numba backend, independently of the server's code; pushes arrive in a different
random order every round.
"""

from __future__ import annotations

import random
import subprocess
import time

import numpy as np
import pytest
import torch
from byteps_espresso.kernels import create, names
from byteps_espresso.kernels.base import to_numpy

NUMEL = 20_001  # 80 KB: two partitions at the tests' BYTEPS_PARTITION_BYTES=64 KiB
ROUNDS = 3
# Dense keys run on every layout; each compressor on 1 server x 2 workers and 2 servers x 4
# workers, which covers both server counts and both worker counts for every codec.
LAYOUTS = [(1, 2), (1, 4), (2, 2), (2, 4)]
CASES = [("dense", s, w) for s, w in LAYOUTS] + [("dense16", s, w) for s, w in LAYOUTS] + [
    (codec, s, w) for codec in names() for s, w in ((1, 2), (2, 4))]


def _data(rank: int, round_: int, numel: int, dtype: str = "float32") -> np.ndarray:
    return np.random.default_rng([rank, round_, 7]).standard_normal(numel, np.float32
                                                                    ).astype(dtype)


def _compress(codec: str, x: np.ndarray, names_: list[str], parts: list, round_: int) -> list:
    comp = create(codec, backend="torch")
    return [to_numpy(comp.compress(torch.from_numpy(x[off:off + n].copy()), name=key_name,
                                   step=round_)[0])
            for key_name, (off, n) in zip(names_, parts, strict=True)]


def reference(codec: str, inputs: list, names_: list[str], parts: list, round_: int, *,
              comp=None):
    """Decompress each pusher's payload, sum in rank order, re-compress (numba backend).

    ``comp`` is the reference's own compressor of this tensor, kept across rounds like the
    server's (stateful codecs such as signum carry momentum from round to round)."""
    if codec.startswith("dense"):
        total = inputs[0].astype(np.float32)
        for x in inputs[1:]:
            total = total + x
        return total.astype(inputs[0].dtype)
    out = []
    for i, (key_name, (_, n)) in enumerate(zip(names_, parts, strict=True)):
        ctx = comp.context((n,), "float32", name=key_name, step=round_)
        total = sum_in_order(comp, [inp[i] for inp in inputs], ctx)
        out.append(comp.compress(total, name=key_name, step=round_)[0])
    return out


def sum_in_order(comp, payloads, ctx) -> np.ndarray:
    total = np.array(comp.decompress(payloads[0], ctx), dtype=np.float32).reshape(-1)
    for payload in payloads[1:]:
        total += np.asarray(comp.decompress(payload, ctx)).reshape(-1)
    return total


def assert_same_bits(codec: str, got, want, what: str) -> None:
    if codec.startswith("dense"):
        assert got.dtype == want.dtype, what
        assert got.tobytes() == want.tobytes(), f"{what}: dense sum differs"
        return
    assert len(got) == len(want), what
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert len(g) == len(w), f"{what} partition {i}"
        for j, (a, b) in enumerate(zip(g, w, strict=True)):
            assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), (
                f"{what}: partition {i} array {j} differs from the reference")


@pytest.mark.timeout(180)
@pytest.mark.parametrize(("codec", "num_servers", "num_pushers"), CASES)
def test_round_trip_matches_reference_in_any_arrival_order(ps_job_factory, num_servers,
                                                           num_pushers, codec):
    job = ps_job_factory(num_servers)
    clients = job.clients[:num_pushers]
    name = f"{codec}-{num_pushers}"
    dtype = "float16" if codec == "dense16" else "float32"
    for client in clients:
        client.declare(name, NUMEL, pushers=list(range(num_pushers)),
                       compressor=None if codec.startswith("dense") else codec, dtype=dtype)
    parts, key_names = clients[0].partitions(name), clients[0].key_names(name)
    assert sum(n for _, n in parts) == NUMEL
    assert len(parts) == (1 if dtype == "float16" else 2)  # 40 KB vs 80 KB at 64 KiB keys
    if num_servers == 2 and len(parts) == 2:
        assert sorted(clients[0].servers_of(name)) == [0, 1], "partitions not balanced"
    rng = random.Random(f"{name}-{num_servers}")
    ref_comp = None if codec.startswith("dense") else create(codec, backend="numba")
    for round_ in range(ROUNDS):
        dense = [_data(r, round_, NUMEL, dtype) for r in range(num_pushers)]
        inputs = (dense if codec.startswith("dense")
                  else [_compress(codec, x, key_names, parts, round_) for x in dense])
        order = list(range(num_pushers))
        rng.shuffle(order)
        handles = {}
        for rank in order:
            handles[rank] = clients[rank].push_pull_async(name, inputs[rank], round_)
            time.sleep(rng.random() * 0.01)
        results = {rank: handles[rank].wait() for rank in range(num_pushers)}
        want = reference(codec, inputs, key_names, parts, round_, comp=ref_comp)
        for rank, got in results.items():
            assert_same_bits(codec, got, want, f"{name} round {round_} rank {rank} order {order}")


@pytest.mark.timeout(120)
def test_server_recompress_false_answers_the_dense_aggregate(ps_job_factory):
    """server_recompress=False: the pull returns the decompressed rank-order sum."""
    job = ps_job_factory(1)
    clients = job.clients[:2]
    codec = names()[0]
    for client in clients:
        client.declare("nore", 1000, pushers=[0, 1], compressor=codec,
                       params={"server_recompress": False})
    inputs = [_compress(codec, _data(r, 0, 1000), ["nore"], [(0, 1000)], 0) for r in range(2)]
    handles = [c.push_pull_async("nore", inputs[r], 0) for r, c in enumerate(clients)]
    comp = create(codec, backend="numba")
    want = sum_in_order(comp, [inputs[0][0], inputs[1][0]],
                        comp.context((1000,), "float32", name="nore", step=0))
    for h in handles:
        (got,) = h.wait()
        assert got.dtype == np.float32 and got.tobytes() == want.tobytes()


@pytest.mark.timeout(240)
def test_worker_processes_round_trip_every_codec(tmp_path, ps_tools):
    """Two worker processes (torch-backend payloads) against two servers, 2 rounds."""
    procs: list[subprocess.Popen] = []
    with ps_tools.ps_job(tmp_path, 2, 2) as job:
        try:
            procs = [ps_tools.start_worker(job.env, r, tmp_path, "roundtrip", str(tmp_path))
                     for r in range(2)]
            for proc in procs:
                assert proc.wait(timeout=200) == 0, job.logs()
        finally:
            ps_tools.kill_all(procs)
    # Every worker closed: the scheduler shut the servers down and every process exited 0.
    assert {n: p.returncode for n, p in job.procs.items()} == {
        "scheduler": 0, "server0": 0, "server1": 0}, job.logs()
    saved = [dict(np.load(tmp_path / f"worker{r}.npz")) for r in range(2)]
    comps = {codec: create(codec, backend="numba") for codec in names()}  # kept across rounds
    for round_ in range(2):
        want = saved[0][f"dense/{round_}/in"] + saved[1][f"dense/{round_}/in"]
        for s in saved:
            assert s[f"dense/{round_}/out"].tobytes() == want.tobytes()
        for codec in names():
            comp = comps[codec]
            n_parts = len({k.split("/")[2] for k in saved[0] if k.startswith(f"{codec}/{round_}/")})
            sizes = np.array_split(np.empty(NUMEL), n_parts)
            for i in range(n_parts):
                key_name = codec if n_parts == 1 else f"{codec}#{i}"
                n = len(sizes[i])
                arrays = len({k.split("/")[3] for k in saved[0]
                              if k.startswith(f"{codec}/{round_}/{i}/")})
                payloads = [tuple(s[f"{codec}/{round_}/{i}/{j}/in"] for j in range(arrays))
                            for s in saved]
                ctx = comp.context((n,), "float32", name=key_name, step=round_)
                ref = comp.compress(sum_in_order(comp, payloads, ctx), name=key_name,
                                    step=round_)[0]
                for s in saved:
                    for j in range(arrays):
                        assert s[f"{codec}/{round_}/{i}/{j}/out"].tobytes() == ref[j].tobytes(), (
                            f"{codec} round {round_} partition {i} array {j}")
    assert "Traceback" not in job.logs()


@pytest.mark.timeout(120)
def test_server_error_feedback_carries_the_residual_across_rounds(ps_job_factory):
    """server_error_feedback: the server re-compresses aggregate + residual of its key, like
    an ErrorFeedback-wrapped reference compressor kept across rounds."""
    from byteps_espresso.kernels import ErrorFeedback

    job = ps_job_factory(2)
    clients = job.clients[:2]
    params = {"ratio": 0.05, "server_error_feedback": True}
    for client in clients:
        client.declare("ef", NUMEL, pushers=[0, 1], compressor="topk", params=params)
    parts, key_names = clients[0].partitions("ef"), clients[0].key_names("ef")
    ref = ErrorFeedback(create("topk", backend="numba", ratio=0.05))
    plain = create("topk", backend="numba", ratio=0.05)
    differs = False
    for round_ in range(3):
        inputs = [[to_numpy(plain.compress(_data(r, round_, NUMEL)[o:o + n], name=k,
                                           step=round_)[0])
                   for k, (o, n) in zip(key_names, parts, strict=True)] for r in range(2)]
        handles = [c.push_pull_async("ef", inputs[r], round_) for r, c in enumerate(clients)]
        for i, (k, (_, n)) in enumerate(zip(key_names, parts, strict=True)):
            ctx = ref.context((n,), "float32", name=k, step=round_)
            total = sum_in_order(plain, [inputs[0][i], inputs[1][i]], ctx)
            want = ref.compress(total, name=k, step=round_)[0]
            differs |= round_ > 0 and any(
                a.tobytes() != b.tobytes()
                for a, b in zip(want, plain.compress(total, name=k, step=round_)[0],
                                strict=True))
            for h in handles:
                got = h.wait()[i]
                assert all(a.tobytes() == b.tobytes() for a, b in zip(got, want, strict=True))
    assert differs, "the residual never changed a re-compressed aggregate"
