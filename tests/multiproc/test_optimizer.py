"""DistributedOptimizer on 2 emulated machines x 2 workers (gloo, loopback).

After every step all workers' parameters are bit-identical and equal a single-process
re-computation (the average over workers of the gradients, accumulated over
``backward_passes_per_step`` passes); push_pull sums a named tensor.
"""

from __future__ import annotations

import importlib.util
import json
import os
import statistics
from pathlib import Path

import numpy as np
import pytest
import torch
from byteps_espresso.worker.check import REPLAN_GAIN
from byteps_espresso.worker.profiler import _CODEC_REPS, _LANE_REPS, _PROBE_ROUNDS
from byteps_espresso.worker.runtime import DEFAULT_LANES

from byteps_espresso.strategy import Strategy
from byteps_espresso.strategy.buckets import Bucket
from byteps_espresso.strategy.compressor_costs import Linear
from byteps_espresso.strategy.options import Option

WORLD = 4
_spec = importlib.util.spec_from_file_location(
    "optimizer_worker", Path(__file__).parent / "workers" / "optimizer_worker.py")
worker = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(worker)


def _expected(passes: int, steps: int, width: int = 33) -> list[np.ndarray]:
    net = worker.model(width)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    out = []
    for step in range(steps):
        grads = [torch.zeros_like(p) for p in net.parameters()]
        for rank in range(WORLD):
            for k in range(passes):
                net.zero_grad()
                x, y = worker.batch(rank, step, k)
                torch.nn.functional.mse_loss(net(x), y).backward()
                for g, p in zip(grads, net.parameters(), strict=True):
                    g.add_(p.grad)
        for g, p in zip(grads, net.parameters(), strict=True):
            p.grad = g / WORLD
        opt.step()
        out.append(torch.cat([p.detach().reshape(-1) for p in net.parameters()]).numpy())
    return out


@pytest.mark.timeout(200)
# fp16 without servers all-reduces the casts in half precision (AllreduceC(flat))
@pytest.mark.parametrize("case", [("none", 1, 4, 1e-5, 1), ("none", 2, 3, 1e-5, 0),
                                  ("fp16", 1, 3, 2e-3, 1), ("fp16", 1, 3, 2e-3, 0)],
                         ids=["none-ps", "none-2passes-collectives", "fp16-ps",
                              "fp16-collectives"])
def test_workers_stay_identical_and_match_single_process(tmp_path, cluster, case):
    compression, passes, steps, rtol, servers = case
    args = [str(tmp_path), compression, str(passes), str(steps)]
    if servers:
        with cluster.ps_job(servers=servers) as root:
            cluster.run_workers("optimizer_worker.py", args, root_port=root, servers=servers,
                                timeout=150)
    else:  # no scheduler: rank 0 hosts the store
        cluster.run_workers("optimizer_worker.py", args, root_port=cluster.free_port_pair(),
                            timeout=150)
    _ranks_identical(tmp_path, steps)
    for step, want in enumerate(_expected(passes, steps)):
        np.testing.assert_allclose(np.load(tmp_path / f"params_{step}_0.npy"), want, rtol=rtol,
                                   atol=rtol)
    for r in range(WORLD):
        assert np.array_equal(np.load(tmp_path / f"ranks_{r}.npy"), np.full(5, 6.0, np.float32))


def _check_exact(out: Path, steps: int, width: int = 33) -> None:
    """Every rank's parameters after every step are identical and match _expected."""
    _ranks_identical(out, steps)
    for step, want in enumerate(_expected(1, steps, width)):
        np.testing.assert_allclose(np.load(out / f"params_{step}_0.npy"), want, rtol=1e-5,
                                   atol=1e-5)


@pytest.mark.timeout(200)
def test_dgc_recipe_moves_momentum_before_communication_exactly(tmp_path, cluster):
    """Every step profiled, so every bucket goes uncompressed: each worker sends its own
    velocity and SGD steps without momentum, which is SGD with momentum on the average."""
    steps = 4
    env = {"ESPRESSO_PROFILE_STEPS": str(steps + 1)}
    _train(tmp_path, cluster, "dgc", steps, env)
    # the optimizer stepped without momentum: the workers' velocities carried it
    assert {(tmp_path / f"momentum_{r}.txt").read_text() for r in range(WORLD)} == {"0.0"}
    _check_exact(tmp_path, steps)


@pytest.mark.timeout(200)
@pytest.mark.parametrize(("steps", "measured", "compression"),
                         [(4, "in the lanes", "espresso"), (1, "at start-up", "espresso"),
                          (4, "in the lanes", "espresso-traffic")],
                         ids=["lane-probes", "paused-probes", "ps-from-traffic"])
def test_profiled_iterations_stay_exact_and_plan_from_the_probes(tmp_path, cluster, steps,
                                                                 measured, compression):
    """Every step profiled. With 2+ profiled steps the lanes run link and compressor probes
    next to the fp32 synchronization; with 1 (no iteration after the first for the steps'
    timings) every rank probes with training paused. On the wide model the profiled
    push/pulls give the PS bandwidth and only the latency-bound PS probe runs. Results stay
    exact, and the plan after the last step uses the probes."""
    out = tmp_path / "profile"
    env = {"ESPRESSO_PROFILE_STEPS": str(steps), "ESPRESSO_PROFILE_OUT": str(out)}
    _train(tmp_path, cluster, compression, steps, env)
    wide = compression == "espresso-traffic"
    _check_exact(tmp_path, steps, worker.WIDE if wide else 33)
    if steps > 1:  # what the PS path was inverted from
        probes = json.loads((out / "probes.json").read_text())
        ps = {int(n) for n in probes["links_us"]["ps"]}
        if wide:  # the small probe, and what each worker pushed of the one bucket
            assert probes["ps_source"] == "latency probe + profiled push/pulls"
            bucket = 8 * worker.WIDE + 2 * worker.WIDE + 1
            # On one host the fp32 path is the flat push/pull; else each worker's shard.
            shared = json.loads((out / "cluster.json").read_text())["shared_host"]
            assert ps == {256, bucket if shared else (bucket + 1) // 2}
        else:
            assert probes["ps_source"] == "probes" and ps == {256, 1 << 18}
        # Every probing round times the latency-bound size, only the first the large one.
        rounds = max(_PROBE_ROUNDS, DEFAULT_LANES)
        for path, counts in probes["link_samples"].items():
            assert counts["256"] == rounds * _LANE_REPS, path
            assert all(c == _LANE_REPS for n, c in counts.items() if n != "256"), path
            # every timed call, and the median inverted is theirs (unless the PS path was
            # probed again with training paused)
            calls = probes["link_calls_us"][path]
            assert {n: len(us) for n, us in calls.items()} == counts, path
            for n, us in calls.items():
                assert all(u > 0 for u in us)
                if path != "ps" or probes["ps_source"] != "paused probes":
                    assert probes["links_us"][path][n] == statistics.median(us), (path, n)
        assert probes["lane_seconds"]["links/0"] > 0 and probes["lane_seconds"]["compressor/1"] > 0
        # the fp32 steps the latencies were fitted to, per profiled bucket and step
        steps_of = probes["fp32_steps"]
        fp32 = Option.parse(steps_of["option"])
        assert len(steps_of["us"]) == len(steps_of["numels"]) > 0
        assert all(len(row) == len(fp32.steps) for row in steps_of["us"])
        assert all(us is None or us > 0 for row in steps_of["us"] for us in row)
        assert any(us is not None for row in steps_of["us"] for us in row)
        # every rank's CPU time per profiled fp32 iteration, and the cores the 4 ranks share
        # (one kernel: the test's machines are processes of this host)
        assert len(probes["fp32_cpu_ms"]) == WORLD and min(probes["fp32_cpu_ms"]) > 0
        assert probes["host"] == {"cpus": len(os.sched_getaffinity(0)), "ranks": WORLD}
    cluster_json = json.loads((out / "cluster.json").read_text())
    assert cluster_json["intra_link"] == "measured"
    assert cluster_json["server_latency_us"] is not None and cluster_json["server_gbps"] > 0
    assert cluster_json["lanes"] == DEFAULT_LANES  # the timeline holds Options behind their lane
    costs = json.loads((out / "costs.json").read_text())
    assert measured in costs["note"]
    assert set(costs["compressors"]["randomk"]) >= (
        {"gpu", "cpu", "server"} if steps > 1 else {"gpu", "cpu"})
    if steps > 1:  # the lanes' kernels priced from the median timing of each size
        for dev, ops in probes["codec_calls_us"].items():
            for op, calls in ops.items():
                # the smallest and largest size in every round, others within its budget
                sizes = sorted(calls, key=int)
                assert len(sizes) >= 2 and all(
                    len(calls[n]) == rounds * _CODEC_REPS for n in (sizes[0], sizes[-1]))
                assert all(0 < len(us) <= rounds * _CODEC_REPS and min(us) > 0
                           for us in calls.values()), (dev, op)
                line = Linear.fit([int(n) for n in calls],
                                  [statistics.median(us) for us in calls.values()])
                assert costs["compressors"]["randomk"][dev][op] == pytest.approx(
                    line.to_dict(), rel=1e-9), (dev, op)
    workload = json.loads((out / "workload.json").read_text())
    assert sorted(t["name"] for t in workload["tensors"]) == ["0.bias", "0.weight", "2.bias",
                                                              "2.weight"]
    assert all(t["ready_gap_us"] >= 0 for t in workload["tensors"])


def _train(tmp_path, cluster, compression, steps, env):
    """The workers train ``steps`` steps of ``compression`` with one server."""
    with cluster.ps_job(servers=1) as root:
        cluster.run_workers("optimizer_worker.py",
                            [str(tmp_path), compression, "1", str(steps)],
                            root_port=root, servers=1, timeout=150, extra_env=env)


def _trained_on(out: Path, trials: dict) -> str:
    """The algorithm the start-up left every rank training on: the trials' kept finalist,
    or, where the check after the trials ran, what it kept (it starts from the trials' kept
    one and may re-plan or fall back: ``check.json``'s ``stayed``)."""
    path = out / "check.json"
    if not path.exists():
        return trials["kept"]
    check = json.loads(path.read_text())
    assert check["kept"]["algorithm"] == trials["kept"]
    stayed = check["stayed"]
    return check[stayed]["algorithm"] if stayed in ("kept", "replanned") else stayed


def _ranks_identical(out: Path, steps: int) -> None:
    """Every rank's parameters after every step are bit-identical to rank 0's."""
    for step in range(steps):
        got = [np.load(out / f"params_{step}_{r}.npy") for r in range(WORLD)]
        for r in range(1, WORLD):
            assert np.array_equal(got[r], got[0]), f"step {step}: rank {r} differs from rank 0"


# Steps after the trials for the check of the kept strategy to conclude: each strategy it
# checks (the kept one, then a re-plan or a fall-back, then another fall-back) runs
# _CHECK_STEPS iterations and is decided on the next. With fewer, a run could end while a
# re-plan was under check: no check.json, and the ranks on the re-plan, not on the trials'
# kept strategy.
_CHECK_STEPS = 2
_AFTER_TRIALS = 3 * (_CHECK_STEPS + 1) + 1


def _run_trials(tmp_path, cluster, compression, steps):
    """2 profiled steps, then trials of 2 steps per finalist, then the check of
    ``_CHECK_STEPS`` steps per strategy; files under tmp_path/profile."""
    _train(tmp_path, cluster, compression, steps,
           {"ESPRESSO_PROFILE_STEPS": "2", "ESPRESSO_TRIAL_STEPS": "2",
            "ESPRESSO_CHECK_STEPS": str(_CHECK_STEPS),
            "ESPRESSO_PROFILE_OUT": str(tmp_path / "profile")})


@pytest.mark.timeout(200)
def test_trials_switch_strategies_in_step_and_every_rank_keeps_the_same(tmp_path, cluster):
    """2 profiled steps, then every finalist (the plan, the runnable baselines and the plan
    under no-gpu and no-cpu: up to 7) for 2 steps each,
    then the kept one: the ranks' parameters stay bit-identical through every switch, the
    profiled steps equal the single-process result, and every rank keeps the finalist
    trials.json names, the fastest measured."""
    out = tmp_path / "profile"
    steps = 2 + 2 * 7 + _AFTER_TRIALS
    _run_trials(tmp_path, cluster, "espresso-trials", steps)
    _ranks_identical(tmp_path, steps)
    for step, want in enumerate(_expected(1, 2)):  # the profiled steps
        np.testing.assert_allclose(np.load(tmp_path / f"params_{step}_0.npy"), want, rtol=1e-5,
                                   atol=1e-5)
    trials = json.loads((out / "trials.json").read_text())
    finalists = trials["finalists"]
    assert finalists[0]["algorithm"] == "espresso" and len(finalists) >= 2
    assert all(len(f["iteration_ms"]) == 2 for f in finalists)
    measured = [f["measured_ms"] for f in finalists]
    assert trials["kept"] == finalists[measured.index(min(measured))]["algorithm"]
    trained_on = _trained_on(out, trials)
    assert {(tmp_path / f"kept_{r}.txt").read_text() for r in range(WORLD)} == {trained_on}
    assert json.loads((out / "strategy.json").read_text())["algorithm"] == trained_on


@pytest.mark.timeout(200)
def test_the_fewest_buckets_are_a_layout_the_trials_measure(tmp_path, cluster):
    """Where the plan keeps DDP's small first bucket, the plan on the fewest buckets is the
    second finalist: the trials switch layouts in step on every rank, and it is measured."""
    out = tmp_path / "profile"
    steps = 2 + 2 * 7 + 2
    _run_trials(tmp_path, cluster, "espresso-fewest", steps)
    _ranks_identical(tmp_path, steps)
    finalists = json.loads((out / "trials.json").read_text())["finalists"]
    fewest = [f for f in finalists if f["algorithm"] == "espresso/fewest-buckets"]
    # The two weight matrices share a bucket only on the fewest buckets.
    weights = {"0.weight", "2.weight"}
    planned = {n for n in finalists[0]["options"] if n.split("+")[0] in weights}
    if len(planned) == 1:  # the plan kept the fewest itself: no second finalist of them
        assert not fewest
    else:
        assert finalists[1]["algorithm"] == "espresso/fewest-buckets"
        assert len(fewest[0]["iteration_ms"]) == 2 and fewest[0]["measured_ms"] > 0
        assert len({n for n in fewest[0]["options"] if n.split("+")[0] in weights}) == 1


@pytest.mark.timeout(200)
def test_the_kept_strategy_is_checked_and_every_rank_trains_on_the_one_that_stayed(
        tmp_path, cluster):
    """2 profiled steps, no trials, then the check's 3 iterations (one a warm-up) of the plan:
    every rank times its steps, rank 0 refits the latencies and re-plans once; a re-planned
    strategy runs 3 checked iterations too and stays only if it measured faster. The ranks'
    parameters stay bit-identical through any switch, and every rank ends on the strategy
    check.json says stayed."""
    out = tmp_path / "profile"
    env = {"ESPRESSO_PROFILE_STEPS": "2", "ESPRESSO_TRIAL_STEPS": "0",
           "ESPRESSO_CHECK_STEPS": "3", "ESPRESSO_PROFILE_OUT": str(out)}
    steps = 2 + 3 + 3 + 2
    _train(tmp_path, cluster, "espresso", steps, env)
    _ranks_identical(tmp_path, steps)
    check = json.loads((out / "check.json").read_text())
    kept = check["kept"]
    assert (check["start"], check["steps"], len(kept["iteration_ms"])) == (2, 3, 3)
    # every rank's CPU time per checked iteration, the servers' beside rank 0 (on its cores)
    assert check["host"] == {"cpus": len(os.sched_getaffinity(0)), "ranks": WORLD}
    assert len(kept["cpu_ms"]) == WORLD and min(kept["cpu_ms"]) > 0
    assert kept["servers_cpu_ms"] is not None and kept["servers_cpu_ms"] >= 0
    # every bucket's Option was timed, each communication step on some rank
    assert {r["name"] for r in check["timed_runs"]} == set(kept["options"])
    for run in check["timed_runs"]:
        option = Option.parse(run["option"])
        assert option == Option.parse(kept["options"][run["name"]])
        assert len(run["measured_us"]) == len(run["priced_us"]) == len(option.steps)
        assert all(us is not None and us > 0 for us, st in zip(run["measured_us"],
                                                                option.steps, strict=True)
                   if not st.kind.is_compute)
        # each step's slowest rank (the first to arrive, its wait included) beside its
        # fastest: timed where the fastest was
        assert len(run["slowest_us"]) == len(option.steps)
        for fast, slow in zip(run["measured_us"], run["slowest_us"], strict=True):
            assert (fast is None) == (slow is None) and (fast is None or slow >= fast)
    assert check["factors"] and all(f >= 1.0 for f in check["factors"].values())
    assert all(f >= 1.0 for f in check["compute_factors"].values())
    again = check["replanned"]
    if again is None:
        assert check["stayed"] == "kept"
        assert check["replanned_predicted_ms"] > check["kept_refitted_ms"] * (1 - REPLAN_GAIN)
    else:
        assert len(again["iteration_ms"]) == 3
        assert check["stayed"] == ("replanned" if again["measured_ms"] < kept["measured_ms"]
                                   else "kept")
    stayed = kept if check["stayed"] == "kept" else again
    for r in range(WORLD):
        assert json.loads((tmp_path / f"options_{r}.json").read_text()) == stayed["options"]
    # what ESPRESSO_STRATEGY would reuse
    saved = Strategy.load(out / "strategy.json")
    assert {name: str(o) for name, o in saved.options.items()} == stayed["options"]
    # each checked strategy's buckets, named as its Options are (benchmarks/predict.py)
    assert [list(b.tensors) for b in saved.layout] == stayed["buckets"]
    for record in (kept, again or kept):
        assert [Bucket.of(m).name for m in record["buckets"]] == list(record["options"])


@pytest.mark.timeout(200)
def test_a_kept_strategy_measured_slower_than_the_profiled_fp32_path_gives_way_to_it(
        tmp_path, cluster):
    """No trial runs (a start-up budget of 0), so the check is the kept strategy's first
    measurement; its 3 iterations sleep (the worker's SLOWED steps), so they measure slower
    than the profiled fp32 iterations by far more than REPLAN_GAIN. The fp32 finalist is
    checked next instead of a re-plan, measures faster (no sleep) and trains on, on every
    rank, with the parameters bit-identical through the switch."""
    out = tmp_path / "profile"
    env = {"ESPRESSO_PROFILE_STEPS": "4", "ESPRESSO_STARTUP_BUDGET": "0",
           "ESPRESSO_CHECK_STEPS": "3", "ESPRESSO_PROFILE_OUT": str(out)}
    steps = 4 + 3 + 3 + 2
    _train(tmp_path, cluster, "espresso-slowed", steps, env)
    _ranks_identical(tmp_path, steps)
    trials = json.loads((out / "trials.json").read_text())
    assert trials["kept"] == "espresso"
    assert all(f["measured_ms"] is None for f in trials["finalists"] if not f["profiled"])
    check = json.loads((out / "check.json").read_text())
    kept, again = check["kept"], check["replanned"]
    assert kept["algorithm"] == "espresso" and kept["measured_ms"] > worker.SLOW_S * 1e3
    assert check["fp32_ms"] < kept["measured_ms"] * (1 - REPLAN_GAIN)
    assert again["algorithm"] == "fp32" and len(again["iteration_ms"]) == 3
    assert again["measured_ms"] < kept["measured_ms"] and check["stayed"] == "fp32"
    fp32 = next(f for f in trials["finalists"] if f["algorithm"] == "fp32")
    assert again["options"] == fp32["options"]
    for r in range(WORLD):
        assert (tmp_path / f"kept_{r}.txt").read_text() == "fp32"
        assert json.loads((tmp_path / f"options_{r}.json").read_text()) == fp32["options"]
    saved = Strategy.load(out / "strategy.json")  # what ESPRESSO_STRATEGY would reuse
    assert saved.algorithm == "fp32"


@pytest.mark.timeout(200)
def test_a_slow_fp16_plan_falls_back_to_ddps_fp16_hook_plan_before_the_fp32_path(
        tmp_path, cluster):
    """fp16 planned, no trial runs, and the kept strategy's 3 checked iterations sleep: the
    allreduce-c finalist (every profiled bucket cast and all-reduced, DDP's fp16 hook) is
    checked next, measures faster and stays, unless the profiled fp32 iterations measured
    faster still: then the fp32 path is checked after it, and the faster of the two stays.
    Every rank ends on the strategy check.json names, parameters bit-identical."""
    out = tmp_path / "profile"
    env = {"ESPRESSO_PROFILE_STEPS": "4", "ESPRESSO_STARTUP_BUDGET": "0",
           "ESPRESSO_CHECK_STEPS": "3", "ESPRESSO_PROFILE_OUT": str(out)}
    steps = 4 + 3 + 3 + 3 + 2
    _train(tmp_path, cluster, "espresso-slowed-fp16", steps, env)
    _ranks_identical(tmp_path, steps)
    trials = json.loads((out / "trials.json").read_text())
    summed = next(f for f in trials["finalists"] if f["algorithm"] == "allreduce-c")
    assert set(summed["options"].values()) == {"Comp(gpu) -> AllreduceC(flat) -> Decomp(gpu)"}
    fp32 = next(f for f in trials["finalists"] if f["algorithm"] == "fp32")
    assert summed["options"].keys() == fp32["options"].keys()  # the profiled buckets
    check = json.loads((out / "check.json").read_text())
    kept, again = check["kept"], check["replanned"]
    assert kept["measured_ms"] > worker.SLOW_S * 1e3 and check["fallback"] == "allreduce-c"
    assert again["algorithm"] == "allreduce-c" and again["options"] == summed["options"]
    assert again["measured_ms"] < kept["measured_ms"]
    if check["then"]:  # the profile measured fp32 faster than allreduce-c by REPLAN_GAIN
        (then,) = check["then"]
        assert then["algorithm"] == "fp32" and then["options"] == fp32["options"]
        stayed = then if then["measured_ms"] < again["measured_ms"] else again
    else:
        stayed = again
    assert check["stayed"] == stayed["algorithm"]
    for r in range(WORLD):
        assert (tmp_path / f"kept_{r}.txt").read_text() == stayed["algorithm"]
        assert json.loads((tmp_path / f"options_{r}.json").read_text()) == stayed["options"]
    assert Strategy.load(out / "strategy.json").algorithm == stayed["algorithm"]


@pytest.mark.timeout(200)
def test_trials_wait_for_the_compressors_warm_up(tmp_path, cluster):
    """dgc with a sparsity warm-up of worker.WARMUP iterations, planned after 2 profiled steps:
    the plan trains through the warm-up and the trials begin where the payloads reach the
    size the planner priced. Every bucket counts the training's iterations, whichever layout
    (the plan's, a finalist's) brought it in, so the warm-up does not start over."""
    out = tmp_path / "profile"
    steps = worker.WARMUP + 2 * 7 + _AFTER_TRIALS
    _run_trials(tmp_path, cluster, "espresso-warmup", steps)
    _ranks_identical(tmp_path, steps)
    trials = json.loads((out / "trials.json").read_text())
    assert trials["start"] == worker.WARMUP
    measured = [f for f in trials["finalists"] if not f["profiled"]]
    assert len(measured) >= 2 and all(len(f["iteration_ms"]) == 2 for f in measured)
    assert {(tmp_path / f"kept_{r}.txt").read_text() for r in range(WORLD)} == \
        {_trained_on(out, trials)}
    for r in range(WORLD):
        counters = json.loads((tmp_path / f"counters_{r}.json").read_text())
        assert counters["iteration"] == steps
        assert counters["buckets"] == dict.fromkeys(counters["buckets"], steps)
