"""Training throughput of examples/train.py per strategy, with the planner's prediction.

Runs 2 emulated machines x 2 workers (+ 1 PS server and the scheduler) as processes on this
host (loopback), once per strategy:

- ``fp32``: uncompressed (``Compression.none``; BytePS' hierarchical path);
- ``espresso``: profile, plan per tensor, then measured trials of the plan's finalists
  (``Compression.espresso``; the "kept" column says which finalist it kept);
- ``all-gpu`` and ``cpu-only``: the strategy engine's baselines, planned on the same profile.

For each it records samples/s and the median time per iteration over the epochs after the
first (which holds the profiling iterations), and the planner's predicted iteration time
(for fp32: BytePS' uncompressed path on every tensor, priced on the espresso run's measured
profile; see :func:`fp32_prediction`). Prints a table; writes JSON to
benchmarks/results/train.json.

Usage: python benchmarks/train.py [--quick] [--compressor randomk --ratio 0.01]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from byteps_espresso.deploy.launch import free_port_pair  # p and p + 1 both free
from byteps_espresso.worker.profiler import read_profile

from byteps_espresso.strategy import Constraints
from byteps_espresso.strategy.baselines import fp32_baseline_option
from byteps_espresso.strategy.context import PlanContext

REPO = Path(__file__).resolve().parents[1]
MACHINES, LOCAL, SERVERS = 2, 2, 1


def job_env(root: int, extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DMLC_", "BYTEPS_",
                                                                      "ESPRESSO_"))}
    env.update({"DMLC_NUM_WORKER": str(MACHINES), "BYTEPS_LOCAL_SIZE": str(LOCAL),
                "DMLC_NUM_SERVER": str(SERVERS), "DMLC_PS_ROOT_URI": "127.0.0.1",
                "DMLC_PS_ROOT_PORT": str(root),
                "ESPRESSO_LOG_LEVEL": "WARNING", "PYTHONPATH": str(REPO), **extra})
    return env


def run_job(train_args: list[str], extra_env: dict[str, str], timeout: float) -> None:
    """Scheduler + servers + all workers of one training run; raises if any worker fails."""
    root = free_port_pair()
    env = job_env(root, extra_env)
    procs: list[subprocess.Popen] = []
    logs = []
    try:
        for role in ["scheduler"] + ["server"] * SERVERS:
            log = tempfile.TemporaryFile("w+")
            logs.append(log)
            procs.append(subprocess.Popen([sys.executable, "-m", "byteps_espresso.server"],
                                          env={**env, "DMLC_ROLE": role}, stdout=log,
                                          stderr=subprocess.STDOUT))
        workers = []
        for rank in range(MACHINES * LOCAL):
            log = tempfile.TemporaryFile("w+")
            logs.append(log)
            wenv = {**env, "DMLC_ROLE": "worker", "DMLC_WORKER_ID": str(rank // LOCAL),
                    "BYTEPS_LOCAL_RANK": str(rank % LOCAL)}
            workers.append(subprocess.Popen(
                [sys.executable, str(REPO / "examples" / "train.py"), *train_args, "--quiet"],
                env=wenv, stdout=log, stderr=subprocess.STDOUT))
        procs += workers
        deadline = time.monotonic() + timeout
        for w in workers:
            w.wait(timeout=max(1.0, deadline - time.monotonic()))
        bad = [i for i, w in enumerate(workers) if w.returncode != 0]
        if bad:
            log = logs[SERVERS + 1 + bad[0]]
            log.seek(0)
            raise RuntimeError(f"worker {bad[0]} failed:\n{log.read()[-3000:]}")
    finally:
        for p in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=5)
            if p.poll() is None:
                p.kill()
                p.wait()
        for log in logs:
            log.close()


def fp32_prediction(profile: Path, compressor: str, params: dict) -> float:
    """The model's iteration time (ms) for ``Compression.none`` -- the fp32 Option on every
    tensor (``baselines.fp32_option``, the plan's ``fp32`` baseline), which is what the fp32
    run executes -- on the profile the Espresso run measured (``ESPRESSO_PROFILE_OUT``)."""
    workload, cluster, costs = read_profile(profile)
    ctx = PlanContext(workload, cluster, compressor, params, costs, Constraints())
    option = fp32_baseline_option(ctx)
    return ctx.iteration_us(ctx.index([option] * len(workload.tensors))) / 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer steps (smoke run)")
    ap.add_argument("--compressor", default="randomk")
    ap.add_argument("--ratio", type=float, default=0.01)
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "train.json"))
    args = ap.parse_args()
    steps = 30 if args.quick else 80
    epochs = 2 if args.quick else 3
    common = ["--model", "lstm", "--epochs", str(epochs), "--steps-per-epoch", str(steps)]
    runs = [("fp32", ["--compression", "fp32"]),
            ("espresso", ["--compression", "espresso", "--algorithm", "espresso"]),
            ("all-gpu", ["--compression", "espresso", "--algorithm", "all-gpu"]),
            ("cpu-only", ["--compression", "espresso", "--algorithm", "cpu-only"])]
    results = {}
    fp32_pred = None
    with tempfile.TemporaryDirectory() as tmp:
        for label, flags in runs:
            metrics = Path(tmp) / f"{label}.json"
            train_args = [*common, *flags, "--compressor", args.compressor, "--ratio",
                          str(args.ratio), "--metrics-out", str(metrics)]
            t0 = time.perf_counter()
            env = {"ESPRESSO_PROFILE_STEPS": "8"}
            if label == "espresso":
                env["ESPRESSO_PROFILE_OUT"] = str(Path(tmp) / "profile")
            run_job(train_args, env, timeout=900)
            data = json.loads(metrics.read_text())
            later = data["history"][1:]
            results[label] = {
                "samples_per_s": sorted(r["samples_per_s"] for r in later)[len(later) // 2],
                "iteration_ms": sorted(r["iteration_ms_median"] for r in later)[len(later) // 2],
                "predicted_ms": data["predicted_ms"], "baselines_ms": data["baselines_ms"],
                "final_loss": data["history"][-1]["loss"], "wall_s": time.perf_counter() - t0,
                "kept": data.get("algorithm"),  # espresso: the finalist its trials kept
            }
            print(f"{label}: {results[label]}", flush=True)
            if label == "espresso":
                fp32_pred = fp32_prediction(Path(tmp) / "profile", args.compressor,
                                            {"ratio": args.ratio})
    results["fp32"]["predicted_ms"] = fp32_pred
    print(f"\n{'strategy':10} {'samples/s':>10} {'ms/iter':>9} {'predicted':>10} {'error':>7}"
          f" {'speedup':>8} {'loss':>7}  kept")
    base = results["fp32"]["samples_per_s"]
    for label, r in results.items():
        pred = r["predicted_ms"]
        err = f"{(pred - r['iteration_ms']) / r['iteration_ms'] * 100:+.0f}%" if pred else "-"
        print(f"{label:10} {r['samples_per_s']:10.0f} {r['iteration_ms']:9.1f} "
              f"{(f'{pred:.1f}' if pred else '-'):>10} {err:>7} "
              f"{r['samples_per_s'] / base:7.2f}x {r['final_loss']:7.3f}  {r['kept'] or '-'}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machines": MACHINES, "workers_per_machine": LOCAL,
                               "servers": SERVERS, "compressor": args.compressor,
                               "ratio": args.ratio, "steps_per_epoch": steps, "epochs": epochs,
                               "results": results}, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
