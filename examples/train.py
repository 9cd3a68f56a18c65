"""Train a small language model with byteps-espresso's drop-in ``byteps.torch`` API.

The task is synthetic but learnable: token sequences from a fixed random Markov chain (each
token is followed by its successor with probability ``--determinism``, otherwise by a random
token), so the loss falls from ln(vocab) towards the chain's entropy. The model (embedding +
LSTM + output layer, or a smaller embedding-bag MLP with ``--model mlp``) has large embedding
and output matrices and little compute: gradient traffic dominates, which is where
compression pays off.

Run it under the launcher, or by hand with BytePS's environment on every process, e.g. for
2 machines x 2 workers on this host with the scheduler (and its TCPStore) on port 9000::

    DMLC_NUM_WORKER=2 BYTEPS_LOCAL_SIZE=2 DMLC_WORKER_ID=0 BYTEPS_LOCAL_RANK=0 \\
    DMLC_NUM_SERVER=1 DMLC_PS_ROOT_URI=127.0.0.1 DMLC_PS_ROOT_PORT=9000 \\
        python examples/train.py --compression espresso --compressor randomk --ratio 0.01

``--compression`` is ``fp32`` (uncompressed), ``fp16``, ``espresso`` (profile, then plan per
tensor with ``--compressor``/``--ratio``) or ``strategy`` (``--strategy FILE`` from
``espresso plan``). Rank 0 prints per-epoch loss and throughput and, with ``--metrics-out``,
writes them as JSON.

With GPUs it trains on ``cuda:<local rank>`` as BytePS scripts do: every process of a machine
sees all of its GPUs and ``torch.cuda.set_device(bps.local_rank())`` picks one (a local job
with more workers per machine than GPUs shares them round-robin).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import statistics
import time
from pathlib import Path

import torch
from torch import nn
from tqdm import tqdm

import byteps_espresso.torch as bps


class LSTMModel(nn.Module):
    """Embedding -> LSTM -> vocabulary logits (next-token prediction)."""

    def __init__(self, vocab: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.lstm = nn.LSTM(dim, hidden, batch_first=True)
        self.out = nn.Linear(hidden, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h, _ = self.lstm(self.embed(tokens))
        return self.out(h)


class MLPModel(nn.Module):
    """Embedding of the current token -> hidden layer -> vocabulary logits (cheap)."""

    def __init__(self, vocab: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.hidden = nn.Linear(dim, hidden)
        self.out = nn.Linear(hidden, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.hidden(self.embed(tokens))))


MODELS = {"lstm": LSTMModel, "mlp": MLPModel}


class MarkovTask:
    """Sequences from a fixed random chain; each rank draws its own batches."""

    def __init__(self, vocab: int, determinism: float, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.successor = torch.randperm(vocab, generator=g)
        self.vocab = vocab
        self.determinism = determinism

    def batch(self, batch: int, seq: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = torch.empty(batch, seq + 1, dtype=torch.long)
        tokens[:, 0] = torch.randint(self.vocab, (batch,), generator=g)
        for t in range(seq):
            follow = torch.rand(batch, generator=g) < self.determinism
            rand = torch.randint(self.vocab, (batch,), generator=g)
            tokens[:, t + 1] = torch.where(follow, self.successor[tokens[:, t]], rand)
        return tokens[:, :-1], tokens[:, 1:]

    def entropy(self) -> float:
        """The best achievable loss (nats per token)."""
        p, v = self.determinism, self.vocab
        p_next = p + (1 - p) / v
        p_other = (1 - p) / v
        return -(p_next * math.log(p_next) + (v - 1) * p_other * math.log(p_other))


# ---- held-out loss (time to accuracy) ----
# The held-out batch's generator seed: apart from the training generators (seed * 1000 + rank
# + 1), identical in every run, so every run is measured on the same sequences.
HELDOUT_SEED = 2**31 - 1


class HeldOut:
    """The training clock and the loss on a fixed held-out batch every ``--eval-every`` steps.

    Every rank evaluates (all at the same steps, so no rank waits for another), and the time
    spent evaluating is left out of the clock: ``elapsed_s`` is training time only.
    """

    def __init__(self, task: MarkovTask, model: nn.Module, loss_fn: nn.Module,
                 args: argparse.Namespace) -> None:
        self.model, self.loss_fn, self.every = model, loss_fn, args.eval_every
        self.vocab = args.vocab
        self.batch = task.batch(args.eval_batch, args.seq,
                                torch.Generator().manual_seed(HELDOUT_SEED - args.seed))
        self.start = time.perf_counter()
        self.excluded = 0.0
        self.steps = 0
        self.steps_elapsed_s: list[float] = []  # training clock at the end of each step
        self.evals: list[dict] = []

    def elapsed(self) -> float:
        return time.perf_counter() - self.start - self.excluded

    def step_done(self) -> None:
        self.steps += 1
        self.steps_elapsed_s.append(self.elapsed())
        if self.every and self.steps % self.every == 0:
            self.evaluate(self.steps)

    def evaluate(self, step: int) -> None:
        if not self.every:
            return
        t0 = time.perf_counter()
        elapsed = self.elapsed()
        x, y = self.batch
        with torch.no_grad():
            loss = self.loss_fn(self.model(x).reshape(-1, self.vocab), y.reshape(-1))
        self.evals.append({"step": step, "elapsed_s": elapsed, "heldout_loss": float(loss)})
        self.excluded += time.perf_counter() - t0

    def metrics(self) -> dict:
        return {"steps_elapsed_s": self.steps_elapsed_s, "heldout": self.evals}
# ---- end held-out loss ----


def compression(args: argparse.Namespace) -> bps.CompressionSpec:
    if args.compression == "fp32":
        return bps.Compression.none
    if args.compression == "fp16":
        return bps.Compression.fp16
    if args.compression == "strategy":
        if not args.strategy:
            raise SystemExit("--compression strategy needs --strategy FILE")
        return bps.Compression.strategy(args.strategy)
    params = {"ratio": args.ratio} if args.compressor in ("randomk", "topk", "dgc") else {}
    return bps.Compression.espresso(args.compressor, algorithm=args.algorithm, **params)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--compression", default="espresso",
                   choices=["fp32", "fp16", "espresso", "strategy"])
    p.add_argument("--compressor", default="randomk", help="for --compression espresso")
    p.add_argument("--ratio", type=float, default=0.01, help="sparsifiers' kept fraction")
    p.add_argument("--algorithm", default="espresso",
                   help="planner algorithm: espresso or a baseline (all-gpu, cpu-only, ...)")
    p.add_argument("--strategy", help="strategy JSON for --compression strategy")
    p.add_argument("--model", default="lstm", choices=sorted(MODELS))
    p.add_argument("--vocab", type=int, default=2000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--batch-size", type=int, default=16, help="per worker")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--steps-per-epoch", type=int, default=100)
    p.add_argument("--lr", type=float, default=1.0)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--determinism", type=float, default=0.9)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--metrics-out", help="rank 0 writes loss and throughput JSON here")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    # ---- held-out loss (time to accuracy) ----
    p.add_argument("--eval-every", type=int, default=0,
                   help="every N steps (and before the first and after the last) evaluate the "
                        "loss on a fixed held-out batch; 0: never")
    p.add_argument("--eval-batch", type=int, default=64, help="held-out sequences")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    bps.init()
    try:
        train(args)
    finally:
        bps.shutdown()


def training_device() -> torch.device:
    """``cuda:<local rank>`` when there are GPUs (``torch.cuda.set_device(bps.local_rank())``,
    round-robin when this machine has fewer GPUs than workers), else the CPU."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    torch.cuda.set_device(bps.local_rank() % torch.cuda.device_count())
    return torch.device("cuda", torch.cuda.current_device())


def train(args: argparse.Namespace) -> None:
    rank, world = bps.rank(), bps.size()
    device = training_device()
    torch.manual_seed(args.seed)
    task = MarkovTask(args.vocab, args.determinism, args.seed)
    model = MODELS[args.model](args.vocab, args.dim, args.hidden).to(device)
    bps.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    opt = bps.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                   compression=compression(args))
    bps.broadcast_optimizer_state(opt, root_rank=0)
    gen = torch.Generator().manual_seed(args.seed * 1000 + rank + 1)
    loss_fn = nn.CrossEntropyLoss()
    history = []
    clock = HeldOut(task, model, loss_fn, args)
    clock.evaluate(0)
    for epoch in range(args.epochs):
        losses, iter_s = [], []
        bar = tqdm(range(args.steps_per_epoch), desc=f"epoch {epoch}",
                   disable=rank != 0 or args.quiet)
        start = time.perf_counter()
        for _ in bar:
            t0 = time.perf_counter()
            x, y = (t.to(device) for t in task.batch(args.batch_size, args.seq, gen))
            opt.zero_grad()
            loss = loss_fn(model(x).reshape(-1, args.vocab), y.reshape(-1))
            loss.backward()
            opt.step()
            iter_s.append(time.perf_counter() - t0)
            losses.append(loss.item())
            clock.step_done()
            bar.set_postfix(loss=f"{losses[-1]:.3f}")
        elapsed = time.perf_counter() - start
        mean_loss = bps.push_pull(torch.tensor([statistics.fmean(losses)], device=device),
                                  name="epoch.loss")
        row = {"epoch": epoch, "loss": float(mean_loss.item()),
               "samples_per_s": args.batch_size * world * args.steps_per_epoch / elapsed,
               "iteration_ms_median": statistics.median(iter_s) * 1e3}
        history.append(row)
        if rank == 0:
            logging.info("epoch %d on %s: loss %.4f (best possible %.4f), %.0f samples/s, "
                         "%.2f ms/iteration", epoch, device, row["loss"], task.entropy(),
                         row["samples_per_s"], row["iteration_ms_median"])
    if clock.steps % max(1, args.eval_every) != 0:
        clock.evaluate(clock.steps)  # the final held-out loss
    if rank == 0 and args.metrics_out:
        strategy = bps.planned_strategy()
        Path(args.metrics_out).write_text(json.dumps({
            "compression": args.compression, "compressor": args.compressor,
            "world_size": world, "history": history, "entropy": task.entropy(),
            "predicted_ms": strategy.predicted_ms if strategy is not None else None,
            "algorithm": strategy.algorithm if strategy is not None else None,
            "baselines_ms": dict(strategy.baselines) if strategy is not None else None,
            **clock.metrics(),
        }, indent=1) + "\n")


if __name__ == "__main__":
    main()
