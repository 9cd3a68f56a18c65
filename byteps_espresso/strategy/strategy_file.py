"""Strategy: one Option per tensor name, the inputs it was planned for, and its predictions.

File format (JSON, DESIGN.md "Strategy file")::

    {"format": "byteps-espresso-strategy", "version": 1,
     "algorithm": "espresso", "predicted_iteration_ms": 81.2, "search_time_ms": 6.1,
     "baselines_ms": {"fp32": 120.3, ...}, "lower_bound_ms": 80.9,
     "compressor": {"name": "randomk", "params": {"ratio": 0.01}},
     "constraints": ["no-cpu"],
     "cluster": {...Cluster fields...}, "workload": {...Workload JSON...},
     "options": {"fc.weight": ["Comp(gpu)", "AllgatherC(flat)", "Decomp(gpu)"], ...},
     "buckets": [["fc.weight"], ["fc.bias", "conv3.weight", "conv3.bias"], ...]}

With tensor fusion (``strategy/buckets.py``) the workload is the fused one: each of its
tensors, and each key of ``options``, is a bucket, and ``buckets`` lists every bucket's member
gradients in backward order. Without ``buckets`` every option is one gradient.

Loading validates every option against the decision tree and the cluster, and checks that the
option names match the workload's tensors; errors name the field and the file.

Example:
    >>> s = Strategy.load("strategy.json"); s.options["fc.weight"]
"""

from __future__ import annotations

import json
import os
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from byteps_espresso.strategy.buckets import Bucket, BucketError, check_layout, singletons
from byteps_espresso.strategy.cluster import Cluster, ClusterError
from byteps_espresso.strategy.options import Option, OptionError
from byteps_espresso.strategy.search import BOUND_ROUNDING
from byteps_espresso.strategy.tree import ConstraintError, Constraints, validate
from byteps_espresso.strategy.workload import Workload, WorkloadError, atomic_write_text, read_json

__all__ = ["FORMAT", "Strategy", "StrategyError"]

FORMAT = "byteps-espresso-strategy"
VERSION = 1


class StrategyError(ValueError):
    """A strategy file is malformed; the message names the file and the field."""


@dataclass(frozen=True)
class Strategy:
    """A planned strategy.

    Attributes:
        options: tensor name -> Option, in backward order.
        predicted_ms: predicted iteration time of these options.
        baselines: baseline name -> predicted iteration time (ms) under the same model.
        algorithm: which algorithm produced the options.
        search_time_ms: how long the algorithm took.
        workload, cluster, compressor, params, constraints: the inputs (with fusion the
            workload has one tensor per bucket).
        buckets: the member gradients of each option's bucket (empty: one gradient each).
        plan_time_ms: from the loaded profile to the strategy: model build + search (not
            stored in the file; 0.0 for a loaded strategy).
        lower_bound_ms: no strategy of the tree is predicted faster under the same model
            (``PlanContext.bound_us``); a plan at it is optimal under the model. None: not
            computed (a strategy file written without it).
    """

    options: dict[str, Option]
    predicted_ms: float
    baselines: dict[str, float]
    algorithm: str
    search_time_ms: float
    workload: Workload
    cluster: Cluster
    compressor: str
    params: dict[str, Any] = field(default_factory=dict)
    constraints: Constraints = field(default_factory=Constraints)
    buckets: tuple[Bucket, ...] = ()
    plan_time_ms: float = 0.0
    lower_bound_ms: float | None = None

    @property
    def layout(self) -> tuple[Bucket, ...]:
        """Every option's bucket, in backward order (a bucket of one without fusion)."""
        return self.buckets or singletons(self.workload.names)

    @property
    def compressed_tensors(self) -> list[str]:
        return [n for n, o in self.options.items() if o.is_compressed]

    @property
    def cpu_offloaded_tensors(self) -> list[str]:
        return [n for n, o in self.options.items() if o.uses_cpu]

    def speedups(self) -> dict[str, float]:
        """Baseline time / predicted time, per baseline (>1: this strategy is faster)."""
        return {k: v / self.predicted_ms for k, v in self.baselines.items() if self.predicted_ms}

    def summary(self) -> str:
        """A one-screen report: inputs, predicted times, and the decisions grouped."""
        lines = [
            f"{self.workload.model}: {len(self.options)} tensors, "
            f"{sum(t.numel for t in self.workload.tensors) * 4 / 1e6:.1f} MB of gradients",
            f"cluster: {self.cluster.describe()}",
            f"compressor: {self.compressor} {json.dumps(self.params)}"
            + (f"; constraints: {', '.join(self.constraints.to_strings())}"
               if self.constraints.to_strings() else ""),
            f"{self.algorithm}: predicted iteration {self.predicted_ms:.2f} ms "
            f"(search {self.search_time_ms:.1f} ms); {len(self.compressed_tensors)} compressed, "
            f"{len(self.cpu_offloaded_tensors)} on CPU",
            *self._bound_lines(),
            *self._fusion_lines(),
            "",
            f"{'baseline':<12} {'ms':>9} {'speedup':>8}",
        ]
        for name, ms in self.baselines.items():
            lines.append(f"{name:<12} {ms:>9.2f} {ms / self.predicted_ms:>7.2f}x")
        lines += ["", f"{'tensors':>7} {'elements':>12}  option"]
        sizes = {t.name: t.numel for t in self.workload.tensors}
        groups: Counter[tuple[str, str]] = Counter()
        span: dict[tuple[str, str], list[int]] = {}
        for name, opt in self.options.items():
            key = (str(opt), _size_band(sizes[name]))
            groups[key] += 1
            span.setdefault(key, []).append(sizes[name])
        for (text, _), count in sorted(groups.items(), key=lambda kv: -max(span[kv[0]])):
            lo, hi = min(span[(text, _)]), max(span[(text, _)])
            rng = f"{hi:,}" if lo == hi else f"{lo:,}-{hi:,}"
            lines.append(f"{count:>7} {rng:>12}  {text}")
        return "\n".join(lines)

    def _bound_lines(self) -> list[str]:
        if not self.lower_bound_ms:  # None (not computed), or a bound of nothing
            return []
        above = self.predicted_ms / self.lower_bound_ms - 1
        verdict = "optimal under the model" if above <= BOUND_ROUNDING else \
            f"{100 * above:.2f}% above it"
        return [f"lower bound of every strategy: {self.lower_bound_ms:.2f} ms ({verdict})"]

    def _fusion_lines(self) -> list[str]:
        fused = [b for b in self.layout if b.fused]
        if not fused:
            return []
        gradients = sum(len(b.tensors) for b in self.layout)
        return [f"fusion: {gradients} gradients in {len(self.layout)} buckets "
                f"({len(fused)} fused, up to {max(len(b.tensors) for b in fused)} gradients)"]

    # ---- JSON ---------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "format": FORMAT,
            "version": VERSION,
            "algorithm": self.algorithm,
            "predicted_iteration_ms": self.predicted_ms,
            "search_time_ms": self.search_time_ms,
            "baselines_ms": dict(self.baselines),
            "compressor": {"name": self.compressor, "params": dict(self.params)},
            "constraints": self.constraints.to_strings(),
            "cluster": self.cluster.to_dict(),
            "workload": self.workload.to_dict(),
            "options": {name: opt.names() for name, opt in self.options.items()},
        }
        if self.buckets:
            out["buckets"] = [list(b.tensors) for b in self.buckets]
        if self.lower_bound_ms is not None:
            out["lower_bound_ms"] = self.lower_bound_ms
        return out

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the JSON file atomically (temporary file + rename)."""
        atomic_write_text(path, json.dumps(self.to_dict(), indent=1) + "\n")

    @classmethod
    def from_dict(cls, data: Any, where: str = "strategy") -> Strategy:
        """Parse and validate a strategy object.

        Raises:
            StrategyError: a missing or malformed field (names ``where`` and the field).
        """
        if not isinstance(data, dict):
            raise StrategyError(f"{where}: expected a JSON object")
        if data.get("format") != FORMAT:
            raise StrategyError(f"{where}: field 'format' must be {FORMAT!r}")
        if data.get("version") != VERSION:
            raise StrategyError(f"{where}: field 'version' must be {VERSION}")
        try:
            workload = Workload.from_dict(data.get("workload"), f"{where}: field 'workload'")
            cluster = Cluster.from_dict(data.get("cluster"), f"{where}: field 'cluster'")
            constraints = Constraints.parse(_list(data, "constraints", where),
                                            f"{where}: field 'constraints'")
        except (WorkloadError, ClusterError, ConstraintError) as exc:
            raise StrategyError(str(exc)) from None
        comp = data.get("compressor")
        if not isinstance(comp, dict) or not isinstance(comp.get("name"), str) \
                or not isinstance(comp.get("params", {}), dict):
            raise StrategyError(f"{where}: field 'compressor' must be "
                                "{\"name\": str, \"params\": {...}}")
        options = _parse_options(data.get("options"), workload, cluster, comp["name"], where)
        baselines = data.get("baselines_ms", {})
        if not isinstance(baselines, dict) or not all(
                isinstance(v, int | float) for v in baselines.values()):
            raise StrategyError(f"{where}: field 'baselines_ms' must map names to numbers")
        for key in ("predicted_iteration_ms", "search_time_ms", "lower_bound_ms"):
            if not isinstance(data.get(key, 0.0), int | float):
                raise StrategyError(f"{where}: field {key!r} must be a number")
        bound = data.get("lower_bound_ms")
        return cls(options, float(data.get("predicted_iteration_ms", 0.0)),
                   {str(k): float(v) for k, v in baselines.items()},
                   str(data.get("algorithm", "")), float(data.get("search_time_ms", 0.0)),
                   workload, cluster, comp["name"], dict(comp.get("params", {})), constraints,
                   _parse_buckets(data.get("buckets"), workload, where),
                   lower_bound_ms=None if bound is None else float(bound))

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Strategy:
        """Read and validate a strategy file.

        Raises:
            StrategyError: unreadable file, bad JSON or a malformed field (names the file).
        """
        return cls.from_dict(read_json(path, StrategyError, "strategy file"), str(path))


def _parse_options(raw: Any, workload: Workload, cluster: Cluster, compressor: str,
                   where: str) -> dict[str, Option]:
    if not isinstance(raw, dict):
        raise StrategyError(f"{where}: field 'options' must map tensor names to step lists")
    names = workload.names
    if set(raw) != set(names):
        missing = sorted(set(names) - set(raw))
        extra = sorted(set(raw) - set(names))
        detail = (f"missing {missing[:3]}" if missing else "") + \
                 (f" unknown {extra[:3]}" if extra else "")
        raise StrategyError(f"{where}: field 'options' does not match the workload's "
                            f"tensors ({detail.strip()})")
    options: dict[str, Option] = {}
    for name in names:
        steps = raw[name]
        if not isinstance(steps, list) or not all(isinstance(s, str) for s in steps):
            raise StrategyError(f"{where}: field 'options.{name}' must be a list of step names")
        try:
            opt = Option.parse(steps)
            validate(opt, cluster, compressor)
        except OptionError as exc:
            raise StrategyError(f"{where}: field 'options.{name}': {exc}") from None
        options[name] = opt
    return options


def _parse_buckets(raw: Any, workload: Workload, where: str) -> tuple[Bucket, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, list) or not all(
            isinstance(b, list) and b and all(isinstance(n, str) for n in b) for b in raw):
        raise StrategyError(f"{where}: field 'buckets' must be a list of non-empty lists of "
                            "gradient names")
    buckets = tuple(Bucket.of(b) for b in raw)
    if [b.name for b in buckets] != workload.names:
        raise StrategyError(f"{where}: field 'buckets' names buckets "
                            f"{[b.name for b in buckets][:3]}... but the workload's tensors are "
                            f"{workload.names[:3]}...; each workload tensor is one bucket, "
                            "named after its first gradient and how many follow")
    try:
        check_layout(buckets, [n for b in buckets for n in b.tensors], f"{where}: field 'buckets'")
    except BucketError as exc:
        raise StrategyError(str(exc)) from None
    return buckets


def _list(data: dict, key: str, where: str) -> list[str]:
    value = data.get(key, [])
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise StrategyError(f"{where}: field {key!r} must be a list of strings")
    return value


def _size_band(numel: int) -> str:
    return f"{numel.bit_length():02d}"
