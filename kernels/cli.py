"""``espresso compressors``: list the registered compressors, wire ids and sizes."""

from __future__ import annotations

import argparse
import json

from byteps_espresso.kernels import create, names, wire_id

from byteps_espresso.cli import register

__all__ = ["describe"]

# Default parameters shown for the sparsifiers (their size depends on the ratio).
_SHOWN = {"topk": {"ratio": 0.01}, "randomk": {"ratio": 0.01}, "dgc": {"ratio": 0.01}}
# Tensor size for the bytes-per-element column (large enough that scalars do not matter).
_NUMEL = 1 << 20


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


def _args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def _run(args: argparse.Namespace) -> int:
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
