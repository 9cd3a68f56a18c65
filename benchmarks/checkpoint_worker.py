"""Worker of benchmarks/checkpoint.py: train, checkpoint every rank at one step, or resume.

Modes: ``full`` trains ``--steps`` steps and after ``--save-at`` of them saves every rank's
checkpoint (model + ``optimizer.state_dict()``); ``resume`` loads it in new processes and
trains the rest; ``resume-torch`` does the same with the torch optimizer's state only (the
``"espresso"`` section dropped: what a checkpoint held before it existed). Each rank writes
OUT/<mode>_RANK.json (held-out loss, timings, sizes) and OUT/<mode>_params_RANK.npy.

The model is an embedding-bag MLP over a synthetic next-token task (each token is followed
by its successor with probability 0.9): large embedding and output matrices, as in
examples/train.py's ``--model mlp``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

import byteps_espresso.torch as bps


def batch(vocab: int, rank: int, step: int, size: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100_003 * rank + step)
    x = torch.randint(vocab, (size,), generator=g)
    jump = torch.rand(size, generator=g) < 0.1
    y = torch.where(jump, torch.randint(vocab, (size,), generator=g), (x + 1) % vocab)
    return x, y


def model(vocab: int, dim: int, hidden: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(vocab, dim), nn.Linear(dim, hidden), nn.Tanh(),
                         nn.Linear(hidden, vocab))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--mode", choices=("full", "resume", "resume-torch"), required=True)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--save-at", type=int, default=30)
    p.add_argument("--compressor", default="randomk")
    p.add_argument("--ratio", type=float, default=0.01)
    p.add_argument("--vocab", type=int, default=2000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--hidden", type=int, default=128)
    args = p.parse_args()
    bps.init()
    rank = bps.rank()
    net = model(args.vocab, args.dim, args.hidden)
    opt = bps.DistributedOptimizer(
        torch.optim.SGD(net.parameters(), lr=0.5, momentum=0.9),
        named_parameters=net.named_parameters(),
        compression=bps.Compression.espresso(args.compressor, ratio=args.ratio))
    facts: dict = {"mode": args.mode}
    first = 0
    if args.mode != "full":
        t0 = time.perf_counter()
        ckpt = torch.load(args.out / f"ckpt_{rank}.pt", weights_only=True)
        net.load_state_dict(ckpt["model"])
        state = ckpt["optimizer"]
        if args.mode == "resume-torch":
            state = {k: v for k, v in state.items() if k != "espresso"}
        opt.load_state_dict(state)
        facts["load_s"] = time.perf_counter() - t0
        first = args.save_at
    for step in range(first, args.steps):
        opt.zero_grad()
        x, y = batch(args.vocab, rank, step)
        nn.functional.cross_entropy(net(x), y).backward()
        opt.step()
        if args.mode == "full" and step + 1 == args.save_at:
            t0 = time.perf_counter()
            state = opt.state_dict()
            facts["state_dict_s"] = time.perf_counter() - t0
            facts["phase"] = state["espresso"]["phase"]
            torch.save({"model": net.state_dict(), "optimizer": state},
                       args.out / f"ckpt_{rank}.pt")
            facts["checkpoint_bytes"] = (args.out / f"ckpt_{rank}.pt").stat().st_size
            torch.save({"model": net.state_dict(), "optimizer": {
                k: v for k, v in state.items() if k != "espresso"}}, args.out / f"torch_{rank}.pt")
            facts["torch_only_bytes"] = (args.out / f"torch_{rank}.pt").stat().st_size
    with torch.no_grad():
        x, y = batch(args.vocab, 10_000, 0, size=4096)  # held out: a rank no worker has
        facts["heldout_loss"] = nn.functional.cross_entropy(net(x), y).item()
    strategy = bps.planned_strategy()
    facts["algorithm"] = strategy.algorithm if strategy else None
    flat = torch.cat([q.detach().reshape(-1) for q in net.parameters()])
    np.save(args.out / f"{args.mode}_params_{rank}.npy", flat.numpy(), allow_pickle=False)
    (args.out / f"{args.mode}_{rank}.json").write_text(json.dumps(facts))
    bps.shutdown()


if __name__ == "__main__":
    main()
