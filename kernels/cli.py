"""``espresso compressors``: list the registered compressors, wire ids and sizes.

``espresso compressors --warm-up`` runs every compressor's numba kernels, and the planner's
simulator kernels, once, so that ``NUMBA_CACHE_DIR`` holds their compiled code (the Docker
images and ``make setup`` do this, and jobs start without compiling).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
from byteps_espresso.kernels import create, names, wire_id

from byteps_espresso.cli import register

__all__ = ["describe", "warm_up"]

# Default parameters shown for the sparsifiers (their size depends on the ratio).
_SHOWN = {"topk": {"ratio": 0.01}, "randomk": {"ratio": 0.01}, "dgc": {"ratio": 0.01}}
# Tensor size for the bytes-per-element column (large enough that scalars do not matter).
_NUMEL = 1 << 20
# Tensor size of the warm-up: numba compiles per argument type, not size; 64 Ki elements is
# above the kernels' serial cut-off, so the parallel code paths run too.
_WARM_NUMEL = 1 << 16


def describe() -> list[dict]:
    """One entry per algorithm: name, wire id, payload dtypes, bytes per element, flags."""
    rows = []
    for name in names():
        c = create(name, backend="numba", **_SHOWN.get(name, {}))
        rows.append({
            "name": name, "wire_id": wire_id(name),
            "payload": [str(d) for d in c.payload_dtypes],
            "bytes_per_element": c.compressed_nbytes(_NUMEL) / _NUMEL,
            "unbiased": bool(c.unbiased), "deterministic": bool(c.deterministic),
            "params": c.params,
        })
    return rows


def _dispatchers() -> Iterator[Any]:
    """Every numba-compiled function of the kernels package."""
    from numba.core.registry import CPUDispatcher

    for module_name, module in list(sys.modules.items()):
        if module_name.startswith("byteps_espresso.kernels"):
            for obj in vars(module).values():
                if isinstance(obj, CPUDispatcher):
                    yield obj


def warm_up(selected: list[str] | None = None) -> dict[str, int]:
    """Compress, decompress and aggregate with each compressor's numba backend once.

    Args:
        selected: compressor names (default: every registered one).

    Returns:
        ``{"compressors": ..., "compiled": ..., "cached": ...}``: kernels numba compiled in
        this process and kernels it loaded from its cache (``NUMBA_CACHE_DIR``).
    """
    x = np.random.default_rng(0).standard_normal(_WARM_NUMEL).astype(np.float32)
    chosen = selected or names()
    for name in chosen:
        c = create(name, backend="numba")
        payload, ctx = c.compress(x, name="warm-up", step=0)
        c.aggregate([payload, payload], ctx)
    seen = {id(d): d for d in _dispatchers()}.values()
    return {"compressors": len(chosen),
            "compiled": sum(sum(d.stats.cache_misses.values()) for d in seen),
            "cached": sum(sum(d.stats.cache_hits.values()) for d in seen)}


def _args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--warm-up", nargs="*", metavar="NAME",
                        help="run the numba kernels of the named compressors (default: all) "
                             "once, filling NUMBA_CACHE_DIR")


def _run(args: argparse.Namespace) -> int:
    if args.warm_up is not None:
        unknown = sorted(set(args.warm_up) - set(names()))
        if unknown:
            print(f"espresso compressors: unknown compressor(s) {', '.join(unknown)}; "
                  f"known: {', '.join(names())}", file=sys.stderr)
            return 2
        from byteps_espresso.strategy.context import load_kernels

        start = time.perf_counter()
        counts = warm_up(args.warm_up)
        load_kernels()  # the planner's simulator too: a first plan then compiles nothing
        counts["seconds"] = round(time.perf_counter() - start, 1)
        if args.json:
            print(json.dumps(counts))
        else:
            print(f"warmed {counts['compressors']} compressors in {counts['seconds']} s: "
                  f"{counts['compiled']} kernels compiled, {counts['cached']} loaded from "
                  f"the cache in {os.environ.get('NUMBA_CACHE_DIR') or 'the default place'}")
        return 0
    rows = describe()
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    print(f"{'name':<10} {'id':>3} {'B/elem':>7}  {'unbiased':<8} {'payload':<24} params")
    for r in rows:
        params = ", ".join(f"{k}={v}" for k, v in r["params"].items()) or "-"
        print(f"{r['name']:<10} {r['wire_id']:>3} {r['bytes_per_element']:>7.4f}  "
              f"{'yes' if r['unbiased'] else 'no':<8} {' + '.join(r['payload']):<24} {params}")
    return 0


register("compressors", "list compressors: wire ids, payload dtypes, bytes per element",
         _args, _run)
