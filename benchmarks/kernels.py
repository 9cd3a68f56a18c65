"""Compressor throughput: every algorithm, numba and torch-on-CPU backends, against memcpy.

For each size (float32 elements) and algorithm, times compress and decompress on both
backends, interleaved with a numpy copy of the same array (``np.copyto``), and reports
medians in GB/s of float32 input (numel * 4 bytes / seconds). Compilation is excluded: every
kernel runs once before timing. Each repeat times copy, numba and torch back to back, so the
ratios compare figures taken under the same (shared, noisy) machine load. Prints a table,
checks the targets, writes JSON.

Targets (at 2**24 elements):
  * numba compress of fp16, int8, signsgd, efsignsgd, onebit, randomk >= 30% of copy bandwidth
  * numba >= torch-CPU for compress and decompress of every algorithm

Usage:
    python benchmarks/kernels.py            # sizes 2**16, 2**20, 2**24, 9 repeats
    python benchmarks/kernels.py --quick    # same table, 3 repeats
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numba
import numpy as np
import torch
from byteps_espresso.kernels import create, names

SPARSE_PARAMS = {"ratio": 0.01}
PARAMS = {"topk": SPARSE_PARAMS, "randomk": SPARSE_PARAMS, "dgc": SPARSE_PARAMS}
COPY_TARGET = ("fp16", "int8", "signsgd", "efsignsgd", "onebit", "randomk")
COPY_FRACTION = 0.30
TARGET_SIZE = 1 << 24
RESULTS = Path(__file__).resolve().parent / "results" / "kernels.json"
# --quick writes here, so `make main` never overwrites the recorded full run.
QUICK_RESULTS = RESULTS.with_name("kernels_quick.json")
BACKENDS = ("numba", "torch")


def _time(fn, *args) -> float:
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0


def measure(name: str, x: np.ndarray, repeats: int) -> dict[str, dict[str, float]]:
    """Median seconds of copy and of both backends' compress and decompress.

    Every repeat times copy, numba and torch back to back, so that all three see the same
    machine load (the host is shared); each compressor is warmed up first (numba compiles).
    """
    params = PARAMS.get(name, {})
    comps = {b: create(name, backend=b, **params) for b in BACKENDS}
    args = {"numba": x, "torch": torch.from_numpy(x)}
    dst = np.empty_like(x)
    for b, c in comps.items():
        c.decompress(*c.compress(args[b], name="bench", step=0))
    times: dict[str, list[float]] = {"copy": []}
    for b in BACKENDS:
        times[f"{b}_compress"], times[f"{b}_decompress"] = [], []
    for step in range(1, repeats + 1):
        times["copy"].append(_time(np.copyto, dst, x))
        for b, c in comps.items():
            t0 = time.perf_counter()
            payload, ctx = c.compress(args[b], name="bench", step=step)
            times[f"{b}_compress"].append(time.perf_counter() - t0)
            times[f"{b}_decompress"].append(_time(c.decompress, payload, ctx))
    med = {k: statistics.median(v) for k, v in times.items()}
    nbytes = comps["numba"].compressed_nbytes(x.size)
    return {b: {"copy_s": med["copy"], "compress_s": med[f"{b}_compress"],
                "decompress_s": med[f"{b}_decompress"], "compressed_bytes": nbytes}
            for b in BACKENDS}


def gbps(numel: int, seconds: float) -> float:
    return numel * 4 / seconds / 1e9


def run(sizes: list[int], algorithms: list[str], repeats: int) -> list[dict]:
    rows = []
    for numel in sizes:
        x = np.random.default_rng(numel).standard_normal(numel).astype(np.float32)
        for name in algorithms:
            for backend, m in measure(name, x, repeats).items():
                rows.append({
                    "algorithm": name, "backend": backend, "numel": numel,
                    "copy_gbps": gbps(numel, m["copy_s"]),
                    "compress_gbps": gbps(numel, m["compress_s"]),
                    "decompress_gbps": gbps(numel, m["decompress_s"]),
                    "compress_s": m["compress_s"], "decompress_s": m["decompress_s"],
                    "copy_s": m["copy_s"], "compressed_bytes": m["compressed_bytes"],
                })
    return rows


def check_targets(rows: list[dict]) -> list[dict]:
    """One entry per target at TARGET_SIZE with the measured figures and pass/miss."""
    at = {(r["algorithm"], r["backend"]): r for r in rows if r["numel"] == TARGET_SIZE}
    checks = []
    for name in sorted({a for a, _ in at}):
        nb, tc = at.get((name, "numba")), at.get((name, "torch"))
        if name in COPY_TARGET and nb:
            ratio = nb["compress_gbps"] / nb["copy_gbps"]
            checks.append({"target": f"{name} numba compress >= 30% of copy",
                           "measured": f"{ratio:.0%} ({nb['compress_gbps']:.2f} / "
                                       f"{nb['copy_gbps']:.2f} GB/s)",
                           "met": ratio >= COPY_FRACTION})
        if nb and tc:
            for op in ("compress", "decompress"):
                a, b = nb[f"{op}_gbps"], tc[f"{op}_gbps"]
                checks.append({"target": f"{name} numba {op} >= torch-CPU",
                               "measured": f"{a:.2f} vs {b:.2f} GB/s ({a / b:.1f}x)",
                               "met": a >= b})
    return checks


def table(rows: list[dict]) -> str:
    head = (f"{'algorithm':<10} {'numel':>9} {'B/elem':>6} {'copy':>6} | "
            f"{'numba comp':>10} {'%copy':>5} {'decomp':>6} | {'torch comp':>10} {'decomp':>6}"
            f" | {'nb/tc comp':>10}")
    lines = [head, "-" * len(head)]
    by = {(r["algorithm"], r["numel"], r["backend"]): r for r in rows}
    for (name, numel, backend), nb in by.items():
        if backend != "numba":
            continue
        tc = by[(name, numel, "torch")]
        lines.append(
            f"{name:<10} {'2^' + str(numel.bit_length() - 1):>9} "
            f"{nb['compressed_bytes'] / numel:>6.3f} {nb['copy_gbps']:>6.2f} | "
            f"{nb['compress_gbps']:>10.2f} {nb['compress_gbps'] / nb['copy_gbps']:>5.0%} "
            f"{nb['decompress_gbps']:>6.2f} | {tc['compress_gbps']:>10.2f} "
            f"{tc['decompress_gbps']:>6.2f} | {nb['compress_gbps'] / tc['compress_gbps']:>9.1f}x")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 repeats instead of 9")
    parser.add_argument("--repeats", type=int, default=None, help="timed repeats per cell")
    parser.add_argument("--sizes", type=int, nargs="+", default=[16, 20, 24],
                        help="log2 of the tensor sizes (default: 16 20 24)")
    parser.add_argument("--algorithms", nargs="+", default=None, choices=names(),
                        help="subset of algorithms (default: all)")
    parser.add_argument("--out", type=Path, default=None,
                        help=f"JSON output path (default: {RESULTS.name}, "
                             f"{QUICK_RESULTS.name} with --quick)")
    args = parser.parse_args(argv)
    out = args.out or (QUICK_RESULTS if args.quick else RESULTS)
    repeats = args.repeats or (3 if args.quick else 9)
    sizes = [1 << s for s in args.sizes]
    algorithms = args.algorithms or names()
    started = time.time()
    rows = run(sizes, algorithms, repeats)
    checks = check_targets(rows)
    print(f"GB/s of float32 input, medians of {repeats} repeats; copy = np.copyto of the same "
          f"array in the same run; {numba.get_num_threads()} numba threads, "
          f"{torch.get_num_threads()} torch threads; load average "
          f"{' '.join(f'{v:.1f}' for v in os.getloadavg())}")
    print(table(rows))
    if checks:
        print("\ntargets at 2^24:")
        for c in checks:
            print(f"  [{'met ' if c['met'] else 'MISS'}] {c['target']}: {c['measured']}")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "command": " ".join(["python", "benchmarks/kernels.py", *(argv or sys.argv[1:])]),
        "repeats": repeats, "seconds": round(time.time() - started, 1),
        "machine": {"cpus": os.cpu_count(), "numba_threads": numba.get_num_threads(),
                    "torch_threads": torch.get_num_threads(), "platform": platform.platform(),
                    "processor": platform.processor(), "loadavg_end": os.getloadavg(),
                    "gpu": "not measured (no GPU available)"},
        "rows": rows, "targets": checks,
    }, indent=1))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
