"""The cost model's predictions of strategies that ran, from the runs' own records.

Every run of ``Compression.espresso`` with ``ESPRESSO_PROFILE_OUT`` leaves its profile
(workload, cluster, costs) and its check (``check.json``: each strategy it checked, that
strategy's Options per bucket and its measured median iteration). benchmarks/ddp.py keeps one
such folder per run (``out/ddp/<model>-<link>-<variant>-<rep>-profile``). This prices every
checked strategy again on its run's profile with the model as it is now, beside the prediction
the run made and what the check measured, so that a change to the model is scored on strategies
that really ran without running them again.

A strategy's buckets are the members the check recorded (``buckets``), or in older records
read back from their names: a bucket is named after its first gradient in backward order,
``first+N`` when N more follow it (``buckets.from_names``).

    .venv/bin/python benchmarks/predict.py out/ddp/*-profile [--json out.json]

Prints one row per checked strategy (run; which one: ``kept``, ``replanned`` (the first
checked after it, a re-plan or a fall-back) or ``then``, with its algorithm; its prediction
at the time, now, and the check's measured median), the median absolute error of both
predictions against the measured medians, in how many of the pairs of strategies one run
checked the model (now) predicts the faster-measured one faster, and the cost per collective
step that would reconcile each pair's predicted and measured differences.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import NamedTuple

import torch
from byteps_espresso.worker.check import cores_ms
from byteps_espresso.worker.profiler import excluded_names

from byteps_espresso.strategy import Cluster, CompressorCosts, Option, Workload
from byteps_espresso.strategy.buckets import Bucket, BucketError, from_names, fuse, reorder
from byteps_espresso.strategy.context import PlanContext
from byteps_espresso.strategy.strategy_file import Strategy


def median_ms(record: dict) -> float:
    """A checked strategy's slowest-rank median iteration: ``median_ms`` where the check
    recorded it beside its measured time (``worker.trials.settled_ms``), else
    ``measured_ms`` (earlier checks measured the median there)."""
    return record.get("median_ms") or record["measured_ms"]


def checked(check: dict) -> list[tuple[str, dict]]:
    """(role, record) of every strategy the check measured, the kept one first."""
    out = [("kept", check["kept"])]
    if check.get("replanned"):
        out.append(("replanned", check["replanned"]))
    out += [("then", r) for r in check.get("then", [])]
    return [(role, r) for role, r in out if r.get("measured_ms") and r.get("options")]


def one_dimensional(workload: Workload) -> frozenset[str]:
    """What ``Compression.espresso`` keeps apart by default (``excluded_names``: the gradients
    of at most one dimension; for fp16 only before it stopped), from the profile's shapes."""
    return excluded_names({t.name: torch.empty(t.shapes[0], device="meta")
                           for t in workload.tensors if t.shapes is not None}, None)


class Profile(NamedTuple):
    """What one run's ``ESPRESSO_PROFILE_OUT`` folder holds for pricing: the measured
    workload, cluster and costs, and the strategy file (compressor, constraints, layout)."""

    folder: Path
    workload: Workload
    cluster: Cluster
    costs: CompressorCosts
    planned: Strategy

    @classmethod
    def load(cls, folder: Path) -> Profile:
        return cls(folder, Workload.load(folder / "workload.json"),
                   Cluster.load(folder / "cluster.json"),
                   CompressorCosts.load(folder / "costs.json"),
                   Strategy.load(folder / "strategy.json"))

    def price(self, options: dict[str, str], buckets: list[list[str]] | None = None) -> float:
        """The model's iteration (ms) of ``options`` (bucket name -> Option) on ``buckets``
        (their members, as the check records them), or where the record has none: buckets
        named as in the strategy file's layout take its members (a layout that kept
        gradients apart is no run of the backward order); others are read back from their
        names (:func:`buckets.from_names`)."""
        workload, planned = self.workload, self.planned
        known = {b.name: b for b in planned.layout}
        if buckets is not None:
            layout = [Bucket.of(members) for members in buckets]
        elif all(name in known for name in options):
            layout = [b for b in planned.layout if b.name in options]
        else:
            where = str(self.folder)
            try:
                layout = list(from_names(list(options), workload.names, where))
            except BucketError:  # then the run kept its default exclusions apart
                layout = list(from_names(list(options), workload.names, where,
                                         one_dimensional(workload)))
        fused = fuse(reorder(workload, [n for b in layout for n in b.tensors]), layout)
        ctx = PlanContext(fused, self.cluster, planned.compressor, planned.params, self.costs,
                          planned.constraints)
        choice = ctx.index([Option.parse(options[t.name]) for t in fused.tensors])
        return ctx.iteration_us(choice) / 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folders", nargs="+", type=Path, help="ESPRESSO_PROFILE_OUT folders")
    ap.add_argument("--json", type=Path, default=None, help="write the rows here")
    args = ap.parse_args()
    rows = []
    for folder in sorted(args.folders):
        if not (folder / "check.json").is_file():
            print(f"{folder}: no check.json, skipped", file=sys.stderr)
            continue
        check = json.loads((folder / "check.json").read_text())
        profile = Profile.load(folder)
        for role, record in checked(check):
            try:
                now = profile.price(record["options"], record.get("buckets"))
            except BucketError as exc:
                print(f"{folder.name} {role}: skipped, {exc}", file=sys.stderr)
                continue
            steps = sum(not st.kind.is_compute for o in record["options"].values()
                        for st in Option.parse(o).steps)
            rows.append({"run": folder.name.removesuffix("-profile"), "role": role,
                         "algorithm": record.get("algorithm"),
                         "predicted_ms": record["predicted_ms"], "now_ms": now,
                         "measured_ms": median_ms(record), "collective_steps": steps,
                         "cores_ms": cores_ms(record, check.get("host"))})
    print(f"{'run':44} {'checked':22} {'then ms':>8} {'now ms':>8} {'change':>7} "
          f"{'measured':>9} {'error then':>10} {'error now':>9} {'cores ms':>9}")
    for r in rows:
        m = r["measured_ms"]
        which = f"{r['role']} ({r['algorithm']})"
        cores = "-" if r["cores_ms"] is None else f"{r['cores_ms']:.1f}"
        print(f"{r['run']:44} {which:22} {r['predicted_ms']:8.1f} {r['now_ms']:8.1f} "
              f"{r['now_ms'] / r['predicted_ms'] - 1:+7.1%} {m:9.1f} "
              f"{r['predicted_ms'] / m - 1:+10.0%} {r['now_ms'] / m - 1:+9.0%} {cores:>9}")
    summary = {}
    if rows:
        then = statistics.median(abs(r["predicted_ms"] / r["measured_ms"] - 1) for r in rows)
        now = statistics.median(abs(r["now_ms"] / r["measured_ms"] - 1) for r in rows)
        pairs = ordered_pairs(rows)
        per_step = step_costs(rows)
        summary = {"median_abs_error_then": then, "median_abs_error_now": now,
                   "pairs": len(pairs), "pairs_ordered_now": sum(pairs),
                   "reconciling_step_ms": per_step}
        print(f"\nmedian absolute error over {len(rows)} checked strategies: "
              f"then {then:.1%}, now {now:.1%}; the model orders {sum(pairs)} of {len(pairs)} "
              "pairs of strategies checked in one run as they measured")
        floored = [r for r in rows if r["cores_ms"] is not None]
        if floored:
            errors = [abs(max(r["now_ms"], r["cores_ms"]) / r["measured_ms"] - 1)
                      for r in floored]
            without = statistics.median(abs(r["now_ms"] / r["measured_ms"] - 1)
                                        for r in floored)
            summary["median_abs_error_cores"] = statistics.median(errors)
            print(f"with the measured cores' floor (max of now and cores ms) over the "
                  f"{len(floored)} strategies that recorded their CPU time: "
                  f"{statistics.median(errors):.1%} (now without it: {without:.1%}), "
                  f"{sum(e <= 0.15 for e in errors)} within 15%")
        if per_step:
            print(f"a cost per collective step that would reconcile each such pair: "
                  f"{min(per_step):.1f} to {max(per_step):.1f} ms (median "
                  f"{statistics.median(per_step):.1f}) over {len(per_step)} pairs")
    if args.json is not None:
        args.json.write_text(json.dumps({"command": " ".join(sys.argv), **summary,
                                         "rows": rows}, indent=1) + "\n")


def step_costs(rows: list[dict]) -> list[float]:
    """For every two strategies one run's check measured with different numbers of collective
    steps per iteration: the cost per step that, added to the model's predictions, would make
    their predicted difference the measured one (one constant would have to fit them all)."""
    out = []
    for checked in _by_run(rows).values():
        for i, a in enumerate(checked):
            for b in checked[i + 1:]:
                if a["collective_steps"] != b["collective_steps"]:
                    out.append(((a["measured_ms"] - b["measured_ms"])
                                - (a["now_ms"] - b["now_ms"]))
                               / (a["collective_steps"] - b["collective_steps"]))
    return out


def _by_run(rows: list[dict]) -> dict[str, list[dict]]:
    runs: dict[str, list[dict]] = {}
    for r in rows:
        runs.setdefault(r["run"], []).append(r)
    return runs


def ordered_pairs(rows: list[dict]) -> list[bool]:
    """For every two strategies one run's check measured: whether the model (now) predicts
    the one that measured faster as the faster (what the check needs the model for)."""
    return [(a["now_ms"] < b["now_ms"]) == (a["measured_ms"] < b["measured_ms"])
            for checked in _by_run(rows).values()
            for i, a in enumerate(checked) for b in checked[i + 1:]]


if __name__ == "__main__":
    main()
