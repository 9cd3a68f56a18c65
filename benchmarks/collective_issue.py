"""How to issue many small collectives: blocking calls per lane thread, or async work handles.

The executor issues each Option's collectives as blocking calls on its lane's thread
(``worker/executor.py``, 2 lanes by default, each with its own process groups). This measures,
on 4 worker processes with gloo on loopback, one batch of ``--tensors`` all-reduces of
``--numel`` float32 elements each, issued

- ``blocking x1``: one thread, one blocking ``all_reduce`` after the other;
- ``blocking x2 lanes``: two threads, each over its own group, each blocking on half of them
  (what the runtime does);
- ``async x1``: one thread issuing every ``all_reduce(async_op=True)``, then waiting on the
  work handles;
- ``async x2 lanes``: the same over two groups, alternating.

Reported: the median batch time over ``--iters`` batches (after ``--warmup``), median over
ranks. Prints a table; writes JSON to benchmarks/results/collective_issue.json.

Usage: python benchmarks/collective_issue.py [--tensors 50] [--numel 1024 65536]
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
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WORLD = 4
MODES = ("blocking x1", "blocking x2 lanes", "async x1", "async x2 lanes")


def _batch(mode: str, tensors: list, groups: list) -> None:
    import torch.distributed as dist

    if mode == "blocking x1":
        for t in tensors:
            dist.all_reduce(t, group=groups[0])
    elif mode == "blocking x2 lanes":
        def lane(k: int) -> None:
            for t in tensors[k::2]:
                dist.all_reduce(t, group=groups[k])
        threads = [threading.Thread(target=lane, args=(k,)) for k in range(2)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
    elif mode == "async x1":
        for w in [dist.all_reduce(t, group=groups[0], async_op=True) for t in tensors]:
            w.wait()
    else:
        works = [dist.all_reduce(t, group=groups[i % 2], async_op=True)
                 for i, t in enumerate(tensors)]
        for w in works:
            w.wait()


def worker(rank: int, port: int, out: Path, args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=WORLD)
    groups = [dist.new_group(list(range(WORLD))) for _ in range(2)]
    rows = []
    for numel in args.numel:
        tensors = [torch.ones(numel) for _ in range(args.tensors)]
        times: dict[str, list[float]] = {m: [] for m in MODES}
        for it in range(args.warmup + args.iters):
            for mode in MODES:  # interleaved, so load changes hit every mode alike
                dist.barrier(group=groups[0])
                t0 = time.perf_counter()
                _batch(mode, tensors, groups)
                if it >= args.warmup:
                    times[mode].append(time.perf_counter() - t0)
        rows.append({"numel": numel, "tensors": args.tensors,
                     "ms": {m: statistics.median(v) * 1e3 for m, v in times.items()}})
    dist.destroy_process_group()
    (out / f"rank{rank}.json").write_text(json.dumps(rows))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tensors", type=int, default=50, help="all-reduces per batch")
    ap.add_argument("--numel", type=int, nargs="+", default=[1024, 65536],
                    help="float32 elements per tensor")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" /
                    "collective_issue.json")
    ap.add_argument("--worker", nargs=3, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker is not None:
        worker(int(args.worker[0]), int(args.worker[1]), Path(args.worker[2]), args)
        return 0
    from byteps_espresso.deploy.launch import free_port_pair

    port = free_port_pair()
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        extra = ["--tensors", str(args.tensors), "--warmup", str(args.warmup), "--iters",
                 str(args.iters), "--numel", *map(str, args.numel)]
        procs = [subprocess.Popen([sys.executable, __file__, "--worker", str(r), str(port), tmp,
                                   *extra], env=env) for r in range(WORLD)]
        try:
            for p in procs:
                p.wait(timeout=args.timeout)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        if any(p.returncode != 0 for p in procs):
            raise SystemExit(f"a worker failed: {[p.returncode for p in procs]}")
        ranks = [json.loads((Path(tmp) / f"rank{r}.json").read_text()) for r in range(WORLD)]
    rows = [{"numel": row["numel"], "tensors": row["tensors"],
             "ms": {m: statistics.median(rk[i]["ms"][m] for rk in ranks) for m in MODES}}
            for i, row in enumerate(ranks[0])]
    print(f"{args.tensors} all-reduces per batch, {WORLD} processes, gloo, loopback, "
          f"{os.cpu_count()} cores (shared with other jobs); median batch ms")
    print(f"{'numel':>8}  " + "  ".join(f"{m:>18}" for m in MODES))
    for row in rows:
        print(f"{row['numel']:>8}  " + "  ".join(f"{row['ms'][m]:>18.2f}" for m in MODES))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "command": "python benchmarks/collective_issue.py " + " ".join(argv or sys.argv[1:]),
        "host": {"cores": os.cpu_count(), "python": platform.python_version()},
        "world": WORLD, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
