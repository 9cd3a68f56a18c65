"""PowerSGD in training over real processes: 2 machines x 2 workers and a server (gloo and
the PS on loopback). Both of each bucket's sums (P beside the uncompressed members, then Q)
run on the job's collectives (``sums="allreduce"``) or on its fp32 Option through the server
(``sums="ps"``). Every rank ends with the same gradients,
bit for bit, and they match PowerSGD's steps computed here from every rank's inputs (within
float32 rounding: the servers and the intra-machine reduce sum in another order than this
oracle). The checkpoint section holds each compressed matrix's error and Q.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from byteps_espresso.kernels.powersgd import PowerSGD

MACHINES, LOCAL = 2, 2
WORLD = MACHINES * LOCAL
CAP_MB = 0.02  # 20,971 bytes: "big" (96 x 64 floats) is alone in its bucket
_spec = importlib.util.spec_from_file_location(
    "powersgd_worker", Path(__file__).parent / "workers" / "powersgd_worker.py")
worker = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(worker)


def _oracle(steps: int, dense: frozenset[str] = frozenset()) -> list[dict[str, torch.Tensor]]:
    """Each parameter's averaged gradient per step, PowerSGD's steps with rank-order sums
    (the exact average for the parameters in ``dense``)."""
    states = [PowerSGD(rank=worker.RANK, start_iter=worker.START_ITER, seed=3)
              for _ in range(WORLD)]
    out = []
    for step in range(steps):
        per_rank = [worker.grads(r, step) for r in range(WORLD)]
        avg = {}
        for name, shape in worker.PARAMS:
            gs = [g[name] for g in per_rank]
            if name in dense or not states[0].compresses(shape, step):
                avg[name] = sum(gs[1:], gs[0]) / WORLD
                continue
            ps = [s.start(name, g, step) for s, g in zip(states, gs, strict=True)]
            qs = [s.middle(name, sum(ps[1:], ps[0])) for s in states]
            totals = [s.finish(name, sum(qs[1:], qs[0]), WORLD) for s in states]
            avg[name] = totals[0].view(shape) / WORLD
        out.append(avg)
    return out


@pytest.mark.timeout(200)
@pytest.mark.parametrize("sums", ["allreduce", "ps"])
def test_powersgd_buckets_match_its_steps_on_every_rank(tmp_path, cluster, sums):
    steps = 3
    # errors measured in iterations 0 and 2 (nothing is compressed in 0: start_iter)
    env = {"ESPRESSO_BUCKET_CAP_MB": str(CAP_MB), "ESPRESSO_COMPRESSION_ERROR_EVERY": "2"}
    with cluster.ps_job(servers=1) as root:
        cluster.run_workers("powersgd_worker.py", [str(tmp_path), str(steps), sums],
                            root_port=root, servers=1, timeout=150, extra_env=env)
    runs = [json.loads((tmp_path / f"run_{r}.json").read_text()) for r in range(WORLD)]
    # each rank's own relative error, for every bucket holding a compressed matrix
    errors = [run.pop("errors") for run in runs]
    compressed = [b for b in runs[0]["buckets"] if set(b) & {"w", "conv", "big"}]
    assert all(len(e) == len(compressed) and all(0 < v < 1 for v in e.values())
               for e in errors), errors
    assert all(run == runs[0] for run in runs)
    assert ["big"] in runs[0]["buckets"] and len(runs[0]["buckets"]) >= 2
    if sums == "ps":
        assert runs[0]["options"] == [f"Comp(gpu) -> {runs[0]['fp32']} -> Decomp(gpu)"]
        assert "PushPull" in runs[0]["fp32"]
    else:
        # the machines share this host: the flat all-reduce (the hierarchy only adds latency)
        assert runs[0]["allreduce"] == "Allreduce(flat)"
        assert runs[0]["options"] == ["Comp(gpu) -> Allreduce(flat) -> Decomp(gpu)"]
    assert runs[0]["compression"]["compressor"] == "powersgd"
    assert runs[0]["state"] == {n: ["error", "q"] for n in ("big", "conv", "w")}
    want = _oracle(steps)
    for step in range(steps):
        for name, shape in worker.PARAMS:
            got = [np.load(tmp_path / f"grad_{step}_{r}_{name}.npy") for r in range(WORLD)]
            assert got[0].shape == shape
            assert all(np.array_equal(g, got[0]) for g in got), f"step {step} {name}"
            scale = float(want[step][name].abs().max())
            np.testing.assert_allclose(got[0], want[step][name].numpy(), rtol=0,
                                       atol=1e-4 * scale, err_msg=f"step {step} {name}")
    # after start_iter the matrices are rank-2 estimates, not the exact average
    exact = sum(worker.grads(r, 2)["w"] for r in range(WORLD)) / WORLD
    assert not np.allclose(np.load(tmp_path / "grad_2_0_w.npy"), exact.numpy(), atol=0.05)


# A planned PowerSGD strategy: each bucket compressed or not, each with the dense Option its
# sums run on (the hierarchical PS path for "big", the flat all-reduce for "b" and "w"), and
# "s" and "conv" uncompressed through the servers. Backward order: big, s, conv, b, w.
PLANNED = {
    ("big",): "Comp(gpu) -> ReduceScatter(intra) -> PushPull(inter) -> Allgather(intra) "
              "-> Decomp(gpu)",
    ("s", "conv"): "PushPull(flat)",
    ("b", "w"): "Comp(gpu) -> Allreduce(flat) -> Decomp(gpu)",
}


def _planned_strategy(path: Path) -> None:
    from byteps_espresso.strategy import Cluster, Strategy, Workload
    from byteps_espresso.strategy.buckets import Bucket, fuse
    from byteps_espresso.strategy.options import Option
    from byteps_espresso.strategy.tree import validate
    from byteps_espresso.strategy.workload import TensorProfile

    shapes = dict(worker.PARAMS)
    order = [name for name, _ in reversed(worker.PARAMS)]
    workload = Workload(tuple(TensorProfile(n, int(np.prod(shapes[n])), 10.0, (shapes[n],))
                              for n in order), 100.0, "powersgd-test")
    buckets = tuple(Bucket.of(list(members)) for members in PLANNED)
    fused = fuse(workload, buckets)
    cluster = Cluster.preset(MACHINES, LOCAL, "pcie", 1, servers=1)
    options = {b.name: Option.parse(text) for b, text in zip(buckets, PLANNED.values(),
                                                              strict=True)}
    for option in options.values():
        validate(option, cluster, "powersgd")
    Strategy(options, 1.0, {}, "espresso", 0.0, fused, cluster, "powersgd",
             {"rank": worker.RANK, "start_iter": worker.START_ITER, "seed": 3},
             buckets=buckets).save(path)


@pytest.mark.timeout(200)
def test_a_planned_powersgd_strategy_runs_each_buckets_option(tmp_path, cluster):
    steps = 3
    strategy = tmp_path / "strategy.json"
    _planned_strategy(strategy)
    with cluster.ps_job(servers=1) as root:
        cluster.run_workers("powersgd_worker.py", [str(tmp_path), str(steps),
                                                   f"strategy:{strategy}"],
                            root_port=root, servers=1, timeout=150)
    runs = [json.loads((tmp_path / f"run_{r}.json").read_text()) for r in range(WORLD)]
    for run in runs:
        run.pop("errors")
    assert all(run == runs[0] for run in runs)
    assert runs[0]["buckets"] == [list(m) for m in PLANNED]
    assert sorted(runs[0]["by_bucket"].values()) == sorted(PLANNED.values())
    # only the compressed buckets' matrices keep PowerSGD state
    assert runs[0]["state"] == {n: ["error", "q"] for n in ("big", "w")}
    want = _oracle(steps, dense=frozenset({"conv", "s"}))
    for step in range(steps):
        for name, _ in worker.PARAMS:
            got = [np.load(tmp_path / f"grad_{step}_{r}_{name}.npy") for r in range(WORLD)]
            assert all(np.array_equal(g, got[0]) for g in got), f"step {step} {name}"
            scale = float(want[step][name].abs().max())
            np.testing.assert_allclose(got[0], want[step][name].numpy(), rtol=0,
                                       atol=1e-4 * scale, err_msg=f"step {step} {name}")
    # "conv" went uncompressed: the exact average, where a compressed bucket would not be
    exact = sum(worker.grads(r, 2)["conv"] for r in range(WORLD)) / WORLD
    np.testing.assert_allclose(np.load(tmp_path / "grad_2_0_conv.npy"), exact.numpy(),
                               rtol=0, atol=1e-5)


@pytest.mark.timeout(200)
def test_powersgd_profiled_planned_and_tried_in_training(tmp_path, cluster):
    from byteps_espresso.strategy import Strategy
    from byteps_espresso.strategy.tree import option_set

    steps, profile = 16, tmp_path / "profile"
    env = {"ESPRESSO_PROFILE_OUT": str(profile), "ESPRESSO_TRIAL_STEPS": "2"}
    with cluster.ps_job(servers=1) as root:
        cluster.run_workers("powersgd_worker.py", [str(tmp_path), str(steps), "espresso"],
                            root_port=root, servers=1, timeout=150, extra_env=env)
    runs = [json.loads((tmp_path / f"run_{r}.json").read_text()) for r in range(WORLD)]
    for run in runs:
        run.pop("errors")
    assert all(run == runs[0] for run in runs)  # one strategy and layout on every rank
    for step in range(steps):
        for name, _ in worker.PARAMS:
            got = [np.load(tmp_path / f"grad_{step}_{r}_{name}.npy") for r in range(WORLD)]
            assert all(np.array_equal(g, got[0]) for g in got), f"step {step} {name}"
    # the kept strategy is the planner's, of PowerSGD's tree, priced from the shapes the
    # profile recorded and the products the lanes timed
    kept = Strategy.load(profile / "strategy.json")
    assert kept.compressor == "powersgd" and kept.params["rank"] == worker.RANK
    tree = option_set(kept.cluster, None, "powersgd")
    assert all(o in tree for o in kept.options.values())
    assert sorted(runs[0]["by_bucket"].values()) == sorted(map(str, kept.options.values()))
    shapes = {t.name: t.shapes for t in json_workload(profile / "workload.json")}
    assert shapes["big"] == ((96, 64),) and shapes["conv"] == ((16, 4, 3, 3),)
    costs = json.loads((profile / "costs.json").read_text())
    assert "in the lanes" in costs["note"] and "powersgd" in costs["compressors"]
    # (trials run where the plan has finalists within reach, which the timings decide)


def json_workload(path: Path):  # type: ignore[no-untyped-def]
    from byteps_espresso.strategy import Workload

    return Workload.load(path).tensors
