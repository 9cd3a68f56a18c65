"""One training process of benchmarks/ddp.py: the same model under torch DDP or this runtime.

Launched by ``espresso-launch`` (loopback or the emulated cluster) in both cases, so that
both runtimes see the same processes, cores, links and gloo interface: ``bps.init()`` joins
the job (and creates torch.distributed's default group), then either

    --runtime ddp       torch.nn.parallel.DistributedDataParallel over that default group
                        (gloo), with ``--hook none|fp16|powersgd`` (torch's communication
                        hooks: fp16_compress_hook, powerSGD_hook), or
    --runtime espresso  bps.DistributedOptimizer with ``--compression none`` or
                        ``espresso`` (``--compressor``/``--ratio``), or
    --runtime local     no synchronization at all: each rank steps on its own gradients.
                        The same processes on the same cores with nothing exchanged, so
                        its iteration is the floor any synchronization (DDP's, a hook's
                        or this runtime's) adds to; its loss is one rank's, not comparable.

Models (``--model``): ``lstm`` (examples/train.py: embedding + LSTM + output, 5 tensors),
``transformer`` (4 encoder layers, d_model 256: 51 tensors), ``mlp`` (three large linear
layers regressing a fixed random teacher). Every ``--eval-every`` steps rank 0 evaluates a
fixed held-out batch with the clock paused. Rank 0 writes ``--metrics-out`` JSON: each
iteration's wall time and its own process CPU time (every thread), the held-out loss against
training time, the runtime's set-up time and the strategy in use.

The training clock starts with the runtime's set-up: every rank has built the model and the
``torch.optim`` optimizer and waits for the others (a barrier on torch.distributed's default
group, whatever the runtime), then wraps them (DDP's constructor, or
``bps.DistributedOptimizer``: with ``Compression.espresso`` rank 0 loads the planner and
times the kernels there); the slowest rank's wrapping time is the set-up, and the clock
starts with it. Every rank then evaluates, waits for the others again, and steps; after each
evaluation the same. Without the barriers the ranks reached their first step up to 1.3 s
apart on the shared cores (the first ``torch.optim`` optimizer of a process imports
``torch._dynamo``: 1.4-2.1 s per rank on 2 cores): DDP's constructor, which broadcasts the
module's state, absorbed that spread outside the clock, while rank 0's first step under
``bps.DistributedOptimizer`` waited 0.4-1.3 s for the others inside it, and the runtime's
own set-up (0.3-1.5 s per rank with ``Compression.espresso``) was not counted.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import sys
import time
from pathlib import Path

import torch
from torch import nn

import byteps_espresso.torch as bps

ROOT = Path(__file__).resolve().parents[1]
VOCAB, SEQ = 1000, 16  # Markov-chain token task of examples/train.py


def _example():  # examples/train.py, by path: it is a script, not a package
    if "espresso_example_train" in sys.modules:
        return sys.modules["espresso_example_train"]
    spec = importlib.util.spec_from_file_location("espresso_example_train",
                                                  ROOT / "examples" / "train.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while it runs
    spec.loader.exec_module(module)
    return module


class Transformer(nn.Module):
    """Embedding -> 4 post-norm encoder layers (d_model 256, 4 heads) -> vocabulary logits."""

    def __init__(self, vocab: int = VOCAB, dim: int = 256, layers: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        layer = nn.TransformerEncoderLayer(dim, nhead=4, dim_feedforward=2 * dim, dropout=0.0,
                                           batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.out = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.out(self.encoder(self.embed(tokens)))


def mlp(width: int = 1024, inputs: int = 256, outputs: int = 64) -> nn.Module:
    return nn.Sequential(nn.Linear(inputs, width), nn.ReLU(), nn.Linear(width, width),
                         nn.ReLU(), nn.Linear(width, outputs))


class Task:
    """Batches and loss of one model's task; each rank draws its own batches."""

    def __init__(self, model: str, seed: int) -> None:
        self.model = model
        if model == "mlp":
            torch.manual_seed(seed + 7)
            self.teacher = mlp(width=256)
            for p in self.teacher.parameters():
                p.requires_grad_(False)
        else:
            self.chain = _example().MarkovTask(VOCAB, 0.9, seed)

    def batch(self, size: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        if self.model == "mlp":
            x = torch.randn(size, 256, generator=g)
            return x, self.teacher(x)
        return self.chain.batch(size, SEQ, g)

    def loss(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.model == "mlp":
            return nn.functional.mse_loss(out, y)
        return nn.functional.cross_entropy(out.reshape(-1, VOCAB), y.reshape(-1))


def build(model: str) -> nn.Module:
    if model == "lstm":
        return _example().LSTMModel(VOCAB, 64, 128)
    if model == "transformer":
        return Transformer()
    return mlp()


def _ddp(model: nn.Module, hook: str) -> nn.Module:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    if hook == "powersgd":
        # One bucket: powerSGD_hook issues each bucket's second all-reduce (Q) from the
        # first's completion callback, so with several buckets in flight the ranks issue the
        # buckets' collectives in different orders; gloo then aborts ("Received data size
        # doesn't match expected size", seen on the transformer here) or hangs. With one
        # bucket the order is fixed. An explicit cap also drops DDP's small first bucket.
        ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=1024)
    else:
        ddp = nn.parallel.DistributedDataParallel(model)
    if hook == "fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif hook == "powersgd":
        # Rank 4 with error feedback and warm start (the hook's defaults but the rank); plain
        # all-reduce for the first 10 iterations (the default, 1,000, exceeds these runs).
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=4,
                                            start_powerSGD_iter=10, use_error_feedback=True,
                                            warm_start=True)
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    return ddp


def _compression(args: argparse.Namespace) -> bps.CompressionSpec:
    """examples/train.py's choice: its ``--compression fp32`` is this script's ``none``."""
    if args.compression == "powersgd":  # as the powersgd hook above: rank 4, 10 plain first
        return bps.Compression.powersgd(4, start_iter=10)
    if args.compressor == "powersgd":  # the same settings, planned per bucket
        return bps.Compression.espresso("powersgd", rank=4, start_iter=10)
    return _example().compression(argparse.Namespace(
        compression="fp32" if args.compression == "none" else "espresso",
        compressor=args.compressor, ratio=args.ratio, algorithm="espresso", strategy=None))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runtime", choices=["ddp", "espresso", "local"], required=True)
    p.add_argument("--hook", choices=["none", "fp16", "powersgd"], default="none")
    p.add_argument("--compression", choices=["none", "espresso", "powersgd"], default="none")
    p.add_argument("--compressor", default="efsignsgd")
    p.add_argument("--ratio", type=float, default=0.01)
    p.add_argument("--model", choices=["lstm", "transformer", "mlp"], required=True)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--batch-size", type=int, default=16, help="per worker")
    p.add_argument("--lr", type=float, default=None, help="default: per model")
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--metrics-out", required=True)
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    bps.init()
    try:
        train(args)
    finally:
        bps.shutdown()


_LR = {"lstm": 1.0, "transformer": 0.05, "mlp": 0.05}  # SGD with momentum 0.9


def _every_rank_here() -> None:
    """Wait for every rank, off the clock (see the module docstring)."""
    torch.distributed.barrier()


def _slowest(seconds: float) -> float:
    """The largest of every rank's ``seconds``."""
    t = torch.tensor([seconds], dtype=torch.float64)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return float(t.item())


def train(args: argparse.Namespace) -> None:
    rank, world = bps.rank(), bps.size()
    torch.manual_seed(args.seed)
    task = Task(args.model, args.seed)
    model = build(args.model)
    bps.broadcast_parameters(model.state_dict(), root_rank=0)
    lr = args.lr if args.lr is not None else _LR[args.model]
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    net = model
    _every_rank_here()
    wrapping = time.perf_counter()
    if args.runtime == "ddp":
        net = _ddp(model, args.hook)
    elif args.runtime == "espresso":
        opt = bps.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                       compression=_compression(args))
    setup_s = _slowest(time.perf_counter() - wrapping)
    held_x, held_y = task.batch(256, torch.Generator().manual_seed(12345))
    gen = torch.Generator().manual_seed(args.seed * 1000 + rank + 1)
    iteration_s, evals, trained = [], [], setup_s

    def evaluate(step: int) -> None:
        with torch.no_grad():
            evals.append({"step": step, "train_s": trained,
                          "heldout_loss": float(task.loss(model(held_x), held_y))})

    evaluate(0)
    _every_rank_here()
    cpu_s = []  # the process's CPU time per iteration, every thread (gloo's, lanes)
    for step in range(1, args.steps + 1):
        t0, c0 = time.perf_counter(), time.process_time()
        x, y = task.batch(args.batch_size, gen)
        opt.zero_grad()
        task.loss(net(x), y).backward()
        opt.step()
        dt = time.perf_counter() - t0
        cpu_s.append(time.process_time() - c0)
        iteration_s.append(dt)
        trained += dt
        if step % args.eval_every == 0 or step == args.steps:
            evaluate(step)
            _every_rank_here()
    if rank == 0:
        strategy = bps.planned_strategy() if args.runtime == "espresso" else None
        Path(args.metrics_out).write_text(json.dumps({
            "world_size": world, "model": args.model,
            "tensors": sum(1 for p in model.parameters() if p.requires_grad),
            "gradient_bytes": sum(p.numel() * 4 for p in model.parameters()),
            "setup_s": setup_s, "iteration_s": iteration_s, "cpu_s": cpu_s, "evals": evals,
            "algorithm": strategy.algorithm if strategy is not None else None,
            "predicted_ms": strategy.predicted_ms if strategy is not None else None,
            "buckets": len(strategy.layout) if strategy is not None else None,
            "compressed": len(strategy.compressed_tensors) if strategy is not None else None,
        }, indent=1) + "\n")


if __name__ == "__main__":
    main()
