"""The README's main job, shrunk: fp32 then Espresso on the local 2 x 2 cluster, one server,
reported as time to a target held-out loss beside final loss, throughput and start-up."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_demo_trains_both_ways_and_reports(tmp_path):
    out = tmp_path / "demo"
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("DMLC_", "BYTEPS_", "ESPRESSO_", "CUDA_VISIBLE"))}
    env["ESPRESSO_PROFILE_STEPS"] = "2"
    env["ESPRESSO_TRIAL_STEPS"] = "2"  # 2 + up to 7 x 2 trial steps fit in the 18
    result = subprocess.run(
        [sys.executable, "-m", "byteps_espresso.deploy.demo", "--epochs", "2",
         "--steps-per-epoch", "9", "--eval-every", "3", "--local", "--out", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=360)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    text = result.stdout
    assert "== strategy in use" in text and "predicted iteration" in text
    trials = out / "profile" / "trials.json"
    if trials.exists():  # more than one finalist: the report shows what was measured
        kept = json.loads(trials.read_text())["kept"]
        assert "== measured trials" in text and f"{kept}" in text.split("<- kept")[0]
    assert "== time to accuracy: held-out loss <=" in text
    verdict = text.split("espresso vs fp32: ")[1].splitlines()[0]
    assert "final held-out loss" in verdict and "throughput" in verdict  # loss beside speed
    assert "start-up" in text and ("profiling" in text or "none" in text)
    assert "the strategy in use compresses" in text
    picture = Path(text.split("predicted-timeline picture: ")[1].split()[0])
    assert picture.is_file() and picture.stat().st_size > 10_000
    for run in ("fp32", "espresso"):
        metrics = json.loads((out / f"{run}.json").read_text())
        assert metrics["world_size"] == 4
        assert len(metrics["history"]) == 2
        assert all(r["loss"] > 0 and r["samples_per_s"] > 0 for r in metrics["history"])
        # held-out losses before the first step, every 3 steps and after the last (step 18)
        assert [e["step"] for e in metrics["heldout"]] == list(range(0, 19, 3))
        elapsed = [e["elapsed_s"] for e in metrics["heldout"]]
        assert elapsed == sorted(elapsed) and elapsed[-1] > 0
        assert len(metrics["steps_elapsed_s"]) == 18
        log = (out / f"{run}.log").read_text()
        assert "[scheduler]" in log and "[server 0]" in log and "[worker 3]" in log
    assert (out / "profile" / "strategy.json").is_file()
