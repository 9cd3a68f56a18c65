"""benchmarks/ddp.py over real jobs: the no-synchronization floor (``local``) beside DDP, and
a run that fails is recorded and left out, not the end of the benchmark."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "ddp.py"


@pytest.mark.timeout(400)
def test_floor_beside_ddp_and_a_failed_run_is_recorded(tmp_path):
    out = tmp_path / "ddp.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--settings", "loopback", "--models", "mlp",
         "--variants", "local", "ddp", "espresso-nosuchcompressor", "--repeats", "1",
         "--steps", "6", "--eval-every", "3", "--json", str(out), "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=360)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = {r["variant"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"local", "ddp", "espresso-nosuchcompressor"}, rows
    local, ddp = rows["local"], rows["ddp"]
    for row in (local, ddp):
        assert row["failed_runs"] == [] and row["iteration_ms"] > 0, row
        assert [e["step"] for e in row["evals"][0]] == [0, 3, 6], row["evals"]
        # the runtime's set-up (the slowest rank's) is on the training clock from step 0
        assert row["setup_s"] > 0 and row["first_iteration_ms"] > 0, row
        assert row["evals"][0][0]["train_s"] == row["setup_s"], row["evals"]
        # no planner, no check: nothing predicted, nothing refitted
        assert row["predicted_ms"] is None and row["refitted_ms"] is None, row
    # The floor trains rank 0 on its own batches: it learns, but it is not DDP's run, so
    # it gets no time to DDP's target; DDP itself reaches its own final loss.
    assert local["evals"][0][-1]["heldout_loss"] < local["evals"][0][0]["heldout_loss"]
    assert local["time_to_target_s"] is None and ddp["time_to_target_s"] is not None
    failed = rows["espresso-nosuchcompressor"]
    assert failed["iteration_ms"] is None and len(failed["failed_runs"]) == 1, failed
    assert "espresso-nosuchcompressor-0.log" in failed["failed_runs"][0], failed
    assert "every run failed" in proc.stdout, proc.stdout
    log = (tmp_path / "mlp-loopback-espresso-nosuchcompressor-0.log").read_text()
    assert "nosuchcompressor" in log and "Error" in log, log[-2000:]


@pytest.mark.timeout(400)
def test_a_kept_variant_trains_the_strategy_its_planned_run_kept(tmp_path):
    out = tmp_path / "ddp.json"
    # Listed first, the -kept variant has no strategy in the first round: recorded as failed.
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--settings", "loopback", "--models", "mlp",
         "--variants", "espresso-efsignsgd-kept", "espresso-efsignsgd", "--repeats", "2",
         "--steps", "8", "--eval-every", "4", "--json", str(out), "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=360)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = {r["variant"]: r for r in json.loads(out.read_text())["rows"]}
    kept, planned = rows["espresso-efsignsgd-kept"], rows["espresso-efsignsgd"]
    assert planned["failed_runs"] == [], planned
    assert len(kept["failed_runs"]) == 1, kept
    assert "list espresso-efsignsgd before espresso-efsignsgd-kept" in kept["failed_runs"][0]
    # The second round trained the strategy the first planned run kept, from its first step:
    # its prediction is that file's, and nothing was profiled, planned or tried.
    saved = json.loads(
        (tmp_path / "mlp-loopback-espresso-efsignsgd-0-profile" / "strategy.json").read_text())
    assert kept["predicted_ms"] == saved["predicted_iteration_ms"], (kept, saved)
    assert kept["iteration_ms"] > 0 and kept["evals"][0][-1]["step"] == 8, kept
    assert (tmp_path / "mlp-loopback-espresso-efsignsgd-1-profile" / "trials.json").exists()
    assert not (tmp_path / "mlp-loopback-espresso-efsignsgd-kept-1-profile").exists()
