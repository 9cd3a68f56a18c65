"""``plan``: run one algorithm and every baseline on a workload, return a Strategy.

Example:
    >>> from byteps_espresso.strategy import Cluster, Workload, plan
    >>> s = plan(Workload.builtin("vgg16"), Cluster.preset(8, 8, "nvlink", 100), "randomk",
    ...          {"ratio": 0.01})
    >>> print(s.summary())
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from byteps_espresso.strategy import baselines, search
from byteps_espresso.strategy.buckets import (
    CANDIDATE_CAPS,
    DEFAULT_FIRST_CAP_BYTES,
    Bucket,
    fewest,
    fuse_apart,
    plan_fused,
)
from byteps_espresso.strategy.cluster import Cluster
from byteps_espresso.strategy.compressor_costs import CompressorCosts
from byteps_espresso.strategy.context import PlanContext, load_kernels
from byteps_espresso.strategy.options import Option
from byteps_espresso.strategy.strategy_file import Strategy
from byteps_espresso.strategy.timeline import Timeline
from byteps_espresso.strategy.tree import Constraints
from byteps_espresso.strategy.workload import Workload

__all__ = ["FEWEST_BUCKETS", "REPORTED_BASELINES", "RESTRICTED", "RUNNABLE_BASELINES",
           "pinned_buckets", "plan", "plan_alone", "plan_bucketed", "plan_fewest_buckets",
           "plan_finalists", "plan_with_timelines"]

log = logging.getLogger(__name__)

# Baselines reported next to every plan (bruteforce only on request: it refuses large inputs).
REPORTED_BASELINES = ("fp32", "all-gpu", "hipress", "cpu-only", "upper-bound")
# The reported baselines that are strategies one can run (upper-bound is a bound).
RUNNABLE_BASELINES = ("fp32", "all-gpu", "hipress", "cpu-only")
# Device restrictions under which plan_finalists plans again: the greedy search commits to one
# device mix, and on 2 x 2 CPU workers the plan under no-gpu measured fastest of 21 strategies
# in three calibration runs in a row (BENCHMARKS.md, "Cost-model calibration").
RESTRICTED = {"no-gpu": {"allow_gpu": False}, "no-cpu": {"allow_cpu": False}}
# The label of plan_fewest_buckets' strategies (after the algorithm's name).
FEWEST_BUCKETS = "fewest-buckets"


def _options(workload: Workload, solution: baselines.Solution) -> dict[str, Option]:
    return dict(zip(workload.names, solution.options, strict=True))


def _key(options: dict[str, Option]) -> tuple[str, ...]:
    """An option set's identity: finalists with the same Options per tensor are one."""
    return tuple(map(str, options.values()))


def _pin(solution: baselines.Solution, pinned: frozenset[str]) -> baselines.Solution:
    """``solution`` with every tensor of ``pinned`` that it compresses on the fp32 Option,
    priced again (the search chose the others without knowing; a pinned tensor it left
    uncompressed keeps its Option)."""
    ctx = solution.ctx
    names = ctx.workload.names
    options = solution.options
    moved = [i for i, n in enumerate(names) if n in pinned and options[i].is_compressed]
    if not moved:
        return solution
    try:
        dense = baselines.fp32_baseline_option(ctx)
    except baselines.BaselineUnavailable:  # the constraints forbid it: any uncompressed one
        allowed = ctx.uncompressed()
        if not allowed:
            raise ValueError(f"{len(moved)} tensor(s) must stay uncompressed (e.g. "
                             f"{names[moved[0]]!r}), but the constraints allow no uncompressed "
                             "Option; relax them or exclude fewer tensors") from None
        dense = allowed[0]
    choice = solution.choice.copy()
    choice[moved] = ctx.index([dense])[0]
    return baselines.Solution(choice, ctx.iteration_us(choice), ctx)


def _run(workload: Workload, cluster: Cluster, compressor: str, params: dict[str, Any] | None,
         *, algorithm: str, constraints: Constraints | None, costs: CompressorCosts | None,
         baseline_names: tuple[str, ...], pinned: frozenset[str] = frozenset(),
         incumbent_us: float | None = None) \
        -> tuple[Strategy, baselines.Solution, dict[str, baselines.Solution]]:
    """The algorithm's Strategy and Solution, and the Solution of every available baseline;
    the tensors in ``pinned`` uncompressed in all of them (:func:`_pin`); ``incumbent_us``:
    :attr:`PlanContext.incumbent_us`."""
    params = dict(params or {})
    algo = baselines.get(algorithm)
    # plan time: the model build (tree, prices, catalogue) and the search; search time: the
    # search alone. Loading the compiled kernels is paid once per process, before the clock.
    load_kernels()
    with search.gc_paused():  # the model build allocates many small objects too
        t_plan = time.perf_counter()
        ctx = PlanContext(workload, cluster, compressor, params, costs,
                          constraints or Constraints(), incumbent_us=incumbent_us)
        ctx.prepare()
        t0 = time.perf_counter()
        solution = _pin(algo.run(ctx), pinned)
        t1 = time.perf_counter()
        search_ms, plan_ms = (t1 - t0) * 1e3, (t1 - t_plan) * 1e3
        others: dict[str, baselines.Solution] = {}
        for name in baseline_names:
            if name == algorithm:
                others[name] = solution
                continue
            try:
                others[name] = _pin(baselines.get(name).run(ctx), pinned)
            except baselines.BaselineUnavailable as exc:
                log.info("baseline %s skipped: %s", name, exc)
    reported = {name: sol.iteration_us / 1e3 for name, sol in others.items()}
    strategy = Strategy(_options(workload, solution), solution.iteration_us / 1e3, reported,
                        algorithm, search_ms, workload, cluster, compressor, params,
                        ctx.constraints, plan_time_ms=plan_ms)
    return strategy, solution, others


def plan_with_timelines(workload: Workload, cluster: Cluster, compressor: str = "randomk",
                        params: dict[str, Any] | None = None, *, algorithm: str = "espresso",
                        constraints: Constraints | None = None,
                        costs: CompressorCosts | None = None,
                        baseline_names: tuple[str, ...] = REPORTED_BASELINES,
                        pinned: frozenset[str] = frozenset(), bound: bool = False,
                        incumbent_us: float | None = None) \
        -> tuple[Strategy, dict[str, Timeline]]:
    """Like :func:`plan`, also returning the timelines of the chosen strategy ("chosen") and
    of the fp32 baseline ("fp32", when available); ``bound``: report the lower bound of every
    strategy (``Strategy.lower_bound_ms``)."""
    strategy, solution, others = _run(workload, cluster, compressor, params,
                                      algorithm=algorithm, constraints=constraints, costs=costs,
                                      baseline_names=baseline_names, pinned=pinned,
                                      incumbent_us=incumbent_us)
    if bound:  # outside the plan's clock: the search prices it only where it does not stop
        # at the floor first (pinned tensors only raise the optimum above it)
        strategy = replace(strategy, lower_bound_ms=solution.ctx.bound_us / 1e3)
    timelines = {"chosen": solution.ctx.evaluator.timeline(solution.choice)}
    if "fp32" in others:
        fp32 = others["fp32"]
        timelines["fp32"] = (timelines["chosen"] if fp32 is solution
                             else fp32.ctx.evaluator.timeline(fp32.choice))
    return strategy, timelines


def plan_finalists(workload: Workload, cluster: Cluster, compressor: str = "randomk",
                   params: dict[str, Any] | None = None, *, within: float,
                   algorithm: str = "espresso", constraints: Constraints | None = None,
                   costs: CompressorCosts | None = None,
                   pinned: frozenset[str] = frozenset(),
                   incumbent_us: float | None = None) -> list[Strategy]:
    """The planned strategy first, then the alternatives predicted within ``within`` times
    its iteration time, fastest first, each option set once. The planned strategy is the
    algorithm's, or the options of a restricted run of it where that predicts faster (a
    restricted run searches part of the same tree).

    The alternatives are every runnable baseline and the same algorithm restricted to one
    device (``RESTRICTED``, named like ``espresso/no-gpu``). For measured trials
    (``worker.trials``): where the model's error may exceed the gap between strategies,
    running the finalists for a few iterations decides between them. Each finalist is a
    Strategy of its own (``algorithm`` names it) with the plan's reported baselines.
    ``incumbent_us``: an iteration time the plan is known to reach
    (:attr:`PlanContext.incumbent_us`; not the restricted runs', which may be slower).
    """
    base = constraints or Constraints()
    strategy, _, others = _run(workload, cluster, compressor, params, algorithm=algorithm,
                               constraints=base, costs=costs,
                               baseline_names=REPORTED_BASELINES, pinned=pinned,
                               incumbent_us=incumbent_us)
    alternatives = [(name, _options(workload, sol),
                     sol.iteration_us / 1e3, base)
                    for name, sol in others.items() if name in RUNNABLE_BASELINES]
    restricted_runs = []
    for label, change in RESTRICTED.items():
        if all(getattr(base, k) == v for k, v in change.items()):
            continue  # the plan itself is restricted so
        restricted = replace(base, **change)
        try:
            alt, _, _ = _run(workload, cluster, compressor, params, algorithm=algorithm,
                             constraints=restricted, costs=costs, baseline_names=(),
                             pinned=pinned)
        except ValueError as exc:  # nothing left to plan with under the restriction
            log.info("finalist %s/%s skipped: %s", algorithm, label, exc)
            continue
        restricted_runs.append((f"{algorithm}/{label}", alt.options, alt.predicted_ms,
                                restricted))
    alternatives += restricted_runs
    # A restricted run searches a subset of the same tree, so where it predicts faster than
    # the unrestricted search (whose greedy steps missed it: on the 2 x 2 CPU workers of the
    # main job, espresso/no-gpu at 72.3 ms against espresso's 76.2) its options are the plan.
    best = min(restricted_runs, key=lambda a: a[2], default=None)
    if best is not None and best[2] < strategy.predicted_ms:
        strategy = replace(strategy, options=best[1], predicted_ms=best[2])
    out = [strategy]
    seen = {_key(strategy.options)}
    limit = strategy.predicted_ms * within
    for name, options, predicted_ms, used in sorted(alternatives, key=lambda a: a[2]):
        if _key(options) in seen or predicted_ms > limit:
            continue
        seen.add(_key(options))
        out.append(replace(strategy, options=options, predicted_ms=predicted_ms,
                           algorithm=name, constraints=used))
    return out


def plan_alone(workload: Workload, cluster: Cluster, compressor: str = "randomk",
               params: dict[str, Any] | None = None, *, algorithm: str = "espresso",
               constraints: Constraints | None = None, costs: CompressorCosts | None = None,
               pinned: frozenset[str] = frozenset(), incumbent_us: float | None = None) \
        -> tuple[Strategy, baselines.Solution]:
    """Like :func:`plan` without the baselines (the Strategy reports none): the algorithm's
    strategy, timed as ``plan`` times it, and its Solution. ``incumbent_us``: an iteration
    time another candidate reaches (:attr:`PlanContext.incumbent_us`)."""
    strategy, solution, _ = _run(workload, cluster, compressor, params, algorithm=algorithm,
                                 constraints=constraints, costs=costs, baseline_names=(),
                                 pinned=pinned, incumbent_us=incumbent_us)
    return strategy, solution


def pinned_buckets(fused: Workload, apart: frozenset[str]) -> frozenset[str]:
    """The buckets of ``fused`` made of gradients in ``apart``: a bucket named after its first
    member (``first`` or ``first+N``) holds only such gradients when that one is
    (:func:`~byteps_espresso.strategy.buckets.layout_apart`)."""
    return frozenset(n for n in fused.names if n in apart or n.rsplit("+", 1)[0] in apart)


def plan_bucketed(workload: Workload, cluster: Cluster, compressor: str = "randomk",
                  params: dict[str, Any] | None = None, *, within: float | None,
                  algorithm: str = "espresso", constraints: Constraints | None = None,
                  costs: CompressorCosts | None = None, caps: Sequence[int] = CANDIDATE_CAPS,
                  first_cap_bytes: int = DEFAULT_FIRST_CAP_BYTES,
                  apart: frozenset[str] = frozenset()) \
        -> tuple[tuple[Bucket, ...], list[tuple[int, int, float]], list[Strategy]]:
    """What ``Compression.espresso`` plans at start-up: the bucket layout, then its strategies.

    Each distinct greedy layout of ``caps``, and the one with the fewest buckets
    (:func:`~byteps_espresso.strategy.buckets.plan_fused`), is planned with ``algorithm``
    alone (no baselines, no finalists: only its predicted time decides the layout), and only
    the kept layout gets the full plan: its finalists (:func:`plan_finalists`, when
    ``within`` is given) or the plan with its baselines.

    The gradients in ``apart`` (``Compression.espresso(exclude=...)``) are fused only with
    each other and their buckets stay uncompressed in every plan.

    Returns:
        (the kept layout, [(cap, buckets, predicted ms) per distinct layout], the strategies
        of the kept layout, the planned one first). The strategies describe the fused
        workload; the caller records the layout in them.
    """
    base = constraints or Constraints()

    def predicted_ms(fused: Workload, best_ms: float | None) -> float:
        return plan_alone(fused, cluster, compressor, params, algorithm=algorithm,
                          constraints=base, costs=costs, pinned=pinned_buckets(fused, apart),
                          incumbent_us=None if best_ms is None else best_ms * 1e3
                          )[0].predicted_ms

    buckets, tried = plan_fused(workload, predicted_ms, caps, first_cap_bytes, apart)
    fused = fuse_apart(workload, buckets, apart)
    pinned = pinned_buckets(fused, apart)
    # The kept layout's plan again, with its baselines or finalists: it reaches the time its
    # plan above did, so a long search of Algorithm 2 cuts there.
    reached_us = min(ms for _, _, ms in tried) * 1e3
    if within is not None:
        return buckets, tried, plan_finalists(fused, cluster, compressor, params, within=within,
                                              algorithm=algorithm, constraints=base,
                                              costs=costs, pinned=pinned,
                                              incumbent_us=reached_us)
    return buckets, tried, [plan(fused, cluster, compressor, params, algorithm=algorithm,
                                 constraints=base, costs=costs, pinned=pinned,
                                 incumbent_us=reached_us)]


def plan_fewest_buckets(workload: Workload, cluster: Cluster, compressor: str = "randomk",
                        params: dict[str, Any] | None = None, *, algorithm: str = "espresso",
                        constraints: Constraints | None = None,
                        costs: CompressorCosts | None = None,
                        caps: Sequence[int] = CANDIDATE_CAPS,
                        apart: frozenset[str] = frozenset()) \
        -> tuple[tuple[Bucket, ...], Strategy]:
    """``algorithm`` alone (no baselines) on the layout with the fewest buckets
    (:func:`~byteps_espresso.strategy.buckets.fewest`: the largest of ``caps`` for every
    bucket, without the small first one; the gradients in ``apart`` fused only with each
    other, their buckets uncompressed). Its Strategy describes the fused workload, is named
    ``<algorithm>/fewest-buckets`` (:data:`FEWEST_BUCKETS`) and records the layout.

    A trial finalist beside the planned layout (``worker/profiler.py``): each bucket's Option
    adds its collectives, and where the workers share a host's cores every collective waits
    for the last member to arrive, a cost the model does not see. On the LSTM of
    examples/train.py at 1 Gbit/s (emulated, 2 x 2 workers on 2 cores) the planned three
    buckets were predicted at 21.3 ms and measured 32.6, these two at 21.2 and 25.9
    (BENCHMARKS.md, "Fewer buckets, measured")."""
    base = constraints or Constraints()
    buckets = fewest([(t.name, t.numel) for t in workload.tensors], caps, apart)
    fused = fuse_apart(workload, buckets, apart)
    strategy, _ = plan_alone(fused, cluster, compressor, params, algorithm=algorithm,
                             constraints=base, costs=costs,
                             pinned=pinned_buckets(fused, apart))
    return buckets, replace(strategy, algorithm=f"{algorithm}/{FEWEST_BUCKETS}",
                            buckets=buckets if any(b.fused for b in buckets) else ())


def plan(workload: Workload, cluster: Cluster, compressor: str = "randomk",
         params: dict[str, Any] | None = None, *, algorithm: str = "espresso",
         constraints: Constraints | None = None, costs: CompressorCosts | None = None,
         pinned: frozenset[str] = frozenset(), incumbent_us: float | None = None) -> Strategy:
    """Plan a per-tensor strategy.

    Args:
        workload: tensors in backward order with ready gaps.
        cluster: machines, links, servers, CPU threads.
        compressor: kernels registry name; ``params`` its parameters (e.g. ``{"ratio": 0.01}``).
        algorithm: ``espresso`` or a baseline name (see ``baselines.ALGORITHMS``).
        constraints: prune the decision tree.
        costs: compression cost profile (default: the shipped, measured one).
        pinned: tensors kept uncompressed (``Compression.espresso(exclude=...)``).
        incumbent_us: an iteration time known to be reachable (another plan's):
            :attr:`PlanContext.incumbent_us`.

    Returns:
        The Strategy with its predicted iteration time and the baselines' times.

    Raises:
        ValueError: unknown compressor/algorithm, a compressor without a cost profile, or an
            input too large for ``bruteforce``.
    """
    strategy, _ = plan_with_timelines(workload, cluster, compressor, params,
                                      algorithm=algorithm, constraints=constraints, costs=costs,
                                      pinned=pinned, incumbent_us=incumbent_us)
    return strategy
