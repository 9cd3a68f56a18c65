"""Profiling at start-up and planning: from measured iterations to a per-tensor Strategy.

For the first ``ESPRESSO_PROFILE_STEPS`` iterations the optimizer synchronizes uncompressed
and its hooks record when each gradient becomes ready. During the first of them
:class:`LaneProbes` measures every cost the planner needs *inside the engine's lanes*: right
after the last gradient of an iteration is handed over, one lane times the compressor on the
model's own tensor sizes on both devices (torch backend on the training device, numba
backend through the host pool), beside the synchronization, under the contention its Options
will run in (other workers sharing the host and still finishing their backward, the
interpreter lock); once the synchronization is over, another lane runs a round of link probes
on idle links (all-reduces on the intra groups and local rank 0's inter group, push/pulls
through the servers: the first round of two sizes, the later ones of the latency-bound size
only; the PS path's of that one alone where the iterations' own push/pulls give the
bandwidth). ``step()`` waits for them, so the next
forward pass runs alone and the ready times stay clean. The latencies that training sees are
then fitted to the profiled iterations' own steps (:func:`in_training_latency`; probes taken
while training is paused saw 0.4-0.8 ms per collective where training saw 1-7 ms on a host
whose cores the local workers share; see BENCHMARKS.md, "Worker runtime"). The first
``max(_PROBE_ROUNDS, lanes)`` profiled
iterations probe, one lane each, a lane's first round opening with an untimed call per size
and path (:func:`probe_lanes`); the compressor is timed within a time budget per round.

After the last profiled iteration every rank calls :meth:`EspressoSpec.plan`, which

1. builds the :class:`~byteps_espresso.strategy.Workload` from rank 0's ready times (backward
   order of the last profiled iteration; median gaps over the profiled iterations after the
   first, which includes warm-up);
2. inverts the median probe times through the ring all-reduce model
   ``t = 2(k-1) a + 2(k-1)/k n/B`` (and ``t = 2a + 2n/B`` for a push/pull) into latency ``a``
   and bandwidth ``B`` per path, scales the exchange collectives' and the PS path's latency to
   what the profiled iterations' own steps took (:func:`in_training_latency`), and fits
   :class:`~byteps_espresso.strategy.CompressorCosts` to the median compressor timings (with
   fewer than two profiled iterations it probes once more with training paused instead);
3. on rank 0 plans with the strategy engine, logs the one-screen summary, writes workload,
   cluster, costs and strategy JSON to ``ESPRESSO_PROFILE_OUT`` when set, and broadcasts the
   strategy as JSON bytes (no pickle); every rank rebuilds the same Strategy from them.
"""

from __future__ import annotations

import fnmatch
import json
import logging
import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from byteps_espresso.worker.check import step_medians
from byteps_espresso.worker.codecs import CodecPair
from byteps_espresso.worker.lowrank import LowRank, cost_samples
from byteps_espresso.worker.lowrank import measure_costs as lowrank_costs
from byteps_espresso.worker.optimizer import HOOK_PLAN, CompressionSpec, Plan, StartupProfile
from byteps_espresso.worker.session import (
    Session,
    every_rank,
    slowest_across_ranks,
    span_across_ranks,
)
from byteps_espresso.worker.trials import MODEL_ERROR

from byteps_espresso.strategy.buckets import CANDIDATE_CAPS, MiB
from byteps_espresso.strategy.costs import EXCHANGES, INTER, INTRA, CompressedSizes, Pricer, link_of
from byteps_espresso.strategy.options import ROUNDING, Device, Kind, Option, Scope
from byteps_espresso.strategy.tree import PARTNER

__all__ = ["EspressoSpec", "LaneProbes", "StrategyFileSpec", "default_error_feedback",
           "fit_compute", "fit_latency", "in_training_latency", "measure_cluster", "measure_costs",
           "probe_lanes", "read_profile", "ready_offsets", "step_prices", "workload_from_offsets",
           "workload_from_ready_times"]

log = logging.getLogger(__name__)

# Biased codecs that need error feedback to converge (Karimireddy et al., "Error Feedback
# Fixes SignSGD", ICML 2019; Stich et al., "Sparsified SGD with Memory", NeurIPS 2018).
_NEEDS_EF = frozenset({"topk", "dgc", "efsignsgd", "onebit", "randomk"})

# Link probe sizes in float32 elements: a latency-bound and a bandwidth-bound message (the
# large one as probed with training paused).
_PROBE_SMALL, _PROBE_LARGE = 256, 1 << 20
# The lanes' bandwidth-bound probe: 1 MiB, 8.4 ms at 1 Gbit/s (0.34 ms at 25 Gbit/s), ten
# times the latencies probed on the emulated links here. At 4 MiB the probes were most of the
# start-up on slow links (the main job at 1 Gbit/s: 9.1 s of profiling for 5 iterations of
# 87 ms, BENCHMARKS.md "End-to-end"). Sizing it to a time budget from the warm-up round
# failed: that round's first collectives are slow, so the probes shrank to 16 KiB, which the
# latency drowned (a 1 Gbit/s link read as 120 Tbit/s).
_PROBE_LANES = 1 << 18
_PROBE_REPS = 5
# Profiled iterations that run probes: at least one per lane (the lanes take turns), at least
# two in all; the later profiled iterations only record ready times and the
# fp32 steps' times, free of probes beside them. Probing in every profiled iteration made
# each cost 0.3-0.7 s on the emulated 1 Gbit/s cluster against fp32 iterations of 0.11 s
# (the main job); with two timed rounds the profiling as a whole took as long (2.4-3.6 s
# against 2.4-3.0 s, BENCHMARKS.md "End-to-end"): the heavier rounds spend what the later
# iterations save.
_PROBE_ROUNDS = 2
# Timed calls per probe size in each probing iteration (medians over all of them are taken).
# The first round is 1 + 2 x _LANE_REPS calls per path, the first an untimed small call; the
# later ones time only the latency-bound size (1 + _LANE_REPS calls): their large calls were
# the bulk of the second round (41 of 58 ms on the LSTM at 1 Gbit/s, 30 of them the inter
# all-reduce) and the first round's two samples price the bandwidth.
_LANE_REPS = 2
# The profiled iterations' own push/pulls price the PS path's bandwidth (only the small PS
# probe runs, for the latency) when one of them moves at least this many float32 elements
# per worker (256 KiB: 2.1 ms at 1 Gbit/s, where the probed PS latencies were 0.5-1.2 ms;
# the LSTM of the main job pushes 129,000 elements of its 258,000-element bucket from each
# worker after the machine's ReduceScatter). They then measure the bandwidth under the
# traffic the Options will share. The large PS probes were the costliest on slow links
# (1 MiB push/pulls of every worker through one server link, twice per round), and read
# less bandwidth than training got (the fp32 push/pulls ran faster than the probes'
# bandwidth alone predicted: PS latency factor x0.00 in the main job).
_TRAFFIC_MIN = 1 << 16
# Compressor timings per size in each timed round (medians over the rounds are taken).
_CODEC_REPS = 1
# Compressor timing repetitions per size (median taken); sizes capped to keep start-up short.
_TIMING_REPS = 3
_MAX_TIMED_SIZES = 6
# Seconds of compressor timing per probing round (and for the servers' profile at planning):
# the smallest and largest size always, then others until a round has spent this
# (CompressorCosts fits t = a + b n, so two sizes price the rest).
# Without it the torch codec on a CPU training device (efsignsgd: 78 ns per element, 39 ms
# per call at 500K elements) made a round over six sizes take 160-570 ms in the main job,
# against fp32 iterations of 0.11 s (one round ran behind the warm-up's link probes).
_CODEC_BUDGET_S = 0.08
# Alternatives predicted within this factor of the planned strategy's time are measured in trials
# (worker/trials.py): on a host whose cores the workers share the model has been 1.6-2.4x
# optimistic and has inverted rankings (in the main job, `make main`, it predicted the plan at
# 27.2 ms and cpu-only at 34.3 ms, which measured 65.9 and 57.6 ms); the start-up budget
# prices an unmeasured finalist with the same factor.
_TRIAL_WITHIN = MODEL_ERROR


def default_error_feedback(compressor: str, params: Mapping[str, Any]) -> bool:
    """Error feedback on by default for biased sparsifiers and sign codecs (not scaled randomk)."""
    if compressor == "randomk" and params.get("scale", False):
        return False
    return compressor in _NEEDS_EF


def excluded_names(params: Mapping[str, Any], patterns: Sequence[str] | None,
                   compressor: str | None = None) -> frozenset[str]:
    """The parameters kept out of compression: those whose name matches one of ``patterns``
    (``fnmatch`` globs, e.g. ``*.bias``), or by default (``None``) those of at most one
    dimension: biases and normalization scales, which DGC's and PowerSGD's reference
    implementations send uncompressed (their elementwise error is a large share of a small
    tensor, and they save almost nothing). None by default for a ``compressor`` that only
    rounds (fp16, :data:`~byteps_espresso.strategy.options.ROUNDING`): its error is a
    rounding of each element whatever the tensor's size, and DDP's fp16 hook casts every
    gradient."""
    if patterns is None:
        if compressor in ROUNDING:
            return frozenset()
        return frozenset(name for name, p in params.items() if p.dim() <= 1)
    return frozenset(name for name in params
                     if any(fnmatch.fnmatchcase(name, pat) for pat in patterns))


def _codec(session: Session, compressor: str, params: Mapping[str, Any],
           error_feedback: bool | None) -> CodecPair:
    ef = default_error_feedback(compressor, params) if error_feedback is None else error_feedback
    rt = session.runtime
    return CodecPair(compressor, dict(params), error_feedback=ef, device=rt.device,
                     device_kernels=rt.cfg.device_kernels)


# ---- workload ----------------------------------------------------------------------------------
def ready_offsets(ready: Sequence[Mapping[str, float]], starts: Sequence[float],
                  names: Sequence[str]) -> np.ndarray:
    """Per iteration and tensor, microseconds from the iteration's start to the gradient.

    Args:
        ready: per iteration, {tensor name: time its gradient was ready} (perf_counter s).
        starts: per iteration, when it began (the previous step's end).
        names: the tensors, in a fixed order (the columns).

    Returns:
        float64 array (iterations x tensors); NaN where a gradient was not seen.
    """
    # Every rank profiled the same iterations (len(starts) - 1), even where a rank's hooks
    # saw nothing in one of them, so the rows line up across ranks.
    rows = len(starts) - 1 if starts else len(ready)
    out = np.full((rows, len(names)), np.nan)
    for it, times in enumerate(ready[:rows]):
        for j, name in enumerate(names):
            if name in times:
                out[it, j] = (times[name] - starts[it]) * 1e6
    return out


def workload_from_offsets(offsets: np.ndarray, names: Sequence[str],
                          numel: Mapping[str, int], model: str = "profiled",
                          shapes: Mapping[str, Sequence[int]] | None = None) -> Any:
    """A Workload from :func:`ready_offsets` (one rank's, or the maximum over ranks).

    With the maximum over ranks a gradient counts as ready when the slowest worker has it,
    which is when a collective on it can complete; on a host whose cores the local workers
    share, the workers drift ms apart within an iteration.

    Returns:
        ``strategy.Workload`` in the backward order of the last usable iteration;
        ``forward_us`` is the median time from iteration start to the first gradient and
        each gap the median over the usable iterations after the first (warm-up);
        each tensor with its shape where ``shapes`` gives it.
    """
    from byteps_espresso.strategy import TensorProfile, Workload

    def shape(name: str) -> tuple[tuple[int, ...], ...] | None:
        return None if shapes is None else (tuple(int(d) for d in shapes[name]),)

    usable = [i for i in range(offsets.shape[0]) if not np.isnan(offsets[i]).any()]
    if not usable:
        raise ValueError("no profiled iteration saw every gradient; are some parameters unused? "
                         "set ESPRESSO_PROFILE_STEPS higher or pass only used parameters")
    iters = usable[1:] or usable  # the first iteration includes warm-up
    order = np.argsort(offsets[iters[-1]], kind="stable")
    ordered = np.maximum.accumulate(offsets[iters][:, order], axis=1)
    gaps = np.diff(ordered, axis=1, prepend=ordered[:, :1])
    median_gaps = np.median(gaps, axis=0)
    tensors = tuple(TensorProfile(names[j], int(numel[names[j]]), float(g), shape(names[j]))
                    for j, g in zip(order, median_gaps, strict=True))
    return Workload(tensors, forward_us=max(1.0, float(np.median(ordered[:, 0]))), model=model,
                    source="measured by byteps_espresso.worker.profiler")


def workload_from_ready_times(ready: Sequence[Mapping[str, float]], starts: Sequence[float],
                              numel: Mapping[str, int], model: str = "profiled") -> Any:
    """A Workload from one rank's ready times (see :func:`ready_offsets`)."""
    names = list(numel)
    return workload_from_offsets(ready_offsets(ready, starts, names), names, numel, model)


# ---- links ---------------------------------------------------------------------------------------
def _time(fn: Any, reps: int) -> float:
    fn()  # warm-up (connections, allocations)
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples) * 1e6


def _invert(t_small: float, t_large: float, steps: float, volume: float, *,
            n_small: int = _PROBE_SMALL, n_large: int = _PROBE_LARGE) -> tuple[float, float]:
    """(latency us, Gbit/s) from t = steps*a + volume*n*4 bytes/B at the two probe sizes
    (``n_small`` and ``n_large`` float32 elements took ``t_small`` and ``t_large`` us).

    Where the large probe took no longer than the small one (noise on a fast link: on
    loopback 2.72 ms for 256 floats against 1.51 ms for 1 MiB once) the difference says
    nothing of the bandwidth, which then is the lower bound the large probe alone gives (all
    of its time spent on bytes), not the 8 Pbit/s a clamped difference made of it."""
    dt = t_large - t_small
    if dt > 0:
        gbps = volume * (n_large - n_small) * 32 / dt / 1e3
    else:
        gbps = volume * n_large * 32 / max(t_large, 1e-3) / 1e3
    latency = max(0.0, (t_small - volume * n_small * 32 / (gbps * 1e3)) / max(steps, 1.0))
    return latency, gbps


def _probes(topo: Any, scope: Scope) -> bool:
    """Whether this rank's ``scope`` group runs link probes. Every machine's intra group
    does; of the ``local_size`` inter groups, which share each machine's NIC, only local rank
    0's: side by side they split the NIC and queued each other's small probes behind their
    large ones (a 1 Gbit/s link read as 0.5-0.8 Gbit/s per group with 2-3 ms of latency), and
    the cost model divides the NIC among the groups itself (strategy/costs.py)."""
    return topo.size(scope) >= 2 and (scope is Scope.INTRA or topo.index(Scope.INTRA) == 0)


def _paused_link_times(session: Session) -> dict[tuple[str, int], float]:
    """Median microseconds per (path, probe size), probed while training is paused: all-reduces
    on the intra and inter groups (:func:`_probes`) and, with servers, push/pulls (all ranks
    must call it)."""
    rt = session.runtime
    transport = rt.transports[0]
    times = {}
    for scope in (Scope.INTRA, Scope.INTER):
        if not _probes(rt.topology, scope):
            continue
        for n in (_PROBE_SMALL, _PROBE_LARGE):
            x = torch.ones(n, device=rt.device)
            times[(scope.value, n)] = _time(
                lambda x=x, scope=scope: transport.allreduce(scope, x), _PROBE_REPS)
    return times | _paused_ps_times(session)


def _paused_ps_times(session: Session) -> dict[tuple[str, int], float]:
    """Median microseconds of push/pulls per probe size, training paused (every rank calls
    it; none without servers)."""
    rt = session.runtime
    ps = rt.ps
    times = {}
    if rt.cfg.num_servers and ps is not None:
        for n in (_PROBE_SMALL, _PROBE_LARGE):
            key = f"espresso.probe.{n}"
            ps.declare(key, n, list(range(rt.topology.world_size)))
            x = np.ones(n, dtype=np.float32)
            times[("ps", n)] = _time(
                lambda key=key, x=x: ps.push_pull(key, x, ps.next_probe_round(key)), _PROBE_REPS)
    return times


def _two_sizes(times: Mapping[tuple[str, int], float], path: str) -> tuple[float, float, int, int]:
    """(t_small, t_large, n_small, n_large): ``path``'s smallest and largest probe."""
    sizes = sorted(n for p, n in times if p == path)
    small, large = sizes[0], sizes[-1]
    return times[(path, small)], times[(path, large)], small, large


def _cluster(topo: Any, servers: int, cpu_threads: int, times: Mapping[tuple[str, int], float],
             h2d_gbps: float, *, lanes: int) -> Any:
    """``strategy.Cluster`` from probe times per (path, size in elements), each path's
    smallest and largest probe inverted through the ring all-reduce model per scope and the
    push/pull model for the servers; ``lanes``: the executor's lanes per worker. Only a rank
    whose groups probed every path can build it (rank 0 does: :func:`_probes`).

    Raises:
        ValueError: a path of the cluster was not probed on this rank.
    """
    from byteps_espresso.strategy import Cluster

    lat: dict[str, float] = {}
    gbps: dict[str, float] = {}
    for scope in (Scope.INTRA, Scope.INTER):
        k = topo.size(scope)
        if k < 2:  # a group of one: nothing crosses a link
            lat[scope.value], gbps[scope.value] = 0.0, 1e4
            continue
        if not any(path == scope.value for path, _ in times):
            raise ValueError(f"no {scope.value} link probes on this rank; the cluster is "
                             "built where they ran (rank 0)")
        t_small, t_large, n_small, n_large = _two_sizes(times, scope.value)
        lat[scope.value], gbps[scope.value] = _invert(
            t_small, t_large, 2 * (k - 1), 2 * (k - 1) / k, n_small=n_small, n_large=n_large)
    server_gbps, server_lat = 0.0, None
    if servers:
        t_small, t_large, n_small, n_large = _two_sizes(times, "ps")
        server_lat, per_worker = _invert(t_small, t_large, 2, 2, n_small=n_small,
                                         n_large=n_large)
        # Every worker pushes and pulls through the servers at once.
        server_gbps = per_worker * topo.world_size / servers
    return Cluster(machines=topo.machines, gpus_per_machine=topo.local_size,
                   intra_gbps=gbps["intra"], intra_latency_us=lat["intra"],
                   inter_gbps=gbps["inter"], inter_latency_us=lat["inter"],
                   servers=servers, server_gbps=server_gbps, cpu_threads=cpu_threads,
                   h2d_gbps=h2d_gbps, intra_link="measured", server_latency_us=server_lat,
                   lanes=lanes)


def _copy_gbps(device: torch.device) -> float:
    x = torch.ones(_PROBE_LARGE, device=device)
    us = _time(lambda: x.to("cpu", copy=True), _PROBE_REPS)
    return _PROBE_LARGE * 32 / us / 1e3


def measure_cluster(session: Session) -> Any:
    """Probe intra, inter and PS links while training is paused (all ranks must call it).

    Returns:
        ``strategy.Cluster`` with the measured latencies and bandwidths on rank 0, None on
        the others (their inter groups do not probe, :func:`_probes`).
    """
    rt = session.runtime
    times = _paused_link_times(session)
    if rt.topology.rank != 0:
        return None
    return _cluster(rt.topology, rt.cfg.num_servers, rt.cfg.cpu_threads, times,
                    _copy_gbps(rt.device), lanes=rt.lanes)


def in_training_latency(cluster: Any, option: Option, numels: Sequence[int],
                        measured_us: np.ndarray, *, compressor: str,
                        params: Mapping[str, Any], costs: Any) -> tuple[Any, dict[str, float]]:
    """The cluster with its exchange and PS latencies scaled to what the profiled steps took.

    The probes run after backward; the Options run during it, on the cores backward uses.
    Each communication step of the profiled ``option`` (the fp32 path every tensor ran while
    profiling) was timed in its lane, and the model prices it as a latency part plus the rest
    (bandwidth, server work). The factors are fitted, each by least squares over its steps
    of ``measured = rest + factor x latency part``, every step's error relative to its price
    at the probes' latency, at least 1: ``exchange`` over the steps in which every member
    sends and receives (``Cluster.exchange_latency``: the all-reduce, reduce-scatter and
    all-gather kinds, whose cost the contention multiplies), one factor per link
    (``inter_exchange``: ``Cluster.inter_exchange_latency``; a link whose exchanges the
    profiled path does not run keeps its probed latency), ``ps`` over the push/pulls
    (``server_latency_us``). Relative errors let the latency-bound steps (a small bucket's)
    decide the factor: a bandwidth-bound step's latency part is a sliver of its time and its
    residual mostly the bandwidth's error. The median over steps of (measured - rest) /
    latency part, which weighed them alike, gave factors of 0 to 19 across the end-to-end
    runs of 2049aa5 (BENCHMARKS.md, "End-to-end"). Rooted collectives keep the probed
    latency: with every intra latency scaled by the exchanges' factor, a Reduce -> PushPull
    -> Broadcast plan (one member per machine works, the other waits) was predicted at 57.8
    ms and ran at 44.5 (BENCHMARKS.md, "Worker runtime").

    The floor: the probes ran with training paused, so their latency is the least a step
    pays in training. A profiled step faster than its priced rest says the bandwidth or the
    servers' work is overpriced, not that the latency vanished. In the end-to-end runs of
    2049aa5, 18 of 28 PS fits came out below 1 and 7 at 0; with 0 the PS path priced a
    256-float push/pull that took 2.2 ms at almost nothing, and a plan of eight sequential
    PowerSGD push/pulls per iteration, predicted at 38.8 ms, ran at 71-77 ms.

    Args:
        cluster: the probed cluster.
        option: the Option every tensor ran while profiling.
        numels: the tensors' element counts (rows of ``measured_us``).
        measured_us: (tensors x steps) each step's time: on a collective every member
            finishes together, so the member that arrived last (the minimum over ranks)
            measures the step itself.
        compressor, params, costs: what the cluster is priced with.

    Returns:
        (cluster, {"exchange": factor, "ps": factor}) for the kinds of step measured.
    """
    return fit_latency(cluster, [(option, int(n), measured_us[j]) for j, n in enumerate(numels)],
                       compressor=compressor, params=params, costs=costs)


_PUSH_PULLS = frozenset({Kind.PUSH_PULL, Kind.PUSH_PULL_C})
# Which steps each latency factor is fitted over (their kinds, and the link they cross; None:
# either), and the Cluster field it scales.
_LATENCY_KINDS = {
    "exchange": ("exchange_latency", EXCHANGES, INTRA),
    "inter_exchange": ("inter_exchange_latency", EXCHANGES, INTER),
    "ps": ("server_latency_us", _PUSH_PULLS, None),
    "rooted": ("rooted_latency", frozenset(
        k for k in Kind if not k.is_compute and k not in EXCHANGES | _PUSH_PULLS), None),
}


def _floats(values: np.ndarray) -> list[float | None]:
    """JSON numbers of a float array, None for NaN (a step that was not timed)."""
    return [None if np.isnan(v) else float(v) for v in values]


def step_prices(cluster: Any, option: Option, numels: Sequence[int], *, compressor: str,
                sizes: Any, costs: Any) -> np.ndarray:
    """Each step's price (us) of ``option`` on tensors of ``numels`` elements on ``cluster``
    (tensors x steps)."""
    return Pricer(cluster, compressor, sizes, costs, list(numels)).tasks(option).per_step(
        len(option.steps))


def _by_option(runs: Sequence[tuple[Option, int, np.ndarray]]) \
        -> dict[Option, tuple[list[int], np.ndarray]]:
    """The timed runs grouped by Option, to price each Option once: (element counts,
    (runs x steps) measured us)."""
    grouped: dict[Option, list[tuple[int, np.ndarray]]] = {}
    for option, numel, measured in runs:
        grouped.setdefault(option, []).append((numel, np.asarray(measured, dtype=float)))
    return {o: ([n for n, _ in got], np.stack([m for _, m in got])) for o, got in grouped.items()}


def _normal_equation(part: np.ndarray, rest: np.ndarray, measured: np.ndarray,
                     weight: np.ndarray) -> tuple[float, float]:
    """The two sums of the weighted least squares of ``measured = rest + factor x part`` over
    the entries with a part and a measurement: factor = first / second."""
    ok = (part > 0) & np.isfinite(measured)
    w, p = weight[ok], part[ok]
    return float(np.sum(w * p * (measured[ok] - rest[ok]))), float(np.sum(w * p * p))


def fit_latency(cluster: Any, runs: Sequence[tuple[Option, int, np.ndarray]], *,
                compressor: str, params: Mapping[str, Any], costs: Any,
                kinds: Sequence[str] = ("exchange", "inter_exchange", "ps"),
                unmeasured: bool = False) -> tuple[Any, dict[str, float]]:
    """The cluster with the latencies of ``kinds`` scaled to what ``runs`` took.

    Each run is (Option, elements, each step's measured us; NaN where none was measured).
    Per kind, one factor by least squares over every run's steps of that kind, of
    ``measured = rest + factor x latency part`` on each step's error relative to its price
    (see :func:`in_training_latency`), at least 1. ``exchange`` scales
    ``Cluster.exchange_latency`` (the exchanges over the intra link), ``inter_exchange``
    ``Cluster.inter_exchange_latency`` (those over the inter link), ``ps`` the PS path's
    latency (``server_latency_us``, made explicit), ``rooted`` ``Cluster.rooted_latency``.
    With every machine on one host, the two links' exchanges share a factor where only one
    link's were timed. A kind no step measured keeps its probed latency (factor 1); with
    ``unmeasured`` it takes the largest factor fitted (the host's message latency: a plan
    priced on this cluster must not favour a kind no step checked). Returns (cluster,
    {kind: factor}) for the kinds fitted.
    """
    sizes = CompressedSizes(compressor, dict(params))
    kinds = [what for what in kinds if what != "ps" or cluster.servers]

    def per_step(c: Any, option: Option, numels: list[int]) -> np.ndarray:
        return step_prices(c, option, numels, compressor=compressor, sizes=sizes, costs=costs)

    # The PS path's latency explicit, so it stays apart from the collectives'.
    cluster = replace(cluster, server_latency_us=cluster.ps_latency_us if cluster.servers
                      else None)
    sums = {what: [0.0, 0.0] for what in kinds}
    for option, (numels, measured) in _by_option(runs).items():
        base = per_step(cluster, option, numels)
        for what in kinds:
            name, members, link = _LATENCY_KINDS[what]
            cols = [i for i, st in enumerate(option.steps) if st.kind in members
                    and (link is None or link_of(cluster, st.scope) == link)]
            if not cols:
                continue
            latency = (base - per_step(replace(cluster, **{name: 0.0}), option, numels))[:, cols]
            price = base[:, cols]
            num, den = _normal_equation(latency, price - latency, measured[:, cols],
                                        1.0 / np.where(price > 0, price, 1.0) ** 2)
            sums[what][0] += num
            sums[what][1] += den
    factors = {what: max(1.0, num / den) for what, (num, den) in sums.items() if den > 0}
    exchanges = ("exchange", "inter_exchange")
    if cluster.shared_host and all(what in sums for what in exchanges):
        # Every machine on one host (espresso-launch --local): both links are its loopback,
        # so a link whose exchanges no step ran takes the other's factor.
        fitted = [factors[what] for what in exchanges if what in factors]
        if len(fitted) == 1:
            factors.update(dict.fromkeys(exchanges, fitted[0]))
    top = max(factors.values(), default=1.0)
    scaled = cluster
    for what, factor in ({what: factors.get(what, top) for what in kinds} if unmeasured
                         else factors).items():
        name = _LATENCY_KINDS[what][0]
        scaled = replace(scaled, **{name: getattr(scaled, name) * factor})
    return scaled, factors


def fit_compute(cluster: Any, runs: Sequence[tuple[Option, int, np.ndarray]], *,
                compressor: str, params: Mapping[str, Any],
                costs: Any) -> tuple[Any, dict[str, float]]:
    """The cost profile with its compression lines scaled to what ``runs``' compute steps
    took, one factor per device.

    Each run is (Option, elements, each step's measured us; NaN where none was measured).
    Per device (``gpu``: the training device, ``cpu``: the host threads), one factor by
    least squares over every Comp and Decomp step on it of ``measured = rest + factor x
    kernel part`` (``rest``: what the step's price holds besides the device's kernels, the
    host steps' copies), at least 1: the kernels were timed alone before the first step,
    and in training they share their device with the backward pass, the other local
    workers and the lanes (on the emulated cluster, four workers on two cores, a checked
    efsignsgd Decomp took 13.6 ms against 3.3 ms priced). The squares are absolute, not
    relative as :func:`fit_latency`'s: the large kernels, not the small ones' fixed costs,
    make an iteration. A device no step ran takes the largest factor fitted, as
    fit_latency's unmeasured kinds do: a plan priced on the refitted profile must not favour
    a device no step checked. Every compressor's lines on a device (the job's and the
    partner's) scale alike; the servers' are not timed by the check and stay. Returns
    (costs, {device: factor}) for the devices fitted."""
    sizes = CompressedSizes(compressor, dict(params))
    sums = {d.value: [0.0, 0.0] for d in Device}
    for option, (numels, measured) in _by_option(runs).items():
        base = step_prices(cluster, option, numels, compressor=compressor, sizes=sizes,
                           costs=costs)
        for device in {st.device.value for st in option.steps if st.kind.is_compute}:
            cols = [j for j, st in enumerate(option.steps)
                    if st.kind.is_compute and st.device.value == device]
            rest = step_prices(cluster, option, numels, compressor=compressor, sizes=sizes,
                               costs=costs.scaled({device: 0.0}))[:, cols]
            kernel = base[:, cols] - rest
            num, den = _normal_equation(kernel, rest, measured[:, cols], np.ones_like(kernel))
            sums[device][0] += num
            sums[device][1] += den
    factors = {device: max(1.0, num / den) for device, (num, den) in sums.items() if den > 0}
    if not factors:
        return costs, factors
    top = max(factors.values())
    return costs.scaled({d.value: factors.get(d.value, top) for d in Device}), factors


# ---- compressor costs ------------------------------------------------------------------------
def _timed_sizes(numels: Sequence[int]) -> list[int]:
    sizes = sorted(set(numels))
    if len(sizes) > _MAX_TIMED_SIZES:
        picks = np.linspace(0, len(sizes) - 1, _MAX_TIMED_SIZES).round().astype(int)
        sizes = [sizes[i] for i in sorted(set(picks.tolist()))]
    if len(sizes) < 2:
        sizes = sorted({*sizes, max(sizes[0] * 4, 4096) if sizes else 4096})
    return sizes


def _within_budget(sizes: Sequence[int], budget_s: float | None) -> Any:
    """Yield ``sizes`` until ``budget_s`` seconds have passed since the first (None: all of
    them): the smallest and the largest first, always (the widest span for the fit of
    t = a + b n, whose slope prices the large tensors), then the rest from the smallest up."""
    ordered = sorted(set(sizes))
    ordered = ordered[:1] + ordered[-1:] + ordered[1:-1] if len(ordered) > 1 else ordered
    t0 = time.perf_counter()
    for i, n in enumerate(ordered):
        if i >= 2 and budget_s is not None and time.perf_counter() - t0 > budget_s:
            return
        yield n


def _isolated_samples(codec: CodecPair, numels: Sequence[int], device: torch.device,
                      devices: dict[Device, str], budget_s: float | None = None,
                      ) -> list[dict[str, Any]]:
    """Timings of the bare codec, one call at a time; ``devices`` maps the device run on to
    the profile entry the sample is for; sizes as :func:`_within_budget` yields them."""
    # Time the bare codec: error-feedback state must not be touched by the probes.
    bare = codec.bare()
    steady = bare.steady_step  # after any warm-up: what the steady state runs
    samples: list[dict[str, Any]] = []
    for n in _within_budget(_timed_sizes(numels), budget_s):
        x = torch.randn(n, generator=torch.Generator().manual_seed(n)).to(device)
        for dev, entry in devices.items():
            payload = bare.compress(dev, x, "espresso.probe", steady)
            comp_us = _time(lambda dev=dev, x=x: bare.compress(dev, x, "espresso.probe",
                                                               steady), _TIMING_REPS)
            dec_us = _time(lambda dev=dev, p=payload, n=n: bare.decompress(
                dev, p, n, "espresso.probe", steady), _TIMING_REPS)
            samples.append({"compressor": codec.name, "device": entry, "op": "compress",
                            "numel": n, "us": comp_us})
            samples.append({"compressor": codec.name, "device": entry, "op": "decompress",
                            "numel": n, "us": dec_us})
    return samples


def measure_costs(codec: CodecPair, numels: Sequence[int], device: torch.device) -> Any:
    """Time compress and decompress on both devices for the model's tensor sizes.

    Returns:
        ``strategy.CompressorCosts`` fitted from the samples (per device, per op).
    """
    from byteps_espresso.strategy import CompressorCosts

    samples = _isolated_samples(codec, numels, device, {Device.GPU: "gpu", Device.CPU: "cpu"})
    return CompressorCosts.fit(samples, note=f"measured at start-up on {device} (gpu) and "
                               "the host (cpu) by byteps_espresso.worker.profiler",
                               params={codec.name: dict(codec.params)})


# ---- probes inside the lanes, during the profiled iterations --------------------------------
def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def probe_lanes(iteration: int, lanes: int) -> tuple[int, ...]:
    """The lanes that run the link probes in profiled iteration ``iteration`` (none: that
    iteration runs no probes).

    One lane per round, the lanes taking turns, in the first ``max(_PROBE_ROUNDS, lanes)``
    iterations: probes on several lanes at once would split the links between them and read
    as less bandwidth. A lane's first round starts with one untimed call per size and path
    (its groups' first collectives, its PS keys: 0.15-0.5 s on the emulated 1 Gbit/s
    cluster). A whole warm-up round on every lane before the timed ones cost the main job's
    first iteration 0.5-0.9 s more than fp32's (BENCHMARKS.md, "End-to-end").
    """
    return (iteration % lanes,) if iteration < max(_PROBE_ROUNDS, lanes) else ()


def _push_pulls(fp32: Option, sizes: Sequence[int], size: Any) -> list[tuple[int, np.ndarray]]:
    """(step index, elements each worker pushes and pulls per bucket of ``sizes``) for every
    uncompressed PushPull of ``fp32``: the bucket's shard where the step runs on one (after a
    ReduceScatter: 1/local size of it), as the pricer counts it."""
    from byteps_espresso.strategy.program import compile_option, shard_numel

    numel = np.asarray(sizes, dtype=np.float64)
    return [(op.index, shard_numel(numel, op.shards, size))
            for op in compile_option(fp32).ops if op.kind is Kind.PUSH_PULL]


def ps_from_traffic(fp32: Option, sizes: Sequence[int], size: Any) -> bool:
    """Whether the profiled iterations' push/pulls price the PS path's bandwidth: ``fp32``
    (the Option they run, on buckets of ``sizes`` elements) pushes and pulls at least
    ``_TRAFFIC_MIN`` elements uncompressed in one step. ``size``: elements per scope's group
    (``Topology.size``)."""
    return any(moved.size and moved.max() >= _TRAFFIC_MIN
               for _, moved in _push_pulls(fp32, sizes, size))


def traffic_times(fp32: Option, sizes: Sequence[int], steps_us: np.ndarray | None,
                  size: Any) -> dict[tuple[str, int], float]:
    """``{("ps", elements): us}``: the median time of the fp32 push/pull steps per size each
    worker moves (``steps_us``: buckets of ``sizes`` x steps, as
    :meth:`LaneProbes.step_times` gives it; NaN skipped)."""
    if steps_us is None:
        return {}
    per: dict[int, list[float]] = {}
    for i, moved in _push_pulls(fp32, sizes, size):
        for n, us in zip(moved, steps_us[:, i], strict=True):
            if np.isfinite(us):
                per.setdefault(int(n), []).append(float(us))
    return {("ps", n): statistics.median(us) for n, us in per.items()}


class LaneProbes:
    """Link and compressor probes run in the engine's lanes during profiled iterations.

    :meth:`issue` is called by the optimizer right after it hands over the last gradient of
    each profiled iteration, so the compressor's timings run next to the fp32
    synchronization, and :meth:`issue_links` once that synchronization is over, on every
    rank at the same point of the lanes' order (collectives must be issued in the same order
    everywhere), in the iterations :func:`probe_lanes` names. The planner uses the medians
    over the rounds.

    Args:
        session: the process's session (topology, servers, device, host pool).
        codec: the job's compressor (None: links only).
        numels: the model's tensor sizes (the compressor is timed on up to
            ``_MAX_TIMED_SIZES`` of them).
        traffic: elements per bucket the profiled iterations synchronize on the fp32 path;
            where :func:`ps_from_traffic` holds, their push/pulls price the PS path instead
            of probes.
        low_rank: a low-rank compressor's (parameters, the model's parameter shapes), whose
            matrix products are timed instead of a codec (``worker.lowrank.cost_samples``).
    """

    def __init__(self, session: Session, codec: CodecPair | None, numels: Sequence[int],
                 traffic: Mapping[str, int] | None = None,
                 low_rank: tuple[Mapping[str, Any], Sequence[Sequence[int]]] | None = None,
                 ) -> None:
        rt = session.runtime
        self.fp32 = session.fp32
        # The same on every rank (the same layout and Option), so the probes stay in step.
        self.ps_from_traffic = bool(rt.cfg.num_servers) and ps_from_traffic(
            self.fp32, list((traffic or {}).values()), rt.topology.size)
        self.topology = rt.topology
        self.lanes = rt.lanes
        self.device = rt.device
        self.servers = rt.cfg.num_servers
        self.cpu_threads = rt.cfg.cpu_threads
        self.codec = None if codec is None else codec.bare()
        self.low_rank = low_rank
        self.links: dict[tuple[str, int], list[float]] = {}
        self.compressor: dict[tuple[str, str, int], list[float]] = {}
        self.handles: list[Any] = []
        self.rounds = 0
        # Lane seconds per (what, profiled iteration), for the start-up's breakdown.
        self.spent: dict[tuple[str, int], float] = {}
        # What :meth:`cluster` inverted: us per (path, elements), and where the PS's came from.
        self.medians: dict[tuple[str, int], float] = {}
        # And the fp32 steps it was given: (elements per bucket, us per bucket and step).
        self.steps: tuple[list[int], list[list[float | None]]] = ([], [])
        self.ps_source = "probes"
        # The kernels' timings alone and the copy bandwidth (:meth:`time_alone`), None until
        # taken.
        self.alone: list[dict[str, Any]] | None = None
        self.h2d_gbps: float | None = None
        self._probe = {n: torch.ones(n, device=rt.device) for n in (_PROBE_SMALL, _PROBE_LANES)}
        self._host = {n: np.ones(n, dtype=np.float32) for n in (_PROBE_SMALL, _PROBE_LANES)}
        self._timed = {n: torch.randn(n, generator=torch.Generator().manual_seed(n)).to(rt.device)
                       for n in (_timed_sizes(numels) if codec is not None else [])}
        # The profiled iterations' own steps, timed where they run (see in_training_latency).
        self._executors = list(session.plain.executors)
        for ex in self._executors:
            ex.timings = []

    def close(self) -> None:
        """Stop timing the lanes' steps (the profile is no longer needed)."""
        for ex in self._executors:
            ex.timings = None

    # ---- issuing -----------------------------------------------------------------------------
    def issue(self, engine: Any, iteration: int) -> None:
        """Queue the compressor's timings of a probing iteration in a lane, beside the fp32
        synchronization (same call on every rank, after its last bucket)."""
        # The compressor needs no warm-up: the optimizer loaded its kernels when it was built
        # (CodecPair.load_kernels). It runs on the lane the iteration's link probes leave free.
        if self.codec is not None and probe_lanes(iteration, engine.lanes):
            self.handles.append(engine.call(iteration + 1, self._spending(
                "compressor", iteration, self._codec), "espresso.probe.codec"))
        elif self.low_rank is not None and probe_lanes(iteration, engine.lanes):
            self.handles.append(engine.call(iteration + 1, self._spending(
                "compressor", iteration, self._low_rank_products), "espresso.probe.lowrank"))

    def issue_links(self, engine: Any, iteration: int) -> None:
        """Queue one round of link probes in a lane, once the iteration's synchronization is
        over (same call on every rank). Beside it they queued behind its traffic on the
        shaped links: the small all-reduce between machines took 5.5-17 ms where the link has
        no latency of its own, and a 1 Gbit/s link read as 0.9-2.1 Gbit/s, a 0.25 Gbit/s one
        as 0.19-0.20 (BENCHMARKS.md, "End-to-end"). The latencies training sees are fitted to
        its own steps afterwards (:func:`in_training_latency`)."""
        lanes = probe_lanes(iteration, engine.lanes)
        if not lanes:
            return
        self.rounds += 1
        for lane in lanes:
            first = iteration < engine.lanes  # the lanes take turns from iteration 0
            self.handles.append(engine.call(lane, self._spending(
                "links", iteration, lambda ex, lane=lane, first=first: self._links(
                    ex, lane, first, bandwidth=iteration == 0)), "espresso.probe.links"))

    def wait(self, timeout: float) -> None:
        """Wait for every probe queued so far (raises a probe's error)."""
        for handle in self.handles:
            handle.wait(timeout)
        self.handles.clear()

    @property
    def complete(self) -> bool:
        """Whether at least one round was measured."""
        return self.rounds > 0

    def record(self) -> dict[str, Any]:
        """The link times :meth:`cluster` inverted (us per path and elements), how many timed
        calls each median is of and every call's time in the order taken (so that another
        statistic of the probes can be scored offline against what the strategies measured),
        every compressor timing in the lanes (``codec_calls_us``: device, op, elements), the
        PS path's source, the profiled fp32 steps' times (what :func:`in_training_latency`
        fits, so a profile can be fitted again offline) and the lanes' seconds, as
        ``probes.json`` in ``ESPRESSO_PROFILE_OUT``."""
        links: dict[str, dict[str, float]] = {}
        for (path, n), us in sorted(self.medians.items()):
            links.setdefault(path, {})[str(n)] = us
        samples: dict[str, dict[str, int]] = {}
        calls: dict[str, dict[str, list[float]]] = {}
        for (path, n), times in sorted(self.links.items()):
            samples.setdefault(path, {})[str(n)] = len(times)
            calls.setdefault(path, {})[str(n)] = [float(us) for us in times]
        numels, steps_us = self.steps
        codec: dict[str, dict[str, dict[str, list[float]]]] = {}
        for (dev, op, n), times in sorted(self.compressor.items()):
            codec.setdefault(dev, {}).setdefault(op, {})[str(n)] = [float(us) for us in times]
        return {"links_us": links, "link_samples": samples, "link_calls_us": calls,
                "codec_calls_us": codec, "ps_source": self.ps_source,
                "fp32_steps": {"option": str(self.fp32), "numels": numels, "us": steps_us},
                "lane_seconds": {f"{what}/{it}": sec
                                 for (what, it), sec in sorted(self.spent.items())}}

    def spent_text(self) -> str:
        """``"links 0.31 + 0.25 + 0.22 s, compressor 0.12 + 0.10 s"``: lane seconds per
        profiled iteration (lanes run side by side, so these overlap)."""
        parts = []
        for what in ("links", "compressor"):
            per = {}
            for (w, it), sec in sorted(self.spent.items()):
                if w == what:
                    per[it] = per.get(it, 0.0) + sec
            if per:
                parts.append(f"{what} " + " + ".join(f"{sec:.2f}" for sec in per.values())
                             + " s")
        return ", ".join(parts) or "none"

    # ---- the probes (lane threads) -----------------------------------------------------------
    def _spending(self, what: str, iteration: int, fn: Any) -> Any:
        """``fn`` (a lane call), its wall time added to :attr:`spent`."""
        def timed(ex: Any) -> None:
            t0 = time.perf_counter()
            try:
                fn(ex)
            finally:
                key = (what, iteration)
                self.spent[key] = self.spent.get(key, 0.0) + time.perf_counter() - t0

        return timed

    def _timed_call(self, fn: Any, pool: Any = None) -> tuple[Any, float]:
        """(fn(), microseconds); in ``pool`` when given, as the executor runs cpu steps."""
        t0 = time.perf_counter()
        out = pool.submit(fn).result() if pool is not None else fn()
        _synchronize(self.device)
        return out, (time.perf_counter() - t0) * 1e6

    def _links(self, ex: Any, lane: int, first: bool, bandwidth: bool) -> None:
        # An untimed small call on each path absorbs the members' skew (how far apart they
        # reached this point, which is not a link cost); the timed calls that follow it start
        # together, since each collective ends at about the same time on every member. On a
        # lane's first round every size it probes gets an untimed call (first collectives,
        # PS keys). Only the first round (``bandwidth``) times the bandwidth-bound size.
        small = self._probe[_PROBE_SMALL]
        for scope in (Scope.INTRA, Scope.INTER):
            if not _probes(self.topology, scope):
                continue
            sizes = self._probe if bandwidth else {_PROBE_SMALL: small}
            for x in sizes.values() if first else (small,):
                ex.transport.allreduce(scope, x)
            for _ in range(_LANE_REPS):
                for n, x in sizes.items():
                    _, us = self._timed_call(
                        lambda x=x, scope=scope: ex.transport.allreduce(scope, x))
                    self.links.setdefault((scope.value, n), []).append(us)
        if self.servers and ex.ps is not None:
            def key(n: int) -> str:  # a lane's rounds follow its own order
                return f"espresso.probe.lane{lane}.{n}"

            # With the bandwidth from the training's push/pulls, the latency-bound size only.
            sizes = self._host if bandwidth and not self.ps_from_traffic \
                else {_PROBE_SMALL: self._host[_PROBE_SMALL]}
            for n in sizes:
                ex.ps.declare(key(n), n, list(range(self.topology.world_size)))
            for n, x in sizes.items() if first else ((_PROBE_SMALL, sizes[_PROBE_SMALL]),):
                ex.ps.push_pull(key(n), x, ex.ps.next_probe_round(key(n)))
            for _ in range(_LANE_REPS):
                for n, x in sizes.items():
                    _, us = self._timed_call(lambda n=n, x=x: ex.ps.push_pull(
                        key(n), x, ex.ps.next_probe_round(key(n))))
                    self.links.setdefault(("ps", n), []).append(us)

    def _codec(self, ex: Any) -> None:
        codec = self.codec
        assert codec is not None
        steady = codec.steady_step  # after any warm-up: what the steady state runs
        for n in _within_budget(list(self._timed), _CODEC_BUDGET_S):
            x = self._timed[n]
            for _ in range(_CODEC_REPS):
                for dev in (Device.GPU, Device.CPU):
                    pool = ex.cpu_pool if dev is Device.CPU else None
                    payload, comp = self._timed_call(
                        lambda dev=dev, x=x: codec.compress(dev, x, "espresso.probe", steady),
                        pool)
                    _, dec = self._timed_call(lambda dev=dev, p=payload, n=n: codec.decompress(
                        dev, p, n, "espresso.probe", steady), pool)
                    self.compressor.setdefault((dev.value, "compress", n), []).append(comp)
                    self.compressor.setdefault((dev.value, "decompress", n), []).append(dec)

    def _low_rank_products(self, ex: Any) -> None:
        assert self.low_rank is not None
        params, shapes = self.low_rank
        for x in cost_samples(params, shapes, self.device, _CODEC_BUDGET_S):
            self.compressor.setdefault((x["device"], x["op"], x["numel"]), []).append(x["us"])

    # ---- results -----------------------------------------------------------------------------
    def step_times(self, names: Sequence[str], steps: int) -> np.ndarray:
        """Median wall time (us) of each step of each tensor's Option over the profiled
        iterations after its first (tensors x steps; NaN where none was recorded). Stops the
        recording."""
        medians: dict[tuple[str, int], float] = {}
        for ex in self._executors:
            medians |= step_medians(ex.timings or ())
            ex.timings = None
        out = np.full((len(names), steps), np.nan)
        for j, name in enumerate(names):
            for i in range(steps):
                out[j, i] = medians.get((name, i), np.nan)
        return out

    def cluster(self, sizes: Sequence[int], steps_us: np.ndarray, session: Session) -> Any:
        """``strategy.Cluster`` from the medians of the probes and, where
        :attr:`ps_from_traffic`, of the profiled push/pulls: ``steps_us`` as
        :meth:`step_times` gives it for the buckets of ``sizes`` elements, the same on every
        rank (the minimum over ranks). The PS path is inverted from the latency probe and the
        largest push/pull. Should no push/pull of at least ``_TRAFFIC_MIN`` elements have been
        timed, every rank probes the PS path with training paused. Every rank calls it; the
        cluster is built on rank 0 (the others return None: :func:`_probes`), with the copy
        bandwidth :meth:`time_alone` measured (measured now where it has not run)."""
        medians = {key: statistics.median(us) for key, us in self.links.items()}
        self.steps = ([int(n) for n in sizes], [[float(us) if np.isfinite(us) else None
                                                 for us in row] for row in steps_us])
        self.ps_source = "probes"
        if self.ps_from_traffic:
            ps = traffic_times(self.fp32, sizes, steps_us, self.topology.size)
            if max((n for _, n in ps), default=0) < _TRAFFIC_MIN:
                ps = _paused_ps_times(session)
                medians = {k: v for k, v in medians.items() if k[0] != "ps"}
                self.ps_source = "paused probes"
            else:
                self.ps_source = "latency probe + profiled push/pulls"
                ps = dict([max(ps.items(), key=lambda kv: kv[0][1])])
            medians |= ps
        self.medians = medians
        if self.topology.rank != 0:
            return None
        if self.h2d_gbps is None:
            self.h2d_gbps = _copy_gbps(self.device)
        return _cluster(self.topology, self.servers, self.cpu_threads, medians, self.h2d_gbps,
                        lanes=self.lanes)

    def time_alone(self, numels: Sequence[int]) -> None:
        """Time what :meth:`costs` prices from the kernels alone, before the first step (on
        the rank that plans): the ``server`` profile (the numba kernels as the PS servers run
        them: the lanes' ``cpu`` timings include the workers' contention, which the servers'
        own processes do not share) and the intra-machine partner of mixed Options. Neither
        depends on the profile. Timed at planning instead, while every rank waited, they
        took about 30 ms of the last profiled iteration (a third of a 1 Gbit/s LSTM
        iteration; the numba kernels' first load included); here they follow the planner's
        kernels. The copy bandwidth between the device and the host is measured here too
        (about 10 ms of that iteration on a CPU device)."""
        self.h2d_gbps = _copy_gbps(self.device)
        codec = self.codec
        if codec is None:
            return
        samples = []
        if self.servers:
            samples += _isolated_samples(codec, numels, self.device, {Device.CPU: "server"},
                                         _CODEC_BUDGET_S)
        topo = self.topology
        if topo.machines > 1 and topo.local_size > 1 and codec.name != PARTNER:
            # mixed Options (the partner inside the machine) are priced only with its profile
            samples += _isolated_samples(codec.partner(PARTNER), numels, self.device,
                                         {Device.GPU: "gpu", Device.CPU: "cpu"},
                                         _CODEC_BUDGET_S)
        self.alone = samples

    def costs(self, numels: Sequence[int]) -> Any:
        """``strategy.CompressorCosts`` fitted to the median timings in the lanes, plus what
        :meth:`time_alone` measured (timed now where it has not run).

        Each size is timed once in each of the first ``_PROBE_ROUNDS`` probing iterations, so
        the median is the mean of two calls, and one slow call (the lane shares its process
        with the fp32 traffic and its cores with the other ranks) priced the transformer's
        largest bucket (1-2.4M elements) as if a kernel took 24-81 ns an element in 7 of 38
        transformer profiles on the emulated cluster (at most 2.3 ns in the 83 other
        profiles; the fp16 cast timed alone: 0.25 ns). Fitting the least call instead
        planned EFSignSGD on the transformer at 1 Gbit/s slower (median 198.0 against 173.3
        ms over four alternating rounds; BENCHMARKS.md, "Exchange latency per link; the
        kernels' lane timings"): the mean of two stays, and ``probes.json`` keeps every call
        (:meth:`record`) so that another statistic can be scored offline."""
        from byteps_espresso.strategy import CompressorCosts

        name = "powersgd" if self.low_rank is not None else self.codec.name  # type: ignore
        samples = [{"compressor": name, "device": dev, "op": op, "numel": n,
                    "us": statistics.median(us)}
                   for (dev, op, n), us in sorted(self.compressor.items())]
        if self.low_rank is not None:  # its products alone: no numba kernels, no partner
            return CompressorCosts.fit(
                samples, note=f"PowerSGD's products timed in the lanes during the profiled "
                f"iterations on {self.device}, in multiply-adds; by "
                "byteps_espresso.worker.profiler", params={name: dict(self.low_rank[0])})
        codec = self.codec
        assert codec is not None
        if self.alone is None:
            self.time_alone(numels)
        return CompressorCosts.fit([*samples, *(self.alone or [])],
                                   note=f"measured in the lanes during the profiled "
                                   f"iterations on {self.device} (gpu) and the host pool (cpu); "
                                   "server: the numba kernels alone; by "
                                   "byteps_espresso.worker.profiler",
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
    exclude: tuple[str, ...] | None = None
    # DGC's recipe (``{"clip_norm": ...}``): momentum correction, clipping and masking move
    # into the codec and the optimizer's momentum before communication; None: not used.
    recipe: Mapping[str, Any] | None = None
    takes_checkpoint_strategy = True
    # What rank 0 planned from, for the check's re-plan (:meth:`replan`), per model (the
    # frozenset of its gradients' names): (workload, costs, apart, caps).
    _planned: dict[frozenset[str], tuple[Any, Any, frozenset[str], tuple[int, ...]]] = field(
        default_factory=dict, init=False, compare=False, repr=False)

    def profile_steps(self, session: Session) -> int:
        return max(1, session.runtime.cfg.profile_steps)

    def excluded(self, session: Session, params: Mapping[str, Any]) -> frozenset[str]:
        patterns = self.exclude
        if patterns is None and session.runtime.cfg.exclude is not None:
            patterns = session.runtime.cfg.exclude
        return excluded_names(params, patterns, self.compressor)

    @property
    def low_rank(self) -> bool:
        """PowerSGD: planned per bucket, run by :class:`LowRank` around a dense Option."""
        from byteps_espresso.strategy.lowrank import is_lowrank

        return is_lowrank(self.compressor)

    def codec(self, session: Session) -> CodecPair | None:
        if self.low_rank:
            return None
        return _codec(session, self.compressor, self.params, self.error_feedback)

    def lowrank(self, session: Session, shapes: Mapping[str, torch.Size]) -> LowRank | None:
        return LowRank.of_job(session, self.params, shapes) if self.low_rank else None

    def probes(self, session: Session, numels: Sequence[int], traffic: Mapping[str, int],
               shapes: Mapping[str, Sequence[int]] | None = None) -> LaneProbes | None:
        # The fp32 steps' timings keep the iterations after the first: one would leave none.
        if self.profile_steps(session) < 2:
            return None
        low_rank = (dict(self.params), list((shapes or {}).values())) if self.low_rank \
            else None
        probes = LaneProbes(session, self.codec(session), numels, traffic, low_rank=low_rank)
        if session.runtime.topology.rank == 0:
            kernels_s, trees_s = self._load_planner(session)
            t0 = time.perf_counter()
            probes.time_alone(numels)
            log.info("loaded the planner's kernels in %.2f s and this cluster's trees in "
                     "%.2f s, timed the kernels alone in %.2f s, before the first step",
                     kernels_s, trees_s, time.perf_counter() - t0)
        return probes

    def _load_planner(self, session: Session) -> tuple[float, float]:
        """Rank 0 (which plans) loads the planner now, before the first step, as the probes
        load the codec's kernels: its numba kernels, and this cluster's trees (the Options,
        their programs and twins, under the finalists' restrictions), by planning a model of
        two gradients. Both are paid once per process, like an import, and neither depends
        on what the profile measures. At planning time every rank waited for them: the
        kernels were most of a first plan's 250-310 ms in the main job (7 ms with them
        loaded), the trees 120-230 ms of a first plan's CPU (BENCHMARKS.md, "Prices from a
        task table"). In a thread beside the profiled iterations the loading slowed those by
        40-150 ms each (it is mostly Python, under the lock). Returns the seconds each
        took."""
        from byteps_espresso.strategy import Cluster, CompressorCosts
        from byteps_espresso.strategy.context import load_kernels
        from byteps_espresso.strategy.planner import plan_bucketed

        rt = session.runtime
        t0 = time.perf_counter()
        load_kernels()
        loaded = time.perf_counter()
        topo = rt.topology
        cluster = Cluster.preset(topo.machines, topo.local_size, "pcie", 10.0,
                                 servers=rt.cfg.num_servers, cpu_threads=rt.cfg.cpu_threads,
                                 lanes=rt.lanes, shared_host=rt.shared_host,
                                 host_device=rt.device.type == "cpu")
        numel = {"espresso.warm.a": 1 << 16, "espresso.warm.b": 1 << 10}
        shapes = {"espresso.warm.a": (256, 256), "espresso.warm.b": (32, 32)}
        workload = workload_from_offsets(np.zeros((1, 2)), list(numel), numel, shapes=shapes)
        # Nominal costs (1 us per thousand elements): the trees do not depend on them, and
        # a compressor without a shipped profile is priced from the probes' timings later.
        devices = ("gpu",) if self.low_rank else ("gpu", "cpu", "server")
        costs = CompressorCosts.fit(
            {"compressor": c, "device": d, "op": op, "numel": n, "us": 1.0 + n / 1e3}
            for c in (self.compressor, PARTNER) for d in devices
            for op in ("compress", "decompress") for n in (1e3, 1e6))
        plan_bucketed(workload, cluster, self.compressor, dict(self.params),
                      within=_TRIAL_WITHIN if self._trials(session) else None,
                      algorithm=self.algorithm, constraints=self.constraints, costs=costs)
        return loaded - t0, time.perf_counter() - loaded

    def plan(self, session: Session, tensors: Sequence[tuple[str, int]],
             profile: Any | None) -> Plan:
        from byteps_espresso.strategy import Strategy
        from byteps_espresso.strategy.planner import plan_bucketed

        rt = session.runtime
        numel = dict(tensors)
        names = list(numel)
        ready, starts = (profile.ready, profile.starts) if profile is not None else ([], [])
        offsets = slowest_across_ranks(session, ready_offsets(ready, starts, names))
        probes = profile.probes if profile is not None else None
        in_lanes = probes is not None and probes.complete
        fp32_slowest, fp32_fastest, fp32_cpu = _fp32_iterations(session, profile,
                                                                probes is not None)
        # The profiled iterations ran the fp32 path per bucket (every gradient's own when the
        # profile names none).
        profiled = dict(profile.buckets) if profile is not None and profile.buckets else numel
        if in_lanes:  # the last member to reach a step measured it: the minimum over ranks
            steps_us, _ = span_across_ranks(
                session, probes.step_times(list(profiled), len(session.fp32.steps)))
        # Paused probes are collectives too: every rank takes them, or none does. Rank 0,
        # which plans, gets the cluster.
        cluster = (probes.cluster(list(profiled.values()), steps_us, session) if in_lanes
                   else measure_cluster(session))
        data: bytes | None = None
        if rt.topology.rank == 0:
            # shared_host: the fp32 baseline's path; local_server_share: the push/pull bytes
            # that stay off a machine's link; host_device: cpu steps share the cores of the
            # training device.
            cluster = cluster.with_(shared_host=rt.shared_host,
                                    local_server_share=rt.local_server_share,
                                    host_device=rt.device.type == "cpu")
            shapes = profile.shapes if profile is not None and profile.shapes else None
            workload = workload_from_offsets(offsets, names, numel, shapes=shapes)
            codec = self.codec(session)
            if self.low_rank and not (in_lanes and probes.compressor):
                costs = lowrank_costs(self.params, list((shapes or {}).values()), rt.device)
            else:
                costs = probes.costs(list(numel.values())) if in_lanes else measure_costs(
                    codec, list(numel.values()), rt.device)  # type: ignore[arg-type]
            if in_lanes:
                cluster, factors = in_training_latency(
                    cluster, session.fp32, list(profiled.values()), steps_us,
                    compressor=self.compressor, params=self.params, costs=costs)
                log.info("probes in the lanes: %s; PS path from the %s", probes.spent_text(),
                         probes.ps_source)
                log.info("latency in training vs the probes: %s", ", ".join(
                    f"{path} x{f:.2f}" for path, f in factors.items()) or "not measured")
            t0 = time.perf_counter()
            apart = profile.excluded if profile is not None else frozenset()
            if apart:
                log.info("kept uncompressed (exclude=, ESPRESSO_EXCLUDE or at most one "
                         "dimension): %d parameter(s), e.g. %s", len(apart), sorted(apart)[:4])
            self._planned[frozenset(names)] = planned = (
                workload, costs, apart, _bucket_caps(rt.cfg.bucket_cap_mb))
            # Trials only when the planner chose freely: a baseline asked for by name runs.
            buckets, tried, finalists = plan_bucketed(
                workload, cluster, self.compressor, dict(self.params),
                within=_TRIAL_WITHIN if self._trials(session) else None,
                algorithm=self.algorithm, constraints=self.constraints, costs=costs,
                caps=planned[3], apart=apart)
            finalists = self._laid_out(finalists, buckets, profile=profile, workload=workload,
                                       cluster=cluster, costs=costs, apart=apart,
                                       caps=planned[3])
            log.info("planned in %.1f ms (bucket caps: %s):\n%s",
                     (time.perf_counter() - t0) * 1e3, ", ".join(
                         f"{cap / MiB:g} MiB, {n} buckets: {ms:.2f} ms" for cap, n, ms in tried),
                     finalists[0].summary())
            if len(finalists) > 1:
                log.info("measuring %d finalists for %d iterations each: %s", len(finalists),
                         rt.cfg.trial_steps, ", ".join(
                             f"{s.algorithm} ({s.predicted_ms:.1f} ms)" for s in finalists))
            if rt.cfg.profile_out:
                _write_profile(Path(rt.cfg.profile_out), workload, cluster, costs, finalists[0],
                               probes={**probes.record(), "fp32_cpu_ms": fp32_cpu,
                                       "host": rt.host_cores} if in_lanes else None)
            data = json.dumps([s.to_dict() for s in finalists]).encode()
        data = rt.broadcast_bytes(data, 0)
        finalists = [Strategy.from_dict(d, "broadcast strategy") for d in json.loads(data)]
        session.strategy = finalists[0]
        plan = _plan_of(finalists[0], tuple(finalists) if len(finalists) > 1 else ())
        if plan.finalists and profile is not None:
            plan = replace(plan, fp32_ms=fp32_slowest, fp32_fastest_ms=fp32_fastest)
        return plan

    def checks(self, session: Session) -> bool:
        # The planner's own pick only (a baseline asked for by name runs as asked), from a
        # profile measured in the lanes (whose cluster the check refits).
        return (self.algorithm == "espresso" and session.runtime.cfg.check_steps >= 2
                and self.profile_steps(session) >= 2)

    def replan(self, session: Session, kept: Any,
               runs: Sequence[Any]) -> tuple[Any | None, dict[str, Any]]:
        from byteps_espresso.strategy import Strategy

        rt = session.runtime
        data: bytes | None = None
        if rt.topology.rank == 0:
            new, info = self._replanned(kept, runs)
            data = json.dumps({"info": info, "strategy": None if new is None
                               else new.to_dict()}).encode()
        got = json.loads(rt.broadcast_bytes(data, 0))
        new = None if got["strategy"] is None else Strategy.from_dict(got["strategy"],
                                                                      "re-planned strategy")
        return new, got["info"]

    def _replanned(self, kept: Any, runs: Sequence[Any]) -> tuple[Any | None, dict[str, Any]]:
        """Rank 0's part of :meth:`replan`: the refit, the kept strategy priced again, the
        re-plan, and whether it switches (``worker.check``)."""
        from byteps_espresso.worker.check import REPLAN_GAIN

        from byteps_espresso.strategy.context import PlanContext
        from byteps_espresso.strategy.planner import plan_bucketed

        t0 = time.perf_counter()
        workload, costs, apart, caps = self._planned[frozenset(
            n for b in kept.layout for n in b.tensors)]
        timed_steps = [(r.option, r.numel, r.steps_us) for r in runs]
        refit, factors = fit_latency(
            kept.cluster, timed_steps, compressor=self.compressor, params=self.params,
            costs=costs, kinds=("exchange", "inter_exchange", "rooted", "ps"),
            unmeasured=True)
        costs, compute = fit_compute(refit, timed_steps, compressor=self.compressor,
                                     params=self.params, costs=costs)
        ctx = PlanContext(kept.workload, refit, self.compressor, dict(self.params), costs,
                          kept.constraints)
        kept_ms = ctx.iteration_us(ctx.index([kept.options[n]
                                              for n in kept.workload.names])) / 1e3
        buckets, _, (new,) = plan_bucketed(
            workload, refit, self.compressor, dict(self.params), within=None,
            algorithm=self.algorithm, constraints=self.constraints, costs=costs, caps=caps,
            apart=apart)
        new = replace(new, buckets=buckets if any(b.fused for b in buckets) else ())
        replan_ms = (time.perf_counter() - t0) * 1e3
        sizes = CompressedSizes(self.compressor, dict(self.params))
        timed = [{"name": r.name, "option": str(r.option), "numel": r.numel,
                  "measured_us": _floats(r.steps_us), "slowest_us": _floats(r.slowest_us),
                  "priced_us": step_prices(refit, r.option, [r.numel],
                                           compressor=self.compressor, sizes=sizes,
                                           costs=costs)[0].tolist()}
                 for r in runs]
        info = {"factors": factors, "others_factor": max(factors.values(), default=1.0),
                "compute_factors": compute, "timed_runs": timed, "kept_refitted_ms": kept_ms,
                "replanned_predicted_ms": new.predicted_ms, "replan_ms": replan_ms}
        same = new.options == kept.options and new.layout == kept.layout
        if same or new.predicted_ms > kept_ms * (1 - REPLAN_GAIN):
            return None, info
        log.info("re-planned on the refitted latencies:\n%s", new.summary())
        return new, info

    def _on_layout(self, algorithm: str, workload: Any, cluster: Any, costs: Any,
                   layout: Sequence[Any], *, apart: frozenset[str] = frozenset()) -> Any:
        """The baseline ``algorithm`` planned on the buckets of ``layout``, those of the
        gradients in ``apart`` uncompressed."""
        from byteps_espresso.strategy.buckets import fuse, reorder
        from byteps_espresso.strategy.planner import pinned_buckets, plan

        fused = fuse(reorder(workload, [n for b in layout for n in b.tensors]), layout)
        again = plan(fused, cluster, self.compressor, dict(self.params),
                     algorithm=algorithm, constraints=self.constraints, costs=costs,
                     pinned=pinned_buckets(fused, apart))
        return replace(again, buckets=tuple(layout) if any(b.fused for b in layout) else ())

    def _laid_out(self, finalists: list[Any], planned_layout: Sequence[Any], *,
                  profile: Any | None, workload: Any, cluster: Any, costs: Any,
                  apart: frozenset[str], caps: Sequence[int]) -> list[Any]:
        """The finalists of ``plan_bucketed`` (on ``planned_layout``) with their buckets
        recorded. Where there are trials: the fp32 finalist on the profiled iterations'
        buckets (added where the plan is the fp32 path on other buckets), the hook's plan on
        DDP's buckets (:meth:`_hook_plan`, last: the check falls back to it where the trials
        leave it unmeasured), and second the plan
        on the fewest buckets
        (:func:`~byteps_espresso.strategy.planner.plan_fewest_buckets`), where that layout is
        not the planned one and is predicted within ``_TRIAL_WITHIN`` of the plan. The model
        ranks layouts by their overlap with the backward pass and misses what each bucket's
        collectives wait for on shared cores, so the trials measure both; second, so that
        the start-up budget reaches it."""
        from byteps_espresso.strategy.baselines import fp32_option
        from byteps_espresso.strategy.buckets import fewest
        from byteps_espresso.strategy.planner import plan_fewest_buckets

        kept = tuple(planned_layout) if any(b.fused for b in planned_layout) else ()
        finalists = [replace(s, buckets=kept) for s in finalists]
        if len(finalists) < 2:
            return finalists
        if profile is not None and profile.layout:
            # The profiled iterations ran fp32 on their own buckets: the fp32 finalist keeps
            # those, so that they measure it (worker/trials.py). Where the plan is the fp32
            # path on other buckets, plan_finalists left fp32 out as its duplicate; on the
            # profiled buckets it is another strategy, measured already, and what the check
            # falls back to (optimizer._Sync._fp32_faster).
            path = fp32_option(cluster.machines, cluster.gpus_per_machine, cluster.servers,
                               cluster.shared_host)
            if tuple(profile.layout) != tuple(planned_layout) and all(
                    s.algorithm != "fp32" for s in finalists) and all(
                    o == path for o in finalists[0].options.values()):
                finalists.append(replace(finalists[0], algorithm="fp32"))
            finalists = [self._on_layout("fp32", workload, cluster, costs, profile.layout)
                         if s.algorithm == "fp32" else s for s in finalists]
            finalists += self._hook_plan(finalists, workload, cluster, costs, apart=apart,
                                         layout=profile.layout, caps=caps)
        if fewest([(t.name, t.numel) for t in workload.tensors], caps, apart) \
                == tuple(planned_layout):
            return finalists  # the plan is on the fewest buckets already: nothing to plan
        _, on_fewest = plan_fewest_buckets(
            workload, cluster, self.compressor, dict(self.params), algorithm=self.algorithm,
            constraints=self.constraints, costs=costs, caps=caps, apart=apart)
        if on_fewest.predicted_ms > finalists[0].predicted_ms * _TRIAL_WITHIN:
            return finalists
        return [finalists[0], on_fewest, *finalists[1:]]

    def _hook_plan(self, finalists: Sequence[Any], workload: Any, cluster: Any, costs: Any,
                   *, apart: frozenset[str], layout: Sequence[Any],
                   caps: Sequence[int]) -> list[Any]:
        """``[the hook's plan]`` where the compressor's payloads sum and that plan is not a
        finalist already, else ``[]``: every bucket of ``layout`` (the profiled one, DDP's)
        compressed on the training device and summed in one flat all-reduce (``allreduce-c``),
        what DDP's fp16 hook runs, issued from the gradient hook's thread here too. The model
        priced mixtures of collectives and push/pulls below it that measured slower (the
        LSTM's fp16 plan at 1 Gbit/s predicted 26.9 ms, measured 43.2, where the hook's plan
        runs in 23.4; BENCHMARKS.md, "Issued on the submitting thread"), so it is measured
        rather than ranked. Not for the other compressors: their hook's plan, the payloads
        all-gathered (``allgather-c``), ran EFSignSGD's LSTM at 36.3 ms at 1 Gbit/s where the
        planned mixtures ran at 30.6, and the check's five noisy iterations could not tell
        them apart (BENCHMARKS.md, "The fp16 hook's plan as a fall-back"). With gradients
        kept uncompressed (``apart``, an ``exclude=`` list) its buckets are DDP's caps over
        each kind alone (:func:`~byteps_espresso.strategy.buckets.ddp_layout`), theirs
        uncompressed."""
        from byteps_espresso.strategy.baselines import BaselineUnavailable
        from byteps_espresso.strategy.buckets import ddp_layout
        from byteps_espresso.strategy.tree import sums_payloads

        if not sums_payloads(self.compressor):
            return []
        if apart:  # the caps of the profiled layout (optimizer.default_layout)
            numel = {t.name: t.numel for t in workload.tensors}
            layout = ddp_layout([(n, numel[n]) for b in layout for n in b.tensors],
                                caps[0] if len(caps) == 1 else None, apart)
        try:
            hooked = self._on_layout(HOOK_PLAN, workload, cluster, costs, layout, apart=apart)
        except BaselineUnavailable as exc:  # the tree or the constraints leave it out
            log.info("no %s fall-back: %s", HOOK_PLAN, exc)
            return []
        if any(s.options == hooked.options and s.layout == hooked.layout for s in finalists):
            return []
        return [hooked]

    def _trials(self, session: Session) -> bool:
        return self.algorithm == "espresso" and session.runtime.cfg.trial_steps >= 2


def _bucket_caps(cap_mb: float | None) -> tuple[int, ...]:
    """The bucket caps the plan tries, bytes: ``ESPRESSO_BUCKET_CAP_MB``'s, or the
    candidates."""
    return tuple(CANDIDATE_CAPS) if cap_mb is None else (int(cap_mb * MiB),)


def _fp32_iterations(session: Session, profile: StartupProfile | None,
                     probed: bool) -> tuple[float | None, float | None, list[float] | None]:
    """The profiled iterations on the fp32 path, from those after the first that ran no
    probes (``probed``: the lanes probed), in one all-gather (all ranks call it; every rank
    profiled the same iterations, so all agree on which): (slowest, fastest, cpu).

    slowest and fastest: the fastest of those iterations, ms, on the slowest rank (an
    iteration is over when the last worker's gradients are in; the fp32 finalist's measured
    time) and on the fastest rank (the start-up budget's unit); None without any. The
    fastest iteration, not the median: the first iterations of a run are slower than its
    steady state (on the LSTM at 1 Gbit/s the profiled ones took 110-115 ms, the fp32 run's
    median 97-100 ms), and the start-up budget counts in fp32 iterations.

    cpu: every rank's median process CPU time (every thread) per such iteration, ms; None
    without any."""
    starts, cpu_starts = (profile.starts, profile.cpu_starts) if profile is not None else ([], [])
    spans, cpu = (_clean_spans(marks, session.runtime.lanes, probed)
                  for marks in (starts, cpu_starts))
    every = every_rank(session, np.array([min(spans) if spans else np.nan,
                                          statistics.median(cpu) if cpu else np.nan]))
    if np.isnan(every[:, 0]).any():
        slowest = fastest = None
    else:
        slowest, fastest = float(every[:, 0].max()) * 1e3, float(every[:, 0].min()) * 1e3
    return slowest, fastest, (None if np.isnan(every[:, 1]).any()
                              else [float(v) * 1e3 for v in every[:, 1]])


def _clean_spans(marks: Sequence[float], lanes: int, probed: bool) -> list[float]:
    """What each profiled iteration after the first that ran no probes (``probed``: the
    lanes probed) took between its ``marks`` (its start and the next's: perf_counter or
    process CPU seconds)."""
    return [marks[i + 1] - marks[i] for i in range(1, len(marks) - 1)
            if not (probed and probe_lanes(i, lanes))]


def _plan_of(strategy: Any, finalists: tuple[Any, ...] = ()) -> Plan:
    """The optimizer's Plan for a Strategy: its Options per bucket, in its backward order."""
    return Plan(dict(strategy.options), [n for b in strategy.layout for n in b.tensors],
                finalists, strategy.layout)


def _write_profile(out: Path, workload: Any, cluster: Any, costs: Any, strategy: Any, *,
                   probes: dict[str, Any] | None = None) -> None:
    out.mkdir(parents=True, exist_ok=True)
    if probes is not None:
        (out / "probes.json").write_text(json.dumps(probes, indent=1) + "\n")
    workload.save(out / "workload.json")
    (out / "cluster.json").write_text(json.dumps(cluster.to_dict(), indent=1) + "\n")
    costs.save(out / "costs.json")
    strategy.save(out / "strategy.json")
    log.info("wrote the measured workload, cluster, costs and strategy to %s", out)


def read_profile(folder: str | Path) -> tuple[Any, Any, Any]:
    """The measured ``(Workload, Cluster, CompressorCosts)`` that rank 0 wrote to
    ``ESPRESSO_PROFILE_OUT``, to price other strategies on the same profile.

    Raises:
        WorkloadError, ClusterError, CostsError: a missing or malformed file (named).
    """
    from byteps_espresso.strategy import Cluster, CompressorCosts, Workload

    folder = Path(folder)
    return (Workload.load(folder / "workload.json"), Cluster.load(folder / "cluster.json"),
            CompressorCosts.load(folder / "costs.json"))


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
        from byteps_espresso.strategy.lowrank import is_lowrank

        strategy = self._load(session)
        if is_lowrank(strategy.compressor) or not any(
                o.is_compressed for o in strategy.options.values()):
            return None
        return _codec(session, strategy.compressor, strategy.params, self.error_feedback)

    def lowrank(self, session: Session, shapes: Mapping[str, torch.Size]) -> LowRank | None:
        from byteps_espresso.strategy.lowrank import is_lowrank

        strategy = self._load(session)
        if not is_lowrank(strategy.compressor):
            return None
        return LowRank.of_job(session, strategy.params, shapes)

    def plan(self, session: Session, tensors: Sequence[tuple[str, int]],
             profile: Any | None) -> Plan:
        strategy = self._load(session)
        session.strategy = strategy
        planned = {n for b in strategy.layout for n in b.tensors}
        names = {n for n, _ in tensors}
        if planned != names:
            raise ValueError(
                f"{self.path} was planned for other parameters: it lacks "
                f"{sorted(names - planned)[:3]} and has {sorted(planned - names)[:3]} that this "
                "model does not; re-plan it from this model's profile (ESPRESSO_PROFILE_OUT)")
        return _plan_of(strategy)
