"""Server-side compressor state read out of one PS job and restored into a fresh one (STATE).

Two real jobs on loopback (scheduler + 2 servers each): the first runs rounds of a key with
server-side error feedback, rank 0 reads the residuals; the second starts from new processes,
rank 0 restores one partition's residual before the key is declared and the other's after
rank 1 has already pushed the next round, and the rounds that follow equal those of an
uninterrupted ErrorFeedback reference bit for bit.
"""

from __future__ import annotations

import numpy as np
import pytest
from byteps_espresso.kernels import ErrorFeedback, create
from byteps_espresso.kernels.base import to_numpy
from byteps_espresso.server.client import PSError

NUMEL = 20_001  # two partitions at the tests' BYTEPS_PARTITION_BYTES=64 KiB
PARAMS = {"ratio": 0.05, "server_error_feedback": True}
SPLIT_AT = 2  # rounds before the checkpoint
ROUNDS = 4


def _data(rank: int, round_: int) -> np.ndarray:
    return np.random.default_rng([rank, round_, 11]).standard_normal(NUMEL, np.float32)


def _run_rounds(clients, rounds, ref, plain, between=None) -> None:
    """Push/pull ``rounds`` of key "ef" (rank 1 first, then ``between()`` once, then rank 0)
    and compare every reply with the reference."""
    parts, key_names = clients[1].partitions("ef"), clients[1].key_names("ef")
    for round_ in rounds:
        inputs = [[to_numpy(plain.compress(_data(r, round_)[o:o + n], name=k, step=round_)[0])
                   for k, (o, n) in zip(key_names, parts, strict=True)] for r in range(2)]
        later = clients[1].push_pull_async("ef", inputs[1], round_)
        if between is not None:
            between()
            between = None
        handles = [clients[0].push_pull_async("ef", inputs[0], round_), later]
        for i, (k, (_, n)) in enumerate(zip(key_names, parts, strict=True)):
            ctx = ref.context((n,), "float32", name=k, step=round_)
            total = np.array(plain.decompress(inputs[0][i], ctx), dtype=np.float32)
            total += plain.decompress(inputs[1][i], ctx)
            want = ref.compress(total, name=k, step=round_)[0]
            for h in handles:
                got = h.wait()[i]
                assert all(a.tobytes() == b.tobytes() for a, b in zip(got, want, strict=True)), (
                    f"round {round_} partition {i} differs from the uninterrupted reference")


@pytest.mark.timeout(240)
@pytest.mark.parametrize("secret", [None, "checkpoint-job-secret-0123456789"],
                         ids=["open", "authenticated"])
def test_server_residuals_survive_a_restart_of_every_ps_process(tmp_path, ps_tools, secret):
    ref = ErrorFeedback(create("topk", backend="numba", ratio=0.05))
    plain = create("topk", backend="numba", ratio=0.05)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    auth = {"ESPRESSO_JOB_SECRET": secret} if secret else {}
    with ps_tools.ps_job(tmp_path / "a", 2, 2, **auth) as job:
        clients = job.connect(2)
        for c in clients:
            c.declare("ef", NUMEL, pushers=[0, 1], compressor="topk", params=PARAMS)
        _run_rounds(clients, range(SPLIT_AT), ref, plain)
        with pytest.raises(PSError, match="only worker rank 0"):
            clients[1].server_state()
        saved = clients[0].server_state()
        key_names = clients[0].key_names("ef")
    assert sorted(saved) == sorted(key_names)
    for k in key_names:  # the servers' residuals are the reference's, bit for bit
        assert saved[k][k]["residual"].tobytes() == ref.residual(k).tobytes()
        assert np.any(saved[k][k]["residual"])

    with ps_tools.ps_job(tmp_path / "b", 2, 2, **auth) as job:
        clients = job.connect(2)
        clients[0].restore_server_state({k: saved[k] for k in key_names[:1]})  # not declared
        clients[1].declare("ef", NUMEL, pushers=[0, 1], compressor="topk", params=PARAMS)

        def restore_the_rest() -> None:  # rank 1 already pushed: the rounds are open
            clients[0].restore_server_state({k: saved[k] for k in key_names[1:]})
            clients[0].declare("ef", NUMEL, pushers=[0, 1], compressor="topk", params=PARAMS)

        _run_rounds(clients, range(SPLIT_AT, ROUNDS), ref, plain, restore_the_rest)
        with pytest.raises(PSError, match="already ran round"):
            clients[0].restore_server_state(saved)
        assert "Traceback" not in job.logs()
