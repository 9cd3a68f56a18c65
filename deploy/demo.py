"""The main job: train examples/train.py on the local cluster with fp32, then with Espresso.

``python -m byteps_espresso.deploy.demo`` (what ``make main`` runs) launches the example model
on the embedded default cluster (2 machines x 2 workers, 1 server, all on this host) twice,
once uncompressed (fp32) and once with ``Compression.espresso`` (profile, plan per tensor,
train), and prints:

* the planned strategy summary (one Option per tensor, predicted iteration time),
* both runs' throughput and final loss, and Espresso's throughput against fp32,
* the path of the predicted-timeline picture (Espresso's strategy above fp32's).

Everything lands in ``--out`` (default ``out/demo``): one log per run with every process's
prefixed output, the metrics JSON written by rank 0, the measured profile and strategy, and
the picture. ``--emulate --inter-gbps G`` runs it on the emulated cluster instead (root).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = ["RunResult", "main", "run_training"]

# Lines of the launcher's output shown live: rank 0's progress bar and per-epoch summary,
# and the launcher's own verdict. Everything is also written to the run's log file.
def _is_live(line: str) -> bool:
    return (line.startswith("[worker 0]") and "epoch" in line) or line.startswith(
        ("espresso-launch:", "Traceback"))


@dataclass(frozen=True)
class RunResult:
    """One training run: its metrics (from rank 0's JSON) and where its files are."""

    name: str
    metrics: dict
    log: Path

    @property
    def samples_per_s(self) -> float:
        """Median throughput over the epochs after the first (the first profiles and plans)."""
        rows = self.metrics["history"]
        steady = rows[1:] or rows
        return statistics.median(r["samples_per_s"] for r in steady)

    @property
    def iteration_ms(self) -> float:
        """Median iteration time over the epochs after the first."""
        rows = self.metrics["history"]
        steady = rows[1:] or rows
        return statistics.median(r["iteration_ms_median"] for r in steady)

    @property
    def final_loss(self) -> float:
        return self.metrics["history"][-1]["loss"]


def launcher_args(args: argparse.Namespace) -> list[str]:
    """The ``espresso-launch`` options for the cluster ``args`` describes."""
    mode = ["--emulate", "--inter-gbps", str(args.inter_gbps)] if args.emulate else ["--local"]
    return [*mode, "--machines", str(args.machines),
            "--workers-per-machine", str(args.workers_per_machine),
            "--servers", str(args.servers)]


def run_training(name: str, cluster: Sequence[str], train: Sequence[str], out: Path, *,
                 env: dict[str, str], live: bool = True, timeout_s: float = 1800) -> RunResult:
    """Launch one training job, stream rank 0's lines, return rank 0's metrics.

    Args:
        name: run name; files are ``out/<name>.log`` and ``out/<name>.json``.
        cluster: launcher options (``--local --machines ...``).
        train: the training command without ``--metrics-out``.
        out: output folder (created).
        env: the job's environment.
        live: copy rank 0's lines to stdout while it runs.
        timeout_s: the whole job's wall-clock limit.

    Raises:
        RuntimeError: the job failed or timed out; the message names the log file.
    """
    out.mkdir(parents=True, exist_ok=True)
    log_path, metrics_path = out / f"{name}.log", out / f"{name}.json"
    metrics_path.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "byteps_espresso.deploy.launch", *cluster, "--",
           *train, "--metrics-out", str(metrics_path)]
    with log_path.open("w") as log, subprocess.Popen(
            cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
        try:
            for line in proc.stdout:
                log.write(line)
                if live and _is_live(line):
                    print(f"  {line.rstrip()}", flush=True)
            proc.wait(timeout=timeout_s)
        except (KeyboardInterrupt, subprocess.TimeoutExpired):
            proc.terminate()  # the launcher stops every process of the job
            proc.wait()
            raise
    if proc.returncode != 0 or not metrics_path.exists():
        raise RuntimeError(f"the {name} run failed (exit code {proc.returncode}); "
                           f"see {log_path}")
    return RunResult(name, json.loads(metrics_path.read_text()), log_path)


def draw_predicted_timeline(profile: Path, picture: Path, compressor: str,
                            params: dict) -> Path:
    """Draw the predicted timeline of the strategy in use (``strategy.json``: the planned one,
    or the finalist the trials kept) above fp32's, priced on the measured profile.

    Returns:
        the picture's path.
    """
    from byteps_espresso.worker.profiler import read_profile

    from byteps_espresso.strategy import Constraints, Strategy
    from byteps_espresso.strategy.baselines import get
    from byteps_espresso.strategy.context import PlanContext
    from byteps_espresso.strategy.plot import draw_timelines

    workload, cluster, costs = read_profile(profile)
    strategy = Strategy.load(profile / "strategy.json")
    ctx = PlanContext(workload, cluster, compressor, params, costs, Constraints())
    fp32 = get("fp32").run(ctx)
    chosen = ctx.index([strategy.options[name] for name in workload.names])
    timelines = {"chosen": ctx.evaluator.timeline(chosen),
                 "fp32": ctx.evaluator.timeline(fp32.choice)}
    draw_timelines(timelines, picture, title=f"examples/train.py on {cluster.machines} x "
                   f"{cluster.gpus_per_machine} workers: predicted iteration, {compressor} "
                   f"{params}, {strategy.algorithm}")
    return picture


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m byteps_espresso.deploy.demo",
                                description=__doc__.splitlines()[0])
    p.add_argument("--train", default="examples/train.py", help="the training script")
    p.add_argument("--out", default="out/demo", help="folder for logs, metrics and picture")
    p.add_argument("--machines", type=int, default=2)
    p.add_argument("--workers-per-machine", type=int, default=2)
    p.add_argument("--servers", type=int, default=1)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--steps-per-epoch", type=int, default=100)
    p.add_argument("--compressor", default="randomk")
    p.add_argument("--ratio", type=float, default=0.01)
    p.add_argument("--emulate", action="store_true", help="emulated cluster (needs root)")
    p.add_argument("--inter-gbps", type=float, default=1.0, help="with --emulate")
    p.add_argument("train_args", nargs=argparse.REMAINDER,
                   help="after --: extra arguments for the training script")
    return p


def main(argv: Sequence[str] | None = None, environ: dict[str, str] | None = None) -> int:
    """Run the fp32 and Espresso jobs and print the comparison; returns the exit code."""
    import os

    args = _parser().parse_args(argv)
    env = dict(os.environ if environ is None else environ)
    train_script = Path(args.train)
    if not train_script.is_file():
        print(f"demo: {train_script} not found; run from the repository root or pass --train",
              file=sys.stderr)
        return 2
    out = Path(args.out)
    extra = args.train_args[1:] if args.train_args[:1] == ["--"] else args.train_args
    base = [sys.executable, str(train_script), "--epochs", str(args.epochs),
            "--steps-per-epoch", str(args.steps_per_epoch), *extra]
    params = {"ratio": args.ratio} if args.compressor in ("randomk", "topk", "dgc") else {}
    espresso = ["--compression", "espresso", "--compressor", args.compressor]
    if "ratio" in params:
        espresso += ["--ratio", str(args.ratio)]
    cluster = launcher_args(args)
    profile = (out / "profile").resolve()
    shape = (f"{args.machines} machines x {args.workers_per_machine} workers, "
             f"{args.servers} server(s), {args.epochs} x {args.steps_per_epoch} steps")
    try:
        print(f"[1/2] fp32 on the {'emulated' if args.emulate else 'local'} cluster "
              f"({shape})", flush=True)
        fp32 = run_training("fp32", cluster, [*base, "--compression", "fp32"], out, env=env)
        print(f"[2/2] espresso ({args.compressor} {params}) on the same cluster", flush=True)
        esp = run_training("espresso", cluster, [*base, *espresso], out,
                           env={**env, "ESPRESSO_PROFILE_OUT": str(profile)})
    except RuntimeError as exc:
        print(f"demo: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("demo: interrupted", file=sys.stderr)
        return 130
    _report(fp32, esp, profile, out, compressor=args.compressor, params=params)
    return 0


def _report(fp32: RunResult, esp: RunResult, profile: Path, out: Path, *, compressor: str,
            params: dict) -> None:
    from byteps_espresso.worker.trials import table

    from byteps_espresso.strategy import Strategy

    strategy = Strategy.load(profile / "strategy.json")
    print("\n== strategy in use (rank 0, planned from the profiled first iterations) ==")
    print(strategy.summary())
    trials = profile / "trials.json"
    if trials.exists():
        data = json.loads(trials.read_text())
        print(f"\n== measured trials ({data['steps']} iterations each, the first a warm-up) ==")
        print(table([(f["algorithm"], f["predicted_ms"], f["measured_ms"])
                     for f in data["finalists"]], data["kept"]))
    picture = draw_predicted_timeline(profile, out.resolve() / "timeline.png", compressor,
                                      params)
    speedup = esp.samples_per_s / fp32.samples_per_s
    print("\n== results (median over the epochs after the first) ==")
    print(f"{'run':10} {'samples/s':>10} {'iter ms':>9} {'final loss':>11}")
    for run in (fp32, esp):
        print(f"{run.name:10} {run.samples_per_s:10.1f} {run.iteration_ms:9.2f} "
              f"{run.final_loss:11.4f}")
    print(f"\nespresso throughput vs fp32: {speedup:.2f}x (strategy in use: "
          f"{strategy.algorithm}, predicted iteration {strategy.predicted_ms:.2f} ms; the "
          f"planner's fp32 baseline {strategy.baselines.get('fp32', float('nan')):.2f} ms)")
    print(f"best possible loss (chain entropy): {esp.metrics['entropy']:.4f}")
    print(f"predicted-timeline picture: {picture}")
    print(f"logs and metrics: {out.resolve()}")


if __name__ == "__main__":
    sys.exit(main())
