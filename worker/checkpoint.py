"""Exact checkpoints of a compressed run: what ``optimizer.state_dict()`` adds under ``"espresso"``.

Uncompressed data-parallel training is resumed exactly by the model's and the torch
optimizer's state alone. A compressed run also depends on

1. the compressors' state on this worker: error-feedback residuals and codec momenta, per
   compression name, on both devices (``CodecPair.state_dict``), or PowerSGD's error and
   warm-start Q per parameter (``LowRank.state_dict``);
2. the iteration counters per tensor or bucket (``Runtime.counters``): they number the PS
   rounds and seed the random draws (random-k indices, stochastic rounding);
3. the strategy in use: buckets, order and one Option per bucket. A job that planned at
   start-up (``Compression.espresso``) chose it from timings, so a resumed job takes the
   checkpoint's instead of profiling again; any other compression must run the same plan;
4. on rank 0, the servers' compressor state (server-side error feedback), read and restored
   through the parameter servers (``PSClient.server_state``).

The section is rank-specific (each rank's residuals differ): every rank saves its own
``state_dict()`` and loads its own file. Values are tensors, numbers and strings (nested
dicts of them; the strategy and plan as JSON text), so ``torch.load(weights_only=True)``
reads it. A checkpoint taken before the strategy was kept (during profiling or the trials)
holds no strategy: loading it restores the torch optimizer's state only, and the start-up
phase runs again.

Example:
    >>> path = f"ckpt.{bps.rank()}.pt"                                      # doctest: +SKIP
    >>> torch.save(opt.state_dict(), path)                                   # doctest: +SKIP
    >>> opt.load_state_dict(torch.load(path, weights_only=True))             # doctest: +SKIP
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["FORMAT", "KEY", "CheckpointError", "apply", "capture", "check"]

log = logging.getLogger(__name__)

KEY = "espresso"
FORMAT = "byteps-espresso-checkpoint"
VERSION = 1
_RUNNING = "running"  # the strategy is kept; "profiling" and "trials" come before
_FIELDS = ("rank", "machines", "local_size", "servers", "iteration", "skipped_steps", "phase",
           "compression", "plan", "strategy", "counters", "codec", "velocity")


class CheckpointError(ValueError):
    """A checkpoint does not fit this job; the message names what differs."""


def _phase(sync: Any) -> str:
    if sync.options is None:
        return "profiling"
    return "trials" if sync.trials is not None else _RUNNING


def _plan(sync: Any) -> dict[str, Any]:
    """The plan in use: backward order, buckets and one Option per bucket."""
    return {"order": list(sync.order), "buckets": [list(b.tensors) for b in sync.buckets],
            "options": {b.name: sync.options[b.name].names() for b in sync.buckets}}


def _compression(sync: Any) -> dict[str, Any]:
    codec = sync.codec
    if sync.lowrank is not None:  # PowerSGD keeps its own error feedback (a parameter)
        return {"compressor": "powersgd", "params": sync.lowrank.params,
                "error_feedback": bool(sync.lowrank.params["error_feedback"]),
                "correction": None}
    if codec is None:
        return {"compressor": None, "params": {}, "error_feedback": False, "correction": None}
    from byteps_espresso.kernels.momentum import MomentumCorrection

    from byteps_espresso.strategy.options import Device

    comp = codec.compressor(Device.GPU)
    correction = ({"momentum": comp.momentum, "clip_norm": comp.clip_norm,
                   "masking": comp.masking} if isinstance(comp, MomentumCorrection) else None)
    return {"compressor": codec.name, "params": dict(codec.params),
            "error_feedback": bool(codec.error_feedback), "correction": correction}


def _idle(sync: Any, what: str) -> None:
    if sync.handles or any(sync.count.values()):
        raise RuntimeError(f"{what} in the middle of an iteration (gradients are being "
                           "accumulated or synchronized); call it after optimizer.step()")


# ---- saving ----------------------------------------------------------------------------------
def capture(sync: Any) -> dict[str, Any]:
    """This rank's section of the checkpoint (see the module docstring).

    Raises:
        RuntimeError: called in the middle of an iteration.
        PSError: rank 0 could not read the servers' state.
    """
    _idle(sync, "optimizer.state_dict()")
    rt = sync.session.runtime
    topo = rt.topology
    phase = _phase(sync)
    strategy = sync.session.strategy if phase == _RUNNING else None
    out: dict[str, Any] = {
        "format": FORMAT, "version": VERSION, "rank": topo.rank, "machines": topo.machines,
        "local_size": topo.local_size, "servers": rt.cfg.num_servers,
        "iteration": sync.iteration, "skipped_steps": sync.skipped, "phase": phase,
        "compression": json.dumps(_compression(sync), sort_keys=True),
        "plan": json.dumps(_plan(sync)) if phase == _RUNNING else "",
        "strategy": json.dumps(strategy.to_dict()) if strategy is not None else "",
        "counters": dict(rt.counters),
        "codec": (sync.codec.state_dict() if sync.codec is not None
                  else sync.lowrank.state_dict() if sync.lowrank is not None else {}),
        # DGC's recipe: each parameter's velocity while its bucket goes uncompressed
        "velocity": {name: u.detach().to("cpu", copy=True) for name, u in sync.velocity.items()},
    }
    if topo.rank == 0 and rt.ps_client is not None:
        out["server_state"] = {
            key: {name: {slot: torch.from_numpy(a) for slot, a in slots.items()}
                  for name, slots in state.items()}
            for key, state in rt.ps_client.server_state().items()}
    return out


# ---- loading ---------------------------------------------------------------------------------
def check(sync: Any, saved: Mapping[str, Any]) -> tuple[Any | None, dict[str, Any] | None]:
    """Validate ``saved`` against this job before anything is changed.

    Returns:
        The checkpoint's Strategy when this job takes it (``Compression.espresso``), else
        None; and the Options per bucket to run (the plan's, with the buckets a compression
        error budget had switched to the fp32 Option), None for a checkpoint without one.

    Raises:
        CheckpointError: another format, world size, rank, server use, compressor or plan;
            the message names both sides and what to change.
        RuntimeError: called in the middle of an iteration.
    """
    _idle(sync, "optimizer.load_state_dict()")
    if not isinstance(saved, Mapping) or saved.get("format") != FORMAT:
        raise CheckpointError(f"the {KEY!r} entry of this state dict is not a {FORMAT} "
                              "section; pass what optimizer.state_dict() returned")
    if saved.get("version") != VERSION:
        raise CheckpointError(f"checkpoint section version {saved.get('version')!r}; this "
                              f"build reads version {VERSION}")
    missing = [f for f in _FIELDS if f not in saved]
    if missing:
        raise CheckpointError(f"the checkpoint section lacks {missing}; it was not written "
                              "by optimizer.state_dict() of this version")
    rt = sync.session.runtime
    topo = rt.topology
    machines, local = int(saved["machines"]), int(saved["local_size"])
    if (machines, local) != (topo.machines, topo.local_size):
        raise CheckpointError(
            f"this checkpoint was saved by a job of {machines} machines x {local} workers "
            f"(world size {machines * local}); this job is {topo.machines} x "
            f"{topo.local_size} (world size {topo.world_size}). Resume with "
            f"DMLC_NUM_WORKER={machines} and BYTEPS_LOCAL_SIZE={local}")
    if int(saved["rank"]) != topo.rank:
        raise CheckpointError(
            f"this checkpoint holds rank {saved['rank']}'s state and this process is rank "
            f"{topo.rank}; every rank saves its own optimizer.state_dict() (the residuals "
            "differ per rank) and loads its own file")
    servers = int(saved["servers"])
    if (servers > 0) != (rt.cfg.num_servers > 0):
        raise CheckpointError(
            f"this checkpoint was saved by a job with DMLC_NUM_SERVER={servers} and this job "
            f"has {rt.cfg.num_servers}; resume with parameter servers exactly when the "
            "checkpointed job had them")
    if saved["phase"] != _RUNNING:
        return None, None
    mine, theirs = _compression(sync), json.loads(saved["compression"])
    if mine != theirs:
        raise CheckpointError(
            f"this checkpoint was trained with {_describe(theirs)} and this job compresses "
            f"with {_describe(mine)}; resume with the same compression (and ESPRESSO_SEED)")
    theirs_plan = json.loads(saved["plan"])
    fp32 = sync.session.fp32.names()
    if sync.compression.takes_checkpoint_strategy and saved["strategy"]:
        from byteps_espresso.strategy import Strategy

        strategy = Strategy.from_dict(json.loads(saved["strategy"]), "the checkpoint's strategy")
        _check_plan(theirs_plan, {
            "order": [n for b in strategy.layout for n in b.tensors],
            "buckets": [list(b.tensors) for b in strategy.layout],
            "options": {n: o.names() for n, o in strategy.options.items()}}, fp32)
        return strategy, theirs_plan["options"]
    if _phase(sync) != _RUNNING:
        raise CheckpointError("this checkpoint ran a fixed plan but this job has not decided "
                              "its strategy yet; resume with the same compression")
    _check_plan(theirs_plan, _plan(sync), fp32)
    return None, theirs_plan["options"]


def _describe(compression: Mapping[str, Any]) -> str:
    if compression["compressor"] is None:
        return "no compression"
    return (f"{compression['compressor']} {json.dumps(compression['params'], sort_keys=True)}"
            f"{' with' if compression['error_feedback'] else ' without'} error feedback")


def _check_plan(theirs: Mapping[str, Any], mine: Mapping[str, Any], fp32: list[str]) -> None:
    """Raise naming the first difference between the checkpoint's plan and this job's (a
    bucket that ran the fp32 Option there was switched by a compression error budget)."""
    if theirs["buckets"] != mine["buckets"]:
        diff = next((i for i, (a, b) in enumerate(zip(theirs["buckets"], mine["buckets"],
                                                      strict=False)) if a != b),
                    min(len(theirs["buckets"]), len(mine["buckets"])))
        raise CheckpointError(
            f"this checkpoint ran another strategy: {len(theirs['buckets'])} buckets against "
            f"{len(mine['buckets'])} here, bucket {diff} holds "
            f"{_at(theirs['buckets'], diff)} there and {_at(mine['buckets'], diff)} here; resume "
            "with the checkpoint's strategy (Compression.espresso takes it from the "
            "checkpoint; a strategy file must be the same)")
    for name, steps in theirs["options"].items():
        if mine["options"].get(name) != steps and not (steps == fp32 and name in mine["options"]):
            raise CheckpointError(
                f"this checkpoint ran another strategy: bucket {name!r} ran "
                f"{' -> '.join(steps)} there and {' -> '.join(mine['options'].get(name, []))} "
                "here; resume with the checkpoint's strategy (Compression.espresso takes it "
                "from the checkpoint; a strategy file must be the same)")


def _at(buckets: list[list[str]], i: int) -> str:
    return str(buckets[i][:3]) if i < len(buckets) else "nothing"


def apply(sync: Any, saved: Mapping[str, Any],
          checked: tuple[Any | None, dict[str, Any] | None]) -> None:
    """Restore what :func:`check` accepted (``checked`` is what it returned): strategy and
    Options, counters, compressor state, DGC recipe velocities, iteration and, on rank 0, the
    servers' state."""
    from byteps_espresso.strategy.options import Option

    strategy, options = checked
    rt = sync.session.runtime
    if saved["phase"] != _RUNNING:
        log.warning("this checkpoint is from iteration %d, before the strategy was kept (%s): "
                    "only the torch optimizer's state is restored and the start-up phase runs "
                    "again, so the resumed run differs from an uninterrupted one. Checkpoint "
                    "after the trials, or pin the strategy with ESPRESSO_STRATEGY",
                    int(saved["iteration"]), saved["phase"])
        return
    if strategy is not None:
        sync.adopt(strategy)
    if options is not None:
        sync.options = {name: Option.parse(steps) for name, steps in options.items()}
    rt.counters.update({str(k): int(v) for k, v in saved["counters"].items()})
    if sync.codec is not None:
        sync.codec.load_state_dict(saved["codec"])
    elif sync.lowrank is not None:
        sync.lowrank.load_state_dict(saved["codec"], sync.device)
    sync.velocity = {name: t.detach().to(sync.device, copy=True)
                     for name, t in saved["velocity"].items()}
    sync.iteration = int(saved["iteration"])
    sync.skipped = int(saved["skipped_steps"])
    server_state = saved.get("server_state")
    if server_state and rt.ps_client is not None:
        rt.ps_client.restore_server_state({
            key: {name: {slot: t.detach().cpu().numpy() for slot, t in slots.items()}
                  for name, slots in state.items()}
            for key, state in server_state.items()})
