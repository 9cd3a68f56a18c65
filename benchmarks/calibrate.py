"""How well the cost model ranks and predicts strategies on this host: predicted vs measured.

One profiled run of examples/train.py (2 machines x 2 workers + 1 PS server on loopback, as
benchmarks/train.py) captures the measured workload, cluster and compressor costs
(``ESPRESSO_PROFILE_OUT``). From that profile the planner produces the Espresso plan, every
reported baseline, Espresso under several constraints, and ``--random`` strategies drawn
uniformly from the decision tree (one Option per tensor; draws predicted above
``--max-predicted-ms`` are redrawn so the runs stay short). Each strategy is then trained from
its file (``--compression strategy``) and its median iteration time over the epochs after the
first is measured.

Reported: every strategy's predicted and measured time and error; the mean and largest
absolute error; Spearman's rank correlation between predicted and measured (1: the model
orders the strategies as they run); where the Espresso plan ranks among the measured ones.
Prints a table and writes benchmarks/results/calibrate.json, with the measured profile, so a
changed cost model can be scored on the same strategies without running them again.

    python benchmarks/calibrate.py [--random 10] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
from byteps_espresso.worker.profiler import read_profile
from train import REPO, run_job  # benchmarks/train.py: one job's processes on loopback

from byteps_espresso.strategy import Constraints, Strategy, plan
from byteps_espresso.strategy.context import PlanContext

ALGORITHMS = ("espresso", "fp32", "all-gpu", "hipress", "cpu-only")
CONSTRAINED = {"no-cpu": ["no-cpu"], "no-gpu": ["no-gpu"], "no-ps": ["no-ps"],
               "flat-only": ["flat-only"], "hierarchical-only": ["hierarchical-only"],
               "max-compressions=1": ["max-compressions=1"]}


def _train_args(args: argparse.Namespace, metrics: Path) -> list[str]:
    return ["--model", "lstm", "--epochs", str(args.epochs), "--steps-per-epoch",
            str(args.steps_per_epoch), "--metrics-out", str(metrics)]


def profile(args: argparse.Namespace, tmp: Path) -> Path:
    """Run the profiled Espresso job once; returns the folder of the measured profile."""
    out = tmp / "profile"
    run_job([*_train_args(args, tmp / "profile.json"), "--compression", "espresso",
             "--compressor", args.compressor, "--ratio", str(args.ratio)],
            {"ESPRESSO_PROFILE_STEPS": "8", "ESPRESSO_PROFILE_OUT": str(out)}, args.timeout_s)
    return out


def candidates(prof: Path, args: argparse.Namespace) -> dict[str, Strategy]:
    """The strategies to measure, planned on the captured profile."""
    workload, cluster, costs = read_profile(prof)
    params = {"ratio": args.ratio}
    out = {name: plan(workload, cluster, args.compressor, params, algorithm=name, costs=costs)
           for name in ALGORITHMS}
    for name, items in CONSTRAINED.items():
        out[name] = plan(workload, cluster, args.compressor, params, costs=costs,
                         constraints=Constraints.parse(items))
    ctx = PlanContext(workload, cluster, args.compressor, params, costs, Constraints())
    ctx.prepare()
    rng = random.Random(args.seed)
    drawn = 0
    while drawn < args.random:
        options = [rng.choice(ctx.options) for _ in workload.names]
        predicted = ctx.iteration_us(ctx.index(options)) / 1e3
        if predicted > args.max_predicted_ms:
            continue
        out[f"random{drawn}"] = Strategy(dict(zip(workload.names, options, strict=True)),
                                         predicted, {}, "random", 0.0, workload, cluster,
                                         args.compressor, params, ctx.constraints)
        drawn += 1
    return out


def measure(name: str, strategy: Strategy, args: argparse.Namespace, tmp: Path) -> list[float]:
    """Median iteration time of each epoch after the first, training from the strategy file."""
    path, metrics = tmp / f"{name}.strategy.json", tmp / f"{name}.metrics.json"
    strategy.save(path)
    run_job([*_train_args(args, metrics), "--compression", "strategy", "--strategy",
             str(path)], {}, args.timeout_s)
    history = json.loads(metrics.read_text())["history"]
    return [epoch["iteration_ms_median"] for epoch in history[1:]]


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rank correlation (no ties expected among measured times)."""
    ra = np.argsort(np.argsort(a)).astype(float)
    rb = np.argsort(np.argsort(b)).astype(float)
    return float(np.corrcoef(ra, rb)[0, 1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--random", type=int, default=10, help="random strategies to add")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-predicted-ms", type=float, default=110.0,
                    help="redraw random strategies predicted slower than this")
    ap.add_argument("--compressor", default="randomk")
    ap.add_argument("--ratio", type=float, default=0.01)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--steps-per-epoch", type=int, default=40)
    ap.add_argument("--timeout-s", type=float, default=900)
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "calibrate.json"))
    args = ap.parse_args()
    t0 = time.perf_counter()
    rows = []
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        prof = profile(args, tmp)
        measured_profile = {name: json.loads((prof / f"{name}.json").read_text())
                            for name in ("workload", "cluster", "costs")}
        strategies = candidates(prof, args)
        for name, strategy in strategies.items():
            epochs = measure(name, strategy, args, tmp)
            measured = statistics.median(epochs)
            rows.append({"strategy": name, "predicted_ms": strategy.predicted_ms,
                         "measured_ms": measured, "epochs_ms": epochs,
                         "error": (strategy.predicted_ms - measured) / measured,
                         "options": {n: str(o) for n, o in strategy.options.items()}})
            print(f"{name}: predicted {strategy.predicted_ms:.1f} ms, measured "
                  f"{measured:.1f} ms {[round(e, 1) for e in epochs]}", flush=True)
    predicted = [r["predicted_ms"] for r in rows]
    measured = [r["measured_ms"] for r in rows]
    errors = [abs(r["error"]) for r in rows]
    by_measured = sorted(rows, key=lambda r: r["measured_ms"])
    espresso_rank = 1 + next(i for i, r in enumerate(by_measured) if r["strategy"] == "espresso")
    summary = {"strategies": len(rows), "mean_abs_error": statistics.fmean(errors),
               "max_abs_error": max(errors), "spearman": spearman(predicted, measured),
               "espresso_rank": espresso_rank, "fastest": by_measured[0]["strategy"]}
    print(f"\n{'strategy':20} {'predicted':>9} {'measured':>9} {'error':>7}")
    for r in by_measured:
        print(f"{r['strategy']:20} {r['predicted_ms']:9.1f} {r['measured_ms']:9.1f} "
              f"{r['error'] * 100:+6.0f}%")
    print(f"mean |error| {summary['mean_abs_error'] * 100:.0f}%, max "
          f"{summary['max_abs_error'] * 100:.0f}%, Spearman {summary['spearman']:.2f}; "
          f"espresso's plan ranks {espresso_rank} of {len(rows)} measured "
          f"(fastest: {summary['fastest']})")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"benchmark": "calibrate", "compressor": args.compressor,
                               "ratio": args.ratio, "seed": args.seed,
                               "wall_s": time.perf_counter() - t0, "summary": summary,
                               "profile": measured_profile, "rows": rows}, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
