"""End-to-end: time to accuracy of examples/train.py on the emulated cluster, fp32 vs Espresso.

2 machines x 2 workers and 1 server machine, each in its own network namespace, links
shaped with tc to each ``--gbps`` setting (default 1 Gbit/s and 0.25 Gbit/s). For every
setting, each strategy trains the example model for the same steps, with each compressor of
``--compressors`` (default EFSignSGD, DGC and random-k):

    fp32      Compression.none (uncompressed PS / collectives); once per setting and round
    espresso  Compression.espresso(compressor), algorithm "espresso" (Algorithms 1+2), then
              measured trials of its finalists (worker/trials.py; "kept" says which)
    all-gpu   every tensor compressed on the GPU (baseline; on request)
    cpu-only  every compression on the host CPUs (baseline; on request)
    powersgd  Compression.powersgd(--powersgd-rank, sums=--powersgd-sums): PowerSGD on every
              bucket, its sums on the collectives or the servers, no planning (on request);
              once per setting and round

The yardstick is time to accuracy: every ``--eval-every`` steps each run evaluates its loss
on one fixed held-out batch (examples/train.py ``--eval-every``; evaluation time is left out
of the clock). Per run: the training seconds until the held-out loss first reaches the
target (``--target-loss``, default fp32's final held-out loss x1.05, median over rounds),
the final held-out loss, the throughput (global batch over the median iteration time of the
epochs after the first) and the start-up split into profiling, planning, the plan's
iterations through a compressor's warm-up (the trials wait for its steady state) and trials
(rank 0's step clock, its "planned in" log line and ``trials.json``), also in fp32
iterations, and what it cost beyond the same first steps of the round's fp32 run ("beyond",
fp32 iterations). Each
strategy runs ``--repeats`` times, interleaved with the others (so slow phases of a shared,
noisy machine hit every strategy alike); the table shows medians over the rounds. The
planner's predicted iteration time (``predicted_ms`` written by rank 0; fp32's: BytePS'
uncompressed path priced on an Espresso run's measured profile) is kept beside the measured
one. Prints the tables and writes benchmarks/results/e2e.json. Needs root (network
namespaces).

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

from byteps_espresso.deploy.demo import (
    TARGET_FACTOR,
    RunResult,
    compressed_tensors,
    profile_steps,
    run_training,
    target_loss,
    target_note,
)
from train import fp32_prediction  # benchmarks/train.py

STRATEGIES = ("fp32", "espresso", "all-gpu", "cpu-only", "powersgd")
# Strategies that run one fixed scheme whatever --compressors says (no planning, no start-up).
FIXED = ("fp32", "powersgd")
# The compressors of the recipes that keep accuracy (EFSignSGD, DGC) and random-k, the
# compressor the earlier tables used, reported beside them.
COMPRESSORS = ("efsignsgd", "dgc", "randomk")
SPARSIFIERS = ("randomk", "topk", "dgc")  # the ones examples/train.py passes --ratio to
ROOT = Path(__file__).resolve().parents[1]


def _train_args(strategy: str, compressor: str, args: argparse.Namespace) -> list[str]:
    base = [sys.executable, str(ROOT / "examples" / "train.py"), "--quiet",
            "--batch-size", str(args.batch_size), "--eval-every", str(args.eval_every),
            "--epochs", str(args.epochs), "--steps-per-epoch", str(args.steps_per_epoch),
            *args.train_args]
    if strategy == "fp32":
        return [*base, "--compression", "fp32"]
    if strategy == "powersgd":
        return [*base, "--compression", "powersgd", "--powersgd-rank", str(args.powersgd_rank),
                "--powersgd-sums", args.powersgd_sums]
    low_rank = ["--param", f"rank={args.powersgd_rank}"] if compressor == "powersgd" else []
    return [*base, "--compression", "espresso", "--compressor", compressor,
            "--ratio", str(args.ratio), "--algorithm", strategy, *low_rank]


def _params(strategy: str, compressor: str, args: argparse.Namespace) -> dict:
    if compressor == "powersgd":  # planned, the planner chooses where each bucket's sums run
        return {"rank": args.powersgd_rank} | (
            {"sums": args.powersgd_sums} if strategy == "powersgd" else {})
    return {"ratio": args.ratio} if compressor in SPARSIFIERS else {}


def _cluster(gbps: float, args: argparse.Namespace) -> list[str]:
    return ["--emulate", "--inter-gbps", str(gbps), "--machines", str(args.machines),
            "--workers-per-machine", str(args.workers_per_machine), "--servers", "1"]


def _median(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _cells(args: argparse.Namespace) -> list[tuple[str, str]]:
    """(strategy, compressor) pairs to run; the fixed schemes once."""
    return [(s, c) for s in args.strategies
            for c in ([{"fp32": "-"}.get(s, s)] if s in FIXED else args.compressors)]


def _row(gbps: float, cell: tuple[str, str], runs: list[RunResult], *,
         profiles: list[Path | None], predicted: list, target: float,
         args: argparse.Namespace, fp32_runs: list[RunResult]) -> dict:
    strategy, compressor = cell
    measured = _median([r.iteration_ms for r in runs])
    predicted_ms = _median(predicted)
    error = None if predicted_ms is None else abs(predicted_ms - measured) / measured
    global_batch = args.batch_size * runs[0].metrics["world_size"]
    steps = 0 if strategy in FIXED else profile_steps(os.environ)
    startups = [r.startup(steps, prof) for r, prof in zip(runs, profiles, strict=True)]
    # What each start-up cost beyond the same first steps of its round's fp32 run (those
    # steps train the model in both); fp32_runs holds one run per round, or none.
    beyond = [s.beyond_s(f) for s, f in zip(startups, fp32_runs, strict=False) if s.steps]
    reached = [r.time_to(target) for r in runs]
    return {"gbps": gbps, "strategy": strategy, "compressor": compressor,
            "params": _params(strategy, compressor, args) if strategy != "fp32" else {},
            "target_loss": target,
            "time_to_target_s": _median(reached), "time_to_target_s_runs": reached,
            "reached": sum(t is not None for t in reached),
            "final_heldout_loss": _median([r.final_heldout for r in runs]),
            "final_heldout_loss_runs": [r.final_heldout for r in runs],
            "heldout": [r.heldout for r in runs],
            "final_train_loss": _median([r.final_loss for r in runs]),
            "samples_per_s": global_batch / measured * 1e3,
            "iteration_ms": measured, "iteration_ms_runs": [r.iteration_ms for r in runs],
            "epoch_samples_per_s": [r.samples_per_s for r in runs],
            "predicted_ms": predicted_ms, "prediction_error": error,
            "startup_s": _median([s.total_s for s in startups]),
            "startup_beyond_fp32_s": _median([b for b in beyond if b is not None]),
            "startup_runs": [{"profiling_s": s.profiling_s, "planning_s": s.planning_s,
                              "warmup_s": s.warmup_s, "trials_s": s.trials_s,
                              "before_first_step_s": s.before_s,
                              "steps": s.steps} for s in startups],
            # per run: (tensors compressed, tensors) by the strategy it ended with
            "compressed_tensors": [compressed_tensors(p) if p is not None else None
                                   for p in profiles],
            # the strategy each run ended with (espresso: the finalist its trials kept)
            "kept": [r.metrics.get("algorithm") for r in runs]}


def run_setting(gbps: float, args: argparse.Namespace, out: Path) -> list[dict]:
    """Every (strategy, compressor) on links of ``gbps``, ``args.repeats`` interleaved rounds."""
    cells = _cells(args)
    runs: dict[tuple[str, str], list[RunResult]] = {c: [] for c in cells}
    profiles: dict[tuple[str, str], list[Path | None]] = {c: [] for c in cells}
    for rep in range(args.repeats):
        for strategy, compressor in cells:
            print(f"-- {gbps:g} Gbit/s: {strategy} {compressor} (round {rep + 1}/"
                  f"{args.repeats})", flush=True)
            label = strategy if strategy in FIXED else f"{strategy}-{compressor}"
            name = f"{gbps:g}gbps-{label}-{rep}"
            env = dict(os.environ)
            profile = None if strategy in FIXED else (out / f"{name}-profile").resolve()
            if profile is not None:
                env["ESPRESSO_PROFILE_OUT"] = str(profile)
            runs[(strategy, compressor)].append(run_training(
                name, _cluster(gbps, args), _train_args(strategy, compressor, args), out,
                env=env, live=args.verbose, timeout_s=args.timeout_s))
            profiles[(strategy, compressor)].append(profile)
    target = target_loss(runs.get(("fp32", "-"), []), args.target_loss)
    note = target_note([r for done in runs.values() for r in done], target)
    if note:
        print(note, flush=True)
    rows = []
    for cell, done in runs.items():
        strategy, compressor = cell
        if strategy == "fp32":
            espresso = next((c for c in cells if c[0] == "espresso"), None)
            predicted = [] if espresso is None else [
                fp32_prediction(p, espresso[1], _params("espresso", espresso[1], args))
                for p in profiles[espresso]]
        else:
            predicted = [r.metrics.get("predicted_ms") for r in done]
        rows.append(_row(gbps, cell, done, profiles=profiles[cell], predicted=predicted,
                         target=target, args=args, fp32_runs=runs.get(("fp32", "-"), [])))
        if strategy == "espresso":
            rows[-1]["trials"] = [_trials(p) for p in profiles[cell]]
            rows[-1]["checks"] = [_check(p) for p in profiles[cell]]
    fp32 = next((r for r in rows if r["strategy"] == "fp32"), None)
    for row in rows:
        row["vs_fp32"] = row["samples_per_s"] / fp32["samples_per_s"] if fp32 else None
        both = fp32 is not None and row["time_to_target_s"] is not None and bool(
            fp32["time_to_target_s"])  # None: never reached; 0: met before training
        row["time_vs_fp32"] = row["time_to_target_s"] / fp32["time_to_target_s"] if both \
            else None
        row["loss_vs_fp32"] = row["final_heldout_loss"] / fp32["final_heldout_loss"] if fp32 \
            else None
        row["startup_fp32_iterations"] = (row["startup_s"] * 1e3 / fp32["iteration_ms"]
                                          if fp32 else None)
        beyond = row["startup_beyond_fp32_s"]
        row["startup_beyond_fp32_iterations"] = (beyond * 1e3 / fp32["iteration_ms"]
                                                 if fp32 and beyond is not None else None)
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


def _check(profile: Path) -> dict | None:
    """What the check of the kept strategy found (``check.json``, worker/check.py), without
    the options and the timed runs."""
    path = profile / "check.json"
    if not path.exists():  # no check: too few steps after the warm-up, or switched off
        return None
    data = json.loads(path.read_text())
    entry = ("algorithm", "predicted_ms", "measured_ms")
    return {**{k: data.get(k) for k in ("start", "factors", "kept_refitted_ms",
                                         "replanned_predicted_ms", "replan_ms", "fp32_ms",
                                         "stayed")},
            "kept": {k: data["kept"][k] for k in entry},
            "replanned": None if data["replanned"] is None
            else {k: data["replanned"][k] for k in entry}}


def _fmt(value: float | None, spec: str, width: int, none: str = "-", unit: str = "") -> str:
    """``value`` with ``unit`` right-aligned in ``width`` characters, or ``none``."""
    text = f"{value:{spec}}{unit}" if value is not None else none
    return f"{text:>{width}}"


def _accuracy_table(rows: list[dict]) -> str:
    """The leading table: time to the target loss, final loss and start-up per strategy."""
    lines = [f"{'Gbit/s':>6} {'strategy':9} {'compressor':10} {'to target':>10} {'vs fp32':>8} "
             f"{'final loss':>10} {'vs fp32':>8} {'start-up s':>10} "
             f"{'(prof+plan+warm-up+trials)':>26} "
             f"{'fp32 its':>8} {'beyond':>6}  compressed"]
    for r in rows:
        never = f"never {r['reached']}/{len(r['time_to_target_s_runs'])}"
        parts = r["startup_runs"]
        split = "+".join(f"{_median([p[k] for p in parts]):.1f}"
                         for k in ("profiling_s", "planning_s", "warmup_s", "trials_s"))
        comp = ",".join("-" if c is None else ("none" if c[0] == 0 else f"{c[0]}/{c[1]}")
                        for c in r["compressed_tensors"])
        lines.append(
            f"{r['gbps']:6g} {r['strategy']:9} {r['compressor']:10} "
            f"{_fmt(r['time_to_target_s'], '.1f', 10, never, 's')} "
            f"{_fmt(r['time_vs_fp32'], '.2f', 8, unit='x')} {r['final_heldout_loss']:10.3f} "
            f"{_fmt(r['loss_vs_fp32'], '.3f', 8, unit='x')} {r['startup_s']:10.1f} {split:>26} "
            f"{_fmt(r['startup_fp32_iterations'], '.0f', 8)} "
            f"{_fmt(r['startup_beyond_fp32_iterations'], '.0f', 6)}  {comp}")
    return "\n".join(lines)


def _speed_table(rows: list[dict]) -> str:
    """Throughput and the planner's prediction, the final loss beside every speedup."""
    lines = [f"{'Gbit/s':>6} {'strategy':9} {'compressor':10} {'samples/s':>10} {'vs fp32':>8} "
             f"{'final loss':>10} {'iter ms':>9} {'predicted':>9} {'error':>6}  kept"]
    for r in rows:
        lines.append(
            f"{r['gbps']:6g} {r['strategy']:9} {r['compressor']:10} {r['samples_per_s']:10.1f} "
            f"{_fmt(r['vs_fp32'], '.2f', 8, unit='x')} {r['final_heldout_loss']:10.3f} "
            f"{r['iteration_ms']:9.1f} {_fmt(r['predicted_ms'], '.1f', 9)} "
            f"{_fmt(r['prediction_error'], '.0%', 6)}  "
            f"{','.join(k or '-' for k in r['kept'])}")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gbps", type=float, nargs="+", default=[1.0, 0.25],
                   help="link settings, Gbit/s (default 1 and 0.25)")
    p.add_argument("--strategies", nargs="+", default=["fp32", "espresso"], choices=STRATEGIES)
    p.add_argument("--compressors", nargs="+", default=list(COMPRESSORS),
                   help="compressors for every strategy but fp32")
    p.add_argument("--machines", type=int, default=2)
    p.add_argument("--workers-per-machine", type=int, default=2)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--steps-per-epoch", type=int, default=80)
    p.add_argument("--repeats", type=int, default=2, help="interleaved rounds per strategy")
    p.add_argument("--batch-size", type=int, default=16, help="per worker")
    p.add_argument("--ratio", type=float, default=0.01, help="sparsifiers' kept fraction")
    # 16: on the LSTM after 160 steps, rank 4 ended 5.2% above fp32's loss, 8 2.1% and 16
    # 0.8%; 16 reaches the target 10 steps sooner than 8 (BENCHMARKS "End-to-end")
    p.add_argument("--powersgd-rank", type=int, default=16, help="for the powersgd strategy")
    p.add_argument("--powersgd-sums", choices=["allreduce", "ps"], default="allreduce",
                   help="for the powersgd strategy: where its sums run")
    p.add_argument("--eval-every", type=int, default=10,
                   help="steps between held-out evaluations (time-to-target resolution)")
    p.add_argument("--target-loss", type=float, default=None,
                   help=f"held-out loss to reach (default: fp32's final x{TARGET_FACTOR})")
    p.add_argument("--timeout-s", type=float, default=1800, help="per training run")
    p.add_argument("--out", default=str(ROOT / "out" / "e2e"), help="logs and metrics")
    p.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "e2e.json"))
    p.add_argument("-v", "--verbose", action="store_true", help="stream rank 0's output")
    p.add_argument("train_args", nargs=argparse.REMAINDER,
                   help="after --: extra arguments for examples/train.py")
    args = p.parse_args()
    args.train_args = args.train_args[1:] if args.train_args[:1] == ["--"] else args.train_args
    if args.eval_every < 1:
        p.error("--eval-every must be >= 1: time to accuracy needs held-out losses")
    if "fp32" not in args.strategies and args.target_loss is None:
        p.error("without fp32 there is no default target: add fp32 or pass --target-loss")
    if os.geteuid() != 0:
        print("e2e: the emulated cluster needs root (network namespaces, tc)", file=sys.stderr)
        return 2
    started = time.time()
    rows = []
    for gbps in args.gbps:
        rows += run_setting(gbps, args, Path(args.out))
    target = sorted({round(r["target_loss"], 4) for r in rows})
    print(f"\n== time to accuracy: held-out loss <= {target} (median over {args.repeats} "
          f"rounds; start-up in seconds and in fp32 iterations) ==")
    print(_accuracy_table(rows))
    print("\n== throughput (median iteration of the epochs after the first) ==")
    print(_speed_table(rows))
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
