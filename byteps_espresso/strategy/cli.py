"""``espresso plan``: plan a per-tensor strategy offline from a workload profile.

    espresso plan --workload vgg16.json --machines 8 --gpus-per-machine 8 --intra nvlink \\
        --inter-gbps 100 --compressor randomk --ratio 0.01 --out strategy.json \\
        --timeline timeline.png

``--workload`` takes a profile JSON file or a built-in name (bert, lstm, resnet50, vgg16);
``--cluster FILE`` (a JSON of Cluster fields) replaces the machine flags. Outputs are written
only after planning succeeded, each through a temporary file and a rename. Bad input exits
with status 2 and a message naming the file and field.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

from byteps_espresso.cli import register
from byteps_espresso.strategy import baselines
from byteps_espresso.strategy.cluster import INTRA_PRESETS, Cluster, ClusterError
from byteps_espresso.strategy.compressor_costs import CompressorCosts, CostsError
from byteps_espresso.strategy.options import OptionError
from byteps_espresso.strategy.planner import REPORTED_BASELINES, plan_with_timelines
from byteps_espresso.strategy.strategy_file import Strategy, StrategyError
from byteps_espresso.strategy.tree import ConstraintError, Constraints, enumerate_options
from byteps_espresso.strategy.workload import BUILTIN_WORKLOADS, Workload, WorkloadError

__all__ = ["add_arguments", "run"]

log = logging.getLogger(__name__)

_INPUT_ERRORS = (WorkloadError, ClusterError, ConstraintError, CostsError, StrategyError,
                 OptionError, baselines.BruteforceTooLarge, baselines.BaselineUnavailable)


# The executor's lanes per worker (worker/runtime.py DEFAULT_LANES; a test keeps them equal,
# without importing torch here): each lane runs one Option at a time, in submission order.
RUNTIME_LANES = 2


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``espresso plan``."""
    p.add_argument("--workload", required=True,
                   help=f"profile JSON file, or a built-in: {', '.join(BUILTIN_WORKLOADS)}")
    p.add_argument("--cluster", help="cluster JSON file (Cluster fields); replaces the "
                                     "machine flags below")
    p.add_argument("--machines", type=int, help="worker machines")
    p.add_argument("--gpus-per-machine", type=int, help="GPUs (workers) per machine")
    p.add_argument("--intra", default="nvlink",
                   help=f"intra-machine link: {' | '.join(INTRA_PRESETS)} | Gbit/s")
    p.add_argument("--inter-gbps", type=float, help="NIC bandwidth per machine, Gbit/s")
    p.add_argument("--compressor", required=True, help="kernels registry name")
    p.add_argument("--ratio", type=float, help="compression ratio parameter (sparsifiers)")
    p.add_argument("--servers", type=int, help="PS servers (default: one per machine)")
    p.add_argument("--lanes", type=int, default=RUNTIME_LANES,
                   help="executor lanes per worker the timeline models (default: the "
                        f"runtime's, {RUNTIME_LANES}; 0: no lane limit); a --cluster file's "
                        "own lanes win")
    p.add_argument("--cpu-threads", type=int, default=None,
                   help="host threads per machine for CPU compression")
    p.add_argument("--algorithm", default="espresso", choices=list(baselines.ALGORITHMS))
    p.add_argument("--constraint", action="append", default=[],
                   help="no-cpu | no-gpu | no-ps | forbid=KIND[,KIND] | max-compressions=N | "
                        "flat-only | hierarchical-only (repeatable)")
    p.add_argument("--costs", help="compression cost profile JSON (default: shipped profile)")
    p.add_argument("--out", required=True, help="strategy JSON to write")
    p.add_argument("--timeline", help="Gantt chart image to write (png, svg, pdf)")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")


def _workload(arg: str) -> Workload:
    if not Path(arg).exists() and arg in BUILTIN_WORKLOADS:
        return Workload.builtin(arg)
    return Workload.load(arg)


def _cluster(args: argparse.Namespace) -> Cluster:
    if args.lanes < 0:
        raise ClusterError(f"--lanes must be >= 0, got {args.lanes}")
    lanes = args.lanes or None
    if args.cluster:
        cluster = Cluster.load(args.cluster)
        return cluster if cluster.lanes is not None else cluster.with_(lanes=lanes)
    missing = [flag for flag, value in (("--machines", args.machines),
                                        ("--gpus-per-machine", args.gpus_per_machine),
                                        ("--inter-gbps", args.inter_gbps)) if value is None]
    if missing:
        raise ClusterError(f"give {', '.join(missing)} (or --cluster FILE)")
    extra: dict[str, Any] = {}
    if args.cpu_threads is not None:
        extra["cpu_threads"] = args.cpu_threads
    try:
        return Cluster.preset(args.machines, args.gpus_per_machine, args.intra, args.inter_gbps,
                              servers=args.servers, lanes=lanes, **extra)
    except ClusterError as exc:
        raise ClusterError(f"command line: {exc}") from None


def _json_report(strategy: Strategy, n_options: int) -> dict[str, Any]:
    return {
        "algorithm": strategy.algorithm,
        "iteration_time_ms": round(strategy.predicted_ms, 4),
        "baselines": {k: round(v, 4) for k, v in strategy.baselines.items()},
        "search_time_ms": round(strategy.search_time_ms, 3),
        "options_per_tensor": n_options,
        "compressed_tensors": len(strategy.compressed_tensors),
        "cpu_offloaded_tensors": len(strategy.cpu_offloaded_tensors),
    }


def _table(strategy: Strategy) -> str:
    lines = [strategy.summary(), ""]
    fp32 = strategy.baselines.get("fp32")
    if fp32:
        lines.append(f"predicted speedup over fp32: {fp32 / strategy.predicted_ms:.2f}x")
    return "\n".join(lines)


class OutputError(ValueError):
    """An output path cannot be written."""


def _check_outputs(args: argparse.Namespace) -> None:
    """Refuse unwritable outputs before planning, so nothing is written half-way."""
    for flag, path in (("--out", args.out), ("--timeline", args.timeline)):
        if path is None:
            continue
        folder = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(folder):
            raise OutputError(f"{flag} {path}: folder {folder} does not exist")
        if not os.access(folder, os.W_OK):
            raise OutputError(f"{flag} {path}: folder {folder} is not writable")
    if args.timeline:
        from byteps_espresso.strategy.plot import supported_formats

        ext = os.path.splitext(args.timeline)[1].lstrip(".").lower()
        if ext not in supported_formats():
            raise OutputError(f"--timeline {args.timeline}: unsupported image type {ext!r}; "
                              f"use one of {', '.join(sorted(supported_formats()))}")


def run(args: argparse.Namespace) -> int:
    """Plan and write the outputs; returns the exit status (2 on bad input)."""
    try:
        _check_outputs(args)
        workload = _workload(args.workload)
        cluster = _cluster(args)
        constraints = Constraints.parse(args.constraint)
        costs = CompressorCosts.load(args.costs) if args.costs else None
        params = {"ratio": args.ratio} if args.ratio is not None else {}
        strategy, timelines = plan_with_timelines(
            workload, cluster, args.compressor, params, algorithm=args.algorithm,
            constraints=constraints, costs=costs, baseline_names=REPORTED_BASELINES)
        if args.timeline:
            from byteps_espresso.strategy.plot import draw_timelines

            draw_timelines(timelines, args.timeline,
                           title=f"{workload.model} on {cluster.describe()}, "
                                 f"{args.compressor} {json.dumps(params)}")
        strategy.save(args.out)
    except (*_INPUT_ERRORS, OutputError) as exc:
        print(f"espresso plan: {exc}", file=sys.stderr)
        return 2
    except ValueError as exc:  # unknown compressor or compressor parameter
        print(f"espresso plan: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"espresso plan: cannot write output: {exc}", file=sys.stderr)
        return 2
    if args.json:
        report = _json_report(strategy, len(enumerate_options(cluster, constraints)))
        print(json.dumps(report))
    else:
        print(_table(strategy))
        print(f"wrote {os.fspath(args.out)}" + (f" and {args.timeline}" if args.timeline else ""))
    return 0


register("plan", "plan a per-tensor compression strategy from a workload profile",
         add_arguments, run)
