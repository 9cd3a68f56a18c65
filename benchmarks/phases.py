"""Where one uncompressed iteration's time goes: forward, backward (with the gradient hooks
that fill and submit the buckets), synchronize and the optimizer step.

Under ``espresso-launch --local`` on 2 machines x 2 workers + 1 server, each worker trains
benchmarks/ddp.py's MLP (256-1024-1024-64, batch 16, one intra-op thread) with
``Compression.none`` for ``--iters`` iterations; rank 0 prints the median of each phase over
the second half. ``--profile`` also prints rank 0's cProfile of the main thread over the
second half (the lanes' threads are not in it). Prints a table and writes
benchmarks/results/phases.json.

    .venv/bin/python benchmarks/phases.py [--iters 60]
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


def worker(out: Path, iters: int, profile: bool) -> None:
    import torch
    from torch import nn

    import byteps_espresso.torch as bps

    torch.set_num_threads(1)
    bps.init()
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
                              nn.Linear(1024, 64))
        opt = bps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                       model.named_parameters(), compression=bps.Compression.none)
        bps.broadcast_parameters(model.state_dict(), 0)
        x, y = torch.randn(16, 256), torch.randn(16, 64)
        times: dict[str, list[float]] = {p: [] for p in PHASES}
        prof = None
        if profile and bps.rank() == 0:
            import cProfile

            prof = cProfile.Profile()
        for i in range(iters):
            if prof is not None and i == iters // 2:
                prof.enable()
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
            out.write_text(json.dumps({p: statistics.median(v[iters // 2:]) * 1e3
                                       for p, v in times.items()}))
    finally:
        bps.shutdown()


def local_job(script: str, args: list[str]) -> dict:
    """Run ``script --worker OUT *args`` as the workers of an ``espresso-launch --local`` job
    of 2 machines x 2 workers + 1 server; returns what rank 0 wrote to OUT (JSON)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rank0.json"
        subprocess.run([sys.executable, "-m", "byteps_espresso.deploy.launch", "--local",
                        "--machines", "2", "--workers-per-machine", "2", "--servers", "1", "--",
                        sys.executable, script, "--worker", str(out), *args],
                       check=True, timeout=900, cwd=ROOT,
                       env=dict(os.environ, ESPRESSO_LOG_LEVEL="WARNING"))
        return json.loads(out.read_text())


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
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(Path(args.worker), args.iters, args.profile)
        return 0
    started = time.time()
    phases = local_job(__file__, ["--iters", str(args.iters),
                                  *(["--profile"] if args.profile else [])])
    print(" ".join(f"{p}={phases[p]:.2f} ms" for p in PHASES))
    write_result(args.json, "phases", started, iters=args.iters, phases_ms=phases)
    return 0


if __name__ == "__main__":
    sys.exit(main())
