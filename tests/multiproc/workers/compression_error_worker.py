"""Worker of test_compression_error: every gradient compressed (random-k, no dense step allowed)
under an error budget no compressor meets.

Usage: compression_error_worker.py OUT_DIR STEPS. After every step the rank saves its flattened
parameters (OUT_DIR/params_STEP_RANK.npy, no pickle) and appends the number of buckets whose
Option compresses to OUT_DIR/compressed_RANK.txt; at the end the last measured errors go to
OUT_DIR/errors_RANK.json.
"""

import json
import sys
from pathlib import Path

import numpy as np
import torch

import byteps_espresso.torch as bps
from byteps_espresso.strategy import Constraints, Kind

# Every step kind that moves uncompressed values: with these forbidden, each option compresses.
DENSE = frozenset({Kind.ALLREDUCE, Kind.REDUCE_SCATTER, Kind.ALLGATHER, Kind.REDUCE,
                   Kind.BROADCAST, Kind.PUSH_PULL})


def main() -> None:
    out, steps = Path(sys.argv[1]), int(sys.argv[2])
    bps.init()
    try:
        torch.manual_seed(5)
        net = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
        opt = bps.DistributedOptimizer(
            torch.optim.SGD(net.parameters(), lr=0.05), named_parameters=net.named_parameters(),
            compression=bps.Compression.espresso("randomk", ratio=0.5, exclude=[],
                                                 constraints=Constraints(forbid=DENSE)))
        g = torch.Generator().manual_seed(bps.rank())
        counts = []
        for step in range(steps):
            opt.zero_grad()
            x = torch.randn(16, 8, generator=g)
            torch.nn.functional.mse_loss(net(x), x.sum(1, keepdim=True).tanh()).backward()
            opt.step()
            flat = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
            np.save(out / f"params_{step}_{bps.rank()}.npy", flat.numpy(), allow_pickle=False)
            counts.append(sum(o.is_compressed for o in opt._bps.options.values())
                          if opt._bps.options is not None else 0)
        (out / f"compressed_{bps.rank()}.txt").write_text(" ".join(map(str, counts)))
        (out / f"errors_{bps.rank()}.json").write_text(json.dumps(opt._bps.compression_errors))
    finally:
        bps.shutdown()


if __name__ == "__main__":
    main()
