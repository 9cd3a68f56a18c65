"""End-to-end: examples/train.py on the emulated cluster, fp32 vs Espresso vs baselines.

2 machines x 2 workers and 1 server machine, each in its own network namespace, links
shaped with tc to each ``--gbps`` setting (default 1 Gbit/s and 0.25 Gbit/s). For every
setting, each strategy trains the example model for the same steps:

    fp32      Compression.none (uncompressed PS / collectives)
    espresso  Compression.espresso(randomk, ratio), algorithm "espresso" (Algorithms 1+2),
              then measured trials of its finalists (worker/trials.py; "kept" says which)
    all-gpu   the same compressor, every tensor compressed on the GPU (baseline)
    cpu-only  the same compressor, every compression on the host CPUs (baseline)

Each strategy runs ``--repeats`` times, interleaved with the others (so slow phases of a
shared, noisy machine hit every strategy alike). Measured: the median iteration time over
the epochs after the first (the first profiles and plans), median over repeats; throughput
is the global batch over that time. Predicted: the planner's iteration time for the strategy
the run used (``predicted_ms`` written by rank 0; fp32's: BytePS' uncompressed path on every
tensor priced on the Espresso run's measured profile), median over repeats. Prints a table
and writes benchmarks/results/e2e.json.
Needs root (network namespaces).

    sudo .venv/bin/python benchmarks/e2e.py
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

from byteps_espresso.deploy.demo import RunResult, run_training
from train import fp32_prediction  # benchmarks/train.py

STRATEGIES = ("fp32", "espresso", "all-gpu", "cpu-only")
ROOT = Path(__file__).resolve().parents[1]


def _train_args(strategy: str, args: argparse.Namespace) -> list[str]:
    base = [sys.executable, str(ROOT / "examples" / "train.py"), "--quiet",
            "--batch-size", str(args.batch_size),
            "--epochs", str(args.epochs), "--steps-per-epoch", str(args.steps_per_epoch),
            *args.train_args]
    if strategy == "fp32":
        return [*base, "--compression", "fp32"]
    return [*base, "--compression", "espresso", "--compressor", args.compressor,
            "--ratio", str(args.ratio), "--algorithm", strategy]


def _cluster(gbps: float, args: argparse.Namespace) -> list[str]:
    return ["--emulate", "--inter-gbps", str(gbps), "--machines", str(args.machines),
            "--workers-per-machine", str(args.workers_per_machine), "--servers", "1"]


def _median(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _row(gbps: float, strategy: str, runs: list[RunResult], predicted: list,
         batch_size: int) -> dict:
    measured = _median([r.iteration_ms for r in runs])
    predicted_ms = _median(predicted)
    error = None if predicted_ms is None else abs(predicted_ms - measured) / measured
    global_batch = batch_size * runs[0].metrics["world_size"]
    return {"gbps": gbps, "strategy": strategy, "samples_per_s": global_batch / measured * 1e3,
            "iteration_ms": measured, "iteration_ms_runs": [r.iteration_ms for r in runs],
            "epoch_samples_per_s": [r.samples_per_s for r in runs],
            "predicted_ms": predicted_ms, "prediction_error": error,
            "final_loss": _median([r.final_loss for r in runs]),
            # the strategy each run ended with (espresso: the finalist its trials kept)
            "kept": [r.metrics.get("algorithm") for r in runs]}


def run_setting(gbps: float, args: argparse.Namespace, out: Path) -> list[dict]:
    """Every strategy on links of ``gbps``, ``args.repeats`` interleaved rounds."""
    runs: dict[str, list[RunResult]] = {s: [] for s in args.strategies}
    for rep in range(args.repeats):
        for strategy in args.strategies:
            print(f"-- {gbps:g} Gbit/s: {strategy} (round {rep + 1}/{args.repeats})",
                  flush=True)
            name = f"{gbps:g}gbps-{strategy}-{rep}"
            env = dict(os.environ)
            if strategy == "espresso":
                env["ESPRESSO_PROFILE_OUT"] = str(out / f"{name}-profile")
            runs[strategy].append(run_training(
                name, _cluster(gbps, args), _train_args(strategy, args), out, env=env,
                live=args.verbose, timeout_s=args.timeout_s))
    fp32_predicted = [fp32_prediction(out / f"{gbps:g}gbps-espresso-{rep}-profile",
                                      args.compressor, {"ratio": args.ratio})
                      for rep in range(len(runs.get("espresso", [])))]
    rows = []
    for strategy, done in runs.items():
        predicted = fp32_predicted if strategy == "fp32" else [
            r.metrics.get("predicted_ms") for r in done]
        rows.append(_row(gbps, strategy, done, predicted, args.batch_size))
    for row in rows:
        if row["strategy"] == "espresso":
            row["trials"] = [_trials(out / f"{gbps:g}gbps-espresso-{rep}-profile")
                             for rep in range(len(runs["espresso"]))]
    fp32 = next((r for r in rows if r["strategy"] == "fp32"), None)
    for row in rows:
        row["vs_fp32"] = row["samples_per_s"] / fp32["samples_per_s"] if fp32 else None
    return rows


def _trials(profile: Path) -> dict | None:
    """What an espresso run's trials measured (``trials.json``), without the options."""
    path = profile / "trials.json"
    if not path.exists():  # a single finalist: no trials
        return None
    data = json.loads(path.read_text())
    return {"kept": data["kept"], "finalists": [
        {k: f[k] for k in ("algorithm", "predicted_ms", "measured_ms")}
        for f in data["finalists"]]}


def _table(rows: list[dict]) -> str:
    lines = [f"{'Gbit/s':>6} {'strategy':9} {'samples/s':>10} {'vs fp32':>8} {'iter ms':>9} "
             f"{'predicted':>9} {'error':>6} {'loss':>7}  kept"]
    for r in rows:
        pred = f"{r['predicted_ms']:9.1f}" if r["predicted_ms"] is not None else f"{'-':>9}"
        err = f"{r['prediction_error']:6.0%}" if r["prediction_error"] is not None else "     -"
        vs = f"{r['vs_fp32']:7.2f}x" if r["vs_fp32"] is not None else f"{'-':>8}"
        lines.append(f"{r['gbps']:6g} {r['strategy']:9} {r['samples_per_s']:10.1f} "
                     f"{vs} {r['iteration_ms']:9.1f} {pred} {err} "
                     f"{r['final_loss']:7.3f}  {','.join(str(k) for k in r['kept'])}")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gbps", type=float, nargs="+", default=[1.0, 0.25],
                   help="link settings, Gbit/s (default 1 and 0.25)")
    p.add_argument("--strategies", nargs="+", default=list(STRATEGIES), choices=STRATEGIES)
    p.add_argument("--machines", type=int, default=2)
    p.add_argument("--workers-per-machine", type=int, default=2)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--steps-per-epoch", type=int, default=80)
    p.add_argument("--repeats", type=int, default=2, help="interleaved rounds per strategy")
    p.add_argument("--batch-size", type=int, default=16, help="per worker")
    p.add_argument("--compressor", default="randomk")
    p.add_argument("--ratio", type=float, default=0.01)
    p.add_argument("--timeout-s", type=float, default=1800, help="per training run")
    p.add_argument("--out", default=str(ROOT / "out" / "e2e"), help="logs and metrics")
    p.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "e2e.json"))
    p.add_argument("-v", "--verbose", action="store_true", help="stream rank 0's output")
    p.add_argument("train_args", nargs=argparse.REMAINDER,
                   help="after --: extra arguments for examples/train.py")
    args = p.parse_args()
    args.train_args = args.train_args[1:] if args.train_args[:1] == ["--"] else args.train_args
    if os.geteuid() != 0:
        print("e2e: the emulated cluster needs root (network namespaces, tc)", file=sys.stderr)
        return 2
    started = time.time()
    rows = []
    for gbps in args.gbps:
        rows += run_setting(gbps, args, Path(args.out))
    print(_table(rows))
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    result = {"benchmark": "e2e", "host": platform.node(), "cpus": os.cpu_count(),
              "commit": commit,
              "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
              "wall_s": time.time() - started,
              "setup": {k: v for k, v in vars(args).items() if k not in ("json", "out")},
              "rows": rows}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
