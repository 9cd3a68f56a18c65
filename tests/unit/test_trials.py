"""Measured trials of the planner's finalists: which are tried, how they are timed, which is kept.

``Trials.choose`` runs over the in-memory transport with ranks as threads, so the exchange of
measured times (the slowest rank's count) is the real collective code path.
"""

import json
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
from byteps_espresso.worker.local_transport import LocalHub
from byteps_espresso.worker.optimizer import first_step_at
from byteps_espresso.worker.session import slowest_across_ranks
from byteps_espresso.worker.trials import Trials, settled_ms

from byteps_espresso.strategy import Cluster, Constraints, Strategy, Workload
from byteps_espresso.strategy.planner import (
    RESTRICTED,
    RUNNABLE_BASELINES,
    plan,
    plan_finalists,
)

WORLD = 4


@pytest.fixture(scope="module")
def inputs():
    return Workload.builtin("resnet50"), Cluster.preset(2, 2, "pcie", 10)


@pytest.fixture(scope="module")
def every(inputs):
    """Every runnable baseline is a finalist (no baseline is 1000x slower here)."""
    return plan_finalists(*inputs, "randomk", {"ratio": 0.01}, within=1000.0)


def test_finalists_start_with_the_plan_then_the_alternatives_fastest_first(inputs, every):
    planned = plan(*inputs, "randomk", {"ratio": 0.01})
    rest = every[1:]
    restricted = {f"espresso/{label}": plan(*inputs, "randomk", {"ratio": 0.01},
                                            constraints=Constraints.parse([label]))
                  for label in RESTRICTED}
    # The plan: the search's, or a restricted run's where that predicts faster.
    fastest = min([planned, *restricted.values()], key=lambda s: s.predicted_ms)
    assert every[0].algorithm == "espresso"
    assert every[0].options == fastest.options
    assert every[0].predicted_ms == pytest.approx(fastest.predicted_ms)
    assert every[0].predicted_ms <= planned.predicted_ms
    assert {s.algorithm for s in rest} <= set(RUNNABLE_BASELINES) | set(restricted)
    assert [s.predicted_ms for s in rest] == sorted(s.predicted_ms for s in rest)
    for s in rest:  # each priced as the plan reports it, with its own options
        if s.algorithm in restricted:
            assert s.options == restricted[s.algorithm].options
            assert s.predicted_ms == pytest.approx(restricted[s.algorithm].predicted_ms)
            assert s.constraints == restricted[s.algorithm].constraints
        else:
            assert s.predicted_ms == pytest.approx(planned.baselines[s.algorithm])
    assert len({tuple(map(str, s.options.values())) for s in every}) == len(every)
    assert "upper-bound" not in {s.algorithm for s in every}  # a bound, not a strategy


def test_a_restriction_the_user_already_set_is_not_planned_twice(inputs):
    some = plan_finalists(*inputs, "randomk", {"ratio": 0.01}, within=1000.0,
                          constraints=Constraints.parse(["no-gpu"]))
    names = [s.algorithm for s in some]
    assert "espresso/no-gpu" not in names
    assert all(not s.constraints.allow_gpu for s in some if s.algorithm.startswith("espresso"))


def test_finalists_are_the_baselines_predicted_within_the_factor(inputs, every):
    within = 1.1
    some = plan_finalists(*inputs, "randomk", {"ratio": 0.01}, within=within)
    limit = every[0].predicted_ms * within
    assert [s.algorithm for s in some] == [
        s.algorithm for s in every if s is every[0] or s.predicted_ms <= limit]
    assert len(some) < len(every)  # fp32 is about 2x the plan on this cluster
    only = plan_finalists(*inputs, "randomk", {"ratio": 0.01}, within=0.0)
    assert [s.algorithm for s in only] == ["espresso"]


def test_each_finalist_runs_its_steps_and_the_warm_up_is_not_counted(every):
    trials = Trials(every[:2], steps=4)
    assert trials.current is every[0]
    for s in (0.005, 0.030, 0.010, 0.020):  # a 5 ms warm-up, faster than any later
        trials.record(s)
    assert trials.current is every[1] and not trials.done
    for s in (0.500, 0.040, 0.020, 0.030):  # a 500 ms warm-up (new keys)
        trials.record(s)
    assert trials.done
    # each finalist's mean after its warm-up, the slowest left out
    np.testing.assert_allclose(trials.measured_ms(), [15.0, 25.0])
    with pytest.raises(RuntimeError, match="choose"):
        trials.record(0.01)


def test_a_measured_time_is_the_mean_after_the_warm_up_without_the_slowest():
    assert settled_ms([1.0, 30.0, 12.0, 20.0, 16.0]) == 16.0  # (12 + 20 + 16) / 3
    assert settled_ms([5.0, 30.0, 10.0]) == 10.0
    assert settled_ms([5.0, 30.0]) == 30.0  # the warm-up never counts, however fast
    with pytest.raises(ValueError, match="after the warm-up"):
        settled_ms([5.0])


@pytest.mark.parametrize(("finalists", "steps", "match"),
                         [(1, 3, "two finalists"), (2, 1, "ESPRESSO_TRIAL_STEPS")])
def test_bad_trials_say_what_to_change(every, finalists, steps, match):
    with pytest.raises(ValueError, match=match):
        Trials(every[:finalists], steps)


def _session(hub: LocalHub, rank: int, out):
    runtime = SimpleNamespace(transports=[hub.transport(rank)],
                              topology=SimpleNamespace(rank=rank, world_size=WORLD),
                              cfg=SimpleNamespace(profile_out=out))
    return SimpleNamespace(runtime=runtime)


def test_every_rank_keeps_the_finalist_fastest_on_its_slowest_rank(tmp_path, every, on_every_rank):
    finalists = every[:3]
    # Per rank, per finalist, ms after the warm-up. Rank 0 alone would keep finalist 0; the
    # slowest rank per finalist reads 40, 25 and 30 ms, so finalist 1 is kept everywhere.
    ms = {0: [10, 25, 30], 1: [40, 12, 11], 2: [12, 12, 12], 3: [11, 11, 30]}

    def run(hub, rank):
        trials = Trials(finalists, steps=2)
        for t in ms[rank]:
            trials.record(1.0)  # warm-up
            trials.record(t / 1e3)
        session = _session(hub, rank, str(tmp_path) if rank == 0 else None)
        return trials.choose(session).algorithm

    kept = on_every_rank(run)
    assert set(kept.values()) == {finalists[1].algorithm}
    written = json.loads((tmp_path / "trials.json").read_text())
    assert written["kept"] == finalists[1].algorithm
    assert [f["measured_ms"] for f in written["finalists"]] == pytest.approx([40, 25, 30])
    assert [f["algorithm"] for f in written["finalists"]] == [s.algorithm for s in finalists]
    assert all(len(f["iteration_ms"]) == 2 for f in written["finalists"])
    saved = Strategy.load(tmp_path / "strategy.json")
    assert saved.options == finalists[1].options and saved.algorithm == finalists[1].algorithm


def _race(hub, rank, tmp_path, trials, ms):
    """Run ``trials`` to the end on ``rank``, each finalist's first iteration 1 s, then
    ``ms(rank, finalist)``; returns (the finalist of each iteration, the one kept)."""
    session = _session(hub, rank, str(tmp_path) if rank == 0 else None)
    seen = []
    while not trials.done:
        finalist = trials.index
        first = not trials.times_ms[finalist]
        trials.record(1.0 if first else ms(rank, finalist) / 1e3, session)
        seen.append(finalist)
    return seen, trials.choose(session).algorithm


def test_a_finalist_trailing_on_any_rank_stops_early_on_every_rank(tmp_path, every,
                                                                  on_every_rank):
    finalists = every[:3]
    # ms after a 1 s warm-up, per finalist: the plan 10 ms on every rank; finalist 1 at
    # 10 ms except on rank 2 (20 ms: over 1.3 x 10 on the slowest rank, so it stops after
    # its 2nd timed iteration everywhere); finalist 2 at 12 ms (within 1.3x: all 5 run).
    def ms(rank, finalist):
        return {0: 10.0, 1: 20.0 if rank == 2 else 10.0, 2: 12.0}[finalist]

    runs = on_every_rank(lambda hub, rank: _race(hub, rank, tmp_path, Trials(finalists, 6),
                                                  ms))
    assert {tuple(seen) for seen, _ in runs.values()} == {(0,) * 6 + (1,) * 3 + (2,) * 6}
    assert {kept for _, kept in runs.values()} == {finalists[0].algorithm}
    written = json.loads((tmp_path / "trials.json").read_text())
    assert [f["stopped_early"] for f in written["finalists"]] == [False, True, False]
    assert [len(f["iteration_ms"]) for f in written["finalists"]] == [6, 3, 6]


def test_the_first_finalist_races_against_the_profiled_fp32_iterations(tmp_path, every,
                                                                       on_every_rank):
    finalists = every[:2]
    # The profiled fp32 iterations took 10 ms (slowest rank). The plan runs 20 ms on rank 1
    # (over 1.3 x 10): it stops after 2 timed iterations on every rank; finalist 1 at 12 ms
    # runs all 5 and is kept. Without the yardstick the plan would run its 6.
    def ms(rank, finalist):
        return {0: 20.0 if rank == 1 else 10.0, 1: 12.0}[finalist]

    def run(hub, rank, fp32_ms):
        return _race(hub, rank, tmp_path, Trials(finalists, 6, fp32_ms=fp32_ms), ms)

    runs = on_every_rank(lambda hub, rank: run(hub, rank, 10.0))
    assert {tuple(seen) for seen, _ in runs.values()} == {(0,) * 3 + (1,) * 6}
    assert {kept for _, kept in runs.values()} == {finalists[1].algorithm}
    assert json.loads((tmp_path / "trials.json").read_text())["finalists"][0]["stopped_early"]
    runs = on_every_rank(lambda hub, rank: run(hub, rank, None))
    assert {tuple(seen) for seen, _ in runs.values()} == {(0,) * 6 + (1,) * 6}


def test_the_profiled_iterations_measure_the_fp32_finalist(tmp_path, every, on_every_rank):
    finalists = [s for s in every if s.algorithm in ("espresso", "fp32", "all-gpu")]
    assert [s.algorithm for s in finalists[:1]] == ["espresso"] and len(finalists) == 3
    fp32 = next(i for i, s in enumerate(finalists) if s.algorithm == "fp32")
    ms = {i: 12.0 + i for i in range(3)}

    def run(hub, rank):
        return _race(hub, rank, tmp_path, Trials(finalists, 4, fp32_ms=11.0),
                     lambda rank, finalist: ms[finalist])

    runs = on_every_rank(run)
    # fp32 trains no trial iterations and, at 11 ms, is the fastest: kept everywhere
    others = [i for i in range(3) if i != fp32]
    assert {tuple(seen) for seen, _ in runs.values()} == {(others[0],) * 4 + (others[1],) * 4}
    assert {kept for _, kept in runs.values()} == {"fp32"}
    written = json.loads((tmp_path / "trials.json").read_text())["finalists"]
    assert [f["profiled"] for f in written] == [i == fp32 for i in range(3)]
    assert written[fp32]["iteration_ms"] == [] and written[fp32]["measured_ms"] == 11.0
    with pytest.raises(ValueError, match="did not measure"):
        Trials([finalists[fp32]] * 2, 4, fp32_ms=11.0)


def test_trials_of_two_timed_iterations_are_never_cut_short(every, on_every_rank):
    def run(hub, rank):
        trials = Trials(every[:2], steps=3)  # 2 timed iterations: nothing left to save
        for s in (1.0, 0.01, 0.01, 1.0, 0.5, 0.5):  # finalist 1 trails 50x
            trials.record(s, _session(hub, rank, None))
        return trials.done, trials.stopped

    assert set(map(repr, on_every_rank(run).values())) == {repr((True, set()))}


def test_a_tie_keeps_the_planned_strategy(every, on_every_rank):
    def run(hub, rank):
        trials = Trials(every[:2], steps=2)
        for _ in range(2):
            trials.record(0.5)
            trials.record(0.02)
        return trials.choose(_session(hub, rank, None)).algorithm

    assert set(on_every_rank(run).values()) == {"espresso"}


def test_choosing_before_every_finalist_ran_is_an_error(every):
    trials = Trials(every[:2], steps=2)
    trials.record(0.1)
    with pytest.raises(RuntimeError, match="still being measured"):
        trials.choose(None)


def test_slowest_across_ranks_is_the_elementwise_maximum(on_every_rank):
    def run(hub, rank):
        values = np.array([[rank, -rank], [np.nan if rank == 2 else 1.0, 0.5]])
        return slowest_across_ranks(_session(hub, rank, None), values)

    for got in on_every_rank(run).values():
        assert got.shape == (2, 2)
        np.testing.assert_array_equal(got[0], [3.0, 0.0])
        assert np.isnan(got[1, 0]) and got[1, 1] == 0.5


def _priced(finalists, *predicted_ms):
    return [replace(s, predicted_ms=ms) for s, ms in zip(finalists, predicted_ms, strict=True)]


def test_the_start_up_budget_leaves_out_finalists_that_do_not_fit(tmp_path, every, on_every_rank):
    finalists = _priced(every[:3], 10.0, 10.0, 10.0)
    # Budget 10 fp32 iterations of 20 ms: 200 ms from the first step. The slowest rank began
    # the trials 130 ms after it, so 70 ms are left. The plan's 3 iterations, unmeasured and
    # priced at its 10 ms prediction x MODEL_ERROR (25 ms), capped at fp32's 20, fit (60 ms);
    # it measures 15 ms, 1.5x its prediction, so the next finalist is priced at 15 ms:
    # 45 spent + 45 > 70, and neither of the others runs.
    def run(hub, rank):
        session = _session(hub, rank, str(tmp_path) if rank == 0 else None)
        trials = Trials(finalists, 3, fp32_ms=20.0, budget=10.0)
        trials.begin(session, 0.100 + 0.010 * rank)
        seen = []
        while not trials.done:
            seen.append(trials.index)
            trials.record(0.015, session)
        return seen, trials.left_ms, trials.choose(session).algorithm

    runs = on_every_rank(run)
    assert {repr(r) for r in runs.values()} == {repr(([0, 0, 0], 70.0, "espresso"))}
    written = json.loads((tmp_path / "trials.json").read_text())
    assert [f["measured_ms"] for f in written["finalists"]] == [15.0, None, None]
    assert written["budget"] == 10.0 and written["budget_left_ms"] == 70.0


def test_a_budget_spent_before_the_trials_keeps_the_plan_untried(tmp_path, every, on_every_rank):
    fp32 = next(s for s in every if s.algorithm == "fp32")
    finalists = _priced([every[0], every[1], fp32], 10.0, 12.0, 10.0)
    # Nothing measured yet: the plan's 3 iterations are priced at its 10 ms prediction x
    # MODEL_ERROR, at most the 20 ms of the profiled fp32 iterations: 60 ms, over the 50 left.
    def run(hub, rank, elapsed_s):
        session = _session(hub, rank, str(tmp_path) if rank == 0 else None)
        trials = Trials(finalists, 3, fp32_ms=20.0, budget=10.0)
        trials.begin(session, elapsed_s)
        done = trials.done
        return done, trials.choose(session).algorithm if done else None

    runs = on_every_rank(lambda hub, rank: run(hub, rank, 0.150))
    assert set(runs.values()) == {(True, "espresso")}
    written = json.loads((tmp_path / "trials.json").read_text())["finalists"]
    assert [f["measured_ms"] for f in written] == [None, None, 20.0]
    # 60 ms fit in 70: the plan runs
    assert set(on_every_rank(lambda hub, rank: run(hub, rank, 0.130)).values()) == {
        (False, None)}


def test_the_budget_counts_in_the_fastest_rank_s_fp32_iteration(tmp_path, every, on_every_rank):
    fp32 = next(s for s in every if s.algorithm == "fp32")
    finalists = _priced([every[0], every[1], fp32], 10.0, 12.0, 10.0)
    # The slowest rank's fastest fp32 iteration is 20 ms, the fastest rank's 18: the budget
    # is 180 ms, 50 left after 130 spent, and the plan's 3 iterations at 20 ms do not fit
    # (with 20-ms units 70 would be left and they would).
    def run(hub, rank):
        session = _session(hub, rank, str(tmp_path) if rank == 0 else None)
        trials = Trials(finalists, 3, fp32_ms=20.0, budget=10.0, budget_unit_ms=18.0)
        trials.begin(session, 0.100 + 0.010 * rank)
        return trials.done, trials.left_ms

    runs = list(on_every_rank(run).values())
    assert [done for done, _ in runs] == [True] * WORLD
    assert [left for _, left in runs] == pytest.approx([50.0] * WORLD)


def test_without_a_budget_or_the_fp32_time_every_finalist_runs(every):
    for trials in (Trials(every[:2], 2, fp32_ms=20.0, budget=None),
                   Trials(every[:2], 2, fp32_ms=None, budget=10.0)):
        trials.begin(None, 1e6)  # no exchange either: nothing to decide
        assert trials.left_ms is None and trials.current is every[0]


def test_the_first_step_begins_at_the_first_zero_grad_or_before_its_first_gradient():
    # built at 0.0; iterations 1 and 2 began at 1.0 and 2.0 and reached their first gradient
    # 0.1 and 0.3 s later (median 0.2); iteration 0's first gradient came at 0.8
    starts, ready = [0.0, 1.0, 2.0], [{"a": 0.8, "b": 0.9}, {"a": 1.1}, {"a": 2.3, "b": 2.4}]
    assert first_step_at(starts, ready, None) == pytest.approx(0.6)
    assert first_step_at(starts, ready, 0.5) == 0.5  # zero_grad() came earlier
    assert first_step_at(starts, ready, 0.7) == pytest.approx(0.6)  # the earlier of the two
    assert first_step_at(starts, [{"a": 0.1}, {"a": 1.5}, {"a": 2.5}], None) == 0.0  # built
    assert first_step_at(starts, [{}, {}], None) == 0.0  # nothing seen
