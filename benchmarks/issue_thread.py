"""Where a bucket's all-reduce is issued during training: DDP's reducer, the gradient hook, or a
Python thread.

The runtime hands each bucket to a lane thread, which issues its collectives
(``worker/executor.py``). On a host whose cores the training itself keeps busy (4 worker
processes on 2 cores, one intra-op thread each), every hand-over to another thread waits for
the scheduler. This measures that cost without the runtime: the LSTM of benchmarks/ddp.py
(batch 16) on 4 gloo ranks on loopback, its gradients in DDP's two buckets (the first six
gradients in backward order, then the embedding), each bucket all-reduced in float32 as soon as
its last gradient is ready, issued

- ``ddp``: by ``DistributedDataParallel`` (its C++ reducer), as the baseline;
- ``hook``: by the last gradient's hook itself (``all_reduce(async_op=True)`` on the training
  thread), waited for after ``backward()``;
- ``thread``: by one Python thread that takes the buckets from a queue, issues each
  all-reduce and waits on it (what a lane does), the training thread waiting for both after
  ``backward()``.

The hook and thread modes copy the gradients into a flat buffer per bucket and back, as the
runtime does. Reported: the median iteration over the last ``--iters`` of ``--warmup +
--iters`` iterations on rank 0, per round, the modes alternating round by round. Prints a
table; writes JSON to benchmarks/results/issue_thread.json.

Usage: python benchmarks/issue_thread.py [--rounds 2] [--iters 200]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import queue
import socket
import statistics
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
WORLD = 4
MODES = ("ddp", "hook", "thread")
FIRST_BUCKET = 6  # gradients in DDP's first bucket (1 MiB cap) of the LSTM, backward order


def _buckets(params: list) -> list[list]:
    order = list(reversed(params))  # backward order: the output layer's first
    return [order[:FIRST_BUCKET], order[FIRST_BUCKET:]]


class _Sync:
    """The two buckets' all-reduces, issued from the gradient hooks (``hook``) or by a Python
    thread fed from them (``thread``); :meth:`finish` waits and writes the sums back."""

    def __init__(self, params: list, mode: str) -> None:
        self.buckets = _buckets(params)
        self.bufs = [torch.empty(sum(p.numel() for p in b)) for b in self.buckets]
        self.of = {id(p): i for i, b in enumerate(self.buckets) for p in b}
        self.mode = mode
        self.ready = [0] * len(self.buckets)
        self.works: list = []
        self.done: queue.Queue = queue.Queue()
        self.todo: queue.Queue = queue.Queue()
        if mode == "thread":
            threading.Thread(target=self._lane, daemon=True).start()
        for p in params:
            p.register_post_accumulate_grad_hook(self._hook)

    def _lane(self) -> None:
        while True:
            buf = self.todo.get()
            dist.all_reduce(buf, async_op=True).wait()
            self.done.put(buf)

    def _hook(self, p: torch.Tensor) -> None:
        i = self.of[id(p)]
        self.ready[i] += 1
        if self.ready[i] < len(self.buckets[i]):
            return
        torch.cat([q.grad.reshape(-1) for q in self.buckets[i]], out=self.bufs[i])
        if self.mode == "hook":
            self.works.append(dist.all_reduce(self.bufs[i], async_op=True))
        else:
            self.todo.put(self.bufs[i])

    def finish(self) -> None:
        if self.mode == "hook":
            for w in self.works:
                w.wait()
            self.works.clear()
        else:
            for _ in self.buckets:
                self.done.get()
        self.ready = [0] * len(self.buckets)
        for bucket, buf in zip(self.buckets, self.bufs, strict=True):
            offset = 0
            for p in bucket:
                p.grad.copy_(buf[offset:offset + p.numel()].view_as(p.grad))
                offset += p.numel()


def _ddp_worker():  # type: ignore[no-untyped-def]
    """benchmarks/ddp_worker.py as a module: its model and task, as benchmarks/ddp.py runs."""
    spec = importlib.util.spec_from_file_location("espresso_ddp_worker",
                                                  ROOT / "benchmarks" / "ddp_worker.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _rank(rank: int, mode: str, run: tuple[int, int, int, str]) -> None:
    """One rank of one mode; ``run``: (port, warm-up iterations, measured ones, result file)."""
    port, warmup, iters, out = run
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    ddp_worker = _ddp_worker()
    task, model = ddp_worker.Task("lstm", 0), ddp_worker.build("lstm")
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=0.1)
    net = torch.nn.parallel.DistributedDataParallel(model) if mode == "ddp" else model
    sync = None if mode == "ddp" else _Sync(params, mode)
    g = torch.Generator().manual_seed(rank)
    times = []
    for _ in range(warmup + iters):
        t0 = time.perf_counter()
        x, y = task.batch(16, g)
        opt.zero_grad()
        task.loss(net(x), y).backward()
        if sync is not None:
            sync.finish()
        opt.step()
        times.append(time.perf_counter() - t0)
    if rank == 0:
        Path(out).write_text(json.dumps(statistics.median(times[warmup:]) * 1e3))
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(mode: str, warmup: int, iters: int, out: Path) -> float:
    mp.spawn(_rank, args=(mode, (_free_port(), warmup, iters, str(out))), nprocs=WORLD)
    return json.loads(out.read_text())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "issue_thread.json"))
    args = p.parse_args(argv)
    got: dict[str, list[float]] = {m: [] for m in MODES}
    scratch = Path(args.json).with_suffix(".tmp")
    for _ in range(args.rounds):
        for mode in MODES:
            got[mode].append(measure(mode, args.warmup, args.iters, scratch))
    scratch.unlink(missing_ok=True)
    ddp = statistics.median(got["ddp"])
    print(f"{'issued by':10} {'iteration ms (rounds)':>28} {'vs ddp':>7}")
    rows = []
    for mode in MODES:
        med = statistics.median(got[mode])
        runs = ", ".join(f"{v:.1f}" for v in got[mode])
        print(f"{mode:10} {med:>10.1f} ({runs:>15}) {med / ddp:>6.2f}x")
        rows.append({"mode": mode, "iteration_ms": med, "rounds_ms": got[mode],
                     "vs_ddp": med / ddp})
    Path(args.json).write_text(json.dumps({
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                    "torch": torch.__version__},
        "world": WORLD, "warmup": args.warmup, "iters": args.iters, "rows": rows}, indent=1))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
