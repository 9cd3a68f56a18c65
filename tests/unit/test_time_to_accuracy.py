"""Time to accuracy as the main job and benchmarks/e2e.py compute it from a run's files."""

import json

import pytest
from byteps_espresso.deploy.demo import (
    TARGET_FACTOR,
    RunResult,
    Startup,
    target_loss,
    target_note,
)


def _run(tmp_path, name, heldout, ends, log_lines=()):
    log = tmp_path / f"{name}.log"
    log.write_text("".join(f"{line}\n" for line in log_lines))
    metrics = {"history": [{"loss": 2.0, "samples_per_s": 10.0, "iteration_ms_median": 5.0}],
               "heldout": [{"step": s, "elapsed_s": t, "heldout_loss": v} for s, t, v in heldout],
               "steps_elapsed_s": ends}
    return RunResult(name, metrics, log)


def test_time_to_target_is_the_first_evaluation_at_or_below_it(tmp_path):
    run = _run(tmp_path, "r", [(0, 0.0, 7.6), (10, 1.5, 3.0), (20, 3.0, 1.9), (30, 4.5, 2.1)], [])
    assert run.time_to(2.0) == 3.0
    assert run.time_to(3.0) == 1.5  # "at or below"
    assert run.time_to(1.0) is None  # never
    assert run.final_heldout == 2.1
    assert target_note([run], 2.0) is None
    assert "already meets the target" in target_note([run], 8.0)  # 7.6 before training


def test_the_default_target_is_fp32s_final_loss_times_the_factor(tmp_path):
    fp32 = [_run(tmp_path, f"f{i}", [(0, 0.0, 7.0), (10, 1.0, v)], []) for i, v in
            enumerate((1.0, 1.2, 1.1))]
    assert target_loss(fp32, None) == pytest.approx(1.1 * TARGET_FACTOR)  # the median
    assert target_loss(fp32, 3.5) == 3.5
    with pytest.raises(ValueError, match="--target-loss"):
        target_loss([_run(tmp_path, "x", [], [])], None)


def test_startup_splits_profiling_planning_and_trials(tmp_path):
    # 3 profiled steps (the third plans: 0.25 s in the log), 2 finalists x 2 trial steps
    # (counted from trials.json's iterations, as a finalist may stop early)
    ends = [1.0, 2.0, 3.5, 4.0, 4.5, 5.0, 5.5, 6.0, 6.2]
    log = ["[worker 0] 2026 profiler: loaded the planner's kernels in 0.25 s and this "
           "cluster's trees in 0.04 s, timed the kernels alone in 0.01 s, before the first "
           "step", "[worker 1] x: planned in 99.0 ms:",
           "[worker 0] 2026 profiler: planned in 250.0 ms:"]
    run = _run(tmp_path, "e", [], ends, log)
    profile = tmp_path / "profile"
    profile.mkdir()
    (profile / "trials.json").write_text(json.dumps(
        {"steps": 2, "kept": "espresso", "finalists": [
            {"iteration_ms": [500.0, 500.0], "stopped_early": False},
            {"iteration_ms": [500.0, 500.0], "stopped_early": False}]}))
    s = run.startup(3, profile)
    # steps 0-2 profile (the last one plans), steps 3-6 are the trials, step 7 runs the kept
    assert s == Startup(3.25, 0.25, 2.0, before_s=0.3, steps=7)
    assert s.total_s == 5.5  # the end of the last trial step
    assert "5.5 s" in s.text(500.0) and "11 fp32 iterations" in s.text(500.0)
    assert ("before the first step: 0.30 s loading the planner and timing the kernels alone"
            in s.text(500.0))
    # fp32 took 3.0 s for the same 7 steps: 2.5 s beyond it, 5 of its 500 ms iterations
    fp32 = _run(tmp_path, "f", [], [0.5, 1.0, 1.5, 2.0, 2.5, 2.75, 3.0, 3.25])
    assert s.beyond_s(fp32) == pytest.approx(2.5)
    assert "2.5 s beyond fp32's first 7 steps (= 5)" in s.text(500.0, fp32)
    assert s.beyond_s(_run(tmp_path, "g", [], [1.0])) is None  # fp32 ran fewer steps
    # without trials the start-up ends with planning; fp32 has none
    assert run.startup(3, tmp_path / "none") == Startup(3.25, 0.25, 0.0, before_s=0.3, steps=3)
    assert run.startup(0, profile).total_s == 0.0
    assert Startup(0.0, 0.0, 0.0).text(5.0) == "none"


def test_startup_counts_the_plan_through_a_warm_up_before_the_trials(tmp_path):
    # 2 profiled steps (the second plans), the plan trains steps 2-4 through the compressor's
    # warm-up, the trials begin at step 5 (trials.json's "start"): 2 finalists x 1 step
    ends = [1.0, 2.0, 2.5, 3.0, 3.5, 4.5, 5.5, 6.0]
    run = _run(tmp_path, "w", [], ends, ["[worker 0] 2026 profiler: planned in 500.0 ms:"])
    profile = tmp_path / "profile"
    profile.mkdir()
    (profile / "trials.json").write_text(json.dumps(
        {"steps": 1, "start": 5, "kept": "espresso", "finalists": [
            {"iteration_ms": [1000.0]}, {"iteration_ms": [1000.0]}]}))
    s = run.startup(2, profile)
    assert s == Startup(1.5, 0.5, 2.0, warmup_s=1.5, steps=7)
    assert s.total_s == 5.5  # the end of step 6, the last trial
    assert "the plan through the compressor's warm-up 1.5" in s.text()
    # The start-up budget ran no trials after the warm-up: the plan, kept, ran from step 2
    (profile / "trials.json").write_text(json.dumps(
        {"steps": 1, "start": 5, "kept": "espresso", "finalists": [
            {"iteration_ms": []}, {"iteration_ms": []}]}))
    assert run.startup(2, profile) == Startup(1.5, 0.5, 0.0, steps=2)
