"""``espresso plan`` and ``espresso show``: plan a per-tensor strategy offline from a workload
profile, and show a saved one again.

    espresso plan --workload vgg16.json --machines 8 --gpus-per-machine 8 --intra nvlink \\
        --inter-gbps 100 --compressor randomk --ratio 0.01 --out strategy.json \\
        --timeline timeline.png
    espresso show strategy.json --timeline timeline.png

``--workload`` takes a profile JSON file or a built-in name (``BUILTIN_WORKLOADS``:
bert, gpt2, lstm, resnet101, resnet50, ugatit, vgg16);
``--cluster FILE`` (a JSON of Cluster fields) replaces the machine flags. Without ``--out``
the plan is printed and nothing is written. Outputs are written only after planning
succeeded, each through a temporary file and a rename. Bad input exits with status 2 and a
message naming the file and field.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from byteps_espresso.cli import register
from byteps_espresso.strategy import baselines
from byteps_espresso.strategy.cluster import (
    DEFAULT_CPU_THREADS,
    INTRA_PRESETS,
    Cluster,
    ClusterError,
)
from byteps_espresso.strategy.compressor_costs import CompressorCosts, CostsError
from byteps_espresso.strategy.context import PlanContext
from byteps_espresso.strategy.options import OptionError
from byteps_espresso.strategy.planner import REPORTED_BASELINES, plan_with_timelines
from byteps_espresso.strategy.strategy_file import Strategy, StrategyError
from byteps_espresso.strategy.timeline import Timeline
from byteps_espresso.strategy.tree import ConstraintError, Constraints, enumerate_options
from byteps_espresso.strategy.workload import BUILTIN_WORKLOADS, Workload, WorkloadError

__all__ = ["add_arguments", "add_show_arguments", "plan_arguments", "plan_from_args", "run",
           "show", "strategy_timelines", "timeline_title"]

log = logging.getLogger(__name__)

_INPUT_ERRORS = (WorkloadError, ClusterError, ConstraintError, CostsError, StrategyError,
                 OptionError, baselines.BruteforceTooLarge, baselines.BaselineUnavailable)


def _finite(text: str) -> float:
    """argparse type: a finite number (``inf``/``nan`` would end up as invalid JSON)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return value


def _gbps(text: str) -> float:
    """argparse type: a bandwidth in Gbit/s, finite and > 0."""
    value = _finite(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a bandwidth > 0 in Gbit/s, got {text!r}")
    return value


def _intra(text: str) -> str | float:
    """argparse type: an intra-link preset name, or a bandwidth in Gbit/s."""
    if text in INTRA_PRESETS:
        return text
    try:
        return _gbps(text)
    except argparse.ArgumentTypeError as exc:
        raise argparse.ArgumentTypeError(f"{exc}; or name a preset: "
                                         f"{', '.join(INTRA_PRESETS)}") from None


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
    p.add_argument("--intra", type=_intra, default="nvlink",
                   help=f"intra-machine link: {' | '.join(INTRA_PRESETS)} | Gbit/s")
    p.add_argument("--inter-gbps", type=_gbps, help="NIC bandwidth per machine, Gbit/s")
    p.add_argument("--compressor", required=True, help="kernels registry name")
    p.add_argument("--ratio", type=_finite,
                   help="compression ratio parameter of sparsifiers (default: the "
                        "compressor's own, see `espresso compressors`)")
    p.add_argument("--param", action="append", default=[], metavar="NAME=VALUE",
                   help="a compressor parameter, the value as JSON (e.g. --param rank=8 for "
                        "powersgd); repeatable")
    p.add_argument("--servers", type=int, help="PS servers (default: one per machine)")
    p.add_argument("--lanes", type=int, default=RUNTIME_LANES,
                   help="executor lanes per worker the timeline models (default: the "
                        f"runtime's, {RUNTIME_LANES}; 0: no lane limit); a --cluster file's "
                        "own lanes win")
    p.add_argument("--cpu-threads", type=int, default=DEFAULT_CPU_THREADS,
                   help="host threads per machine for CPU compression")
    p.add_argument("--algorithm", default="espresso", choices=list(baselines.ALGORITHMS),
                   help="Espresso's search, or a baseline to plan as")
    p.add_argument("--constraint", action="append", default=[],
                   help="no-cpu | no-gpu | no-ps | forbid=KIND[,KIND] | max-compressions=N | "
                        "max-lossy=N | flat-only | hierarchical-only | no-mixed | "
                        "partner=NAME (repeatable)")
    p.add_argument("--costs", help="compression cost profile JSON (default: shipped profile)")
    p.add_argument("--out", help="strategy JSON to write (default: print the plan only)")
    p.add_argument("--timeline", help="Gantt chart image to write (png, svg, pdf)")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")


def _workload(arg: str) -> Workload:
    if Path(arg).exists():
        return Workload.load(arg)
    if arg in BUILTIN_WORKLOADS:
        return Workload.builtin(arg)
    builtins = ", ".join(BUILTIN_WORKLOADS)
    if os.sep in arg or arg.endswith(".json"):
        raise WorkloadError(f"--workload {arg}: no such file (or name a built-in workload: "
                            f"{builtins})")
    raise WorkloadError(f"--workload {arg}: unknown built-in workload; the built-ins are "
                        f"{builtins}, or give a profile JSON file")


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
    try:
        return Cluster.preset(args.machines, args.gpus_per_machine, args.intra, args.inter_gbps,
                              servers=args.servers, cpu_threads=args.cpu_threads,
                              lanes=lanes)
    except ClusterError as exc:
        raise ClusterError(f"command line: {exc}") from None


def _json_report(strategy: Strategy, n_options: int) -> dict[str, Any]:
    return {
        "algorithm": strategy.algorithm,
        "iteration_time_ms": round(strategy.predicted_ms, 4),
        "baselines": {k: round(v, 4) for k, v in strategy.baselines.items()},
        "lower_bound_ms": None if strategy.lower_bound_ms is None
        else round(strategy.lower_bound_ms, 4),
        "search_time_ms": round(strategy.search_time_ms, 3),
        "plan_time_ms": round(strategy.plan_time_ms, 3),
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


def _check_outputs(out: str | None, timeline: str | None) -> None:
    """Refuse unwritable outputs before planning, so nothing is written half-way."""
    for flag, path in (("--out", out), ("--timeline", timeline)):
        if path is None:
            continue
        folder = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(folder):
            raise OutputError(f"{flag} {path}: folder {folder} does not exist")
        if not os.access(folder, os.W_OK):
            raise OutputError(f"{flag} {path}: folder {folder} is not writable")
    if timeline:
        from byteps_espresso.strategy.plot import supported_formats

        ext = os.path.splitext(timeline)[1].lstrip(".").lower()
        if ext not in supported_formats():
            raise OutputError(f"--timeline {timeline}: unsupported image type {ext!r}; "
                              f"use one of {', '.join(sorted(supported_formats()))}")


def timeline_title(strategy: Strategy) -> str:
    """The title of a strategy's timeline picture: workload, cluster, compressor."""
    return (f"{strategy.workload.model} on {strategy.cluster.describe()}, "
            f"{strategy.compressor} {json.dumps(strategy.params)}")


def plan_from_args(args: argparse.Namespace) -> tuple[Strategy, dict[str, Timeline], Cluster,
                                                      Constraints]:
    """Plan what parsed ``espresso plan`` flags describe; writes nothing.

    Returns:
        The strategy, its timelines ("chosen", "fp32"), the cluster and the constraints.

    Raises:
        ValueError: bad input (the message names the flag, file or field).
    """
    workload = _workload(args.workload)
    cluster = _cluster(args)
    constraints = Constraints.parse(args.constraint)
    costs = CompressorCosts.load(args.costs) if args.costs else None
    params = {"ratio": args.ratio} if args.ratio is not None else {}
    for item in args.param:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise ValueError(f"--param {item!r}: write NAME=VALUE, e.g. --param rank=8")
        try:
            params[name] = json.loads(value)
        except json.JSONDecodeError:
            params[name] = value  # a string
    strategy, timelines = plan_with_timelines(
        workload, cluster, args.compressor, params, algorithm=args.algorithm,
        constraints=constraints, costs=costs, baseline_names=REPORTED_BASELINES, bound=True)
    return strategy, timelines, cluster, constraints


def _failing(command: str, exc: BaseException) -> int:
    """Report bad input or an unwritable output; exit status 2."""
    if isinstance(exc, OSError):
        print(f"espresso {command}: cannot write output: {exc}", file=sys.stderr)
    else:
        print(f"espresso {command}: {exc}", file=sys.stderr)
    return 2


# unknown compressor or compressor parameter (ValueError), unwritable output (OSError)
_FAILURES = (*_INPUT_ERRORS, OutputError, ValueError, OSError)


def run(args: argparse.Namespace) -> int:
    """Plan, print the plan and write the outputs asked for; returns the exit status (2 on
    bad input)."""
    try:
        _check_outputs(args.out, args.timeline)
        strategy, timelines, cluster, constraints = plan_from_args(args)
        if args.timeline:
            from byteps_espresso.strategy.plot import draw_timelines

            draw_timelines(timelines, args.timeline, title=timeline_title(strategy))
        if args.out:
            strategy.save(args.out)
    except _FAILURES as exc:
        return _failing("plan", exc)
    if args.json:
        report = _json_report(strategy, len(enumerate_options(cluster, constraints,
                                                              strategy.compressor)))
        print(json.dumps(report))
        return 0
    print(_table(strategy))
    written = [p for p in (args.out, args.timeline) if p]
    if written:
        print(f"wrote {' and '.join(map(os.fspath, written))}")
    return 0


register("plan", "plan a per-tensor compression strategy from a workload profile",
         add_arguments, run)


# ---- espresso show ------------------------------------------------------------------------------
def strategy_timelines(strategy: Strategy, costs: CompressorCosts | None = None
                       ) -> dict[str, Timeline]:
    """Simulate a saved strategy's Options again, and the fp32 baseline, on its workload and
    cluster with ``costs`` (default: the shipped compression cost profile).

    Returns:
        ``{"chosen": ..., "fp32": ...}`` as :func:`plan_with_timelines` draws them.
    """
    ctx = PlanContext(strategy.workload, strategy.cluster, strategy.compressor,
                      dict(strategy.params), costs, strategy.constraints)
    chosen = ctx.index([strategy.options[name] for name in strategy.workload.names])
    timelines = {"chosen": ctx.evaluator.timeline(chosen)}
    try:
        fp32 = baselines.get("fp32").run(ctx)
        timelines["fp32"] = fp32.ctx.evaluator.timeline(fp32.choice)
    except baselines.BaselineUnavailable as exc:
        log.info("fp32 baseline not drawn: %s", exc)
    return timelines


def _tensor_table(strategy: Strategy, timeline: Timeline) -> list[str]:
    """One line per tensor, in backward order: name, elements, finish time, Option."""
    sizes = {t.name: t.numel for t in strategy.workload.tensors}
    width = max(len("tensor"), *(len(n) for n in strategy.options))
    lines = [f"{'tensor':<{width}} {'elements':>12} {'done ms':>8}  option"]
    done = {name: timeline.done_us[i] for i, name in enumerate(strategy.workload.names)}
    for name in strategy.workload.names:
        lines.append(f"{name:<{width}} {sizes[name]:>12,} "
                     f"{(timeline.forward_us + done[name]) / 1e3:>8.2f}  "
                     f"{strategy.options[name]}")
    return lines


def add_show_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``espresso show``."""
    p.add_argument("strategy", help="strategy JSON written by `espresso plan --out` or by a "
                                    "training job (ESPRESSO_PROFILE_OUT)")
    p.add_argument("--timeline", help="Gantt chart image to write (png, svg, pdf)")
    p.add_argument("--costs", help="compression cost profile JSON the strategy was planned "
                                   "with (default: shipped profile)")


def show(args: argparse.Namespace) -> int:
    """Print a saved strategy (summary and every tensor's Option); draw its timeline."""
    try:
        _check_outputs(None, args.timeline)
        strategy = Strategy.load(args.strategy)
        costs = CompressorCosts.load(args.costs) if args.costs else None
        timelines = strategy_timelines(strategy, costs)
        if args.timeline:
            from byteps_espresso.strategy.plot import draw_timelines

            draw_timelines(timelines, args.timeline, title=timeline_title(strategy))
    except _FAILURES as exc:
        return _failing("show", exc)
    chosen_ms = timelines["chosen"].iteration_us / 1e3
    lines = [strategy.summary(), "", *_tensor_table(strategy, timelines["chosen"]), ""]
    if not math.isclose(chosen_ms, strategy.predicted_ms, rel_tol=1e-6):
        lines.append(f"simulated again with {args.costs or 'the shipped cost profile'}: "
                     f"{chosen_ms:.2f} ms (the file says {strategy.predicted_ms:.2f} ms; give "
                     "--costs with the profile it was planned with)")
    if args.timeline:
        lines.append(f"wrote {args.timeline}")
    print("\n".join(lines))
    return 0


register("show", "show a saved strategy: summary, every tensor's Option, timeline picture",
         add_show_arguments, show)


def plan_arguments(argv: Sequence[str]) -> argparse.Namespace:
    """Parse ``espresso plan`` flags, e.g. to plan what a documented command shows.

    Raises:
        SystemExit: bad flags (argparse prints the usage).
    """
    parser = argparse.ArgumentParser(prog="espresso plan")
    add_arguments(parser)
    return parser.parse_args(list(argv))
