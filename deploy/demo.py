"""The main job: train examples/train.py with fp32, then with Espresso, and compare them.

``python -m byteps_espresso.deploy.demo`` (what ``make main`` runs) launches the example model
on a cluster of 2 machines x 2 workers and 1 server twice, once uncompressed (fp32) and once
with ``Compression.espresso`` (profile, plan per tensor, train). As root it uses the
emulated cluster (every machine in its own network namespace, links shaped to
``--inter-gbps``); otherwise, or with ``--local``, loopback, and it says why. It prints:

* the strategy in use (one Option per tensor, predicted iteration time) and the trials,
* per run: the training time until the loss on a fixed held-out batch first reaches the
  target (``--target-loss``, default fp32's final held-out loss x1.05), the final held-out
  loss, the throughput and Espresso's start-up (profiling, planning, trials),
* Espresso against fp32 on all three, whether the strategy compresses anything, and the
  path of the predicted-timeline picture (Espresso's strategy above fp32's).

Everything lands in ``--out`` (default ``out/demo``): one log per run with every process's
prefixed output, the metrics JSON written by rank 0, the measured profile and strategy, and
the picture.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = ["TARGET_FACTOR", "RunResult", "Startup", "compressed_tensors", "main",
           "profile_steps", "run_training", "target_loss", "target_note"]

# The default target of "time to accuracy": fp32's final held-out loss times this factor
# (issue "Time to accuracy": within 5% of what uncompressed training reaches).
TARGET_FACTOR = 1.05
# Rank 0's log line for the planner's search (worker/profiler.py), in milliseconds.
_PLANNED = re.compile(r"^\[worker 0\].*planned in ([0-9.]+) ms")
# Rank 0's log line for loading the planner's kernels (and the cluster's trees, and timing
# the kernels alone) before the first step, in seconds.
_LOADED = re.compile(r"^\[worker 0\].*loaded the planner's kernels in ([0-9.]+) s"
                     r"(?: and this cluster's trees in ([0-9.]+) s)?"
                     r"(?:, timed the kernels alone in ([0-9.]+) s)?")

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
        """The last epoch's mean training loss (over the ranks)."""
        return self.metrics["history"][-1]["loss"]

    @property
    def heldout(self) -> list[dict]:
        """``{"step", "elapsed_s", "heldout_loss"}`` per evaluation (``--eval-every``)."""
        return list(self.metrics.get("heldout") or [])

    @property
    def final_heldout(self) -> float | None:
        """The held-out loss after the last step (None without ``--eval-every``)."""
        return self.heldout[-1]["heldout_loss"] if self.heldout else None

    def time_to(self, target: float) -> float | None:
        """Training seconds until the held-out loss first reached ``target`` (None: never)."""
        return next((e["elapsed_s"] for e in self.heldout if e["heldout_loss"] <= target), None)

    def startup(self, profile_steps: int, profile: Path | None) -> Startup:
        """Where the start-up went: profiled iterations, planning, trials of the finalists.

        Args:
            profile_steps: the job's ``ESPRESSO_PROFILE_STEPS`` (0 for fp32: no start-up).
            profile: the run's ``ESPRESSO_PROFILE_OUT`` folder (for ``trials.json``).
        """
        ends = self.metrics.get("steps_elapsed_s") or []
        if profile_steps == 0 or not ends:
            return Startup(0.0, 0.0, 0.0)
        planning = before = 0.0
        for line in self.log.read_text(errors="replace").splitlines():
            match = _PLANNED.match(line)
            if match:
                planning = float(match.group(1)) / 1e3
            match = _LOADED.match(line)
            if match:
                before = sum(float(g) for g in match.groups() if g is not None)
        planned_at = ends[min(profile_steps, len(ends)) - 1]  # the last profiled step plans
        start = profile_steps  # the step the trials begin at (later after a warm-up)
        trial_steps = 0
        trials = profile / "trials.json" if profile is not None else None
        if trials is not None and trials.exists():
            data = json.loads(trials.read_text())
            trial_steps = sum(len(f["iteration_ms"]) for f in data["finalists"])
            if trial_steps:  # none: the start-up budget kept the plan, which ran from here
                start = max(start, int(data.get("start", start)))
        start = min(start, len(ends))
        steps = min(start + trial_steps, len(ends))
        begun = ends[start - 1]
        return Startup(planned_at - planning, planning, ends[steps - 1] - begun,
                       warmup_s=begun - planned_at, before_s=before, steps=steps)


@dataclass(frozen=True)
class Startup:
    """Seconds from the first step to the first iteration under the kept strategy.

    Attributes:
        profiling_s: the profiled (uncompressed) iterations, planning left out.
        planning_s: the planner's search (rank 0's "planned in" log line).
        trials_s: the finalists' trial iterations (0 without trials).
        warmup_s: the planned strategy's iterations before the trials, while the compressor's
            schedule runs (dgc's sparsity warm-up; worker/optimizer.py): training under the
            plan, part of the start-up only in that the kept strategy comes after them.
        before_s: before the first step, outside the training clock: rank 0 loading the
            planner's kernels and timing the compressor's kernels alone (once per process).
        steps: the steps until the first under the kept strategy (profiled + trials).
    """

    profiling_s: float
    planning_s: float
    trials_s: float
    warmup_s: float = 0.0
    before_s: float = 0.0
    steps: int = 0

    @property
    def total_s(self) -> float:
        return self.profiling_s + self.planning_s + self.warmup_s + self.trials_s

    def beyond_s(self, fp32: RunResult) -> float | None:
        """Seconds beyond what ``fp32``'s run took for the same first :attr:`steps` (the
        start-up's steps train the model too; fp32's first steps are slow as well)."""
        ends = fp32.metrics.get("steps_elapsed_s") or []
        if not self.steps or len(ends) < self.steps:
            return None
        return self.total_s - ends[self.steps - 1]

    def text(self, fp32_iteration_ms: float | None = None,
             fp32: RunResult | None = None) -> str:
        """``"4.1 s (profiling 2.0 + planning 0.1 + trials 2.0)"``, in fp32 iterations too,
        with the time beyond fp32's same steps and what ran before the first step."""
        if self.total_s == 0:
            return "none"
        per = (f" = {self.total_s * 1e3 / fp32_iteration_ms:.0f} fp32 iterations"
               if fp32_iteration_ms else "")
        beyond = self.beyond_s(fp32) if fp32 is not None else None
        if beyond is not None:
            per += f"; {beyond:.1f} s beyond fp32's first {self.steps} steps"
            if fp32_iteration_ms:
                per += f" (= {beyond * 1e3 / fp32_iteration_ms:.0f})"
        if self.before_s:
            per += (f"; before the first step: {self.before_s:.2f} s loading the planner "
                    "and timing the kernels alone")
        warmup = (f" + the plan through the compressor's warm-up {self.warmup_s:.1f}"
                  if self.warmup_s else "")
        return (f"{self.total_s:.1f} s (profiling {self.profiling_s:.1f} + planning "
                f"{self.planning_s:.2f}{warmup} + trials {self.trials_s:.1f}){per}")


def target_loss(fp32_runs: Sequence[RunResult], given: float | None) -> float:
    """The held-out loss to reach: ``given``, else fp32's final one (median) x TARGET_FACTOR.

    Raises:
        ValueError: no target given and no fp32 run with held-out losses to derive it from.
    """
    if given is not None:
        return given
    finals = [r.final_heldout for r in fp32_runs if r.final_heldout is not None]
    if not finals:
        raise ValueError("no target loss: run fp32 with --eval-every > 0 or pass --target-loss")
    return statistics.median(finals) * TARGET_FACTOR


def target_note(runs: Sequence[RunResult], target: float) -> str | None:
    """A warning when ``target`` is no target: the loss before training already meets it."""
    start = [r.heldout[0]["heldout_loss"] for r in runs if r.heldout]
    if start and min(start) <= target:
        return (f"note: the loss before training ({min(start):.4f}) already meets the target "
                f"{target:.4f}, so times to it are 0; train longer or pass --target-loss")
    return None


def profile_steps(env: Mapping[str, str]) -> int:
    """The profiled iterations of a ``Compression.espresso`` job run with ``env``
    (``ESPRESSO_PROFILE_STEPS`` parsed as the workers parse it; at least 1)."""
    from byteps_espresso.config import VARIABLES

    var = next(v for v in VARIABLES if v.attr == "profile_steps")
    raw = env.get(var.name)
    return max(1, var.parse(raw) if raw else var.default)


def compressed_tensors(profile: Path) -> tuple[int, int]:
    """(tensors compressed, tensors) by the strategy in use (``profile/strategy.json``)."""
    from byteps_espresso.strategy import Strategy

    options = Strategy.load(profile / "strategy.json").options
    return sum(o.is_compressed for o in options.values()), len(options)


def launcher_args(args: argparse.Namespace) -> list[str]:
    """The ``espresso-launch`` options for the cluster ``args`` describes."""
    mode = ["--emulate", "--inter-gbps", str(args.inter_gbps)] if args.emulate else ["--local"]
    # (args.emulate is settled by _cluster_mode before this is called)
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

    _, cluster, costs = read_profile(profile)
    strategy = Strategy.load(profile / "strategy.json")
    # the workload as planned: one tensor per bucket when the plan fuses
    workload = strategy.workload
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
    p.add_argument("--compressor", default="efsignsgd")
    p.add_argument("--ratio", type=float, default=0.01, help="sparsifiers' kept fraction")
    p.add_argument("--eval-every", type=int, default=10,
                   help="steps between held-out loss evaluations (time-to-accuracy resolution)")
    p.add_argument("--target-loss", type=float, default=None,
                   help=f"held-out loss to reach (default: fp32's final x{TARGET_FACTOR})")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--emulate", action="store_true", default=None,
                       help="emulated cluster (needs root; the default as root)")
    where.add_argument("--local", action="store_true",
                       help="loopback cluster (the default when not root)")
    p.add_argument("--inter-gbps", type=float, default=1.0,
                   help="link speed of the emulated cluster, Gbit/s")
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
    if args.eval_every < 1:
        print("demo: --eval-every must be >= 1 (time to accuracy needs held-out losses)",
              file=sys.stderr)
        return 2
    out = Path(args.out)
    extra = args.train_args[1:] if args.train_args[:1] == ["--"] else args.train_args
    base = [sys.executable, str(train_script), "--epochs", str(args.epochs),
            "--steps-per-epoch", str(args.steps_per_epoch), "--eval-every",
            str(args.eval_every), *extra]
    params = {"ratio": args.ratio} if args.compressor in ("randomk", "topk", "dgc") else {}
    espresso = ["--compression", "espresso", "--compressor", args.compressor]
    if "ratio" in params:
        espresso += ["--ratio", str(args.ratio)]
    try:
        where = _cluster_mode(args)
    except RuntimeError as exc:
        print(f"demo: {exc}", file=sys.stderr)
        return 2
    cluster = launcher_args(args)
    profile = (out / "profile").resolve()
    shape = (f"{args.machines} machines x {args.workers_per_machine} workers, "
             f"{args.servers} server(s), {args.epochs} x {args.steps_per_epoch} steps")
    try:
        print(f"[1/2] fp32 on the {where} ({shape})", flush=True)
        fp32 = run_training("fp32", cluster, [*base, "--compression", "fp32"], out, env=env)
        print(f"[2/2] espresso ({args.compressor} {params}) on the same cluster", flush=True)
        esp_env = {**env, "ESPRESSO_PROFILE_OUT": str(profile)}
        esp = run_training("espresso", cluster, [*base, *espresso], out, env=esp_env)
    except RuntimeError as exc:
        print(f"demo: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("demo: interrupted", file=sys.stderr)
        return 130
    startup = esp.startup(profile_steps(esp_env), profile)
    _report(fp32, esp, profile, out, compressor=args.compressor, params=params,
            target=target_loss([fp32], args.target_loss), startup=startup)
    return 0


def _cluster_mode(args: argparse.Namespace) -> str:
    """Settle ``args.emulate`` (emulated as root unless ``--local``) and describe the cluster.

    Raises:
        RuntimeError: ``--emulate`` was asked for on a host that cannot emulate.
    """
    from byteps_espresso.deploy.emulate import EmulationError, check_host

    if args.local:
        args.emulate = False
        return "loopback cluster (--local)"
    try:
        check_host()
    except EmulationError as exc:
        if args.emulate:
            raise RuntimeError(str(exc)) from None
        args.emulate = False
        return f"loopback cluster, no shaped links ({exc})"
    args.emulate = True
    return f"emulated cluster, links shaped to {args.inter_gbps:g} Gbit/s"


def _report(fp32: RunResult, esp: RunResult, profile: Path, out: Path, *, compressor: str,
            params: dict, target: float, startup: Startup) -> None:
    from byteps_espresso.worker.check import check_text
    from byteps_espresso.worker.trials import table

    from byteps_espresso.strategy import Strategy

    strategy = Strategy.load(profile / "strategy.json")
    print("\n== strategy in use (rank 0, planned from the profiled first iterations) ==")
    print(strategy.summary())
    trials = profile / "trials.json"
    if trials.exists():
        data = json.loads(trials.read_text())
        print(f"\n== measured trials (up to {data['steps']} iterations each, the first a "
              "warm-up) ==")
        print(table([(f["algorithm"], f["predicted_ms"], f["measured_ms"])
                     for f in data["finalists"]], data["kept"],
                    {f["algorithm"] for f in data["finalists"] if f.get("stopped_early")},
                    {f["algorithm"] for f in data["finalists"] if f.get("profiled")}))
    check = profile / "check.json"
    if check.exists():
        print("\n== the strategy in use checked against the model ==")
        print(check_text(json.loads(check.read_text())))
    picture = draw_predicted_timeline(profile, out.resolve() / "timeline.png", compressor,
                                      params)
    compressed, tensors = compressed_tensors(profile)
    print(f"\n== time to accuracy: held-out loss <= {target:.4f} "
          f"(fp32's final {fp32.final_heldout:.4f}; training seconds, evaluation left out) ==")
    print(f"{'run':10} {'to target':>10} {'final loss':>11} {'samples/s':>10} {'iter ms':>9}  "
          "start-up")
    for run in (fp32, esp):
        reached = run.time_to(target)
        to_target = f"{reached:9.1f}s" if reached is not None else f"{'never':>10}"
        start = startup.text(fp32.iteration_ms, fp32) if run is esp else "none"
        print(f"{run.name:10} {to_target} {run.final_heldout:11.4f} {run.samples_per_s:10.1f} "
              f"{run.iteration_ms:9.2f}  {start}")
    note = target_note([fp32, esp], target)
    if note:
        print(note)
    print(f"\n{_verdict(fp32, esp, target)}")
    if compressed == 0:
        print(f"the strategy in use compresses nothing: all {tensors} tensors run uncompressed "
              f"({strategy.algorithm}); the difference to fp32 is the uncompressed path alone")
    else:
        print(f"the strategy in use compresses {compressed} of {tensors} tensors with "
              f"{compressor} {params} ({strategy.algorithm}, predicted iteration "
              f"{strategy.predicted_ms:.2f} ms; the planner's fp32 baseline "
              f"{strategy.baselines.get('fp32', float('nan')):.2f} ms)")
    print(f"best possible loss (chain entropy): {esp.metrics['entropy']:.4f}")
    print(f"predicted-timeline picture: {picture}")
    print(f"logs and metrics: {out.resolve()}")


def _verdict(fp32: RunResult, esp: RunResult, target: float) -> str:
    """Espresso against fp32: time to the target, final loss and throughput, side by side."""
    loss = f"final held-out loss {esp.final_heldout / fp32.final_heldout:.3f}x fp32's"
    speed = f"throughput {esp.samples_per_s / fp32.samples_per_s:.2f}x"
    t_esp, t_fp32 = esp.time_to(target), fp32.time_to(target)
    if t_esp is None:
        return f"espresso vs fp32: never reached the target; {loss}, {speed}"
    if t_fp32 is None:
        return f"espresso vs fp32: reached the target, fp32 did not; {loss}, {speed}"
    if t_fp32 <= 0:  # met before training (see target_note)
        return f"espresso vs fp32: both met the target before training; {loss}, {speed}"
    return (f"espresso vs fp32: time to target {t_esp / t_fp32:.2f}x fp32's, {loss}, {speed}")


if __name__ == "__main__":
    sys.exit(main())
