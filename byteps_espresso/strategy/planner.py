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
from typing import Any

from byteps_espresso.strategy import baselines
from byteps_espresso.strategy.cluster import Cluster
from byteps_espresso.strategy.compressor_costs import CompressorCosts
from byteps_espresso.strategy.context import PlanContext
from byteps_espresso.strategy.strategy_file import Strategy
from byteps_espresso.strategy.timeline import Timeline
from byteps_espresso.strategy.tree import Constraints
from byteps_espresso.strategy.workload import Workload

__all__ = ["REPORTED_BASELINES", "plan", "plan_with_timelines"]

log = logging.getLogger(__name__)

# Baselines reported next to every plan (bruteforce only on request: it refuses large inputs).
REPORTED_BASELINES = ("fp32", "all-gpu", "hipress", "cpu-only", "upper-bound")


def plan_with_timelines(workload: Workload, cluster: Cluster, compressor: str = "randomk",
                        params: dict[str, Any] | None = None, *, algorithm: str = "espresso",
                        constraints: Constraints | None = None,
                        costs: CompressorCosts | None = None,
                        baseline_names: tuple[str, ...] = REPORTED_BASELINES) \
        -> tuple[Strategy, dict[str, Timeline]]:
    """Like :func:`plan`, also returning the timelines of the chosen strategy ("chosen") and
    of the fp32 baseline ("fp32", when available)."""
    params = dict(params or {})
    ctx = PlanContext(workload, cluster, compressor, params, costs,
                      constraints or Constraints())
    algo = baselines.get(algorithm)
    ctx.prepare()  # the cost model for this workload's sizes; not part of the search time
    t0 = time.perf_counter()
    solution = algo.run(ctx)
    search_ms = (time.perf_counter() - t0) * 1e3
    timelines = {"chosen": solution.ctx.evaluator.timeline(solution.choice)}
    reported: dict[str, float] = {}
    for name in baseline_names:
        if name == algorithm:
            reported[name] = solution.iteration_us / 1e3
            if name == "fp32":
                timelines["fp32"] = timelines["chosen"]
            continue
        try:
            sol = baselines.get(name).run(ctx)
        except baselines.BaselineUnavailable as exc:
            log.info("baseline %s skipped: %s", name, exc)
            continue
        reported[name] = sol.iteration_us / 1e3
        if name == "fp32":
            timelines["fp32"] = sol.ctx.evaluator.timeline(sol.choice)
    options = dict(zip(workload.names, solution.options, strict=True))
    strategy = Strategy(options, solution.iteration_us / 1e3, reported, algorithm, search_ms,
                        workload, cluster, compressor, params, ctx.constraints)
    return strategy, timelines


def plan(workload: Workload, cluster: Cluster, compressor: str = "randomk",
         params: dict[str, Any] | None = None, *, algorithm: str = "espresso",
         constraints: Constraints | None = None, costs: CompressorCosts | None = None) \
        -> Strategy:
    """Plan a per-tensor strategy.

    Args:
        workload: tensors in backward order with ready gaps.
        cluster: machines, links, servers, CPU threads.
        compressor: kernels registry name; ``params`` its parameters (e.g. ``{"ratio": 0.01}``).
        algorithm: ``espresso`` or a baseline name (see ``baselines.ALGORITHMS``).
        constraints: prune the decision tree.
        costs: compression cost profile (default: the shipped, measured one).

    Returns:
        The Strategy with its predicted iteration time and the baselines' times.

    Raises:
        ValueError: unknown compressor/algorithm, a compressor without a cost profile, or an
            input too large for ``bruteforce``.
    """
    strategy, _ = plan_with_timelines(workload, cluster, compressor, params,
                                      algorithm=algorithm, constraints=constraints, costs=costs)
    return strategy
