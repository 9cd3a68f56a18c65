"""Worker of test_powersgd: synchronizes gradients with ``Compression.powersgd`` in buckets.

Usage: powersgd_worker.py OUT_DIR STEPS SUMS, SUMS one of ``Compression.powersgd``'s (every
bucket compressed), ``espresso`` (``Compression.espresso("powersgd")``: profiled, planned per
bucket, tried) or ``strategy:PATH`` (``Compression.strategy``: a PowerSGD strategy file whose
buckets are compressed or not, each with its own sums' Option). Every parameter's
gradient is a per-rank random tensor (see :func:`grads`), so the test recomputes PowerSGD's
steps. After every step each parameter's ``.grad`` goes to OUT_DIR/grad_STEP_RANK_NAME.npy
(no pickle); at the end the bucket layout, the Options and what the checkpoint section holds
go to OUT_DIR/run_RANK.json.
"""

import json
import sys
from pathlib import Path

import numpy as np
import torch

import byteps_espresso.torch as bps

# (name, shape): matrices PowerSGD compresses at rank 2 (a conv weight as 16 x 36), a vector
# and a matrix too small to shrink, which it sums uncompressed; "big" is above the test's
# bucket cap, alone in its bucket.
PARAMS = [("w", (40, 24)), ("b", (24,)), ("conv", (16, 4, 3, 3)), ("s", (3, 2)),
          ("big", (96, 64))]
RANK, START_ITER = 2, 1


def grads(rank: int, step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * rank + step)
    return {name: torch.randn(shape, generator=g) for name, shape in PARAMS}


def main() -> None:
    out, steps, sums = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    bps.init()
    try:
        params = {name: torch.nn.Parameter(torch.zeros(shape)) for name, shape in PARAMS}
        if sums.startswith("strategy:"):
            compression = bps.Compression.strategy(sums.split(":", 1)[1])
        elif sums == "espresso":  # profiled, planned per bucket, trials
            compression = bps.Compression.espresso("powersgd", rank=RANK,
                                                   start_iter=START_ITER, seed=3)
        else:
            compression = bps.Compression.powersgd(RANK, start_iter=START_ITER, seed=3,
                                                   sums=sums)
        opt = bps.DistributedOptimizer(
            torch.optim.SGD(params.values(), lr=0.0), named_parameters=list(params.items()),
            compression=compression)
        for step in range(steps):
            opt.zero_grad(set_to_none=True)
            want = grads(bps.rank(), step)
            sum((p * want[name]).sum() for name, p in params.items()).backward()
            opt.step()
            for name, p in params.items():
                np.save(out / f"grad_{step}_{bps.rank()}_{name}.npy", p.grad.numpy(),
                        allow_pickle=False)
        section = opt.state_dict()["espresso"]
        (out / f"run_{bps.rank()}.json").write_text(json.dumps({
            "buckets": [list(b.tensors) for b in opt._bps.buckets],
            "options": sorted({str(o) for o in opt._bps.options.values()}),
            "by_bucket": {name: str(o) for name, o in opt._bps.options.items()},
            "fp32": str(opt._bps.session.fp32),
            "allreduce": str(opt._bps.session.allreduce),
            "compression": json.loads(section["compression"]),
            "state": {n: sorted(slots) for n, slots in section["codec"]["powersgd"].items()},
            "errors": opt._bps.compression_errors}))
    finally:
        bps.shutdown()


if __name__ == "__main__":
    main()
