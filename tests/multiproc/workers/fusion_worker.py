"""Worker of test_fusion: synchronizes gradients of mixed dtypes and odd sizes in buckets.

Usage: fusion_worker.py OUT_DIR STEPS. Every parameter's gradient is a per-rank constant
(see :func:`grads`), so the test recomputes each bucket's inputs exactly. After every step
each parameter's ``.grad`` (as float64) goes to OUT_DIR/grad_STEP_RANK_NAME.npy (no pickle),
and the bucket layout in use to OUT_DIR/buckets_RANK.json.
"""

import json
import sys
from pathlib import Path

import numpy as np
import torch

import byteps_espresso.torch as bps

# (name, shape, dtype): odd sizes, one above the test's bucket cap, several dtypes.
PARAMS = [("a", (7,), torch.float32), ("b", (3, 5), torch.float64),
          ("c", (11,), torch.bfloat16), ("big", (4099,), torch.float32),
          ("d", (1,), torch.float16), ("e", (33, 3), torch.float32),
          ("f", (5,), torch.float64)]


def grads(rank: int, step: int) -> dict[str, torch.Tensor]:
    """Each parameter's gradient on ``rank`` at ``step``, in the parameter's dtype; rank 1
    leaves ``UNUSED`` out of its loss at step 1 (no gradient: it counts as zeros)."""
    g = torch.Generator().manual_seed(100 * rank + step)
    out = {name: torch.randn(shape, generator=g).to(dtype) for name, shape, dtype in PARAMS}
    if (rank, step) == (1, 1):
        del out[UNUSED]
    return out


UNUSED = "e"  # in the middle of a fused bucket


def main() -> None:
    out, steps = Path(sys.argv[1]), int(sys.argv[2])
    bps.init()
    try:
        params = {name: torch.nn.Parameter(torch.zeros(shape, dtype=dtype))
                  for name, shape, dtype in PARAMS}
        opt = bps.DistributedOptimizer(torch.optim.SGD(params.values(), lr=0.0),
                                       named_parameters=list(params.items()))
        for step in range(steps):
            opt.zero_grad(set_to_none=True)
            want = grads(bps.rank(), step)
            # d(sum(p * g))/dp = g exactly, in p's dtype; registration order is backward
            # order reversed, as for a model's layers.
            loss = sum((p * want[name]).sum().double() for name, p in params.items()
                       if name in want)
            loss.backward()
            try:  # not in the middle of an iteration
                opt.set_backward_passes_per_step(2)
            except RuntimeError as exc:
                (out / f"refused_{bps.rank()}.txt").write_text(str(exc))
            opt.synchronize()  # e.g. to clip gradients: step() must not send them again
            for name, p in params.items():
                np.save(out / f"grad_{step}_{bps.rank()}_{name}.npy",
                        p.grad.double().numpy(), allow_pickle=False)
            if step % 2:
                with opt.skip_synchronize():
                    opt.step()
            else:
                opt.step()
        layout = [list(b.tensors) for b in opt._bps.buckets]
        (out / f"buckets_{bps.rank()}.json").write_text(json.dumps(layout))
        # Submissions per bucket: one per iteration whatever the call order.
        sent = {b.name: opt._bps.engine._steps[b.name] for b in opt._bps.buckets}
        (out / f"sent_{bps.rank()}.json").write_text(json.dumps(sent))
        (out / f"fp32_{bps.rank()}.txt").write_text(str(opt._bps.session.fp32))
    finally:
        bps.shutdown()


if __name__ == "__main__":
    main()
