"""benchmarks/check_reads.py on a made-up ddp.py result: which checked iterations it reads and
what each reduction gives against the run's median iteration."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "check_reads.py"


def _check(stayed: str) -> dict:
    def entry(algorithm, times):
        return {"algorithm": algorithm, "iteration_ms": times, "measured_ms": 1.0,
                "options": {"a": "PushPull(flat)"}}
    return {"stayed": stayed, "kept": entry("espresso", [90.0, 40.0, 40.0, 60.0]),
            "replanned": entry("allreduce-c", [80.0, 10.0, 30.0, 20.0, 60.0]), "then": []}


def test_each_run_reads_the_checked_iterations_of_the_strategy_it_trained_on(tmp_path):
    result = {"rows": [{"model": "m", "setting": "1", "variant": "espresso-fp16",
                        "iteration_ms_runs": [40.0, 20.0]},
                       {"model": "m", "setting": "1", "variant": "ddp", "iteration_ms_runs": [9]}]}
    for rep, stayed in enumerate(("kept", "allreduce-c")):
        folder = tmp_path / f"m-1-espresso-fp16-{rep}-profile"
        folder.mkdir()
        (folder / "check.json").write_text(json.dumps(_check(stayed)))
    (tmp_path / "r.json").write_text(json.dumps(result))
    out = tmp_path / "reads.json"
    subprocess.run([sys.executable, str(SCRIPT), str(tmp_path / "r.json"), "--profiles",
                    str(tmp_path / "{model}-{setting}-{variant}-{rep}-profile"), "--json",
                    str(out)], check=True, capture_output=True, timeout=120)
    kept, fallback = json.loads(out.read_text())["rows"]  # the ddp row is not a planned run
    # kept: 40, 40, 60 after the warm-up against a 40 ms run
    assert (kept["stayed"], kept["median"], kept["fastest"]) == ("kept", 1.0, 1.0)
    assert kept["mean"] == pytest.approx(140 / 3 / 40) and kept["settled_ms"] == 1.0
    # the fall-back: 10, 30, 20, 60 against a 20 ms run; without the slowest, (10+30+20)/3
    assert (fallback["stayed"], fallback["fastest"], fallback["settled_ms"]) == \
        ("allreduce-c", 0.5, 1.0)
