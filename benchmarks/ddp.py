"""This runtime side by side with torch DDP: iteration time, final loss, time to a target loss.

Every run is ``benchmarks/ddp_worker.py`` under ``espresso-launch`` on 2 machines x 2 workers
and 1 server (``--servers``), so both runtimes get the same processes, cores (one intra-op
thread each), links and gloo: on loopback (``loopback``) or on the emulated cluster with
shaped links (``1`` and ``0.25`` Gbit/s; needs root). Variants:

    local        no synchronization: every rank steps alone on the same processes and
                 cores (the floor every other variant adds its communication to; its loss
                 is rank 0's own training, not comparable, and it has no time to target)
    ddp          DDP (gloo all-reduce, 25 MiB buckets), uncompressed
    ddp-fp16     DDP with its fp16_compress_hook
    ddp-powersgd DDP with its powerSGD_hook (rank 4)
    espresso     bps.DistributedOptimizer, Compression.none (fp32 PS path, fused buckets)
    espresso-C   bps.DistributedOptimizer, Compression.espresso(C) (profile, plan, trials)
    espresso-powersgd  bps.DistributedOptimizer, Compression.powersgd (rank 4, as the hook)
    espresso-planned-powersgd  Compression.espresso("powersgd"), rank 4 and 10 plain first
                 as the hook, planned per bucket (which buckets, and the dense path of
                 their sums)
    espresso...-tcp  the same with BYTEPS_ENABLE_IPC=0: dense keys over TCP even where a
                 worker shares a host with a server (on loopback every one does)
    espresso-C-kept  the strategy the last run of espresso-C in this cell kept, from its
                 first step (ESPRESSO_STRATEGY: nothing profiled, planned or tried; list it
                 after espresso-C): what that run's start-up cost it

Runs of one (model, link) cell are interleaved ``--repeats`` times, so a slow phase of the
shared host hits every variant alike. Reported per variant: the median iteration over the
second half of the steps (the steady state, after profiling and trials) and rank 0's process
CPU time over the same iterations (every thread: on shared cores what one rank spends is
what the others wait for), the iteration's ratio to DDP's, the final held-out loss, the
training time until the held-out loss first reaches the
target (DDP's final loss x ``--target-factor``; with the runtime's set-up and start-up
included), for the planned runs the planner's predicted iteration against the measured one
(as planned, before the strategy ran, and as the check refitted the model to the kept
strategy's first timed iterations: ``worker/check.py``, read from each run's
``check.json``), the set-up time (wrapping the model or optimizer, slowest rank:
``ddp_worker.py``) and the first iteration. Prints a table and writes benchmarks/results/ddp.json.

    .venv/bin/python benchmarks/ddp.py --settings loopback               # uncompressed
    sudo .venv/bin/python benchmarks/ddp.py --settings 1 0.25 \\
        --variants ddp ddp-fp16 ddp-powersgd espresso espresso-efsignsgd
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

from byteps_espresso.deploy.demo import run_training

ROOT = Path(__file__).resolve().parents[1]
MODELS = ("lstm", "transformer", "mlp")


def _worker_args(variant: str, model: str, args: argparse.Namespace) -> list[str]:
    variant = variant.removesuffix("-kept").removesuffix("-tcp")
    base = [sys.executable, str(ROOT / "benchmarks" / "ddp_worker.py"), "--model", model,
            "--steps", str(args.steps), "--batch-size", str(args.batch_size),
            "--eval-every", str(args.eval_every)]
    if variant == "local":
        return [*base, "--runtime", "local"]
    if variant.startswith("ddp"):
        hook = variant.partition("-")[2] or "none"
        return [*base, "--runtime", "ddp", "--hook", hook]
    compressor = variant.partition("-")[2]
    if not compressor:
        return [*base, "--runtime", "espresso", "--compression", "none"]
    if compressor == "powersgd":
        return [*base, "--runtime", "espresso", "--compression", "powersgd"]
    if compressor == "planned-powersgd":
        return [*base, "--runtime", "espresso", "--compression", "espresso", "--compressor",
                "powersgd"]
    return [*base, "--runtime", "espresso", "--compression", "espresso", "--compressor",
            compressor, "--ratio", str(args.ratio)]


def _cluster(setting: str, servers: int, colocate: bool = False) -> list[str]:
    shape = ["--local"] if setting == "loopback" else [
        "--emulate", "--inter-gbps", setting, *(["--colocate"] if colocate else [])]
    return [*shape, "--machines", "2", "--workers-per-machine", "2", "--servers", str(servers)]


def _median_of(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _refitted_ms(check: Path) -> float | None:
    """The refitted model's prediction of the strategy that trains on after the check (the
    kept one, refitted to its own timed iterations, or the re-planned one, planned on the
    refitted model); None where no check ran, nothing was refitted, or a fall-back stayed."""
    if not check.exists():
        return None
    record = json.loads(check.read_text())
    if record.get("stayed") == "replanned":
        return record["replanned"]["predicted_ms"]
    if record.get("stayed") not in (None, "kept"):  # a fall-back measured faster, not refitted
        return None
    return record.get("kept_refitted_ms")


def _time_to(evals: list[dict], target: float) -> float | None:
    return next((e["train_s"] for e in evals if e["heldout_loss"] <= target), None)


def _cell(model: str, setting: str, args: argparse.Namespace, out: Path) -> list[dict]:
    runs: dict[str, list[dict]] = {v: [] for v in args.variants}
    failed: dict[str, list[str]] = {v: [] for v in args.variants}
    kept: dict[str, Path] = {}  # per planned variant, the strategy its last run kept
    for rep in range(args.repeats):
        for variant in args.variants:
            name = f"{model}-{setting}-{variant}-{rep}"
            print(f"-- {name}", flush=True)
            env = dict(os.environ, ESPRESSO_LOG_LEVEL="WARNING")
            if variant.removesuffix("-kept").endswith("-tcp"):
                env["BYTEPS_ENABLE_IPC"] = "0"
            if variant.endswith("-kept"):
                planned = variant.removesuffix("-kept")
                if planned not in kept:
                    failed[variant].append(f"no strategy kept by {planned} in this cell: "
                                           f"list {planned} before {variant}")
                    print(f"   failed: {failed[variant][-1]}", flush=True)
                    continue
                env["ESPRESSO_STRATEGY"] = str(kept[planned])
            profile = out / f"{name}-profile"
            env["ESPRESSO_PROFILE_OUT"] = str(profile)  # where rank 0 writes check.json
            try:
                result = run_training(name, _cluster(setting, args.servers, args.colocate),
                                      _worker_args(variant, model, args),
                                      out, env=env, live=False, timeout_s=args.timeout_s)
            except (RuntimeError, subprocess.TimeoutExpired) as exc:
                # One failed run must not lose the others' figures: recorded, left out.
                print(f"   failed: {exc}", flush=True)
                failed[variant].append(str(exc))
                continue
            runs[variant].append({**result.metrics,
                                  "refitted_ms": _refitted_ms(profile / "check.json")})
            if (profile / "strategy.json").exists():
                kept[variant] = profile / "strategy.json"
    rows = []
    for variant, metrics in runs.items():
        if not metrics:
            continue
        half = len(metrics[0]["iteration_s"]) // 2
        iteration_ms = statistics.median(
            statistics.median(m["iteration_s"][half:]) * 1e3 for m in metrics)
        rows.append({"model": model, "setting": setting, "variant": variant,
                     "tensors": metrics[0]["tensors"],
                     "gradient_mb": metrics[0]["gradient_bytes"] / 1e6,
                     "iteration_ms": iteration_ms,
                     "iteration_ms_runs": [statistics.median(m["iteration_s"][half:]) * 1e3
                                           for m in metrics],
                     "cpu_ms": statistics.median(
                         statistics.median(m["cpu_s"][half:]) * 1e3 for m in metrics),
                     "final_loss": statistics.median(m["evals"][-1]["heldout_loss"]
                                                     for m in metrics),
                     "train_s": statistics.median(m["evals"][-1]["train_s"] for m in metrics),
                     "evals": [m["evals"] for m in metrics],
                     "kept": [m.get("algorithm") for m in metrics],
                     "predicted_ms": _median_of([m.get("predicted_ms") for m in metrics]),
                     "refitted_ms": _median_of([m["refitted_ms"] for m in metrics]),
                     "buckets": [m.get("buckets") for m in metrics],
                     "setup_s": statistics.median(m["setup_s"] for m in metrics),
                     "first_iteration_ms": statistics.median(
                         m["iteration_s"][0] * 1e3 for m in metrics),
                     "failed_runs": failed[variant]})
    for row in rows:
        row["prediction_error"] = (None if row["predicted_ms"] is None else
                                   row["predicted_ms"] / row["iteration_ms"] - 1)
        row["refitted_error"] = (None if row["refitted_ms"] is None else
                                 row["refitted_ms"] / row["iteration_ms"] - 1)
    ddp = next((r for r in rows if r["variant"] == "ddp"), None)
    target = ddp["final_loss"] * args.target_factor if ddp else None
    for row in rows:
        row["vs_ddp"] = row["iteration_ms"] / ddp["iteration_ms"] if ddp else None
        row["target_loss"] = target
        # local's loss is one rank's own training: no time to target
        times = ([_time_to(e, target) for e in row["evals"]]
                 if target is not None and row["variant"] != "local" else [])
        reached = [t for t in times if t is not None]
        row["time_to_target_s"] = (statistics.median(reached)
                                   if len(reached) * 2 > len(times) else None)
    return rows + [{"model": model, "setting": setting, "variant": variant,
                    "iteration_ms": None, "failed_runs": failed[variant]}
                   for variant, metrics in runs.items() if not metrics]


def _table(rows: list[dict]) -> str:
    lines = [f"{'model':11} {'link':8} {'variant':20} {'tensors':>7} {'iter ms':>8} "
             f"{'CPU ms':>7} {'vs DDP':>7} {'loss':>8} {'to target s':>11} {'predicted':>9} "
             f"{'refitted':>8} {'set-up s':>8} {'1st it ms':>9}"]
    for r in rows:
        if r["iteration_ms"] is None:
            lines.append(f"{r['model']:11} {r['setting']:8} {r['variant']:20} every run "
                         f"failed: {r['failed_runs'][0]}")
            continue
        vs = f"{r['vs_ddp']:6.2f}x" if r["vs_ddp"] is not None else f"{'-':>7}"
        tt = f"{r['time_to_target_s']:11.1f}" if r["time_to_target_s"] is not None \
            else f"{'never':>11}"
        pred = (f"{r['prediction_error']:+8.0%}" if r["prediction_error"] is not None
                else f"{'-':>9}")
        refit = (f"{r['refitted_error']:+7.0%}" if r["refitted_error"] is not None
                 else f"{'-':>8}")
        failed = f"  ({len(r['failed_runs'])} run(s) failed)" if r["failed_runs"] else ""
        lines.append(f"{r['model']:11} {r['setting']:8} {r['variant']:20} {r['tensors']:7d} "
                     f"{r['iteration_ms']:8.1f} {r['cpu_ms']:7.1f} {vs} {r['final_loss']:8.4f} "
                     f"{tt} {pred} {refit} {r['setup_s']:8.1f} "
                     f"{r['first_iteration_ms']:9.0f}{failed}")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    p.add_argument("--settings", nargs="+", default=["loopback"],
                   help="loopback, or link speeds in Gbit/s for the emulated cluster (root)")
    p.add_argument("--variants", nargs="+", default=["ddp", "espresso"])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--batch-size", type=int, default=16, help="per worker")
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--ratio", type=float, default=0.01, help="sparsifiers' kept fraction")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--servers", type=int, default=1,
                   help="PS server processes, each on its own node when emulated (BytePS "
                        "runs as many as machines); DDP's runs start them too, idle")
    p.add_argument("--colocate", action="store_true",
                   help="emulated: each server in a machine's namespace, beside its workers "
                        "(server j on machine j mod 2), as BytePS deploys them")
    p.add_argument("--target-factor", type=float, default=1.05)
    p.add_argument("--timeout-s", type=float, default=900, help="per run")
    p.add_argument("--out", default=str(ROOT / "out" / "ddp"))
    p.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "ddp.json"))
    args = p.parse_args()
    if any(s != "loopback" for s in args.settings) and os.geteuid() != 0:
        print("ddp: the emulated cluster needs root (network namespaces, tc)", file=sys.stderr)
        return 2
    started = time.time()
    rows = []
    for setting in args.settings:
        for model in args.models:
            cell = _cell(model, setting, args, Path(args.out))
            rows += cell
            print(_table(cell), flush=True)
    print(_table(rows))
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({
        "benchmark": "ddp", "host": platform.node(), "cpus": os.cpu_count(), "commit": commit,
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "wall_s": time.time() - started,
        "setup": {k: v for k, v in vars(args).items() if k not in ("json", "out")},
        "rows": rows}, indent=1) + "\n")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
