"""Worker of test_torch_api_multiproc: ``ESPRESSO_STRATEGY`` loads the plan; nothing profiles.

Usage: strategy_env_worker.py OUT_DIR. The script asks for ``Compression.espresso`` (which
would profile ``ESPRESSO_PROFILE_STEPS`` iterations first); with ``ESPRESSO_STRATEGY`` set the
strategy file must be in use from the first step. Writes OUT_DIR/strategy_RANK.txt with the
strategy's algorithm and the iteration at which it was in use, and OUT_DIR/kernels_RANK.txt
with how many kernel signatures numba had loaded once the optimizer was built and after the
steps (the optimizer loads the codec's kernels when it is built, not in the first step).
"""

import sys
from pathlib import Path

import torch
from byteps_espresso.kernels.cli import _dispatchers

import byteps_espresso.torch as bps


def loaded() -> int:
    return sum(len(d.signatures) for d in {id(d): d for d in _dispatchers()}.values())


def model() -> torch.nn.Module:
    torch.manual_seed(3)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def main() -> None:
    out = Path(sys.argv[1])
    bps.init()
    net = model()
    opt = bps.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1),
                                   named_parameters=net.named_parameters(),
                                   compression=bps.Compression.espresso("randomk", ratio=0.5))
    strategy = bps.planned_strategy()  # before any step: loaded, not planned after profiling
    built = loaded()
    for _ in range(2):
        opt.zero_grad()
        net(torch.randn(4, 8)).pow(2).mean().backward()
        opt.step()
    (out / f"kernels_{bps.rank()}.txt").write_text(f"{built} {loaded()}")
    (out / f"strategy_{bps.rank()}.txt").write_text(
        f"{strategy.algorithm if strategy else None} {strategy.compressor if strategy else None}")
    bps.shutdown()


if __name__ == "__main__":
    main()
