"""Worker of test_optimizer: trains a small model with the drop-in API, saves parameters.

Usage: optimizer_worker.py OUT_DIR COMPRESSION PASSES STEPS. COMPRESSION is a name of
``bps.Compression``, ``espresso`` (random-k planned after ESPRESSO_PROFILE_STEPS uncompressed
iterations), ``espresso-trials`` (the same, with every alternative a finalist of the
measured trials, however slow its prediction), ``espresso-traffic`` (the same on a wider
model whose profiled push/pulls price the PS path instead of the large PS probe),
``espresso-warmup`` (dgc with a sparsity warm-up of WARMUP iterations, every alternative a
finalist: the trials wait for the warm-up to end), ``espresso-fewest`` (espresso-trials on a
model of 1.25 MiB of gradients: the fewest buckets are another layout), ``espresso-slowed``
(espresso-trials whose steps SLOWED sleep SLOW_S each: the iterations the check times of
the kept strategy measure slower than the profiled fp32 ones), ``espresso-slowed-fp16``
(the same planned for fp16, whose fall-backs begin with DDP's fp16-hook plan) or ``dgc``
(DGC's recipe: the optimizer's momentum moves before communication). Each rank's batches are drawn
from a generator seeded by (rank, step, pass), so the test recomputes them. After every step
the flattened parameters are saved as OUT_DIR/params_STEP_RANK.npy (no pickle); at the end
the algorithm of the strategy in use goes to OUT_DIR/kept_RANK.txt and its Options to
OUT_DIR/options_RANK.json.
"""

import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
from byteps_espresso.worker import profiler

import byteps_espresso.torch as bps

WIDE = 8192
WARMUP = 6  # espresso-warmup's sparsity warm-up, in iterations
# espresso-fewest's hidden width: the first layer's weight alone is 1 MiB, so DDP's 1 MiB first
# bucket splits the weights in two and the fewest buckets hold them in one.
FEWEST_WIDTH = 1 << 15
# espresso-slowed(-fp16): after 4 profiled steps and no trials, the check's 3 iterations of
# the kept strategy (steps 4-6) each sleep SLOW_S, s; those of the fall-backs checked next
# do not.
SLOWED = range(4, 7)
SLOW_S = 0.3


def batch(rank: int, step: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + 10 * step + k)
    x = torch.randn(16, 8, generator=g)
    return x, x.sum(dim=1, keepdim=True).tanh()


def model(width: int = 33) -> torch.nn.Module:
    torch.manual_seed(1234)
    return torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.Tanh(),
                               torch.nn.Linear(width, 1))


def main() -> None:
    out, compression, passes, steps = (Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]),
                                       int(sys.argv[4]))
    bps.init()
    try:
        # espresso-traffic: a hidden layer wide enough for the profiled push/pulls to price the
        # PS path (each worker's shard of the one bucket: 40,961 elements).
        wide = compression == "espresso-traffic"
        if wide:
            profiler._TRAFFIC_MIN = 1 << 15
        slowed = compression.startswith("espresso-slowed")
        net = model(WIDE if wide else FEWEST_WIDTH
                    if compression == "espresso-fewest" or slowed else 33)
        if bps.rank() != 0:  # different local init: broadcast_parameters must fix it
            with torch.no_grad():
                for p in net.parameters():
                    p.add_(0.5)
        bps.broadcast_parameters(net.state_dict(), root_rank=0)
        # the wide layers of espresso-fewest diverge at the others' rate
        lr = 1e-4 if compression == "espresso-fewest" or slowed else 0.1
        opt = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9)
        if compression in ("espresso-trials", "espresso-warmup", "espresso-fewest") or slowed:
            profiler._TRIAL_WITHIN = float("inf")  # every alternative a finalist, however slow
        if compression == "espresso-warmup":
            spec = bps.Compression.espresso("dgc", ratio=0.5, warmup_steps=WARMUP)
        elif compression == "dgc":  # DGC's recipe: momentum applied before communication
            spec = bps.Compression.espresso("dgc", ratio=0.5, momentum_correction=True)
        elif compression == "espresso-slowed":
            # random-k at 1%: the plan mostly compresses the 1 MiB layer, and where it does
            # not, it keeps fewer buckets than the profiled iterations' (then its fp32
            # finalist is theirs)
            spec = bps.Compression.espresso("randomk", ratio=0.01)
        elif compression == "espresso-slowed-fp16":
            spec = bps.Compression.espresso("fp16")
        elif compression.startswith("espresso"):
            spec = bps.Compression.espresso("randomk", ratio=0.5)
        else:
            spec = getattr(bps.Compression, compression)
        opt = bps.DistributedOptimizer(opt, named_parameters=net.named_parameters(),
                                       compression=spec,
                                       backward_passes_per_step=passes)
        bps.broadcast_optimizer_state(opt, root_rank=0)
        for step in range(steps):
            if slowed and step in SLOWED:
                time.sleep(SLOW_S)
            opt.zero_grad()
            for k in range(passes):
                x, y = batch(bps.rank(), step, k)
                torch.nn.functional.mse_loss(net(x), y).backward()
            opt.step()
            flat = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
            np.save(out / f"params_{step}_{bps.rank()}.npy", flat.numpy(), allow_pickle=False)
        # The raw API as well: push_pull of a named tensor, async + poll + synchronize.
        h = bps.push_pull_async(torch.full((5,), float(bps.rank())), average=False, name="ranks")
        while not bps.poll(h):
            time.sleep(0.001)
        total = bps.synchronize(h)
        np.save(out / f"ranks_{bps.rank()}.npy", total.numpy(), allow_pickle=False)
        (out / f"momentum_{bps.rank()}.txt").write_text(str(opt.param_groups[0]["momentum"]))
        strategy = bps.planned_strategy()
        (out / f"kept_{bps.rank()}.txt").write_text(strategy.algorithm if strategy else "-")
        (out / f"options_{bps.rank()}.json").write_text(json.dumps(
            {name: str(o) for name, o in strategy.options.items()} if strategy else {}))
        sync = opt._bps  # each bucket's iteration counter against the training's
        counters = {b.name: sync.session.runtime.counters.get(b.name) for b in sync.buckets}
        (out / f"counters_{bps.rank()}.json").write_text(json.dumps(
            {"iteration": sync.iteration, "buckets": counters}))
    finally:
        bps.shutdown()


if __name__ == "__main__":
    main()
