"""Worker of test_nonfinite: rank 1's loss turns NaN at step 2; what does every rank do?

Usage: nonfinite_worker.py OUT_DIR COMPRESSION STEPS (``none``, ``fp16``, ``onebit``: every
bucket one-bit compressed, a codec that drops the flag, or ``powersgd``: rank 1 from the first
step). With
ESPRESSO_NONFINITE=error each rank writes the error it raised to OUT_DIR/error_RANK.txt and
stops training; with ``skip`` it trains on, saving its flattened parameters after every step
(OUT_DIR/params_STEP_RANK.npy, no pickle) and the skipped count to OUT_DIR/skipped_RANK.txt.
"""

import sys
from pathlib import Path

import numpy as np
import torch
from byteps_espresso.worker.optimizer import NonFiniteGradientError, _Uniform

import byteps_espresso.torch as bps

BAD_RANK, BAD_STEP = 1, 2


def main() -> None:
    out, compression, steps = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    bps.init()
    try:
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(6, 9), torch.nn.Tanh(), torch.nn.Linear(9, 1))
        spec = (bps.Compression.powersgd(1, start_iter=0) if compression == "powersgd"
                else _Uniform("onebit") if compression == "onebit"
                else getattr(bps.Compression, compression))
        opt = bps.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1),
                                       named_parameters=net.named_parameters(),
                                       compression=spec)
        g = torch.Generator().manual_seed(bps.rank())
        for step in range(steps):
            opt.zero_grad()
            x = torch.randn(8, 6, generator=g)
            loss = net(x).pow(2).mean()
            if (bps.rank(), step) == (BAD_RANK, BAD_STEP):
                loss = loss * float("nan")  # every gradient of this rank turns NaN
            loss.backward()
            try:
                opt.step()
            except NonFiniteGradientError as exc:
                (out / f"error_{bps.rank()}.txt").write_text(str(exc))
                return
            flat = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
            np.save(out / f"params_{step}_{bps.rank()}.npy", flat.numpy(), allow_pickle=False)
        (out / f"skipped_{bps.rank()}.txt").write_text(str(opt.skipped_steps))
    finally:
        bps.shutdown()


if __name__ == "__main__":
    main()
