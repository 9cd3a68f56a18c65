"""The compression-error budget over real processes (2 x 2 and a server): every rank measures
its buckets' errors in the same iteration, and every bucket over the budget is synchronized
uncompressed from then on, on every rank alike."""

import json

import numpy as np
import pytest

WORLD, STEPS = 4, 4  # iterations 0-3: the errors saved are those of iteration 2


@pytest.mark.timeout(200)
def test_buckets_over_the_error_budget_go_uncompressed_on_every_rank(tmp_path, cluster):
    # profile 1 step, plan at its end (no trials), measure at iteration 2, switch after it
    env = {"ESPRESSO_PROFILE_STEPS": "1", "ESPRESSO_TRIAL_STEPS": "0",
           "ESPRESSO_COMPRESSION_ERROR_EVERY": "2", "ESPRESSO_COMPRESSION_ERROR_BUDGET": "0.05"}
    with cluster.ps_job(servers=1) as root:
        cluster.run_workers("compression_error_worker.py", [str(tmp_path), str(STEPS)],
                            root_port=root, servers=1, timeout=150, extra_env=env)
    counts = {(tmp_path / f"compressed_{r}.txt").read_text() for r in range(WORLD)}
    assert len(counts) == 1, counts  # every rank switched in the same step
    per_step = [int(c) for c in counts.pop().split()]
    errors = [json.loads((tmp_path / f"errors_{r}.json").read_text()) for r in range(WORLD)]
    assert all(e == errors[0] for e in errors)  # the largest over ranks, on every rank
    # planned at the end of step 0, measured in iteration 2 (ESPRESSO_COMPRESSION_ERROR_EVERY)
    # and switched at its end; a 1-element bucket that random-k sends whole has no error and
    # stays compressed
    over = [n for n, e in errors[0].items() if e > 0.05]
    assert per_step[0] == per_step[1] > 0 and over
    assert per_step[2:] == [per_step[1] - len(over)] * (STEPS - 2)
    for step in range(STEPS):
        got = [np.load(tmp_path / f"params_{step}_{r}.npy") for r in range(WORLD)]
        assert all(np.array_equal(g, got[0]) for g in got), f"step {step}"
