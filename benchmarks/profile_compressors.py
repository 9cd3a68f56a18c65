"""Measure compression costs and write the planner's default profile.

For every compressor in the kernels registry this times, single-threaded, ``compress`` and
``aggregate`` (decompress-and-sum, per payload) at several sizes with

- the numba backend            -> the ``cpu`` profile (one host thread), and
- the torch backend on the CPU -> with the numba timings, scaled to a V100 for the ``gpu``
  profile: the per-element slope of the faster CPU implementation (torch or numba) is
  multiplied by (this host's single-thread copy bandwidth / 900 GB/s, the V100's HBM2
  bandwidth from NVIDIA's Tesla V100 datasheet) and the fixed cost is set to GPU_FIXED_US
  (a handful of kernel launches of ~5 us each, CUDA C Best Practices Guide).
  This is an estimate for machines without a GPU; profile on the GPU when you have one
  (the worker's profiler does at start-up).

It also times one thread summing float32 vectors (the servers' dense aggregation).
Fits t = a + b * numel per (compressor, device, op) and writes
byteps_espresso/data/compressor_costs.json (or --out) with a note of machine, date and method.

    .venv/bin/python benchmarks/profile_compressors.py [--quick] [--out FILE]
"""

from __future__ import annotations

import argparse
import datetime
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

from byteps_espresso.strategy.compressor_costs import CompressorCosts, Linear

V100_HBM_BYTES_PER_S = 900e9  # NVIDIA Tesla V100 datasheet: 900 GB/s HBM2
GPU_FIXED_US = 20.0  # ~4 kernel launches x ~5 us (CUDA C Best Practices Guide, launch overhead)
# Parameters the profile is measured with (the paper's settings: 1% for sparsifiers).
PARAMS = {"randomk": {"ratio": 0.01}, "topk": {"ratio": 0.01}, "dgc": {"ratio": 0.01}}
AGG_PAYLOADS = 4


def _median_us(fn, repeats: int) -> float:  # type: ignore[no-untyped-def]
    fn()  # warm-up (numba compiles here)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def _time_backend(name: str, backend: str, numel: int, repeats: int) -> tuple[float, float]:
    comp = create(name, backend=backend, **PARAMS.get(name, {}))
    rng = np.random.default_rng(0)
    data = rng.standard_normal(numel).astype(np.float32)
    x = torch.from_numpy(data) if backend == "torch" else data
    t_comp = _median_us(lambda: comp.compress(x, name="t", step=1), repeats)
    payloads = [comp.compress(x, name="t", step=s)[0] for s in range(AGG_PAYLOADS)]
    ctx = comp.context((numel,), name="t", step=1)
    t_agg = _median_us(lambda: comp.aggregate(payloads, ctx), repeats) / AGG_PAYLOADS
    return t_comp, t_agg


def _copy_bandwidth() -> float:
    src = np.ones(1 << 26, dtype=np.float32)
    dst = np.empty_like(src)
    us = _median_us(lambda: np.copyto(dst, src), 9)
    return 2 * src.nbytes / (us * 1e-6)  # read + write bytes per second


def _dense_sum() -> Linear:
    xs, ys = [], []
    for numel in (1 << 14, 1 << 18, 1 << 22):
        a = np.ones(numel, dtype=np.float32)
        b = np.ones(numel, dtype=np.float32)
        xs.append(numel)
        ys.append(_median_us(lambda a=a, b=b: np.add(a, b, out=a), 7))
    return Linear.fit(xs, ys)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer sizes and repeats")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "byteps_espresso"
                                             / "data" / "compressor_costs.json"))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    numba.set_num_threads(1)
    sizes = (1 << 12, 1 << 18, 1 << 21) if args.quick else (1 << 12, 1 << 16, 1 << 19, 1 << 22)
    repeats = 3 if args.quick else 5
    host_bw = _copy_bandwidth()
    scale = host_bw / V100_HBM_BYTES_PER_S
    samples = []
    rows = []
    for name in names():
        for numel in sizes:
            cpu = _time_backend(name, "numba", numel, repeats)
            tch = _time_backend(name, "torch", numel, repeats)
            for op, us in zip(("compress", "decompress"), cpu, strict=True):
                samples.append({"compressor": name, "device": "cpu", "op": op, "numel": numel,
                                "us": us})
            rows.append((name, numel, *cpu, *tch))
            for op, us in zip(("compress", "decompress"), tch, strict=True):
                samples.append({"compressor": name, "device": "gpu", "op": op, "numel": numel,
                                "us": us})
    fitted = CompressorCosts.fit(samples)
    models = {}
    for comp, devs in fitted.models.items():
        gpu = {op: Linear(GPU_FIXED_US, min(m.b_us, devs["cpu"][op].b_us) * scale)
               for op, m in devs["gpu"].items()}
        models[comp] = {"cpu": devs["cpu"], "gpu": gpu}
    note = (f"Measured {datetime.date.today().isoformat()} on {platform.node() or 'host'} "
            f"({platform.processor() or platform.machine()}, {os.cpu_count()} cores, shared and "
            f"noisy) by benchmarks/profile_compressors.py: single-thread medians of "
            f"{repeats} runs at sizes {list(sizes)}; cpu = numba backend; gpu = the smaller of "
            f"the torch-CPU and numba slopes x (host copy bandwidth {host_bw / 1e9:.1f} GB/s / "
            f"V100 HBM2 900 GB/s) "
            f"+ {GPU_FIXED_US:g} us fixed (an estimate: no GPU here); decompress = aggregate of "
            f"{AGG_PAYLOADS} payloads / {AGG_PAYLOADS}.")
    costs = CompressorCosts(models, _dense_sum(), note,
                            {k: v for k, v in PARAMS.items() if k in models})
    costs.save(args.out)
    print(f"{'compressor':>12} {'numel':>9} {'numba comp':>11} {'numba agg':>10} "
          f"{'torch comp':>11} {'torch agg':>10}  (us, one thread)")
    for name, numel, c1, a1, c2, a2 in rows:
        print(f"{name:>12} {numel:>9} {c1:>11.1f} {a1:>10.1f} {c2:>11.1f} {a2:>10.1f}")
    print(f"host copy bandwidth {host_bw / 1e9:.1f} GB/s; wrote {args.out}")
    json.dumps(costs.to_dict())
    return 0


if __name__ == "__main__":
    sys.exit(main())
