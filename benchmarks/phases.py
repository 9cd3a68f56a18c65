"""Where one iteration's time goes: forward, backward (with the gradient hooks that fill and
submit the buckets), synchronize and the optimizer step.

Under ``espresso-launch --local`` on 2 machines x 2 workers + 1 server (``--emulate GBPS``:
the emulated cluster with links shaped to GBPS, as root), each worker trains
benchmarks/ddp.py's MLP (256-1024-1024-64, batch 16, one intra-op thread) with
``Compression.none`` (``--compressor NAME``: ``Compression.espresso(NAME)``, its profiled
iterations and trials in the first half) for ``--iters`` iterations; rank 0 prints the median
of each phase over the second half. With a compressor it also prints what the planner
predicted for the strategy in use and the compute it was planned on (the profiled forward
pass and backward gaps of ``workload.json``). ``--profile`` also prints rank 0's cProfile of
the main thread over the second half (the lanes' threads are not in it). Prints a table and
writes benchmarks/results/phases.json.

    .venv/bin/python benchmarks/phases.py [--iters 60] [--compressor efsignsgd] [--emulate 1]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PHASES = ("forward", "backward", "synchronize", "step", "iteration")


def worker(out: Path, iters: int, profile: bool, compressor: str | None) -> None:
    import torch
    from torch import nn

    import byteps_espresso.torch as bps

    torch.set_num_threads(1)
    bps.init()
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
                              nn.Linear(1024, 64))
        compression = (bps.Compression.espresso(compressor) if compressor
                       else bps.Compression.none)
        opt = bps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                       model.named_parameters(), compression=compression)
        bps.broadcast_parameters(model.state_dict(), 0)
        x, y = torch.randn(16, 256), torch.randn(16, 64)
        times: dict[str, list[float]] = {p: [] for p in PHASES}
        prof = None
        if profile and bps.rank() == 0:
            import cProfile

            prof = cProfile.Profile()
        for i in range(iters):
            if i == iters // 2:
                if prof is not None:
                    prof.enable()
                for ex in opt._bps.engine.executors:  # each step's wall time in its lane
                    ex.timings = []
            t0 = time.perf_counter()
            opt.zero_grad()
            loss = ((model(x) - y) ** 2).mean()
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
            opt.synchronize()
            t3 = time.perf_counter()
            with opt.skip_synchronize():
                opt.step()
            t4 = time.perf_counter()
            for phase, sec in zip(PHASES, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t4 - t0),
                                  strict=True):
                times[phase].append(sec)
        if bps.rank() == 0:
            if prof is not None:
                import pstats

                prof.disable()
                pstats.Stats(prof).sort_stats("tottime").print_stats(15)
            result = {p: statistics.median(v[iters // 2:]) * 1e3 for p, v in times.items()}
            steps: dict[str, list[float]] = {}
            for ex in opt._bps.engine.executors:
                for name, _, index, sec in ex.timings or ():
                    step = opt._bps.options[name].steps[index] if opt._bps.options else index
                    steps.setdefault(f"{name}: {index} {step}", []).append(sec * 1e3)
            result["steps"] = {k: statistics.median(v) for k, v in sorted(steps.items())}
            strategy = bps.planned_strategy()
            if strategy is not None:
                result["predicted"] = strategy.predicted_ms
                result["kept"] = strategy.algorithm
            out.write_text(json.dumps(result))
    finally:
        bps.shutdown()


def local_job(script: str, args: list[str], emulate_gbps: float | None = None) -> dict:
    """Run ``script --worker OUT *args`` as the workers of an ``espresso-launch --local`` job
    (``emulate_gbps``: ``--emulate`` with links of that speed) of 2 machines x 2 workers + 1
    server; returns what rank 0 wrote to OUT (JSON), with the profiled compute of an
    Espresso run's ``workload.json`` as ``profiled_compute``."""
    mode = (["--emulate", "--inter-gbps", str(emulate_gbps)] if emulate_gbps
            else ["--local"])
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rank0.json"
        subprocess.run([sys.executable, "-m", "byteps_espresso.deploy.launch", *mode,
                        "--machines", "2", "--workers-per-machine", "2", "--servers", "1", "--",
                        sys.executable, script, "--worker", str(out), *args],
                       check=True, timeout=900, cwd=ROOT,
                       env=dict(os.environ, ESPRESSO_LOG_LEVEL="WARNING",
                                ESPRESSO_PROFILE_OUT=tmp))
        result = json.loads(out.read_text())
        workload = Path(tmp) / "workload.json"
        if workload.exists():
            w = json.loads(workload.read_text())
            result["profiled_compute"] = (w.get("forward_us", 0.0) + sum(
                t["ready_gap_us"] for t in w["tensors"])) / 1e3
        return result


def write_result(path: str, benchmark: str, started: float, **fields: object) -> None:
    """Write a benchmark's JSON with the host, commit and start time."""
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps({
        "benchmark": benchmark, "host": platform.node(), "cpus": os.cpu_count(),
        "commit": commit, "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        **fields}, indent=1) + "\n")
    print(f"wrote {path}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=60)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "phases.json"))
    p.add_argument("--compressor", help="plan with Compression.espresso(NAME) instead of "
                   "training uncompressed")
    p.add_argument("--emulate", type=float, metavar="GBPS",
                   help="the emulated cluster with links of GBPS Gbit/s (as root)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(Path(args.worker), args.iters, args.profile, args.compressor)
        return 0
    started = time.time()
    phases = local_job(__file__, ["--iters", str(args.iters),
                                  *(["--profile"] if args.profile else []),
                                  *(["--compressor", args.compressor] if args.compressor
                                    else [])], args.emulate)
    print(" ".join(f"{p}={phases[p]:.2f} ms" for p in PHASES))
    for step, ms in phases["steps"].items():
        print(f"  {step}: {ms:.2f} ms")
    if "predicted" in phases:
        print(f"kept {phases['kept']}: predicted {phases['predicted']:.2f} ms, planned on "
              f"{phases.get('profiled_compute', float('nan')):.2f} ms of forward + backward")
    write_result(args.json, "phases", started, iters=args.iters, phases_ms=phases,
                 compressor=args.compressor, emulate_gbps=args.emulate)
    return 0


if __name__ == "__main__":
    sys.exit(main())
