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

``--compression`` is ``fp32`` (uncompressed), ``fp16``, ``powersgd`` (rank
``--powersgd-rank`` on every bucket, as DDP's PowerSGD hook), ``espresso`` (profile, then plan
per tensor with ``--compressor``/``--ratio``) or ``strategy`` (``--strategy FILE`` from
``espresso plan``). Rank 0 prints per-epoch loss and throughput and, with ``--metrics-out``,
writes them as JSON.

With GPUs it trains on ``cuda:<local rank>`` as BytePS scripts do: every process of a machine
sees all of its GPUs and ``torch.cuda.set_device(bps.local_rank())`` picks one (a local job
with more workers per machine than GPUs shares them round-robin).

With ``--checkpoint-dir DIR --checkpoint-every K`` every rank saves its model, optimizer
(``optimizer.state_dict()``), data generator and history every K steps, and a job started
again resumes from the latest step every rank saved, e.g. under ``espresso-launch
--max-restarts 3``: the resumed run takes the same steps as an uninterrupted one.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import re
import statistics
import time
from dataclasses import dataclass, field
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

    Every rank evaluates at the same steps, and the time spent evaluating is left out of the
    clock: ``elapsed_s`` is training time only. The ranks are not synchronized around it: a
    rank that finishes its evaluation (or its set-up) first waits for the others inside its
    next step. The runs this example compares all use this runtime, so that wait adds noise
    between them, not a bias; benchmarks/ddp_worker.py, which compares with DDP, synchronizes
    the ranks off the clock.
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


class Checkpoints:
    """Every rank's state every ``--checkpoint-every`` steps, one file per rank and step.

    Each rank saves its own optimizer state (with compression it holds per-rank state such as
    error-feedback residuals), written to a temporary file and renamed, so a process killed
    while saving leaves the previous checkpoint intact. The latest step is the last one every
    rank saved; rank 0 chooses it and the others follow, so the directory needs to be shared
    only when ranks run on different machines.
    """

    KEEP = 2  # checkpoints kept per rank: ranks are at most one step apart, so one is complete
    _NAME = re.compile(r"step(\d+)\.rank(\d+)\.pt")

    def __init__(self, directory: str, rank: int, world: int) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.rank, self.world = rank, world

    def _path(self, step: int, rank: int) -> Path:
        return self.dir / f"step{step:08d}.rank{rank}.pt"

    def _steps(self, rank: int | None = None) -> dict[int, set[int]]:
        found: dict[int, set[int]] = {}
        for path in self.dir.iterdir():
            match = self._NAME.fullmatch(path.name)
            if match and (rank is None or int(match[2]) == rank):
                found.setdefault(int(match[1]), set()).add(int(match[2]))
        return found

    def latest(self) -> int | None:
        """The last step for which every rank's file exists, or None."""
        complete = [s for s, ranks in self._steps().items() if ranks >= set(range(self.world))]
        return max(complete, default=None)

    def save(self, step: int, state: dict) -> None:
        path = self._path(step, self.rank)
        tmp = path.with_name(path.name + ".tmp")
        torch.save({"step": step, "world": self.world, **state}, tmp)
        os.replace(tmp, path)
        for old in sorted(self._steps(self.rank))[:-self.KEEP]:
            self._path(old, self.rank).unlink(missing_ok=True)

    def load(self, step: int) -> dict:
        """This rank's state at ``step`` (tensors on the CPU).

        Raises:
            SystemExit: the file is missing or was saved by a job of another size.
        """
        path = self._path(step, self.rank)
        if not path.exists():
            raise SystemExit(f"rank {self.rank}: no checkpoint {path} for step {step}, which "
                             "rank 0 resumes from; give every rank the same --checkpoint-dir "
                             "(a shared directory when ranks run on several machines)")
        state = torch.load(path, map_location="cpu", weights_only=True)
        if state["world"] != self.world:
            raise SystemExit(f"{path} was saved by a job of {state['world']} workers; this "
                             f"one has {self.world}: use another --checkpoint-dir")
        return state


def compression(args: argparse.Namespace) -> bps.CompressionSpec:
    if args.compression == "fp32":
        return bps.Compression.none
    if args.compression == "fp16":
        return bps.Compression.fp16
    if args.compression == "powersgd":
        return bps.Compression.powersgd(args.powersgd_rank, sums=args.powersgd_sums)
    if args.compression == "strategy":
        if not args.strategy:
            raise SystemExit("--compression strategy needs --strategy FILE")
        return bps.Compression.strategy(args.strategy)
    params = {"ratio": args.ratio} if args.compressor in ("randomk", "topk", "dgc") else {}
    for item in getattr(args, "param", None) or ():
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--param {item!r}: write NAME=VALUE, e.g. warmup_steps=100")
        try:
            params[key] = json.loads(value)
        except json.JSONDecodeError:
            params[key] = value  # a string
    return bps.Compression.espresso(args.compressor, algorithm=args.algorithm, **params)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--compression", default="espresso",
                   choices=["fp32", "fp16", "powersgd", "espresso", "strategy"])
    p.add_argument("--compressor", default="randomk", help="for --compression espresso")
    p.add_argument("--ratio", type=float, default=0.01, help="sparsifiers' kept fraction")
    p.add_argument("--param", action="append", metavar="NAME=VALUE",
                   help="a compressor parameter for --compression espresso (JSON value), "
                        "e.g. --param warmup_steps=100; repeatable")
    p.add_argument("--powersgd-rank", type=int, default=4,
                   help="for --compression powersgd: the approximation rank")
    p.add_argument("--powersgd-sums", choices=["allreduce", "ps"], default="allreduce",
                   help="for --compression powersgd: sum P and Q on the collectives or "
                        "through the parameter servers")
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
    p.add_argument("--checkpoint-dir", help="save checkpoints here, and resume from the latest")
    p.add_argument("--checkpoint-every", type=int, default=0,
                   help="save a checkpoint every N steps (0: never)")
    p.add_argument("--params-out", help="rank 0 saves the final parameters here (torch.save)")
    args = p.parse_args()
    if args.checkpoint_every and not args.checkpoint_dir:
        p.error("--checkpoint-every needs --checkpoint-dir")
    return args


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


@dataclass
class Run:
    """The state a training run carries from step to step, and what resumes it."""

    model: nn.Module
    opt: torch.optim.Optimizer
    gen: torch.Generator
    ckpt: Checkpoints | None
    history: list[dict] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)  # this epoch's, so far
    step: int = 0

    def checkpoint(self, args: argparse.Namespace, epoch_done: bool) -> None:
        """Save every ``--checkpoint-every`` steps; a step that ends an epoch is saved once
        the epoch's row is in the history (``epoch_done``)."""
        if (self.ckpt and self.step % args.checkpoint_every == 0
                and epoch_done == (self.step % args.steps_per_epoch == 0)):
            self.ckpt.save(self.step, {
                "model": self.model.state_dict(), "optimizer": self.opt.state_dict(),
                "generator": self.gen.get_state(), "history": self.history,
                "losses": self.losses})


def start(args: argparse.Namespace, device: torch.device) -> Run:
    """Model, optimizer and data generator: fresh (rank 0's initial parameters everywhere), or
    every rank's own state from the latest checkpoint."""
    rank, world = bps.rank(), bps.size()
    model = MODELS[args.model](args.vocab, args.dim, args.hidden).to(device)
    ckpt = Checkpoints(args.checkpoint_dir, rank, world) if args.checkpoint_dir else None
    resumed = bps.broadcast_object(ckpt.latest() if ckpt and rank == 0 else None, root_rank=0,
                                   name="checkpoint.step")
    state = ckpt.load(resumed) if ckpt and resumed is not None else None
    if state is not None:
        model.load_state_dict(state["model"])
    bps.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    opt = bps.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                   compression=compression(args))
    run = Run(model, opt, torch.Generator().manual_seed(args.seed * 1000 + rank + 1), ckpt)
    if state is None:
        bps.broadcast_optimizer_state(opt, root_rank=0)
        return run
    # Every rank its own optimizer state: with compression it holds per-rank state.
    opt.load_state_dict(state["optimizer"])
    run.gen.set_state(state["generator"])
    run.history, run.losses, run.step = state["history"], state["losses"], state["step"]
    if rank == 0:
        logging.info("resumed from step %d of %s", run.step, args.checkpoint_dir)
    return run


def train(args: argparse.Namespace) -> None:
    rank, world = bps.rank(), bps.size()
    device = training_device()
    torch.manual_seed(args.seed)
    task = MarkovTask(args.vocab, args.determinism, args.seed)
    run = start(args, device)
    model, opt, gen = run.model, run.opt, run.gen
    loss_fn = nn.CrossEntropyLoss()
    clock = HeldOut(task, model, loss_fn, args)
    clock.steps = run.step
    clock.evaluate(run.step)
    for epoch in range(run.step // args.steps_per_epoch, args.epochs):
        iter_s: list[float] = []
        first = run.step - epoch * args.steps_per_epoch
        if first == 0:
            run.losses = []
        bar = tqdm(range(first, args.steps_per_epoch), desc=f"epoch {epoch}",
                   disable=rank != 0 or args.quiet)
        start_s = time.perf_counter()
        for _ in bar:
            t0 = time.perf_counter()
            x, y = (t.to(device) for t in task.batch(args.batch_size, args.seq, gen))
            opt.zero_grad()
            loss = loss_fn(model(x).reshape(-1, args.vocab), y.reshape(-1))
            loss.backward()
            opt.step()
            iter_s.append(time.perf_counter() - t0)
            run.losses.append(loss.item())
            clock.step_done()
            bar.set_postfix(loss=f"{run.losses[-1]:.3f}")
            run.step += 1
            run.checkpoint(args, epoch_done=False)
        elapsed = time.perf_counter() - start_s
        mean_loss = bps.push_pull(torch.tensor([statistics.fmean(run.losses)], device=device),
                                  name="epoch.loss")
        row = {"epoch": epoch, "loss": float(mean_loss.item()),
               "samples_per_s": args.batch_size * world * len(iter_s) / elapsed,
               "iteration_ms_median": statistics.median(iter_s) * 1e3}
        run.history.append(row)
        if rank == 0:
            logging.info("epoch %d on %s: loss %.4f (best possible %.4f), %.0f samples/s, "
                         "%.2f ms/iteration", epoch, device, row["loss"], task.entropy(),
                         row["samples_per_s"], row["iteration_ms_median"])
        run.checkpoint(args, epoch_done=True)
    if clock.steps % max(1, args.eval_every) != 0:
        clock.evaluate(clock.steps)  # the final held-out loss
    if rank == 0 and args.params_out:
        torch.save({k: v.cpu() for k, v in model.state_dict().items()}, args.params_out)
    if rank == 0 and args.metrics_out:
        strategy = bps.planned_strategy()
        Path(args.metrics_out).write_text(json.dumps({
            "compression": args.compression, "compressor": args.compressor,
            "world_size": world, "history": run.history, "entropy": task.entropy(),
            "predicted_ms": strategy.predicted_ms if strategy is not None else None,
            "algorithm": strategy.algorithm if strategy is not None else None,
            "baselines_ms": dict(strategy.baselines) if strategy is not None else None,
            **clock.metrics(),
        }, indent=1) + "\n")

if __name__ == "__main__":
    main()
