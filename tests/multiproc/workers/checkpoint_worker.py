"""Worker of test_checkpoint: train, checkpoint every rank at one step, or resume from it.

Usage: checkpoint_worker.py OUT_DIR COMPRESSION STEPS SAVE_AT [RESUME_DIR [OTHER_STRATEGY]].
COMPRESSION is ``espresso`` (dgc with DGC's recipe, planned after profiling and trials) or a
strategy file path. Each rank's batches are drawn from a generator seeded by (rank, step). Without
RESUME_DIR the script trains STEPS steps and after SAVE_AT of them saves
OUT_DIR/ckpt_RANK.pt (model and optimizer state). With RESUME_DIR it first checks that
checkpoints of another rank, another world size and (with OTHER_STRATEGY, a strategy file)
another strategy are refused by name, then loads its own and trains the steps after
SAVE_AT. At the end: OUT_DIR/params_RANK.npy (flattened parameters, no pickle) and
OUT_DIR/run_RANK.json (losses per step, the strategy in use, checkpoint facts).
"""

import copy
import json
import sys
from pathlib import Path

import numpy as np
import torch
from byteps_espresso.worker.checkpoint import CheckpointError

import byteps_espresso.torch as bps


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(16, 8, generator=g)
    return x, x.sum(dim=1, keepdim=True).tanh()


def model() -> torch.nn.Module:
    torch.manual_seed(1234)
    return torch.nn.Sequential(torch.nn.Linear(8, 33), torch.nn.Tanh(), torch.nn.Linear(33, 1))


def compression(arg: str):
    if arg == "espresso":  # DGC's recipe: momentum correction, and velocities for biases
        return bps.Compression.espresso("dgc", ratio=0.25, momentum_correction=True)
    return bps.Compression.strategy(arg)


def optimizer(net: torch.nn.Module, arg: str) -> torch.optim.Optimizer:
    return bps.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9),
                                    named_parameters=net.named_parameters(),
                                    compression=compression(arg))


def refused(fn, match: str) -> str:
    try:
        fn()
    except CheckpointError as exc:
        assert match in str(exc), f"expected {match!r} in: {exc}"
        return str(exc)
    raise AssertionError(f"no CheckpointError (expected one mentioning {match!r})")


def check_refusals(opt, net, resume: Path, other_strategy: str | None) -> dict:
    """Checkpoints of another rank, world size or strategy are refused, naming the difference;
    nothing of this optimizer changes (each check comes before any state is touched)."""
    rank, world = bps.rank(), bps.size()
    other = torch.load(resume / f"ckpt_{(rank + 1) % world}.pt", weights_only=True)
    errors = {"rank": refused(lambda: opt.load_state_dict(other["optimizer"]), "holds rank")}
    mine = torch.load(resume / f"ckpt_{rank}.pt", weights_only=True)["optimizer"]
    smaller = {**mine, "espresso": {**mine["espresso"], "local_size": 1}}
    errors["world"] = refused(lambda: opt.load_state_dict(smaller), "world size 2")
    if other_strategy is not None:  # an optimizer of a copy: its hooks never fire
        twin = copy.deepcopy(net)
        errors["strategy"] = refused(
            lambda: optimizer(twin, other_strategy).load_state_dict(mine), "another strategy")
    return errors


def main() -> None:
    out, arg, steps, save_at = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    resume = Path(sys.argv[5]) if len(sys.argv) > 5 else None
    other_strategy = sys.argv[6] if len(sys.argv) > 6 else None
    bps.init()
    try:
        rank = bps.rank()
        net = model()
        opt = optimizer(net, arg)
        facts: dict = {}
        first = 0
        if resume is not None:
            facts["refused"] = check_refusals(opt, net, resume, other_strategy)
            ckpt = torch.load(resume / f"ckpt_{rank}.pt", weights_only=True)
            net.load_state_dict(ckpt["model"])
            opt.load_state_dict(ckpt["optimizer"])
            first = save_at
        losses = {}
        for step in range(first, steps):
            opt.zero_grad()
            x, y = batch(rank, step)
            loss = torch.nn.functional.mse_loss(net(x), y)
            loss.backward()
            opt.step()
            losses[step] = loss.item()
            if resume is None and step + 1 == save_at:
                state = {"model": net.state_dict(), "optimizer": opt.state_dict()}
                section = state["optimizer"]["espresso"]
                assert section["phase"] == "running", (
                    f"checkpoint at step {save_at} is still in phase {section['phase']}")
                torch.save(state, out / f"ckpt_{rank}.pt")
                facts["checkpoint_bytes"] = (out / f"ckpt_{rank}.pt").stat().st_size
                facts["server_state_keys"] = len(section.get("server_state", {}))
                facts["velocities"] = len(section["velocity"])
                facts["codec_slots"] = sorted({slot for dev in section["codec"].values()
                                               for slots in dev.values() for slot in slots})
        flat = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
        np.save(out / f"params_{rank}.npy", flat.numpy(), allow_pickle=False)
        strategy = bps.planned_strategy()
        facts.update(losses=losses, algorithm=strategy.algorithm if strategy else None,
                     options={n: str(o) for n, o in strategy.options.items()} if strategy
                     else None)
        (out / f"run_{rank}.json").write_text(json.dumps(facts))
    finally:
        bps.shutdown()


if __name__ == "__main__":
    main()
