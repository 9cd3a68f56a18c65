"""The check of the kept strategy (worker/check.py): step timings reduced over ranks, the
iteration's measured time, the record, and the refit and re-plan of ``EspressoSpec``.

The reductions run over the in-memory transport with ranks as threads, as the trials' do, so
the exchange is the real collective code path.
"""

import json
import math
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
from byteps_espresso.worker.check import (
    REPLAN_GAIN,
    Check,
    Run,
    check_record,
    check_text,
    cores_ms,
    step_medians,
    write_check,
)
from byteps_espresso.worker.local_transport import LocalHub
from byteps_espresso.worker.profiler import EspressoSpec, step_prices
from byteps_espresso.worker.session import span_across_ranks

from byteps_espresso.strategy import Cluster, CompressorCosts, Option, Workload
from byteps_espresso.strategy.buckets import Bucket
from byteps_espresso.strategy.context import PlanContext
from byteps_espresso.strategy.costs import EXCHANGES, INTER, INTRA, CompressedSizes, link_of
from byteps_espresso.strategy.options import Kind
from byteps_espresso.strategy.planner import plan_bucketed

WORLD = 4
PUSH_PULL = Option.parse("PushPull(flat)")
PUSH_PULLS = {Kind.PUSH_PULL, Kind.PUSH_PULL_C}
ROOTED = {Kind.REDUCE, Kind.BROADCAST, Kind.BROADCAST_C, Kind.GATHER_C}
HIER = Option.parse("Reduce(intra) -> PushPull(inter) -> Broadcast(intra)")
SUMMED = Option.parse("Comp(gpu) -> AllreduceC(flat) -> Decomp(gpu)")
A = (Bucket.of(["a"]),)  # the layout of the strategies below: one gradient, "a"


def _session(hub: LocalHub, rank: int):
    runtime = SimpleNamespace(transports=[hub.transport(rank)],
                              topology=SimpleNamespace(rank=rank, world_size=WORLD))
    return SimpleNamespace(runtime=runtime)


def test_step_medians_leave_out_each_run_s_first_iteration():
    timings = [("a", 4, 0, 9.0), ("a", 5, 0, 0.001), ("a", 6, 0, 0.003), ("a", 7, 0, 0.002),
               ("a", 4, 1, 1.0), ("b", 6, 0, 5.0)]  # b: its warm-up only
    assert step_medians(timings) == pytest.approx({("a", 0): 2000.0})


def _executor(timings, runs):
    return SimpleNamespace(timings=list(timings), timed_runs=dict(runs))


def test_runs_take_each_step_s_fastest_and_slowest_rank_and_stop_the_timing(on_every_rank):
    """On a collective the member that arrived last measured the step itself: the minimum
    over ranks; the maximum is the step as the first member to arrive saw it. Rank r's step
    i of bucket ``a`` took (10 + r + i) ms after a 1 s warm-up, where the odd ranks sleep
    through step 1 (NaN: a non-root's step of a rooted Option), so it is what ranks 0 and 2
    took; step 2 of the hierarchical run was never timed (NaN)."""
    def run(hub, rank):
        session = _session(hub, rank)
        a = [("a", it, i, (1.0 if it == 0 else math.nan if i == 1 and rank % 2
                           else (10 + rank + i) / 1e3))
             for it in range(3) for i in range(2)]
        b = [("b", it, 0, (1.0 if it == 0 else (20 - rank) / 1e3)) for it in range(3)]
        ex = [_executor(a, {"a": (HIER, 100)}), _executor(b, {"b": (PUSH_PULL, 7)})]
        check = Check(None, 3, 0, ex)
        runs = check.runs(session)
        assert all(e.timings is None and e.timed_runs == {} for e in ex)
        return runs

    for runs in on_every_rank(run).values():
        assert [(r.name, r.option, r.numel) for r in runs] == [("a", HIER, 100),
                                                               ("b", PUSH_PULL, 7)]
        np.testing.assert_allclose(runs[0].steps_us, [10_000.0, 11_000.0, np.nan])
        np.testing.assert_allclose(runs[1].steps_us, [17_000.0])
        # the first member to arrive waited for the last: each step's slowest rank
        np.testing.assert_allclose(runs[0].slowest_us, [13_000.0, 13_000.0, np.nan])
        np.testing.assert_allclose(runs[1].slowest_us, [20_000.0])


def test_the_span_across_ranks_leaves_out_the_ranks_without_a_value(on_every_rank):
    """Minimum and maximum over the ranks that hold a value; NaN where none does."""
    def run(hub, rank):
        values = np.array([rank, math.nan if rank % 2 else 10.0 * rank, math.nan])
        return span_across_ranks(_session(hub, rank), values)

    for fastest, slowest in on_every_rank(run).values():
        np.testing.assert_array_equal(fastest, [0.0, 0.0, np.nan])
        np.testing.assert_array_equal(slowest, [WORLD - 1.0, 10.0 * (WORLD - 2), np.nan])


def test_ranks_that_timed_different_runs_all_skip_the_refit(on_every_rank):
    def run(hub, rank):
        session = _session(hub, rank)
        name = "b" if rank == 2 else "a"
        timings = [(name, it, 0, 0.01) for it in range(3)]
        return Check(None, 3, 0, [_executor(timings, {name: (PUSH_PULL, 5)})]).runs(session)

    assert set(on_every_rank(run).values()) == {None}


def test_the_measured_iteration_is_the_slowest_rank_s_settled_time(on_every_rank):
    def run(hub, rank):
        session = _session(hub, rank)
        check = Check(None, 4, 0, [])
        # after the warm-up: 10 + rank, 30 and 14 + rank ms; without the slowest, a mean of
        # 12 + rank ms, and a median of 14 + rank ms
        times = [0.001, 0.010 + rank / 1e3, 0.030, 0.014 + rank / 1e3]
        done = [check.record(t) for t in times]
        assert done == [False, False, False, True]
        return check.measure(session), check.measured_ms, check.median_ms

    assert list(on_every_rank(run).values()) == [pytest.approx((15.0, 15.0, 17.0))] * WORLD


def test_the_check_records_every_rank_s_cpu_and_the_servers_beside_rank_0(on_every_rank,
                                                                          tmp_path):
    def run(hub, rank):
        session = _session(hub, rank)
        # rank 0 reads the servers' CPU seconds after the warm-up and after the last one
        readings = iter([10.0, 10.09])
        check = Check(SimpleNamespace(algorithm="espresso", predicted_ms=20.0,
                                      options={"a": PUSH_PULL}, layout=A), 4, 0, [],
                      servers_cpu=(lambda: next(readings)) if rank == 0 else None)
        # CPU ms per iteration after the warm-up: 3 + rank, 9, 4 + rank (median 4 + rank)
        for t, cpu in [(0.05, 0.5), (0.02, 0.003 + rank / 1e3), (0.02, 0.009),
                       (0.02, 0.004 + rank / 1e3)]:
            check.record(t, cpu)
        check.measure(session)
        return check

    checks = on_every_rank(run)
    for check in checks.values():
        assert check.cpu_ms == pytest.approx([4.0, 5.0, 6.0, 7.0])
    assert checks[0].servers_cpu_ms == pytest.approx(30.0)  # 90 ms over 3 iterations
    assert {checks[r].servers_cpu_ms for r in (1, 2, 3)} == {None}
    record = check_record(checks[0], [], "kept", {"cpus": 2, "ranks": 4})
    write_check(tmp_path, record)
    written = json.loads((tmp_path / "check.json").read_text())
    assert written["host"] == {"cpus": 2, "ranks": 4}
    assert written["kept"]["cpu_ms"] == pytest.approx([4.0, 5.0, 6.0, 7.0])
    assert written["kept"]["servers_cpu_ms"] == pytest.approx(30.0)
    # the cores' floor: (4 ranks x 5.5 ms + 30 ms of the servers) over 2 cores
    assert cores_ms(written["kept"], written["host"]) == pytest.approx(26.0)
    assert "(its CPU time allows no less than 26.0 ms on the 2 cores 4 ranks share)" in \
        check_text(record)
    assert cores_ms(written["kept"], {}) is None  # a record without the host


def test_a_failed_reading_of_the_servers_leaves_their_cpu_out():
    readings = iter([math.nan, 10.0])  # the servers did not answer after the warm-up
    check = Check(None, 3, 0, [], servers_cpu=lambda: next(readings))
    assert [check.record(0.01, 0.005) for _ in range(3)] == [False, False, True]
    assert check.servers_cpu_ms is None


def test_the_record_and_the_log_line_say_what_stayed(tmp_path):
    kept_strategy = SimpleNamespace(algorithm="espresso", predicted_ms=40.0,
                                    options={"a": PUSH_PULL}, layout=A)
    kept = Check(kept_strategy, 3, 12, [], times_ms=[90.0, 60.0, 62.0], measured_ms=61.0,
                 info={"factors": {"ps": 3.0}, "others_factor": 3.0, "kept_refitted_ms": 58.0,
                       "replanned_predicted_ms": 45.0, "replan_ms": 20.0})
    again = Check(_with_option(kept_strategy, HIER), 3, 15, [], against=kept,
                  times_ms=[80.0, 50.0, 52.0], measured_ms=51.0)
    record = check_record(kept, [again], "replanned")
    write_check(tmp_path, record)
    written = json.loads((tmp_path / "check.json").read_text())
    assert written == json.loads(json.dumps(record))
    assert written["kept"]["options"] == {"a": str(PUSH_PULL)}
    assert written["replanned"]["options"] == {"a": str(HIER)}
    assert written["kept"]["buckets"] == written["replanned"]["buckets"] == [["a"]]
    assert (written["start"], written["stayed"], written["factors"]) == (12, "replanned",
                                                                          {"ps": 3.0})
    text = check_text(record)
    assert "measured 61.0 ms, predicted 40.0 ms (-34%)" in text
    assert "ps x3.00" in text and "-> predicted 58.0 ms (-5%)" in text
    assert "measured 51.0 ms: the replanned strategy stays" in text
    alone = check_text(check_record(kept, [], "kept"))
    assert alone.endswith(f"(a switch needs {REPLAN_GAIN:.0%} less), the kept strategy stays")


def test_the_log_line_says_the_fp32_path_measured_faster_and_was_checked_next():
    kept_strategy = SimpleNamespace(algorithm="espresso", predicted_ms=97.0,
                                    options={"a": HIER}, layout=A)
    fp32_strategy = SimpleNamespace(algorithm="fp32", predicted_ms=113.8,
                                    options={"a": PUSH_PULL}, layout=A)
    kept = Check(kept_strategy, 3, 4, [], times_ms=[212.0, 206.0, 190.0], measured_ms=206.0,
                 info={"fp32_ms": 131.3})
    fp32 = Check(fp32_strategy, 3, 7, [], against=kept, times_ms=[140.0, 128.0, 127.0],
                 measured_ms=128.0)
    record = check_record(kept, [fp32], "fp32")
    assert (record["fp32_ms"], record["replanned"]["algorithm"]) == (131.3, "fp32")
    text = check_text(record)
    assert ("measured 206.0 ms, predicted 97.0 ms (-53%); the profiled fp32 iterations "
            "measured 131.3 ms: the fp32 path is checked next, nothing refitted, measured "
            "128.0 ms: the fp32 strategy stays") == text.split("iterations: ", 1)[1]


def test_the_record_lists_every_fall_back_checked_after_the_kept_strategy(tmp_path):
    """fp16's kept plan measured slow: DDP's fp16-hook plan (allreduce-c) checked next, then
    the fp32 path, which the profile measured faster than both."""
    kept_strategy = SimpleNamespace(algorithm="espresso", predicted_ms=26.9,
                                    options={"a": HIER}, layout=A)
    summed = Check(SimpleNamespace(algorithm="allreduce-c", predicted_ms=30.0,
                                   options={"a": SUMMED}, layout=A), 3, 7, [],
                   times_ms=[40.0, 33.0, 34.0], measured_ms=34.0)
    fp32 = Check(SimpleNamespace(algorithm="fp32", predicted_ms=44.4,
                                 options={"a": PUSH_PULL}, layout=A), 3, 10, [], against=summed,
                 times_ms=[40.0, 31.0, 32.0], measured_ms=32.0)
    kept = Check(kept_strategy, 3, 4, [], times_ms=[50.0, 43.0, 44.0], measured_ms=43.2,
                 info={"fallback": "allreduce-c"})
    record = check_record(kept, [summed, fp32], "fp32")
    write_check(tmp_path, record)
    written = json.loads((tmp_path / "check.json").read_text())
    assert written["replanned"]["options"] == {"a": str(SUMMED)}
    assert [c["algorithm"] for c in written["then"]] == ["fp32"]
    assert ("measured 43.2 ms, predicted 26.9 ms (-38%); allreduce-c is checked next, nothing "
            "refitted, measured 34.0 ms, then fp32 measured 32.0 ms: the fp32 strategy "
            "stays") == check_text(record).split("iterations: ", 1)[1]


def _with_option(strategy, option):
    return SimpleNamespace(**{**vars(strategy), "options": {"a": option}})


# ---- the refit and the re-plan (rank 0's part of EspressoSpec.replan) ----------------------
@pytest.fixture(scope="module", params=["fp32", "espresso"])
def planned(request):
    """The LSTM's profile on 2 x 2 workers and a server, randomk 1%, planned as the start-up
    plans it (lanes 2): BytePS' path (exchanges inside the machine and push/pulls across)
    or the planner's (exchanges)."""
    workload = Workload.builtin("lstm")
    cluster = Cluster.preset(2, 2, "pcie", 10.0, servers=1, lanes=2)
    costs = CompressorCosts.default()
    buckets, _, (kept,) = plan_bucketed(workload, cluster, "randomk", {"ratio": 0.01},
                                        within=None, algorithm=request.param, costs=costs)
    return workload, costs, replace(kept, buckets=buckets if any(b.fused for b in buckets)
                                    else ())


def _steps(cluster, option, numel, costs):
    return step_prices(cluster, option, [numel], compressor="randomk",
                       sizes=CompressedSizes("randomk", {"ratio": 0.01}), costs=costs)[0]


@pytest.mark.parametrize("truth", [
    {"server_latency_us": 5.0, "exchange_latency": 4.0},
    {"server_latency_us": 3.0, "rooted_latency": 6.0, "exchange_latency": 2.0,
     "inter_exchange_latency": 7.0}])
def test_the_refit_finds_what_the_steps_took_and_a_switch_needs_the_gain(planned, truth):
    """Every timed step took its price on a cluster whose latencies of one or two kinds are
    a few times the planned ones: the refit finds those factors for the kinds the kept
    strategy runs, prices the kept strategy on the refitted cluster, and proposes the
    re-plan only where it is predicted REPLAN_GAIN faster."""
    workload, costs, kept = planned
    base = replace(kept.cluster, server_latency_us=kept.cluster.ps_latency_us)
    scaled = replace(base, **{k: getattr(base, k) * f for k, f in truth.items()})
    fused = {t.name: t.numel for t in kept.workload.tensors}
    runs = [Run(n, o, fused[n], *[_steps(scaled, o, fused[n], costs)] * 2)
            for n, o in kept.options.items()]
    spec = EspressoSpec("randomk", {"ratio": 0.01})  # the trials may keep a baseline
    spec._planned[frozenset(workload.names)] = (workload, costs, frozenset(), (0, 1 << 20))
    new, info = spec._replanned(kept, runs)
    names = {"server_latency_us": "ps", "exchange_latency": "exchange",
             "inter_exchange_latency": "inter_exchange", "rooted_latency": "rooted"}
    assert set(info["factors"]) == {kind for kind, members, links in (
        ("ps", PUSH_PULLS, (INTRA, INTER)), ("exchange", EXCHANGES, (INTRA,)),
        ("inter_exchange", EXCHANGES, (INTER,)), ("rooted", ROOTED, (INTRA, INTER)))
        if any(s.kind in members and link_of(base, s.scope) in links
               for o in kept.options.values() for s in o.steps)}
    # BytePS' path refits two kinds at once: each from its own steps
    assert len(info["factors"]) >= (2 if kept.algorithm == "fp32" else 1)
    for field, factor in truth.items():
        if names[field] in info["factors"]:
            assert info["factors"][names[field]] == pytest.approx(factor, rel=1e-6)
    assert all(f == pytest.approx(1.0) for kind, f in info["factors"].items()
               if kind not in {names[field] for field in truth})
    assert info["others_factor"] == pytest.approx(max(info["factors"].values()))
    # kinds the kept strategy does not run take the largest factor
    refit = replace(base, **{k: getattr(base, k) * info["factors"].get(kind,
                                                                       info["others_factor"])
                             for k, kind in names.items()})
    ctx = PlanContext(kept.workload, refit, "randomk", {"ratio": 0.01}, costs, kept.constraints)
    assert info["kept_refitted_ms"] == pytest.approx(
        ctx.iteration_us(ctx.index([kept.options[n] for n in kept.workload.names])) / 1e3)
    assert len(info["timed_runs"]) == len(runs)
    for r in info["timed_runs"]:  # the steps' prices on the refitted cluster beside them
        assert r["priced_us"] == pytest.approx(list(_steps(refit, Option.parse(r["option"]),
                                                           r["numel"], costs)))
    gain = info["replanned_predicted_ms"] <= info["kept_refitted_ms"] * (1 - REPLAN_GAIN)
    assert (new is not None) == gain
    # BytePS' path on 10 Gbit/s with 3-6x its latencies: the planner's is far faster
    assert gain == (kept.algorithm == "fp32")
    if new is not None:
        assert new.predicted_ms == pytest.approx(info["replanned_predicted_ms"])
        assert new.options != kept.options or new.layout != kept.layout


def test_the_refit_prices_compression_as_the_checked_steps_took_it(planned):
    """The kept strategy's kernels took 2.5x their price on the training device and 2x on
    the host (they share their cores in training): the refit finds those factors for the
    devices its steps ran on (a device no step ran takes the larger), and the kept
    strategy's refitted prediction is its iteration on that profile; the fp32 path has no
    kernels and nothing is fitted."""
    workload, costs, kept = planned
    base = replace(kept.cluster, server_latency_us=kept.cluster.ps_latency_us)
    truth = {"gpu": 2.5, "cpu": 2.0}
    fused = {t.name: t.numel for t in kept.workload.tensors}
    runs = [Run(n, o, fused[n], *[_steps(base, o, fused[n], costs.scaled(truth))] * 2)
            for n, o in kept.options.items()]
    spec = EspressoSpec("randomk", {"ratio": 0.01})
    spec._planned[frozenset(workload.names)] = (workload, costs, frozenset(), (0, 1 << 20))
    _, info = spec._replanned(kept, runs)
    devices = {s.device.value for o in kept.options.values() for s in o.steps
               if s.kind.is_compute}
    assert info["compute_factors"] == pytest.approx({d: truth[d] for d in devices})
    if not devices:
        assert kept.algorithm == "fp32"
        return
    top = max(info["compute_factors"].values())
    ctx = PlanContext(kept.workload, base, "randomk", {"ratio": 0.01},
                      costs.scaled({d: info["compute_factors"].get(d, top) for d in truth}),
                      kept.constraints)
    assert info["kept_refitted_ms"] == pytest.approx(
        ctx.iteration_us(ctx.index([kept.options[n] for n in kept.workload.names])) / 1e3)
    assert info["kept_refitted_ms"] > kept.predicted_ms
