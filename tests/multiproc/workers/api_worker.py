"""Worker of test_torch_api_multiproc: every call of the drop-in API against an oracle.

Usage: api_worker.py OUT_DIR. Run under ``espresso-launch --local`` (any layout, servers >= 1).
Rank r contributes values derived from r, so every rank knows the expected results. The
script never calls ``bps.shutdown()``: the job must still end with exit code 0 (shutdown at
interpreter exit). At the end each rank writes OUT_DIR/api_RANK.json with digests of its
optimizer state and parameters after the resume pattern, for the test to compare.
"""

import gc
import hashlib
import json
import sys
from pathlib import Path

import numpy as np
import torch
from byteps_espresso.worker.objects import encode_object

import byteps_espresso.torch as bps


def raises(exc_type, fn, match=""):
    try:
        fn()
    except exc_type as exc:
        assert match in str(exc), exc
        return
    raise AssertionError(f"{fn} did not raise {exc_type.__name__}")


def check_push_pull(r: int, world: int, total: float) -> None:
    assert bps.declare("grad.w") == 0 and bps.declare("grad.w") == 0
    raises(ValueError, lambda: bps.declare("grad.v", staleness=1), "pipe-SGD")
    t = torch.full((3,), float(r + 1))
    out = bps.push_pull_inplace(t, average=False, name="pp")
    assert out is t and torch.equal(t, torch.full((3,), total)), t
    t = torch.full((3,), float(r + 1), dtype=torch.float64)
    h = bps.push_pull_async_inplace(t, name="pp.avg")
    assert bps.synchronize(h) is t and torch.equal(t, torch.full((3,), total / world,
                                                                  dtype=torch.float64))
    x = torch.full((2,), float(r + 1), requires_grad=True)
    y = bps.push_pull(x, average=True, name="pp.grad")
    assert torch.equal(y.detach(), torch.full((2,), total / world))
    (y * (r + 1)).sum().backward()
    assert torch.equal(x.grad, torch.full((2,), total / world)), x.grad  # average of (r+1)


def check_allreduce(r: int, world: int, total: float) -> None:
    x = torch.full((4,), float(r + 1))
    assert torch.equal(bps.allreduce(x), torch.full((4,), total / world))
    assert torch.equal(bps.allreduce(x, op=bps.Sum), torch.full((4,), total))
    assert torch.equal(bps.allreduce(x, average=False), torch.full((4,), total))
    assert torch.equal(x, torch.full((4,), float(r + 1)))  # not modified
    raises(ValueError, lambda: bps.allreduce(x, average=True, op=bps.Sum), "supersedes")
    raises(ValueError, lambda: bps.allreduce(x, op=bps.Adasum), "Adasum")
    scaled = bps.allreduce(x, op=bps.Sum, prescale_factor=2.0, postscale_factor=0.25)
    assert torch.equal(scaled, torch.full((4,), total * 2.0 * 0.25)), scaled
    ints = torch.tensor([10 * r + 1, -r], dtype=torch.int64)
    int_sum = torch.tensor([sum(10 * k + 1 for k in range(world)), -sum(range(world))])
    assert torch.equal(bps.allreduce(ints, op=bps.Sum), int_sum)
    avg = bps.allreduce(ints)
    assert avg.dtype == torch.int64 and torch.equal(avg, torch.div(int_sum, world,
                                                                   rounding_mode="floor"))
    y = x.clone()
    assert bps.allreduce_(y, op=bps.Sum) is y and torch.equal(y, torch.full((4,), total))
    h1 = bps.allreduce_async(x, name="ar.async")
    y = x.clone()
    h2 = bps.allreduce_async_(y, op=bps.Sum, name="ar.async_")
    assert torch.equal(bps.synchronize(h2), torch.full((4,), total)) and torch.equal(
        y, torch.full((4,), total))
    assert torch.equal(bps.synchronize(h1), torch.full((4,), total / world))
    raises(ValueError, lambda: bps.synchronize(h1), "already synchronized")
    g = torch.ones(3, requires_grad=True)
    (bps.allreduce(g, op=bps.Sum) * (r + 1)).sum().backward()
    assert torch.equal(g.grad, torch.full((3,), total)), g.grad  # gradient summed too


def check_allgather(r: int, world: int) -> None:
    mine = torch.full((r + 1, 2), r, dtype=torch.int32)
    every = bps.allgather(mine)
    expected = torch.cat([torch.full((k + 1, 2), k, dtype=torch.int32) for k in range(world)])
    assert every.dtype == torch.int32 and torch.equal(every, expected), every
    h = bps.allgather_async(torch.tensor(float(r)), name="ag.scalar")
    assert torch.equal(bps.synchronize(h), torch.arange(world, dtype=torch.float32))
    x = torch.full((r + 1, 3), float(r), requires_grad=True)
    y = bps.allgather(x)
    weights = torch.arange(y.shape[0], dtype=torch.float32).unsqueeze(1).expand(-1, 3)
    (y * weights).sum().backward()
    offset = sum(k + 1 for k in range(r))
    assert torch.equal(x.grad, weights[offset:offset + r + 1]), x.grad  # same on every rank
    bad = torch.zeros(1, 3 if r == 0 else 2)
    raises(ValueError, lambda: bps.allgather(bad), "equal shapes")


def check_broadcast(r: int, world: int) -> None:
    root = world - 1
    t = torch.full((3,), float(r))
    out = bps.broadcast(t, root)
    assert torch.equal(out, torch.full((3,), float(root))) and torch.equal(t, torch.full(
        (3,), float(r)))
    assert bps.broadcast_(t, root) is t and torch.equal(t, torch.full((3,), float(root)))
    ints = torch.tensor([r, r * 2])
    h1 = bps.broadcast_async(ints, 0)
    h2 = bps.broadcast_async_(ints, 1)
    assert torch.equal(bps.synchronize(h1), torch.tensor([0, 0]))
    assert torch.equal(bps.synchronize(h2), torch.tensor([1, 2])) and torch.equal(
        ints, torch.tensor([1, 2]))
    x = torch.full((2,), float(r), requires_grad=True)
    (bps.broadcast(x, root) * (r + 1)).sum().backward()
    mean = sum(k + 1 for k in range(world)) / world
    expected = torch.full((2,), mean) if r == root else torch.zeros(2)
    assert torch.equal(x.grad, expected), x.grad
    sent = {"epoch": 5, "betas": (0.9, 0.99), 7: "seven", "blob": b"\x00\x01",
            "t": torch.arange(3, dtype=torch.int16), "a": np.eye(2), "none": None,
            "nan": float("inf")}
    got = bps.broadcast_object(sent if r == 1 else None, root_rank=1)
    assert got.keys() == sent.keys() and got["betas"] == (0.9, 0.99) and got[7] == "seven"
    assert got["blob"] == b"\x00\x01" and torch.equal(got["t"], sent["t"])
    assert np.array_equal(got["a"], np.eye(2)) and got["nan"] == float("inf")
    every = bps.allgather_object({"rank": r, "tag": "x" * r, "pair": (r, -r)})
    assert every == [{"rank": k, "tag": "x" * k, "pair": (k, -k)} for k in range(world)]
    if r == 1:
        raises(TypeError, lambda: bps.broadcast_object(object(), root_rank=1), "object")
    else:
        raises(ValueError, lambda: bps.broadcast_object(None, root_rank=1), "object")


def check_optimizer_ops(r: int, world: int, total: float) -> None:
    for op, factor, expected in ((bps.Average, 1.0, total / world), (bps.Sum, 1.0, total),
                                 (bps.Average, 4.0, total / world)):
        p = torch.nn.Parameter(torch.zeros(3))
        opt = bps.DistributedOptimizer(torch.optim.SGD([p], lr=1.0), [("p", p)], op=op,
                                       gradient_predivide_factor=factor)
        (p * (r + 1)).sum().backward()
        opt.step()
        assert torch.equal(p.detach(), torch.full((3,), -expected)), (op, factor, p)
    q = torch.nn.Parameter(torch.zeros(1))
    raises(ValueError, lambda: bps.DistributedOptimizer(
        torch.optim.SGD([q], lr=1.0), [("q", q)], op=bps.Sum, gradient_predivide_factor=2.0),
        "op=Average")


def digest(obj) -> str:
    return hashlib.sha256(encode_object(obj)).hexdigest()


def torch_state(state: dict) -> dict:
    """The torch optimizer's part of a state dict (the "espresso" section is per rank)."""
    return {k: v for k, v in state.items() if k != "espresso"}


def resume(r: int, out: Path) -> dict:
    """Rank 0 loads a checkpoint into its (wrapped) optimizer; the others start fresh."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 1))
    opt = torch.optim.Adam(model.parameters(), lr=0.5 if r else 0.01, weight_decay=0.1)
    opt = bps.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    if r == 0:
        ckpt_model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 1))
        ckpt = torch.optim.Adam(ckpt_model.parameters(), lr=0.01, betas=(0.8, 0.95),
                                weight_decay=0.1)
        for _ in range(3):  # a checkpoint with 3 steps of state
            ckpt.zero_grad()
            ckpt_model(torch.randn(5, 4)).pow(2).sum().backward()
            ckpt.step()
        torch.save({"model": ckpt_model.state_dict(), "optimizer": ckpt.state_dict()},
                   out / "ckpt.pt")
        loaded = torch.load(out / "ckpt.pt", weights_only=True)
        model.load_state_dict(loaded["model"])
        opt.load_state_dict(loaded["optimizer"])
    bps.broadcast_parameters(model.state_dict(), root_rank=0)
    before = digest([p.detach() for p in model.parameters()])
    bps.broadcast_optimizer_state(opt, root_rank=0)
    assert digest([p.detach() for p in model.parameters()]) == before  # no parameter moved
    state = opt.state_dict()
    assert state["param_groups"][0]["lr"] == 0.01 and state["param_groups"][0]["betas"] == (
        0.8, 0.95)
    assert len(state["state"]) == 4 and float(state["state"][0]["step"]) == 3.0
    after_broadcast = digest(torch_state(state))
    opt.zero_grad()
    model(torch.randn(5, 4, generator=torch.Generator().manual_seed(r))).pow(2).sum().backward()
    opt.step()
    return {"state": after_broadcast, "stepped": digest(torch_state(opt.state_dict())),
            "params": digest([p.detach() for p in model.parameters()])}


def main() -> None:
    out = Path(sys.argv[1])
    bps.init()
    assert gc.get_freeze_count() > 0  # the imports are out of the cyclic collector's reach
    r, world = bps.rank(), bps.size()
    total = float(sum(k + 1 for k in range(world)))
    assert bps.is_initialized()
    assert (bps.cross_rank(), bps.cross_size()) == (r // bps.local_size(),
                                                    world // bps.local_size())
    assert bps.local_rank() == r % bps.local_size()
    check_push_pull(r, world, total)
    check_allreduce(r, world, total)
    check_allgather(r, world)
    check_broadcast(r, world)
    check_optimizer_ops(r, world, total)
    result = resume(r, out)
    (out / f"api_{r}.json").write_text(json.dumps(result))
    print(f"api ok rank={r}", flush=True)
    # No bps.shutdown(): it runs at interpreter exit.


if __name__ == "__main__":
    main()
