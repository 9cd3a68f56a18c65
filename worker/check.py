"""The check of the kept strategy: its own steps timed, the model refitted, one re-plan.

The start-up plans with latencies fitted to the profiled fp32 iterations (worker/profiler.py,
:func:`~byteps_espresso.worker.profiler.in_training_latency`), whose buckets are large: their
steps are mostly bandwidth, so the fit cannot see what a small step costs in training. A
compressed strategy runs many small steps (a PowerSGD bucket's P and Q sums, a compressed
bucket's gathers), and on a host whose cores the workers share each of them waits until
every member is scheduled: on the LSTM at 1 Gbit/s a 16,000-float P took 17-18 ms over
three steps priced at about 1 ms each, and the kept plans ran 30-37% slower than predicted
(BENCHMARKS.md, "End-to-end").

So once a strategy is kept (after the trials, or at once), its first
``ESPRESSO_CHECK_STEPS`` iterations after the compressor's schedule are timed step by step,
as the profiled ones were (``Executor.timings``; the first iteration is a warm-up). The
ranks take each step's minimum over the ranks that run it (the member that arrived last
measured the step itself; a non-root sleeps through a rooted Option's middle steps) and the
slowest rank's measured iteration (:func:`~byteps_espresso.worker.trials.settled_ms`, the
mean after the warm-up with the slowest left out, as the trials measure theirs).
Rank 0 refits the latencies to those steps (one factor per kind of step: exchanges,
push/pulls, rooted collectives; a kind the strategy does not run takes the largest factor
measured, the host's message latency, so that a re-plan cannot flee to a kind no step
checked) and the compression kernels' costs to its Comp and Decomp steps (one factor per
device, :func:`~byteps_espresso.worker.profiler.fit_compute`: the kernels were timed alone,
and in training they share their cores), prices the kept strategy again and re-plans on the
refitted model (:meth:`CompressionSpec.replan`). A plan predicted at least ``REPLAN_GAIN``
faster than the kept one runs the same number of checked iterations and stays only if its
measured time beats the kept one's; otherwise the kept strategy comes back. Fall-backs come
before a re-plan (measured beats predicted; nothing refitted, nothing re-planned), each
checked against the fastest so far and staying by the same rule: for a compressor whose
payloads sum (fp16) the plan DDP's fp16 hook runs (``allreduce-c``: the profiled buckets,
DDP's, cast and all-reduced) where the trials did not measure it, then the fp32 path where
the profiled fp32 iterations measured more than ``REPLAN_GAIN`` faster than the fastest
checked. One re-plan per job: a second would chase the noise of a shared host. With
``ESPRESSO_PROFILE_OUT`` rank 0 writes ``check.json``: the factors, each strategy's
prediction (as planned, refitted) against its measured time and its median, and which one
stayed (and ``strategy.json`` again where another than the kept one stayed).
"""

from __future__ import annotations

import json
import logging
import math
import statistics
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from byteps_espresso.worker.session import Session, every_rank, span_across_ranks
from byteps_espresso.worker.trials import settled_ms

from byteps_espresso.strategy.options import Option
from byteps_espresso.strategy.workload import atomic_write_text

__all__ = ["REPLAN_GAIN", "Check", "Run", "check_record", "check_text", "cores_ms",
           "step_medians", "write_check"]

log = logging.getLogger(__name__)

# The least predicted gain (fraction of the kept strategy's refitted time) worth a switch. A
# switch costs a warm-up iteration on new PS keys and, where the re-plan loses, its checked
# iterations at the slower speed; the refitted predictions were still 1-41% off the checked
# medians on the emulated cluster (28 rounds, BENCHMARKS.md "Checking the kept strategy"),
# so a smaller gain is inside the model's error. A floor chosen, not fitted: the measured
# comparison after the switch decides.
REPLAN_GAIN = 0.10


@dataclass(frozen=True)
class Run:
    """One timed run of an Option in the checked iterations: a bucket's, or a PowerSGD
    bucket's P or Q sum. ``steps_us``: each step's median over the iterations after the first,
    the minimum over ranks (NaN where none was timed). ``slowest_us``: the same medians'
    maximum over ranks, the step as the first member to arrive saw it: the gap between the
    two is how long it waited for the last (the ranks' skew, which the model does not price;
    ``check.json`` records both)."""

    name: str
    option: Option
    numel: int
    steps_us: np.ndarray
    slowest_us: np.ndarray


def step_medians(timings: Sequence[tuple[str, int, int, float]]) -> dict[tuple[str, int], float]:
    """Per (run name, step index), the median wall time (us) over the iterations after the
    run's first (the first is a warm-up: new PS keys, first collectives of a size)."""
    samples: dict[tuple[str, int], list[tuple[int, float]]] = {}
    for name, it, i, sec in timings:
        samples.setdefault((name, i), []).append((it, sec * 1e6))
    out = {}
    for key, got in samples.items():
        first = min(it for it, _ in got)
        later = [us for it, us in got if it > first]
        if later:
            out[key] = statistics.median(later)
    return out


@dataclass
class Check:
    """The checked iterations of one strategy (see the module docstring).

    Args:
        strategy: the strategy under check.
        steps: iterations to time (the first a warm-up; at least 2).
        start: the training iteration the first checked one runs.
        executors: the lanes' executors that run it (their steps are timed).
        against: the kept strategy's check, when this strategy is the re-planned one.
    """

    strategy: Any
    steps: int
    start: int
    executors: list[Any]
    against: Check | None = None
    # Rank 0: the CPU seconds so far of the servers on this process's cores, NaN where a
    # reading failed (None elsewhere, or without servers).
    servers_cpu: Callable[[], float] | None = None
    times_ms: list[float] = field(default_factory=list)
    cpu_times_ms: list[float] = field(default_factory=list)
    measured_ms: float | None = None
    median_ms: float | None = None  # the slowest rank's median after the warm-up, as recorded
    # Each rank's median process CPU time (every thread) per iteration after the warm-up, ms.
    cpu_ms: list[float] | None = None
    # Rank 0: the servers on its cores, their CPU time per iteration after the warm-up, ms.
    servers_cpu_ms: float | None = None
    _servers_from: float = 0.0
    # What the refit found (CompressionSpec.replan), for check.json.
    info: dict[str, Any] = field(default_factory=dict)

    def begin(self) -> None:
        """Time every step of the lanes from the next iteration on."""
        for ex in self.executors:
            ex.timings = []
            ex.timed_runs = {}

    def record(self, seconds: float, cpu_seconds: float = float("nan")) -> bool:
        """One checked iteration took ``seconds``, and this process ``cpu_seconds`` of CPU
        time in it; True once the last has run."""
        self.times_ms.append(seconds * 1e3)
        self.cpu_times_ms.append(cpu_seconds * 1e3)
        done = len(self.times_ms) >= self.steps
        if self.servers_cpu is not None and (len(self.times_ms) == 1 or done):
            # a STATS round trip to each server (about a millisecond) on rank 0: the others
            # wait for it in the first timed iteration, which the settled time may leave out
            now = self.servers_cpu()
            if len(self.times_ms) == 1:  # after the warm-up
                self._servers_from = now
            elif math.isfinite(now - self._servers_from):  # NaN: a reading failed
                self.servers_cpu_ms = (now - self._servers_from) * 1e3 / (self.steps - 1)
        return done

    def measure(self, session: Session) -> float:
        """The slowest rank's measured iteration (:func:`settled_ms`), kept as
        :attr:`measured_ms`, its median after the warm-up (:attr:`median_ms`) and every
        rank's median CPU time per iteration after the warm-up (:attr:`cpu_ms`; all ranks
        call it)."""
        cpu = self.cpu_times_ms[1:]
        mine = np.array([settled_ms(self.times_ms), statistics.median(self.times_ms[1:]),
                         statistics.median(cpu) if cpu else np.nan])
        every = every_rank(session, mine)
        self.measured_ms, self.median_ms = map(float, every[:, :2].max(axis=0))
        self.cpu_ms = [float(v) for v in every[:, 2]]  # NaN: recorded without (tests)
        return self.measured_ms

    def runs(self, session: Session) -> list[Run] | None:
        """The timed runs, each step's minimum and maximum over ranks, and stops the timing
        (all ranks call it). None where the ranks timed different runs (they run one strategy,
        so they should not; the check is then skipped on every rank alike)."""
        medians: dict[tuple[str, int], float] = {}
        ran: dict[str, tuple[Option, int]] = {}
        for ex in self.executors:
            medians |= step_medians(ex.timings or ())
            ran |= ex.timed_runs
            ex.timings = None
            ex.timed_runs = {}
        keys = sorted(medians)
        crc = float(zlib.crc32(repr(keys).encode()))
        lowest, highest = span_across_ranks(session, np.array([crc]))
        if lowest[0] != highest[0]:
            return None
        if not keys:
            return []
        # A member that sleeps through a step (the non-roots of a rooted one) timed nothing
        # there (NaN): the step is what its members took.
        span = span_across_ranks(session, np.array([medians[k] for k in keys]))
        by_name: dict[str, np.ndarray] = {}
        for (name, i), fastest, slowest in zip(keys, *span, strict=True):
            option, _ = ran[name]
            by_name.setdefault(name, np.full((2, len(option.steps)), np.nan))[:, i] = \
                fastest, slowest
        return [Run(name, ran[name][0], ran[name][1], *steps) for name, steps in
                sorted(by_name.items())]


def _entry(check: Check) -> dict[str, Any]:
    return {"algorithm": check.strategy.algorithm, "predicted_ms": check.strategy.predicted_ms,
            "measured_ms": check.measured_ms, "median_ms": check.median_ms,
            "iteration_ms": check.times_ms, "cpu_ms": check.cpu_ms,
            "servers_cpu_ms": check.servers_cpu_ms,
            "options": {name: str(o) for name, o in check.strategy.options.items()},
            "buckets": [list(b.tensors) for b in check.strategy.layout]}


def check_record(kept: Check, later: Sequence[Check], stayed: str,
                 host: Mapping[str, int] | None = None) -> dict[str, Any]:
    """What the check found (``check.json``): the kept check's ``info`` (the factors, the
    kept strategy's refitted prediction, the re-plan's prediction and time; ``fallback``
    where a fall-back was checked instead, with ``fp32_ms`` where it is the fp32 path the
    profiled iterations measured faster); ``replanned``: the strategy checked after the kept
    one (the re-plan, or a fall-back: its ``algorithm`` says which) and ``then``: those
    checked after that one (the fp32 path after the hook's plan); iteration times are this
    rank's, measured times (:func:`settled_ms`) and medians the slowest rank's;
    ``stayed``: ``kept``, ``replanned`` or the fall-back's algorithm (``allreduce-c``,
    ``fp32``), the strategy that trains on; ``host``: the cores this process may run on
    (``cpus``) and the ranks that share them (``ranks``), beside each strategy's ``cpu_ms``
    per rank and ``servers_cpu_ms``, the CPU time of the servers on those cores."""
    return {"steps": kept.steps, "start": kept.start, **kept.info, "host": dict(host or {}),
            "kept": _entry(kept),
            "replanned": _entry(later[0]) if later else None,
            "then": [_entry(c) for c in later[1:]], "stayed": stayed}


def cores_ms(entry: Mapping[str, Any], host: Mapping[str, int] | None) -> float | None:
    """The least iteration the cores allow one checked strategy (an entry of
    ``check.json``): the CPU time per iteration of the ranks that share this host's cores
    (every rank's median in ``cpu_ms``; the ``host["ranks"]`` on the host at their mean) and
    of the servers beside them (``servers_cpu_ms``), over the host's ``cpus``. None where no
    CPU time was recorded."""
    cpu = [v for v in entry.get("cpu_ms") or () if v is not None and math.isfinite(v)]
    if not cpu or not host:
        return None
    servers = entry.get("servers_cpu_ms") or 0.0
    return (statistics.fmean(cpu) * host["ranks"] + servers) / host["cpus"]


def _off(predicted: float | None, measured: float | None) -> str:
    if predicted is None or not measured:
        return "-"
    return f"{predicted:.1f} ms ({(predicted - measured) / measured:+.0%})"


def check_text(record: Mapping[str, Any]) -> str:
    """Rank 0's log line of the check."""
    kept = record["kept"]
    text = (f"check of the kept strategy ({kept['algorithm']}) over {record['steps'] - 1} "
            f"iterations: measured {kept['measured_ms']:.1f} ms, predicted "
            f"{_off(kept['predicted_ms'], kept['measured_ms'])}")
    host = record.get("host")
    floor = cores_ms(kept, host)
    if floor is not None:  # how close to CPU-bound the run is on shared cores
        text += (f" (its CPU time allows no less than {floor:.1f} ms on the {host['cpus']} "
                 f"cores {host['ranks']} ranks share)")
    factors = record.get("factors")
    if record.get("fp32_ms") is not None:
        text += (f"; the profiled fp32 iterations measured {record['fp32_ms']:.1f} ms: "
                 "the fp32 path is checked next, nothing refitted")
    elif record.get("fallback") is not None:
        text += f"; {record['fallback']} is checked next, nothing refitted"
    elif not factors:
        return text + "; no step timed alike on every rank, nothing refitted"
    else:
        compute = record.get("compute_factors") or {}
        text += ("; latency refitted to its steps: " + ", ".join(
            f"{kind} x{f:.2f}" for kind, f in factors.items())
            + f" (kinds it does not run x{record['others_factor']:.2f})"
            + "".join(f", compute on {device} x{f:.2f}" for device, f in compute.items())
            + f" -> predicted {_off(record['kept_refitted_ms'], kept['measured_ms'])}; "
            f"re-planned in {record['replan_ms']:.0f} ms: "
            f"{record['replanned_predicted_ms']:.1f} ms")
    again = record["replanned"]
    if again is None:
        return text + f" (a switch needs {REPLAN_GAIN:.0%} less), the kept strategy stays"
    return text + f", measured {again['measured_ms']:.1f} ms" + "".join(
        f", then {c['algorithm']} measured {c['measured_ms']:.1f} ms"
        for c in record.get("then", ())) + f": the {record['stayed']} strategy stays"


def write_check(out: str | Path, record: Mapping[str, Any]) -> None:
    """``check.json`` in ``ESPRESSO_PROFILE_OUT``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "check.json", json.dumps(record, indent=1) + "\n")
