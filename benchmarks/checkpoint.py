"""Exact checkpoints of a compressed run: resumed against uninterrupted, and what it costs.

Three jobs of ``benchmarks/checkpoint_worker.py`` under ``espresso-launch --local`` (2
machines x 2 workers, 1 server, ``Compression.espresso`` with random-k and error feedback,
profiling and trials at start-up): an uninterrupted run that checkpoints every rank after
``--save-at`` steps, a run resumed from that checkpoint in new processes, and one resumed from
the torch optimizer's state alone (the ``"espresso"`` section dropped). Reported: the held-out
loss and the largest parameter difference of each against the uninterrupted run, the
checkpoint size per rank (rank 0 holds the server's residuals too) against the torch-only
size, and the time of ``state_dict()`` and of loading. Prints a table and writes
benchmarks/results/checkpoint.json.

    .venv/bin/python benchmarks/checkpoint.py
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
WORLD = 4
MODES = ("full", "resume", "resume-torch")


def _job(out: Path, mode: str, args: argparse.Namespace) -> list[dict]:
    cmd = [sys.executable, "-m", "byteps_espresso.deploy.launch", "--local", "--machines", "2",
           "--workers-per-machine", "2", "--servers", "1", "--",
           sys.executable, str(ROOT / "benchmarks" / "checkpoint_worker.py"), "--out", str(out),
           "--mode", mode, "--steps", str(args.steps), "--save-at", str(args.save_at),
           "--ratio", str(args.ratio)]
    env = dict(os.environ, ESPRESSO_LOG_LEVEL="WARNING", ESPRESSO_TRIAL_STEPS="3",
               ESPRESSO_PROFILE_STEPS="3")
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout_s,
                          check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{mode} job failed ({done.returncode}):\n{done.stdout[-4000:]}")
    return [json.loads((out / f"{mode}_{r}.json").read_text()) for r in range(WORLD)]


def _max_diff(out: Path, mode: str) -> float:
    return max(float(np.abs(np.load(out / f"{mode}_params_{r}.npy")
                            - np.load(out / f"full_params_{r}.npy")).max())
               for r in range(WORLD))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--save-at", type=int, default=40)
    p.add_argument("--ratio", type=float, default=0.01)
    p.add_argument("--timeout-s", type=float, default=900)
    p.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "results" /
                   "checkpoint.json")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        runs = {mode: _job(out, mode, args) for mode in MODES}
        full = runs["full"]
        if full[0]["phase"] != "running":
            raise RuntimeError(f"the checkpoint at step {args.save_at} was taken in phase "
                               f"{full[0]['phase']}; raise --save-at past the trials")
        rows = [{"mode": mode, "heldout_loss": runs[mode][0]["heldout_loss"],
                 "max_param_diff": 0.0 if mode == "full" else _max_diff(out, mode),
                 "algorithm": runs[mode][0]["algorithm"],
                 "load_s": max(r.get("load_s", 0.0) for r in runs[mode])} for mode in MODES]
    sizes = {"checkpoint_bytes": [r["checkpoint_bytes"] for r in full],
             "torch_only_bytes": [r["torch_only_bytes"] for r in full],
             "state_dict_s": [r["state_dict_s"] for r in full]}
    print(f"{'run':<14} {'held-out loss':>14} {'max |param diff|':>17} {'kept':>16} "
          f"{'load s':>7}")
    for row in rows:
        print(f"{row['mode']:<14} {row['heldout_loss']:>14.6f} {row['max_param_diff']:>17.3g} "
              f"{row['algorithm']!s:>16} {row['load_s']:>7.3f}")
    print(f"checkpoint bytes per rank {sizes['checkpoint_bytes']} (torch state only "
          f"{sizes['torch_only_bytes']}); state_dict() s per rank "
          f"{[round(s, 4) for s in sizes['state_dict_s']]}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"steps": args.steps, "save_at": args.save_at,
                                     "ratio": args.ratio, "rows": rows, **sizes}, indent=1)
                         + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
