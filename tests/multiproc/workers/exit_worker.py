"""Worker of test_torch_api_multiproc: how a script that never calls ``shutdown`` ends.

Usage: exit_worker.py MODE. Every rank joins, trains one step and push-pulls a tensor, then:
``finish`` returns (shutdown at interpreter exit must leave the job cleanly);
``raise`` makes rank 1 raise an uncaught exception while the others push-pull again (they
must fail at once, told the worker was lost, not wait for their time-out).
"""

import sys

import torch

import byteps_espresso.torch as bps


def main() -> None:
    mode = sys.argv[1]
    bps.init()
    model = torch.nn.Linear(4, 2)
    bps.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = bps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    model(torch.ones(3, 4)).sum().backward()
    opt.step()
    total = bps.push_pull(torch.ones(2), average=False, name="ones")
    assert torch.equal(total, torch.full((2,), float(bps.size())))
    print(f"trained rank={bps.rank()}", flush=True)
    if mode == "raise":
        if bps.rank() == 1:
            raise RuntimeError("rank 1 fails on purpose")
        bps.push_pull(torch.ones(2), name="never.complete")


if __name__ == "__main__":
    main()
