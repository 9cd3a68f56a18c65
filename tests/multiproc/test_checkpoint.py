"""Exact checkpoints and reproducible runs, over real processes: 2 machines x 2 workers and a
parameter server on loopback, training with random-k and error feedback (on the workers and,
for PS Options, on the server).

- A fixed strategy file: two runs end bit-identical; a run resumed in new processes (new
  scheduler and server too) from every rank's step-k checkpoint ends bit-identical to the
  uninterrupted one, and checkpoints of another rank, world size or strategy are refused.
- ``Compression.espresso`` with dgc (DGC's recipe: momentum correction in the codec, the
  optimizer's momentum as velocities of the uncompressed biases): the resumed run takes the
  kept strategy from the checkpoint (no profiling, no trials) and ends bit-identical;
  ``ESPRESSO_STRATEGY`` pointed at the kept ``strategy.json`` runs that strategy from the
  first step.
"""

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

STEPS, SAVE_AT = 12, 7
# Espresso: 2 profiled steps, then at most 7 finalists x 2 trial steps: kept by step 16.
ESPRESSO_STEPS, ESPRESSO_SAVE_AT = 24, 18
# Short start-up phases, so that the strategy has settled before the checkpoint at step 18:
# profile 2, trials of 2 per finalist (3: steps 3-8), then the check of 2 steps per strategy
# it tries (the kept one, a fall-back, a re-plan: steps 9-14 at most). With the default 6 a
# fall-back checked at steps 15-20 could be in use at the save and lose after it, so the
# first run ended on another strategy than the checkpoint's (one CI run in three here).
ESPRESSO_ENV = {"ESPRESSO_PROFILE_STEPS": "2", "ESPRESSO_TRIAL_STEPS": "2",
                "ESPRESSO_CHECK_STEPS": "2"}

# One Option per tensor: server-side error feedback on the GPU and CPU backends (the CPU one
# after an intra-machine reduce-scatter), and a worker-only compressed all-gather.
OPTIONS = {
    "2.bias": "Comp(gpu) -> PushPullC(flat) -> Decomp(gpu)",
    "2.weight": "ReduceScatter(intra) -> Comp(cpu) -> PushPullC(inter) -> Decomp(cpu) -> "
                "Allgather(intra)",
    "0.bias": "Comp(gpu) -> AllgatherC(flat) -> Decomp(gpu)",
    "0.weight": "Comp(gpu) -> PushPullC(flat) -> Decomp(gpu)",
}


def _strategy_file(cluster, path: Path, options: dict[str, str]) -> Path:
    from byteps_espresso.strategy import Cluster, plan
    from byteps_espresso.strategy.options import Option

    base = plan(cluster.model_workload("checkpoint_worker"),
                Cluster.preset(2, 2, "pcie", 10, servers=1), "randomk",
                {"ratio": 0.25, "seed": 7}, algorithm="all-gpu")
    strategy = dataclasses.replace(base, options={n: Option.parse(o)
                                                  for n, o in options.items()})
    strategy.save(path)
    return path


def _run(cluster, out: Path, args: list[str], env: dict[str, str] | None = None) -> list[dict]:
    out.mkdir()
    with cluster.ps_job(machines=2, local_size=2, servers=1) as root:
        cluster.run_workers("checkpoint_worker.py", [str(out), *args], machines=2, local_size=2,
                            root_port=root, servers=1, timeout=240, extra_env=env)
    return [json.loads((out / f"run_{r}.json").read_text()) for r in range(4)]


def _params(out: Path) -> list[np.ndarray]:
    return [np.load(out / f"params_{r}.npy") for r in range(4)]


def _same_bits(a: Path, b: Path) -> None:
    for r, (x, y) in enumerate(zip(_params(a), _params(b), strict=True)):
        assert x.tobytes() == y.tobytes(), (
            f"rank {r}: parameters of {b.name} differ from {a.name}, max |diff| "
            f"{np.abs(x - y).max():.3g}")


@pytest.mark.timeout(600)
def test_strategy_file_runs_are_bit_identical_and_resume_exactly(tmp_path, cluster):
    path = _strategy_file(cluster, tmp_path / "strategy.json", OPTIONS)
    other = _strategy_file(cluster, tmp_path / "other.json", {
        **OPTIONS, "0.bias": "Comp(gpu) -> PushPullC(flat) -> Decomp(gpu)"})
    args = [str(path), str(STEPS), str(SAVE_AT)]
    first = _run(cluster, tmp_path / "first", args)
    _run(cluster, tmp_path / "second", args)
    _same_bits(tmp_path / "first", tmp_path / "second")  # reproducible with a strategy file
    params = _params(tmp_path / "first")
    assert all(p.tobytes() == params[0].tobytes() for p in params[1:])
    assert first[0]["server_state_keys"] > 0  # rank 0 saved the server's residuals
    assert first[0]["codec_slots"] == ["residual"]

    resumed = _run(cluster, tmp_path / "resumed",
                   [*args, str(tmp_path / "first"), str(other)])
    _same_bits(tmp_path / "first", tmp_path / "resumed")
    for r in range(4):
        later = {s: v for s, v in first[r]["losses"].items() if int(s) >= SAVE_AT}
        assert resumed[r]["losses"] == later, f"rank {r}: losses after the resume differ"
        refused = resumed[r]["refused"]
        assert f"holds rank {(r + 1) % 4}'s state" in refused["rank"]
        assert "this job is 2 x 2 (world size 4)" in refused["world"]
        assert "bucket '0.bias' ran Comp(gpu) -> AllgatherC(flat) -> Decomp(gpu) there" in \
            refused["strategy"]


@pytest.mark.timeout(600)
def test_espresso_resumes_with_the_checkpoint_strategy_and_the_kept_one_is_reusable(
        tmp_path, cluster):
    profile = tmp_path / "profile"
    args = ["espresso", str(ESPRESSO_STEPS), str(ESPRESSO_SAVE_AT)]
    first = _run(cluster, tmp_path / "first", args,
                 {**ESPRESSO_ENV, "ESPRESSO_PROFILE_OUT": str(profile)})
    # Profiling 50 steps would leave no step of a kept strategy before the end of the run:
    # the resumed run must take the checkpoint's strategy instead.
    resumed = _run(cluster, tmp_path / "resumed", [*args, str(tmp_path / "first")],
                   {**ESPRESSO_ENV, "ESPRESSO_PROFILE_STEPS": "50"})
    _same_bits(tmp_path / "first", tmp_path / "resumed")
    # What the checkpoint had to carry: the velocities of the uncompressed tensors, and
    # momentum correction's state (its two slots, nothing else) for what the codec compressed
    # up to the checkpoint. Which finalists compressed, in the trials and after, depends on
    # what measured fastest: on 2 shared cores one CI run in three kept an uncompressed
    # finalist throughout and held no codec state, and one run kept an uncompressed strategy
    # after compressing in its trials. The resume above is exact either way.
    assert first[0]["codec_slots"] in ([], ["accumulated", "velocity"]), first[0]
    assert first[0]["velocities"] > 0
    for r in range(4):
        assert resumed[r]["options"] == first[r]["options"] == first[0]["options"]
        later = {s: v for s, v in first[r]["losses"].items() if int(s) >= ESPRESSO_SAVE_AT}
        assert resumed[r]["losses"] == later, f"rank {r}: losses after the resume differ"

    kept = json.loads((profile / "strategy.json").read_text())
    assert {n: " -> ".join(o) for n, o in kept["options"].items()} == first[0]["options"]
    pinned = _run(cluster, tmp_path / "pinned", ["espresso", "2", "1"],
                  {**ESPRESSO_ENV, "ESPRESSO_STRATEGY": str(profile / "strategy.json")})
    assert all(p["options"] == first[0]["options"] for p in pinned)
