"""Executor overhead: one Option's time on this rank, per Option and per step.

Runs 2 emulated machines x 2 workers (+ 1 PS server and the scheduler) as processes on this
host (loopback), every worker with the job's real runtime (gloo process groups, the PS
client). Each worker runs a fixed list of Options covering every step kind, on two tensor
sizes, for ``--iters`` measured iterations after ``--warmup`` ones, one Option at a time on
lane 0 (nothing else in flight, so the times are the executor's own path). Measured per
Option: the wall time of ``Executor.run`` and the CPU time of the lane thread during it
(``time.thread_time``: Python, copies and kernels of this thread, without the time spent
blocked on peers); per step: the wall time the executor records (``Executor.timings``).
Reported: medians over iterations, then the median over the 4 ranks. Then batches: 50
tensors submitted to the engine at once and all waited for (as the optimizer does in one
iteration), for the uncompressed Options, median wall time per batch.

``--baseline REV`` runs the same measurement against the tree of git revision ``REV`` too
(its ``byteps_espresso`` package assembled in a temporary folder and put first on the
workers' ``PYTHONPATH``), alternating the two trees round by round, so both see the same
machine load. Prints a table; writes JSON to benchmarks/results/executor_overhead.json.

Usage: python benchmarks/executor_overhead.py [--baseline 2ec2724] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MACHINES, LOCAL, SERVERS = 2, 2, 1
OPTIONS = [
    "Allreduce(flat)",
    "ReduceScatter(intra) -> Allreduce(inter) -> Allgather(intra)",
    "Reduce(intra) -> Allreduce(inter) -> Broadcast(intra)",
    "PushPull(flat)",
    "Reduce(intra) -> PushPull(inter) -> Broadcast(intra)",
    "Comp(gpu) -> AllgatherC(flat) -> Decomp(gpu)",
    "Comp(gpu) -> AllreduceC(flat) -> Decomp(gpu)",
    "Comp(gpu) -> AlltoallC(intra) -> Decomp(gpu) -> Comp(gpu) -> AllgatherC(inter) "
    "-> Decomp(gpu) -> Allgather(intra)",
    "Comp(gpu) -> GatherC(flat) -> Decomp(gpu) -> Comp(gpu) -> BroadcastC(flat) -> Decomp(gpu)",
    "Comp(cpu) -> PushPullC(flat) -> Decomp(cpu)",
]
SIZES = [1024, 262_144]  # elements (4 KB: overhead-bound; 1 MB: copies start to count)
# Batches: BATCH tensors submitted to the engine at once (both lanes), then all waited for,
# as the optimizer does each iteration (a 4-layer transformer encoder has about 50 tensors).
BATCH_OPTIONS = [
    "Allreduce(flat)",
    "ReduceScatter(intra) -> Allreduce(inter) -> Allgather(intra)",
    "ReduceScatter(intra) -> PushPull(inter) -> Allgather(intra)",
]
BATCH, BATCH_NUMEL = 50, 4096


# ---- worker ------------------------------------------------------------------------------------
def worker(out: Path, warmup: int, iters: int) -> None:
    import torch
    from byteps_espresso.worker.codecs import CodecPair
    from byteps_espresso.worker.runtime import Runtime

    from byteps_espresso.config import Config
    from byteps_espresso.strategy.options import Option

    rt = Runtime(Config.from_env())
    rank = rt.topology.rank
    rows = []
    try:
        engine = rt.engine(CodecPair("fp16"))
        for oi, text in enumerate(OPTIONS):
            option = Option.parse(text)
            for numel in SIZES:
                name = f"o{oi}n{numel}"
                x = torch.randn(numel, generator=torch.Generator().manual_seed(rank))
                walls, cpus, steps = [], [], []
                for it in range(warmup + iters):
                    def run(ex, it=it, option=option, x=x, name=name):
                        ex.timings = []
                        t0, c0 = time.perf_counter(), time.thread_time()
                        ex.run(option, x, name=name, step=it)
                        wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
                        per_step = [sec for _, _, _, sec in ex.timings]
                        ex.timings = None
                        return wall, cpu, per_step
                    wall, cpu, per_step = engine.call(0, run, name).wait(60)
                    if it >= warmup:
                        walls.append(wall)
                        cpus.append(cpu)
                        steps.append(per_step)
                rows.append({"option": text, "numel": numel,
                             "wall_ms": statistics.median(walls) * 1e3,
                             "cpu_ms": statistics.median(cpus) * 1e3,
                             "steps_ms": [statistics.median(s) * 1e3
                                          for s in zip(*steps, strict=True)]})
        batches = []
        for oi, text in enumerate(BATCH_OPTIONS):
            option = Option.parse(text)
            xs = [torch.randn(BATCH_NUMEL) for _ in range(BATCH)]
            walls = []
            for it in range(warmup + iters):
                rt.barrier()
                t0 = time.perf_counter()
                handles = [engine.submit(f"b{oi}t{j}", x, option) for j, x in enumerate(xs)]
                for h in handles:
                    h.wait(60)
                if it >= warmup:
                    walls.append(time.perf_counter() - t0)
            batches.append({"option": text, "tensors": BATCH, "numel": BATCH_NUMEL,
                            "wall_ms": statistics.median(walls) * 1e3})
        rt.barrier()
    finally:
        rt.close()
    (out / f"rank{rank}.json").write_text(json.dumps({"options": rows, "batches": batches}))


# ---- launcher ----------------------------------------------------------------------------------
def _job_env(root: int, pythonpath: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DMLC_", "BYTEPS_",
                                                                      "ESPRESSO_"))}
    env.update({"DMLC_NUM_WORKER": str(MACHINES), "BYTEPS_LOCAL_SIZE": str(LOCAL),
                "DMLC_NUM_SERVER": str(SERVERS), "DMLC_PS_ROOT_URI": "127.0.0.1",
                "DMLC_PS_ROOT_PORT": str(root), "ESPRESSO_LOG_LEVEL": "WARNING",
                "OMP_NUM_THREADS": "1", "PYTHONPATH": pythonpath,
                # a fresh tree compiles its numba kernels at start-up (no cache yet)
                "ESPRESSO_START_TIMEOUT": "600"})
    return env


def run_job(pythonpath: str, args: argparse.Namespace) -> list[list[dict]]:
    """One job (scheduler, server, 4 workers); returns each rank's rows."""
    from byteps_espresso.deploy.launch import free_port_pair  # p and p + 1 both free
    from byteps_espresso.deploy.supervisor import stop_process_groups

    root = free_port_pair()
    env = _job_env(root, pythonpath)
    procs: list[subprocess.Popen] = []
    with tempfile.TemporaryDirectory() as tmp:
        try:
            for role in ["scheduler"] + ["server"] * SERVERS:
                procs.append(subprocess.Popen([sys.executable, "-m", "byteps_espresso.server"],
                                              env={**env, "DMLC_ROLE": role},
                                              stdout=subprocess.DEVNULL,
                                              start_new_session=True))
            workers = []
            for rank in range(MACHINES * LOCAL):
                wenv = {**env, "DMLC_ROLE": "worker", "DMLC_WORKER_ID": str(rank // LOCAL),
                        "BYTEPS_LOCAL_RANK": str(rank % LOCAL)}
                workers.append(subprocess.Popen(
                    [sys.executable, __file__, "--worker", tmp, "--warmup", str(args.warmup),
                     "--iters", str(args.iters)], env=wenv, start_new_session=True))
            procs += workers
            deadline = time.monotonic() + args.timeout
            for w in workers:
                w.wait(timeout=max(1.0, deadline - time.monotonic()))
            if any(w.returncode != 0 for w in workers):
                raise RuntimeError(f"a worker failed: exit codes {[w.returncode for w in workers]}")
        finally:  # the scheduler and server end with the job: stop whatever is left
            stop_process_groups(procs, grace_s=5.0)
        return [json.loads((Path(tmp) / f"rank{r}.json").read_text())
                for r in range(MACHINES * LOCAL)]


def baseline_tree(rev: str, into: Path) -> str:
    """Assemble revision ``rev``'s ``byteps_espresso`` package (the folders setup.py maps
    into it moved inside) under ``into``; returns the folder to put on ``PYTHONPATH``."""
    src = into / "src"
    src.mkdir()
    archive = subprocess.run(["git", "-C", str(REPO), "archive", rev], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(src)], input=archive, check=True)
    for folder in ("kernels", "worker", "server", "deploy"):
        shutil.move(str(src / folder), str(src / "byteps_espresso" / folder))
    return str(src)


def _merge_batches(runs: list[list[dict]]) -> list[dict]:
    """Median over rounds and ranks of each batch's median wall time."""
    first = runs[0][0]["batches"]
    return [{**row, "wall_ms": statistics.median(rk["batches"][i]["wall_ms"]
                                                 for rnd in runs for rk in rnd)}
            for i, row in enumerate(first)]


def _merge(runs: list[list[list[dict]]]) -> list[dict]:
    """Median over rounds of each rank's medians, then the median over ranks."""
    runs = [[rk["options"] for rk in rnd] for rnd in runs]  # type: ignore[index]
    out = []
    for i, row in enumerate(runs[0][0]):
        per_rank = [[rnd[r][i] for rnd in runs] for r in range(len(runs[0]))]

        def med(key: str, rows_of_rank: list[list[dict]] = per_rank) -> float:
            return statistics.median(statistics.median(x[key] for x in rows)
                                     for rows in rows_of_rank)
        steps = [statistics.median(statistics.median(x["steps_ms"][j] for x in rows)
                                   for rows in per_rank) for j in range(len(row["steps_ms"]))]
        out.append({"option": row["option"], "numel": row["numel"], "wall_ms": med("wall_ms"),
                    "cpu_ms": med("cpu_ms"), "steps_ms": steps})
    return out


def table(trees: dict[str, list[dict]]) -> str:
    names = list(trees)
    head = f"{'numel':>7}  " + "  ".join(f"{n + ' wall':>12} {n + ' cpu':>11}" for n in names)
    lines = [head + "  option"]
    for i, row in enumerate(trees[names[0]]):
        cells = "  ".join(f"{trees[n][i]['wall_ms']:>10.3f}ms {trees[n][i]['cpu_ms']:>9.3f}ms"
                          for n in names)
        lines.append(f"{row['numel']:>7}  {cells}  {row['option']}")
        for n in names:
            lines.append(f"{'':>9}{n} per step ms: "
                         + ", ".join(f"{s:.3f}" for s in trees[n][i]["steps_ms"]))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", default=None,
                    help="also measure this git revision's tree, alternating rounds")
    ap.add_argument("--rounds", type=int, default=3, help="jobs per tree (alternating)")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per job")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" /
                    "executor_overhead.json")
    ap.add_argument("--worker", type=Path, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker is not None:
        worker(args.worker, args.warmup, args.iters)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        paths = {"current": str(REPO)}
        if args.baseline:
            paths = {args.baseline: baseline_tree(args.baseline, Path(tmp)), **paths}
        runs: dict[str, list] = {n: [] for n in paths}
        for _ in range(args.rounds):
            for n, path in paths.items():
                runs[n].append(run_job(path, args))
    trees = {n: _merge(r) for n, r in runs.items()}
    batches = {n: _merge_batches(r) for n, r in runs.items()}
    print(f"executor overhead, {MACHINES} x {LOCAL} workers + {SERVERS} server, loopback, "
          f"{os.cpu_count()} cores (shared with other jobs); medians of {args.iters} "
          f"iterations x {args.rounds} rounds")
    print(table(trees))
    print(f"\nbatches of {BATCH} tensors x {BATCH_NUMEL} floats submitted at once, median ms")
    for i, row in enumerate(batches[next(iter(batches))]):
        print("  ".join(f"{n}: {batches[n][i]['wall_ms']:8.2f}" for n in batches)
              + f"  {row['option']}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "command": "python benchmarks/executor_overhead.py " + " ".join(argv or sys.argv[1:]),
        "host": {"cores": os.cpu_count(), "python": platform.python_version()},
        "machines": MACHINES, "local_size": LOCAL, "servers": SERVERS,
        "iters": args.iters, "rounds": args.rounds, "trees": trees, "batches": batches},
        indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
