"""The uncompressed paths side by side: which one ``Compression.none`` should run.

Under ``espresso-launch --local`` on 2 machines x 2 workers + 1 server (loopback), every worker
synchronizes one float32 tensor of each size with each path, one at a time after a barrier,
``--iters`` times; reported per (size, path): the median wall time over the second half of
the iterations on rank 0. Paths: a bare gloo all-reduce of the default group (what torch DDP
runs), and the runtime's engine running ``Allreduce(flat)``, the planner's former fp32 baseline
``Reduce(intra) -> PushPull(inter) -> Broadcast(intra)``, BytePS's hierarchical path
``ReduceScatter(intra) -> PushPull(inter) -> Allgather(intra)`` (fp32 between machines on
separate hosts), ``PushPull(flat)`` and the fp32 Option of this job
(``baselines.fp32_option``: flat here, since every machine runs on this host). Sizes: the
gradients of benchmarks/ddp.py's three models (lstm 1.2 MB, mlp 5.4 MB, transformer 13.7 MB).
Prints a table and writes benchmarks/results/fp32_paths.json.

    .venv/bin/python benchmarks/fp32_paths.py [--iters 20]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from phases import local_job, write_result  # noqa: E402  (a script beside this one)

SIZES_MB = (1.2, 5.4, 13.7)  # benchmarks/ddp.py's models: lstm, mlp, transformer (MB float32)
PATHS = ("Allreduce(flat)", "Reduce(intra) -> PushPull(inter) -> Broadcast(intra)",
         "ReduceScatter(intra) -> PushPull(inter) -> Allgather(intra)", "PushPull(flat)",
         "fp32")


def worker(out: Path, iters: int) -> None:
    import torch
    import torch.distributed as dist
    from byteps_espresso.worker.session import current

    import byteps_espresso.torch as bps
    from byteps_espresso.strategy.options import Option

    torch.set_num_threads(1)
    bps.init()
    try:
        session = current()
        rows = []
        for mb in SIZES_MB:
            x = torch.ones(int(mb * 1e6 / 4))
            for path in ("gloo all-reduce", *PATHS):
                option = session.fp32 if path == "fp32" else \
                    Option.parse(path) if path != "gloo all-reduce" else None
                times = []
                for _ in range(iters):
                    dist.barrier()
                    t0 = time.perf_counter()
                    if option is None:
                        y = x.clone()
                        dist.all_reduce(y)
                    else:
                        y = session.plain.submit(f"{mb}/{path}", x, option).wait(60)
                    times.append(time.perf_counter() - t0)
                    if float(y[0]) != bps.size():
                        raise RuntimeError(f"{path}: wrong sum {float(y[0])}")
                rows.append({"mb": mb, "path": str(option) if path == "fp32" else path,
                             "fp32": path == "fp32",
                             "ms": statistics.median(times[iters // 2:]) * 1e3})
        if bps.rank() == 0:
            out.write_text(json.dumps(rows))
    finally:
        bps.shutdown()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "fp32_paths.json"))
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(Path(args.worker), args.iters)
        return 0
    started = time.time()
    rows = local_job(__file__, ["--iters", str(args.iters)])
    for mb in SIZES_MB:
        ref = next(r["ms"] for r in rows if r["mb"] == mb and r["path"] == "gloo all-reduce")
        for r in rows:
            if r["mb"] == mb:
                r["vs_gloo"] = r["ms"] / ref
    print(f"{'MB':>5} {'path':62} {'ms':>7} {'vs gloo':>8}")
    for r in rows:
        mark = "  <- fp32" if r["fp32"] else ""
        print(f"{r['mb']:5.1f} {r['path']:62} {r['ms']:7.2f} {r['vs_gloo']:7.2f}x{mark}")
    write_result(args.json, "fp32_paths", started, iters=args.iters, rows=rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
