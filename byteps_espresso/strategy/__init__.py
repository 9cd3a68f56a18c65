"""The strategy engine: decision tree of Options, cost models, timeline, search, baselines.

Example:
    >>> from byteps_espresso.strategy import Cluster, Workload, plan
    >>> s = plan(Workload.builtin("bert"), Cluster.preset(8, 8, "nvlink", 100), "randomk",
    ...          {"ratio": 0.01})
    >>> s.predicted_ms, s.baselines["fp32"]
"""

from byteps_espresso.strategy.cluster import INTRA_PRESETS, Cluster, ClusterError
from byteps_espresso.strategy.compressor_costs import CompressorCosts, CostsError
from byteps_espresso.strategy.options import Device, Kind, Option, OptionError, Scope, Step
from byteps_espresso.strategy.planner import plan, plan_with_timelines
from byteps_espresso.strategy.strategy_file import Strategy, StrategyError
from byteps_espresso.strategy.tree import (
    ConstraintError,
    Constraints,
    count_decomposition,
    enumerate_options,
    validate,
)
from byteps_espresso.strategy.workload import TensorProfile, Workload, WorkloadError

__all__ = [
    "INTRA_PRESETS",
    "Cluster",
    "ClusterError",
    "CompressorCosts",
    "ConstraintError",
    "Constraints",
    "CostsError",
    "Device",
    "Kind",
    "Option",
    "OptionError",
    "Scope",
    "Step",
    "Strategy",
    "StrategyError",
    "TensorProfile",
    "Workload",
    "WorkloadError",
    "count_decomposition",
    "enumerate_options",
    "plan",
    "plan_with_timelines",
    "validate",
]
