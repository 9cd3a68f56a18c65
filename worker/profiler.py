"""Profiling at start-up and planning: from measured iterations to a per-tensor Strategy.

For the first ``ESPRESSO_PROFILE_STEPS`` iterations the optimizer synchronizes uncompressed
and its hooks record when each gradient becomes ready. Then every rank calls
:meth:`EspressoSpec.plan`, which

1. builds the :class:`~byteps_espresso.strategy.Workload` from rank 0's ready times (backward
   order of the last profiled iteration; median gaps over the profiled iterations after the
   first, which includes warm-up);
2. probes the links: all-reduces of two sizes on the intra and inter groups (every machine and
   local rank at once, as in training) and, with servers, push/pulls of two sizes, inverted
   through the ring all-reduce model ``t = 2(k-1) a + 2(k-1)/k n/B`` (and ``t = 2a + 2n/B``
   for a push/pull) into latency ``a`` and bandwidth ``B``;
3. times the compressor on the model's own tensor sizes on both devices (torch backend on the
   training device, numba backend on the host) and fits
   :class:`~byteps_espresso.strategy.CompressorCosts`;
4. on rank 0 plans with the strategy engine, logs the one-screen summary, writes workload,
   cluster, costs and strategy JSON to ``ESPRESSO_PROFILE_OUT`` when set, and broadcasts the
   strategy as JSON bytes (no pickle); every rank rebuilds the same Strategy from them.
"""

from __future__ import annotations

import json
import logging
import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from byteps_espresso.worker.codecs import CodecPair
from byteps_espresso.worker.optimizer import CompressionSpec
from byteps_espresso.worker.session import Session

from byteps_espresso.strategy.options import Device, Option, Scope

__all__ = ["EspressoSpec", "StrategyFileSpec", "default_error_feedback", "measure_cluster",
           "measure_costs", "workload_from_ready_times"]

log = logging.getLogger(__name__)

# Biased codecs that need error feedback to converge (Karimireddy et al., "Error Feedback
# Fixes SignSGD", ICML 2019; Stich et al., "Sparsified SGD with Memory", NeurIPS 2018).
_NEEDS_EF = frozenset({"topk", "dgc", "efsignsgd", "onebit", "randomk"})

# Link probe sizes in float32 elements: a latency-bound and a bandwidth-bound message.
_PROBE_SMALL, _PROBE_LARGE = 256, 1 << 20
_PROBE_REPS = 5
# Compressor timing repetitions per size (median taken); sizes capped to keep start-up short.
_TIMING_REPS = 3
_MAX_TIMED_SIZES = 6


def default_error_feedback(compressor: str, params: Mapping[str, Any]) -> bool:
    """Error feedback on by default for biased sparsifiers and sign codecs (not scaled randomk)."""
    if compressor == "randomk" and params.get("scale", False):
        return False
    return compressor in _NEEDS_EF


def _codec(session: Session, compressor: str, params: Mapping[str, Any],
           error_feedback: bool | None) -> CodecPair:
    ef = default_error_feedback(compressor, params) if error_feedback is None else error_feedback
    return CodecPair(compressor, dict(params), error_feedback=ef, device=session.runtime.device)


# ---- workload ----------------------------------------------------------------------------------
def workload_from_ready_times(ready: Sequence[Mapping[str, float]], starts: Sequence[float],
                              numel: Mapping[str, int], model: str = "profiled") -> Any:
    """A Workload from per-iteration gradient ready times (perf_counter seconds).

    Args:
        ready: per iteration, {tensor name: time its gradient was ready}.
        starts: per iteration, when it began (the previous step's end).
        numel: element count per tensor.

    Returns:
        ``strategy.Workload`` in the backward order of the last iteration; ``forward_us`` is
        the median time from iteration start to the first gradient.
    """
    from byteps_espresso.strategy import TensorProfile, Workload

    usable = [i for i in range(len(ready)) if len(ready[i]) == len(numel)]
    if not usable:
        raise ValueError("no profiled iteration saw every gradient; are some parameters unused? "
                         "set ESPRESSO_PROFILE_STEPS higher or pass only used parameters")
    iters = usable[1:] or usable  # the first iteration includes warm-up
    order = sorted(numel, key=lambda n: ready[iters[-1]][n])
    gaps = {name: [] for name in order}
    forward = []
    for it in iters:
        times = ready[it]
        forward.append((times[order[0]] - starts[it]) * 1e6)
        prev = times[order[0]]
        for name in order:
            gaps[name].append(max(0.0, (times[name] - prev) * 1e6))
            prev = max(prev, times[name])
    tensors = tuple(TensorProfile(n, int(numel[n]), float(statistics.median(gaps[n])))
                    for n in order)
    return Workload(tensors, forward_us=max(1.0, float(statistics.median(forward))), model=model,
                    source="measured by byteps_espresso.worker.profiler")


# ---- links ---------------------------------------------------------------------------------------
def _time(fn: Any, reps: int) -> float:
    fn()  # warm-up (connections, allocations)
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples) * 1e6


def _invert(t_small: float, t_large: float, steps: float, volume: float) -> tuple[float, float]:
    """(latency us, Gbit/s) from t = steps*a + volume*n*4 bytes/B at the two probe sizes."""
    extra_bits = volume * (_PROBE_LARGE - _PROBE_SMALL) * 4 * 8
    dt = max(t_large - t_small, 1e-3)
    gbps = extra_bits / dt / 1e3
    latency = max(0.0, (t_small - volume * _PROBE_SMALL * 32 / (gbps * 1e3)) / max(steps, 1.0))
    return latency, gbps


def _probe_allreduce(session: Session, scope: Scope) -> tuple[float, float]:
    transport = session.runtime.transports[0]
    k = session.runtime.topology.size(scope)
    times = []
    for n in (_PROBE_SMALL, _PROBE_LARGE):
        x = torch.ones(n, device=session.runtime.device)
        times.append(_time(lambda x=x: transport.allreduce(scope, x), _PROBE_REPS))
    if k < 2:
        return 0.0, 1e4
    return _invert(times[0], times[1], 2 * (k - 1), 2 * (k - 1) / k)


def _probe_ps(session: Session) -> tuple[float, float]:
    ps = session.runtime.ps
    topo = session.runtime.topology
    times = []
    for n in (_PROBE_SMALL, _PROBE_LARGE):
        key = f"espresso.probe.{n}"
        ps.declare(key, n, list(range(topo.world_size)))  # type: ignore[union-attr]
        x = np.ones(n, dtype=np.float32)
        times.append(_time(lambda key=key, x=x: ps.push_pull(  # type: ignore[union-attr]
            key, x, ps.next_probe_round(key)), _PROBE_REPS))  # type: ignore[union-attr]
    latency, per_worker = _invert(times[0], times[1], 2, 2)
    # Every worker pushes and pulls through the servers at once.
    servers = max(1, session.runtime.cfg.num_servers)
    return latency, per_worker * topo.world_size / servers


def _copy_gbps(device: torch.device) -> float:
    x = torch.ones(_PROBE_LARGE, device=device)
    us = _time(lambda: x.to("cpu", copy=True), _PROBE_REPS)
    return _PROBE_LARGE * 32 / us / 1e3


def measure_cluster(session: Session) -> Any:
    """Probe intra, inter and PS links with small collectives (all ranks must call it).

    Returns:
        ``strategy.Cluster`` with the measured latencies and bandwidths.
    """
    from byteps_espresso.strategy import Cluster

    rt = session.runtime
    topo = rt.topology
    intra_lat, intra_gbps = _probe_allreduce(session, Scope.INTRA)
    inter_lat, inter_gbps = _probe_allreduce(session, Scope.INTER)
    servers = rt.cfg.num_servers
    server_gbps = 0.0
    if servers:
        _, server_gbps = _probe_ps(session)
    return Cluster(machines=topo.machines, gpus_per_machine=topo.local_size,
                   intra_gbps=intra_gbps, intra_latency_us=intra_lat, inter_gbps=inter_gbps,
                   inter_latency_us=inter_lat, servers=servers, server_gbps=server_gbps,
                   cpu_threads=rt.cfg.cpu_threads, h2d_gbps=_copy_gbps(rt.device),
                   intra_link="measured")


# ---- compressor costs ------------------------------------------------------------------------
def _timed_sizes(numels: Sequence[int]) -> list[int]:
    sizes = sorted(set(numels))
    if len(sizes) > _MAX_TIMED_SIZES:
        picks = np.linspace(0, len(sizes) - 1, _MAX_TIMED_SIZES).round().astype(int)
        sizes = [sizes[i] for i in sorted(set(picks.tolist()))]
    if len(sizes) < 2:
        sizes = sorted({*sizes, max(sizes[0] * 4, 4096) if sizes else 4096})
    return sizes


def measure_costs(codec: CodecPair, numels: Sequence[int], device: torch.device) -> Any:
    """Time compress and decompress on both devices for the model's tensor sizes.

    Returns:
        ``strategy.CompressorCosts`` fitted from the samples (per device, per op).
    """
    from byteps_espresso.strategy import CompressorCosts

    # Time the bare codec: error-feedback state must not be touched by the probes.
    bare = CodecPair(codec.name, codec.params, device=device)
    samples = []
    for n in _timed_sizes(numels):
        x = torch.randn(n, generator=torch.Generator().manual_seed(n)).to(device)
        for dev in (Device.GPU, Device.CPU):
            payload = bare.compress(dev, x, "espresso.probe", 0)
            comp_us = _time(lambda dev=dev, x=x: bare.compress(dev, x, "espresso.probe", 0),
                            _TIMING_REPS)
            dec_us = _time(lambda dev=dev, p=payload, n=n: bare.decompress(
                dev, p, n, "espresso.probe", 0), _TIMING_REPS)
            samples.append({"compressor": codec.name, "device": dev.value, "op": "compress",
                            "numel": n, "us": comp_us})
            samples.append({"compressor": codec.name, "device": dev.value, "op": "decompress",
                            "numel": n, "us": dec_us})
    return CompressorCosts.fit(samples, note=f"measured at start-up on {device} (gpu) and "
                               "the host (cpu) by byteps_espresso.worker.profiler",
                               params={codec.name: dict(codec.params)})


# ---- the compression specs -------------------------------------------------------------------
@dataclass(frozen=True)
class EspressoSpec(CompressionSpec):
    """``Compression.espresso(...)``: profile, then plan with the strategy engine."""

    compressor: str
    params: Mapping[str, Any] = field(default_factory=dict)
    error_feedback: bool | None = None
    algorithm: str = "espresso"
    constraints: Any | None = None

    def profile_steps(self, session: Session) -> int:
        return max(1, session.runtime.cfg.profile_steps)

    def codec(self, session: Session) -> CodecPair | None:
        return _codec(session, self.compressor, self.params, self.error_feedback)

    def plan(self, session: Session, tensors: Sequence[tuple[str, int]],
             profile: Any | None) -> tuple[dict[str, Option], list[str] | None]:
        from byteps_espresso.strategy import Strategy, plan

        rt = session.runtime
        numel = dict(tensors)
        cluster = measure_cluster(session)
        data: bytes | None = None
        if rt.topology.rank == 0:
            ready, starts = profile if profile is not None else ([], [])
            workload = workload_from_ready_times(ready, starts, numel)
            codec = self.codec(session)
            costs = measure_costs(codec, list(numel.values()), rt.device)  # type: ignore[union-attr]
            t0 = time.perf_counter()
            strategy = plan(workload, cluster, self.compressor, dict(self.params),
                            algorithm=self.algorithm, constraints=self.constraints, costs=costs)
            log.info("planned in %.1f ms:\n%s", (time.perf_counter() - t0) * 1e3,
                     strategy.summary())
            if rt.cfg.profile_out:
                _write_profile(Path(rt.cfg.profile_out), workload, cluster, costs, strategy)
            data = json.dumps(strategy.to_dict()).encode()
        data = rt.broadcast_bytes(data, 0)
        strategy = Strategy.from_dict(json.loads(data.decode()), "broadcast strategy")
        session.strategy = strategy
        return dict(strategy.options), list(strategy.workload.names)


def _write_profile(out: Path, workload: Any, cluster: Any, costs: Any, strategy: Any) -> None:
    out.mkdir(parents=True, exist_ok=True)
    workload.save(out / "workload.json")
    (out / "cluster.json").write_text(json.dumps(cluster.to_dict(), indent=1) + "\n")
    costs.save(out / "costs.json")
    strategy.save(out / "strategy.json")
    log.info("wrote the measured workload, cluster, costs and strategy to %s", out)


@dataclass(frozen=True)
class StrategyFileSpec(CompressionSpec):
    """``Compression.strategy(path)``: Options from a strategy planned offline."""

    path: str
    error_feedback: bool | None = None

    def _load(self, session: Session) -> Any:
        from byteps_espresso.strategy import Strategy

        strategy = Strategy.load(self.path)
        topo = session.runtime.topology
        c = strategy.cluster
        if c.world_size != topo.world_size:
            raise ValueError(
                f"{self.path} was planned for {c.machines} machines x {c.gpus_per_machine} "
                f"workers = {c.world_size}, but this job has {topo.machines} x "
                f"{topo.local_size} = {topo.world_size}; re-plan it with `espresso plan "
                f"--machines {topo.machines} --gpus-per-machine {topo.local_size}` or run "
                "with the matching DMLC_NUM_WORKER / BYTEPS_LOCAL_SIZE")
        if (c.machines, c.gpus_per_machine) != (topo.machines, topo.local_size):
            log.warning("%s was planned for %d x %d; this job is %d x %d", self.path,
                        c.machines, c.gpus_per_machine, topo.machines, topo.local_size)
        return strategy

    def codec(self, session: Session) -> CodecPair | None:
        strategy = self._load(session)
        if not any(o.is_compressed for o in strategy.options.values()):
            return None
        return _codec(session, strategy.compressor, strategy.params, self.error_feedback)

    def plan(self, session: Session, tensors: Sequence[tuple[str, int]],
             profile: Any | None) -> tuple[dict[str, Option], list[str] | None]:
        strategy = self._load(session)
        session.strategy = strategy
        names = {n for n, _ in tensors}
        order = [n for n in strategy.workload.names if n in names]
        return dict(strategy.options), order if len(order) == len(names) else None
