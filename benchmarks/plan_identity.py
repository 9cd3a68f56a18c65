"""Planner results for an identity check: a change meant to make planning faster must not
change what it plans.

``dump`` writes, for the code on the import path, the strategies (Option per tensor),
predicted times and baselines (floats as ``repr``) of:
- every cell of benchmarks/plan.py's (b): the seven workloads x two settings x three
  compressors, on the presets and with 2 executor lanes (84 plans);
- 300 seeded random instances x 3 compressors (strategy.instances, with their constraints);
- the start-up ``plan_bucketed`` on the main job's measured profile (calibrate.json), for
  efsignsgd and randomk, with the finalists.

``compare`` reads two dumps and names every entry that differs. To check a branch against
main, dump both (main from a clone, e.g. ``PYTHONPATH=<clone>``), then compare:

    PYTHONPATH=../main-clone .venv/bin/python benchmarks/plan_identity.py dump /tmp/main.json
    .venv/bin/python benchmarks/plan_identity.py dump /tmp/branch.json
    .venv/bin/python benchmarks/plan_identity.py compare /tmp/main.json /tmp/branch.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from plan import main_job_profile

from byteps_espresso.strategy import Cluster, Workload
from byteps_espresso.strategy.instances import random_instance
from byteps_espresso.strategy.planner import plan, plan_bucketed
from byteps_espresso.strategy.strategy_file import Strategy

COMPRESSORS = {"randomk": {"ratio": 0.01}, "dgc": {"ratio": 0.01}, "efsignsgd": {}}
WORKLOADS = ("lstm", "vgg16", "resnet50", "resnet101", "ugatit", "bert", "gpt2")
SETTINGS = (("nvlink", 100.0), ("pcie", 25.0))
LANES = (None, 2)
INSTANCES = 300
PROFILE = Path(__file__).resolve().parent / "results" / "calibrate.json"
# worker/profiler.py's trial window (benchmarks/plan.py's TRIAL_WITHIN)
TRIAL_WITHIN = 2.5


def _record(s: Strategy) -> dict:
    return {"options": {k: str(v) for k, v in s.options.items()}, "ms": repr(s.predicted_ms),
            "baselines": {k: repr(v) for k, v in s.baselines.items()},
            "algorithm": s.algorithm}


def _table() -> dict:
    out = {}
    for model in WORKLOADS:
        workload = Workload.builtin(model)
        for intra, gbps in SETTINGS:
            for lanes in LANES:
                cluster = Cluster.preset(8, 8, intra, gbps).with_(lanes=lanes)
                for compressor, params in COMPRESSORS.items():
                    out[f"{model}/{intra}/{lanes}/{compressor}"] = _record(
                        plan(workload, cluster, compressor, params))
    return out


def _random() -> dict:
    out: dict = {}
    for seed in range(INSTANCES):
        inst = random_instance(seed)
        for compressor, params in COMPRESSORS.items():
            try:
                out[f"{seed}/{compressor}"] = _record(plan(
                    inst.workload, inst.cluster, compressor, params,
                    constraints=inst.constraints))
            except ValueError as exc:
                out[f"{seed}/{compressor}"] = f"error: {exc}"
    return out


def _startup() -> dict:
    workload, cluster, measured = main_job_profile()
    out = {}
    for compressor in ("efsignsgd", "randomk"):
        costs = measured if measured.has(compressor) else None
        buckets, tried, finalists = plan_bucketed(workload, cluster, compressor,
                                                  COMPRESSORS[compressor],
                                                  within=TRIAL_WITHIN, costs=costs)
        out[compressor] = {"buckets": [b.name for b in buckets],
                           "tried": [[cap, n, repr(ms)] for cap, n, ms in tried],
                           "finalists": [_record(s) for s in finalists]}
    return out


def compare(a: dict, b: dict) -> list[str]:
    """The entries of two dumps that differ (or that only one has)."""
    bad = []
    for part in sorted(set(a) | set(b)):
        x, y = a.get(part, {}), b.get(part, {})
        bad += [f"{part}/{k}" for k in sorted(set(x) | set(y)) if x.get(k) != y.get(k)]
    return bad


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("dump", help="plan everything, write JSON").add_argument("out")
    cmp = sub.add_parser("compare", help="name the entries of two dumps that differ")
    cmp.add_argument("a")
    cmp.add_argument("b")
    args = parser.parse_args(argv)
    if args.cmd == "dump":
        result = {"startup": _startup(), "table": _table(), "random": _random()}
        Path(args.out).write_text(json.dumps(result, indent=0, sort_keys=True) + "\n")
        print(f"wrote {args.out}: " + ", ".join(f"{k} {len(v)}" for k, v in result.items()))
        return 0
    a, b = (json.loads(Path(p).read_text()) for p in (args.a, args.b))
    bad = compare(a, b)
    for key in bad:
        print("differs:", key)
    n = sum(len(v) for v in a.values())
    print(f"{n} entries compared, {len(bad)} differ")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
