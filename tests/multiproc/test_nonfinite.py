"""A NaN gradient on one rank, uncompressed and compressed, over real processes (2 x 2 and a
server): by default every rank stops with the same error naming the tensor, the rank and the
iteration; with ESPRESSO_NONFINITE=skip every rank skips that step and the ranks' parameters
stay finite and bit-identical (PowerSGD's too: its error keeps no NaN)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

WORLD = 4
STEPS = 4
_spec = importlib.util.spec_from_file_location(
    "nonfinite_worker", Path(__file__).parent / "workers" / "nonfinite_worker.py")
worker = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(worker)


def _run(tmp_path, cluster, compression: str, mode: str, env: dict | None = None) -> None:
    with cluster.ps_job(servers=1) as root:
        cluster.run_workers("nonfinite_worker.py", [str(tmp_path), compression, str(STEPS)],
                            root_port=root, servers=1, timeout=150,
                            extra_env={"ESPRESSO_NONFINITE": mode, **(env or {})})


@pytest.mark.timeout(200)
# onebit: the ranks compare notes beside the last bucket; fp16: the flag survives the casts;
# powersgd: the flag rides its first sum
@pytest.mark.parametrize("compression", ["none", "fp16", "onebit", "powersgd"])
def test_every_rank_stops_naming_tensor_rank_and_iteration(tmp_path, cluster, compression):
    _run(tmp_path, cluster, compression, "error")
    errors = [(tmp_path / f"error_{r}.txt").read_text() for r in range(WORLD)]
    assert len(set(errors)) == 1, errors  # the same words on every rank
    # Backward order: the last layer's bias is the first gradient of the NaN rank.
    assert (f"iteration {worker.BAD_STEP}: rank {worker.BAD_RANK}: '2.bias'" in errors[0])
    assert "ESPRESSO_NONFINITE=skip" in errors[0]
    for r in range(WORLD):  # the steps before it completed, the bad one did not
        assert (tmp_path / f"params_{worker.BAD_STEP - 1}_{r}.npy").exists()
        assert not (tmp_path / f"params_{worker.BAD_STEP}_{r}.npy").exists()


@pytest.mark.timeout(200)
@pytest.mark.parametrize(("compression", "env"), [
    ("fp16", {}),  # compressed: the flag survives the casts
    ("onebit", {}),  # compressed by a codec that drops the flag: notes every iteration
    # PowerSGD's error must stay finite past the skipped step (the 9 x 6 weight compressed)
    ("powersgd", {}),
    # uncompressed through the server, one bucket per tensor: the flag rides in the last one
    ("none", {"ESPRESSO_BUCKET_CAP_MB": "0"})])
def test_skip_mode_skips_the_step_on_every_rank(tmp_path, cluster, compression, env):
    _run(tmp_path, cluster, compression, "skip", env)
    assert {(tmp_path / f"skipped_{r}.txt").read_text() for r in range(WORLD)} == {"1"}
    for step in range(STEPS):
        got = [np.load(tmp_path / f"params_{step}_{r}.npy") for r in range(WORLD)]
        assert all(np.isfinite(g).all() for g in got)
        assert all(np.array_equal(g, got[0]) for g in got), f"step {step}"
    skipped = worker.BAD_STEP
    assert np.array_equal(np.load(tmp_path / f"params_{skipped}_0.npy"),
                          np.load(tmp_path / f"params_{skipped - 1}_0.npy"))
