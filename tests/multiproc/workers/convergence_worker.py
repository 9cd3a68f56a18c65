"""Worker of test_convergence: trains the example's MLP on the Markov task once per compression.

Usage: convergence_worker.py OUT_DIR STEPS NAME=COMPRESSOR[:RATIO] ...  (COMPRESSOR ``fp32``
means uncompressed; ``powersgd:R`` is ``Compression.powersgd`` at rank R, not planned;
``dgc+recipe`` is dgc with DGC's momentum correction).
Compressed runs are planned by Espresso under a constraint that forbids
the uncompressed collectives and push/pull, so every tensor is compressed whatever this
machine's timings favour (on a fast loopback the planner may rightly compress nothing, which
would leave compression untested), and that allows one Comp per Option: the compressor's
own error with error feedback is what the test bounds, not that of re-compressing partial
sums at every hop (see test_convergence.py). All runs share one job (one process group and PS
connection); each run prefixes its parameter names so that its strategy and PS keys are its
own. Rank 0 writes OUT_DIR/NAME.json with the loss curve (averaged over workers) and the
planned strategy's number of compressed tensors.
"""

import json
import sys
from pathlib import Path

import torch

import byteps_espresso.torch as bps
from byteps_espresso.strategy import Constraints, Kind

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "examples"))
import train as example

VOCAB, DIM, HIDDEN, BATCH, SEQ, LR = 500, 32, 64, 16, 8, 0.5
# Every step kind that moves uncompressed values: with these forbidden, each option compresses.
DENSE = frozenset({Kind.ALLREDUCE, Kind.REDUCE_SCATTER, Kind.ALLGATHER, Kind.REDUCE,
                   Kind.BROADCAST, Kind.PUSH_PULL})


def run(name: str, spec: str, steps: int, out: Path) -> None:
    compressor, _, ratio = spec.partition(":")
    torch.manual_seed(0)
    task = example.MarkovTask(VOCAB, 0.9, 0)
    model = example.MLPModel(VOCAB, DIM, HIDDEN)
    bps.broadcast_parameters(model.state_dict(), root_rank=0)
    if compressor == "fp32":
        compression = bps.Compression.none
    elif compressor == "powersgd":  # RATIO is the rank; its own fixed scheme, not planned
        compression = bps.Compression.powersgd(int(ratio or 1))
    else:
        params = {"ratio": float(ratio)} if ratio else {}
        if compressor == "dgc+recipe":  # DGC's momentum correction and masking
            compressor, params["momentum_correction"] = "dgc", True
        compression = bps.Compression.espresso(
            compressor, constraints=Constraints(forbid=DENSE, max_compressions=1), exclude=[],
            **params)
    opt = bps.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9),
        named_parameters=[(f"{name}.{n}", p) for n, p in model.named_parameters()],
        compression=compression)
    gen = torch.Generator().manual_seed(100 + bps.rank())
    losses = []
    for _ in range(steps):
        x, y = task.batch(BATCH, SEQ, gen)
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    curve = bps.push_pull(torch.tensor(losses), name=f"{name}.losses")
    strategy = bps.planned_strategy() if compressor not in ("fp32", "powersgd") else None
    if bps.rank() == 0:
        compressed = sum(o.is_compressed for o in strategy.options.values()) if strategy else 0
        if compressor == "powersgd":  # the matrices it compressed keep an error
            compressed = len(opt._bps.lowrank.state.error)
        (out / f"{name}.json").write_text(json.dumps({
            "losses": curve.tolist(), "compressed_tensors": compressed,
            "tensors": len(strategy.options) if strategy else 0,
            "options": {k: str(v) for k, v in strategy.options.items()} if strategy else {},
            "entropy": task.entropy()}))


def main() -> None:
    out, steps = Path(sys.argv[1]), int(sys.argv[2])
    bps.init()
    try:
        for item in sys.argv[3:]:
            name, _, spec = item.partition("=")
            run(name, spec, steps, out)
    finally:
        bps.shutdown()


if __name__ == "__main__":
    main()
