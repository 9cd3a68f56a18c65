"""How the start-up's measured time of a strategy compares with what the strategy then trains at.

The trials and the check time a strategy for a few iterations right after switching to it and
reduce them to one figure (``worker.trials.settled_ms``), by which they keep one strategy or
another. This reads the runs of one ``benchmarks/ddp.py`` invocation back: for every planned
run, the iterations its check timed of the strategy the run then trained on (rank 0's, from
its ``check.json``, the warm-up left out) and the run's median iteration, and prints each
reduction of those iterations as a ratio to that median: the median, the fastest, the mean,
and the mean without the slowest (what ``settled_ms`` takes). A reduction near 1.0 on every
run reads the strategy as it trains.

    .venv/bin/python benchmarks/check_reads.py benchmarks/results/ddp_lstm_settled_mean.json \
        --profiles 'benchmarks/results/profiles/{model}-{setting}-{variant}-settled-{rep}-profile' \
        [--json out.json]

``--profiles``: where each run's ``ESPRESSO_PROFILE_OUT`` folder is (by default where
``ddp.py`` leaves it, ``out/ddp/{model}-{setting}-{variant}-{rep}-profile``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from byteps_espresso.worker.trials import settled_ms
from predict import checked

DEFAULT_PROFILES = "out/ddp/{model}-{setting}-{variant}-{rep}-profile"  # where ddp.py leaves them
READS = {
    "median": lambda t: statistics.median(t[1:]),
    "fastest": lambda t: min(t[1:]),
    "mean": lambda t: statistics.fmean(t[1:]),
    "settled_ms": settled_ms,  # the mean without the slowest
}


def stayed_iterations(check: dict) -> list[float]:
    """Rank 0's checked iterations (ms, the warm-up first) of the strategy the run kept:
    ``stayed`` names its role (``kept``, ``replanned``) or a fall-back's algorithm."""
    return next(r["iteration_ms"] for role, r in checked(check)
                if check["stayed"] in (role, r["algorithm"]))


def reads(result: dict, profiles: str) -> list[dict]:
    rows = []
    for row in result["rows"]:
        if not row["variant"].startswith("espresso-") or row["variant"].endswith("-kept"):
            continue
        for rep, trained in enumerate(row["iteration_ms_runs"]):
            folder = Path(profiles.format(model=row["model"], setting=row["setting"],
                                          variant=row["variant"], rep=rep))
            check = json.loads((folder / "check.json").read_text())
            times = stayed_iterations(check)
            rows.append({"run": f"{row['model']}-{row['setting']}-{row['variant']}-{rep}",
                         "stayed": check["stayed"], "trained_ms": trained,
                         **{name: read(times) / trained for name, read in READS.items()}})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", type=Path, nargs="+", help="benchmarks/ddp.py JSON files")
    ap.add_argument("--profiles", action="append",
                    help="each run's profile folder, a pattern of model, setting, variant "
                         "and rep (one per results file, or one for all; default "
                         f"{DEFAULT_PROFILES})")
    ap.add_argument("--json", type=Path, help="write the rows and the summary here")
    args = ap.parse_args()
    patterns = args.profiles or [DEFAULT_PROFILES]
    if len(patterns) not in (1, len(args.results)):
        ap.error("give one --profiles for all results files or one per file")
    rows = [r for i, result in enumerate(args.results)
            for r in reads(json.loads(result.read_text()), patterns[min(i, len(patterns) - 1)])]
    if not rows:
        sys.exit("no planned runs (espresso-*) in the results")
    print(f"{'run':40} {'stayed':12} {'trained ms':>10} " + " ".join(f"{k:>10}" for k in READS))
    for r in rows:
        print(f"{r['run']:40} {r['stayed']:12} {r['trained_ms']:10.1f} "
              + " ".join(f"{r[k]:10.2f}" for k in READS))
    summary = {}
    for model in sorted({r["run"].split("-")[0] for r in rows}):
        mine = [r for r in rows if r["run"].startswith(model + "-")]
        summary[model] = {k: {"median": statistics.median(r[k] for r in mine),
                              "low": min(r[k] for r in mine), "high": max(r[k] for r in mine),
                              "mean_abs_off": statistics.fmean(abs(r[k] - 1) for r in mine)}
                          for k in READS}
        print(f"\n{model}, {len(mine)} runs: each read against the trained iteration, median "
              "(range; mean distance from 1.0)")
        for k, s in summary[model].items():
            print(f"  {k:10} {s['median']:.2f} ({s['low']:.2f}-{s['high']:.2f}; "
                  f"{s['mean_abs_off']:.3f})")
    if args.json:
        args.json.write_text(json.dumps({"command": " ".join(sys.argv), "summary": summary,
                                         "rows": rows}, indent=1) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
