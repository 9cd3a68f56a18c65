"""Sums of sign payloads and error feedback's residual: read through the tables in place, or
decoded into dense arrays first (what ``Compressor.aggregate`` and ``ErrorFeedback`` did
before), numba backend.

For each size (float32 elements) and sign codec: ``aggregate`` of 2 and 4 payloads against
decoding each payload and adding the dense arrays in list order, and one error-feedback step
(``x + r``, compress, keep the residual) against the same step with the residual taken as
``corrected - decompress(payload)``. Both ways give the same bits (asserted here on every
timed input); the two are timed back to back in each repeat, numba on ``--threads`` threads
(1: one worker's share of a host whose cores the training keeps busy). Reports the medians in
ms and their ratio; prints a table and writes JSON.

    .venv/bin/python benchmarks/sign_sums.py [--sizes 290305 2353153] [--repeats 9]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import numba
import numpy as np
from byteps_espresso.kernels import ErrorFeedback, create

CODECS = ("efsignsgd", "signsgd", "onebit")
# The LSTM's largest bucket (examples/train.py, 290,305 elements) and the transformer's
# 17-member bucket of benchmarks/ddp.py's EFSignSGD plans (2,353,153): BENCHMARKS.md.
SIZES = (290_305, 2_353_153)
RESULTS = Path(__file__).resolve().parent / "results" / "sign_sums.json"


def _timed(fn, budget_s: float = 0.05) -> float:
    """ms per call: as many calls as fit in about ``budget_s``, at least 3."""
    fn()
    t0 = time.perf_counter()
    fn()
    once = time.perf_counter() - t0
    k = max(3, int(budget_s / max(once, 1e-6)))
    t0 = time.perf_counter()
    for _ in range(k):
        fn()
    return (time.perf_counter() - t0) / k * 1e3


def _dense_sum(codec, payloads, ctx) -> np.ndarray:
    total = codec.decompress(payloads[0], ctx)
    for p in payloads[1:]:
        total += codec.decompress(p, ctx)
    return total


def _dense_feedback(codec, x, residual, step: int) -> tuple:
    corrected = x + residual
    payload, ctx = codec.compress(corrected, name="w", step=step)
    return payload, corrected - codec.decompress(payload, ctx)


def measure(name: str, n: int, repeats: int) -> list[dict]:
    codec = create(name, backend="numba")
    rng = np.random.default_rng(n)
    inputs = [rng.standard_normal(n).astype(np.float32) * np.float32(i + 1) for i in range(4)]
    payloads, ctx = [], None
    for x in inputs:
        payload, ctx = codec.compress(x, name="w", step=1)
        payloads.append(payload)
    ef = ErrorFeedback(create(name, backend="numba"))
    ef.compress(inputs[1], name="w", step=0)  # a residual to add
    residual = ef.residual("w").copy()
    got = ef.compress(inputs[0], name="w", step=1)[0], ef.residual("w")
    want = _dense_feedback(codec, inputs[0], residual, 1)
    assert all(np.array_equal(a, b) for a, b in zip(got[0], want[0], strict=True))
    assert np.array_equal(got[1].view(np.uint32), want[1].view(np.uint32))
    cases = {}
    for k in (2, 4):
        assert np.array_equal(codec.aggregate(payloads[:k], ctx).view(np.uint32),
                              _dense_sum(codec, payloads[:k], ctx).view(np.uint32))
        cases[f"sum of {k}"] = (lambda k=k: codec.aggregate(payloads[:k], ctx),
                                lambda k=k: _dense_sum(codec, payloads[:k], ctx))

    def in_place() -> None:
        ef.state["w"]["residual"] = residual
        ef.compress(inputs[0], name="w", step=1)

    cases["error feedback"] = (in_place, lambda: _dense_feedback(codec, inputs[0], residual, 1))
    rows = []
    for case, (new, dense) in cases.items():
        times = [(_timed(new), _timed(dense)) for _ in range(repeats)]
        ms, dense_ms = (statistics.median(t) for t in zip(*times, strict=True))
        rows.append({"codec": name, "numel": n, "case": case, "ms": ms, "dense_ms": dense_ms,
                     "ratio": ms / dense_ms})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=list(SIZES))
    parser.add_argument("--codecs", nargs="+", default=list(CODECS), choices=CODECS)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    numba.set_num_threads(args.threads)
    rows = [r for n in args.sizes for name in args.codecs for r in measure(name, n,
                                                                           args.repeats)]
    print(f"{'codec':10} {'numel':>10} {'case':15} {'in place ms':>11} {'dense ms':>9} "
          f"{'ratio':>6}")
    for r in rows:
        print(f"{r['codec']:10} {r['numel']:>10} {r['case']:15} {r['ms']:>11.3f} "
              f"{r['dense_ms']:>9.3f} {r['ratio']:>6.2f}")
    args.out.write_text(json.dumps({
        "machine": {"python": platform.python_version(), "numba": numba.__version__,
                    "threads": args.threads},
        "repeats": args.repeats, "rows": rows}, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
