"""Measured trials: run the planner's finalists for a few iterations each, keep the fastest.

The planner ranks strategies with a cost model fitted to a short profile. Where the model's
error is larger than the gap between the best strategies (BENCHMARKS.md, "End-to-end": 13-49%
for compressed strategies on a host whose two cores four workers and a server share, while
the three compressed strategies were within 30% of each other) the ranking among the finalists is
better decided by running them, as Horovod's autotuner measures candidate settings instead of
trusting a model. After planning, every finalist of :func:`strategy.planner.plan_finalists`
(the planned strategy first, then the baselines and the plan under a device restriction
predicted within a factor of it) trains for
``ESPRESSO_TRIAL_STEPS`` iterations; the first of them is a warm-up (new PS keys, fresh
error-feedback state) and the mean of the rest, the slowest left out, is the finalist's
measured iteration time (:func:`settled_ms`).

Every rank runs the same finalist in the same iterations (the switch is keyed to the
iteration count, so collectives stay in the same order everywhere). At the end the ranks
exchange their measured times, take the slowest rank's per finalist (an iteration is over
when the last worker's gradients are in) and all keep the same one: the first minimum, so a
tie keeps the planned strategy. Rank 0 logs the measured table and, with ``ESPRESSO_PROFILE_OUT``,
writes ``trials.json`` and replaces ``strategy.json`` with the strategy kept.

A finalist that is clearly slower stops early, as a race drops its laggards: after its first
``_RACE_TIMED`` timed iterations the ranks exchange its time so far and the times of the
finalists already measured (the same collective ``choose`` uses, at the same iteration on
every rank) and, when it is over ``_RACE_FACTOR`` times the fastest of them or of the
profiled fp32 iterations (the first finalist races against those alone), every rank moves
on to the next finalist. The ``fp32`` finalist trains no trial iterations where the profiled
iterations measured it (on their buckets, the ones it then keeps): those ran its Option.
The trials were most of the start-up once the link probes shrank (the main job at
1 Gbit/s: 3.1-3.8 s of 5.8-6.6, 5 finalists x 6 iterations).

The start-up has a budget (``ESPRESSO_STARTUP_BUDGET``, in fp32 iterations): from the first
step to the first iteration under the kept strategy. What the profiled iterations, the
planning and a compressor's warm-up left of it is what the trials may spend. Before each
finalist (:meth:`Trials.begin`, then at every switch) the ranks exchange what they spent and
what the finalists measured, and a finalist runs only if its iterations, priced at its
prediction times the model's error seen so far (``MODEL_ERROR`` before any has run; at
most the fp32 iteration), fit in what is left; the rest are not measured. Where not even the
planned strategy's fit, there are no trials and the plan is kept as the model ranked it.
"""

from __future__ import annotations

import json
import logging
import statistics
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from byteps_espresso.worker.session import Session, slowest_across_ranks

from byteps_espresso.strategy.workload import atomic_write_text

__all__ = ["MODEL_ERROR", "Trials", "settled_ms", "table"]

log = logging.getLogger(__name__)

# Timed iterations after which a finalist may be stopped, and by how much it must trail the
# fastest finalist measured so far. Trial iterations run 11-33% above the same strategy's
# steady state, and vary more (BENCHMARKS.md, "End-to-end"); 1.3x keeps a finalist within
# that noise of the best in the race.
_RACE_TIMED = 2
_RACE_FACTOR = 1.3
# How far over its prediction a finalist may run, as long as none has been measured: on a
# host whose cores the workers share the model has been 1.6-2.4x optimistic (worker/profiler.py
# takes the finalists predicted within this factor of the plan). Within the start-up budget
# the plan's trial at random-k, priced at its prediction alone, took 448 ms of 243 ms left
# (2.3x its prediction; BENCHMARKS.md "End-to-end").
MODEL_ERROR = 2.5


def settled_ms(times_ms: Sequence[float]) -> float:
    """A strategy's measured iteration time (ms): the mean of its timed iterations after the
    first (a warm-up: new PS keys, fresh error-feedback state), the slowest of them left out
    where there are two or more. The trials and the check measure every strategy they run by
    it (the profiled fp32 iterations, few and all early, are read by their fastest:
    ``Plan.fp32_ms``).

    An iteration is timed from one ``synchronize()`` to the next, so when a collective ends
    late the next iteration is short: a mean is the rate, where a median or the fastest
    follows the alternation. On a host whose cores the workers share, a strategy's first
    iterations after a switch also run slower than the same strategy later in the run, and
    leaving out the slowest takes most of that. Against the median iteration of the run that
    trained on the strategy (BENCHMARKS.md "How the start-up reads a strategy's iterations",
    ``benchmarks/check_reads.py``: 8 LSTM runs and 6 of the transformer with EFSignSGD at 1
    Gbit/s) this mean read 0.99x (0.83-1.15x) and 1.04x (0.90-1.17x); the median, read
    before, 1.04x (0.90-1.21x) and 1.06x (0.92-1.27x); the fastest 0.83x (0.58-1.03x) and
    0.79x (0.64-0.99x).

    Raises:
        ValueError: no timed iteration after the warm-up.
    """
    if len(times_ms) < 2:
        raise ValueError(f"{len(times_ms)} timed iteration(s): a measured time needs one "
                         "after the warm-up")
    timed = sorted(times_ms[1:])
    return statistics.fmean(timed[:-1] or timed)


def table(rows: Sequence[tuple[str, float, float | None]], kept: str,
          stopped: Collection[str] = (), profiled: Collection[str] = ()) -> str:
    """The trials as text: (algorithm, predicted ms, measured ms or None) per finalist;
    ``stopped``: the finalists that lost the race and stopped early; ``profiled``: those the
    profiled iterations measured; None: one the start-up budget left unmeasured."""
    # at least the 16 columns the table always had, wider for a longer name
    width = max([16, *(len(algorithm) for algorithm, _, _ in rows)])
    lines = [f"{'finalist':<{width}} {'predicted':>10} {'measured':>9}"]
    for algorithm, predicted, measured in rows:
        mark = ("  <- kept" if algorithm == kept else "")
        mark += ("  (stopped early)" if algorithm in stopped
                 else "  (the profiled iterations)" if algorithm in profiled
                 else "  (not measured: start-up budget)" if measured is None else "")
        ms = "-" if measured is None else f"{measured:.2f}ms"
        lines.append(f"{algorithm:<{width}} {predicted:>8.2f}ms {ms:>9}{mark}")
    return "\n".join(lines)


def _ms(value: float) -> float | None:
    return None if np.isnan(value) else float(value)


class Trials:
    """The finalists and their measured iteration times, one finalist at a time.

    Args:
        finalists: Strategies, the planned one first.
        steps: iterations per finalist, the first a warm-up (at least 2).
        fp32_ms: the profiled fp32 iterations' time (the slowest rank's fastest, the same on
            every rank), a time to race against from the first finalist on, and the measured
            time of the ``fp32`` finalist, which then trains no trial iterations (the caller
            gives it the profiled iterations' buckets); None: none.
        start: the training iteration the first trial iteration runs (``trials.json`` records
            it; later than the plan where a compressor's schedule runs first).
        budget: fp32 iterations the whole start-up may take (``ESPRESSO_STARTUP_BUDGET``;
            needs ``fp32_ms``); None: every finalist runs. :meth:`begin` converts it.
        budget_unit_ms: the fp32 iteration the budget counts in: the fastest profiled one
            over all ranks (default ``fp32_ms``). The slowest rank's fastest ran 5% over
            the fp32 run's steady median on the LSTM at 0.25 Gbit/s (268.6 against 255.3 ms:
            the first iterations are slow), so a start-up within a budget of those ran to
            10.1 of the steady ones (BENCHMARKS.md, "End-to-end").

    Raises:
        ValueError: fewer than two finalists or steps < 2.
    """

    def __init__(self, finalists: Sequence[Any], steps: int,
                 fp32_ms: float | None = None, start: int = 0,
                 budget: float | None = None, *, budget_unit_ms: float | None = None) -> None:
        if len(finalists) < 2:
            raise ValueError("trials need at least two finalists")
        if steps < 2:
            raise ValueError(f"trials need at least 2 steps per finalist (one warm-up), got "
                             f"{steps}; set ESPRESSO_TRIAL_STEPS >= 2, or below 2 to skip them")
        self.finalists = list(finalists)
        self.steps = steps
        self.fp32_ms = fp32_ms
        self.start = start
        self.times_ms: list[list[float]] = [[] for _ in self.finalists]
        self.stopped: set[int] = set()  # finalists stopped early (see the module docstring)
        # Finalists measured by the profiled iterations (see fp32_ms): no trial of their own.
        self.profiled = {i for i, s in enumerate(self.finalists)
                         if fp32_ms is not None and s.algorithm == "fp32"}
        if len(self.profiled) == len(self.finalists):
            raise ValueError("trials need a finalist that the profile did not measure")
        self.index = 0
        self.budget = budget if fp32_ms is not None else None
        self.budget_unit_ms = budget_unit_ms if budget_unit_ms is not None else fp32_ms
        # Trial milliseconds left to spend (slowest rank's); set by begin(), None: no limit.
        self.left_ms: float | None = None
        self.unmeasured: set[int] = set()  # finalists the budget left out
        self._skip_profiled()

    def _skip_profiled(self) -> None:
        while self.index in self.profiled:
            self.index += 1

    def begin(self, session: Session, elapsed_s: float) -> None:
        """Start the trials ``elapsed_s`` after the first step (this rank's count; every
        rank calls it at the same iteration): what the budget leaves is spent on them, and
        where the first finalist does not fit there are none (:attr:`done`; :meth:`choose`
        keeps the planned strategy)."""
        if self.budget is None or self.done:
            return
        assert self.budget_unit_ms is not None
        spent = float(slowest_across_ranks(session, np.array([elapsed_s * 1e3]))[0])
        budget_ms = self.budget * self.budget_unit_ms
        self.left_ms = budget_ms - spent
        if session.runtime.topology.rank == 0:
            log.info("start-up budget %g fp32 iterations (%.0f ms): %.0f ms spent before the "
                     "trials, %.0f ms left for them", self.budget, budget_ms, spent,
                     self.left_ms)
        self._afford(session, spent_ms=0.0)

    def _afford(self, session: Session, spent_ms: float | None = None) -> None:
        """Leave out the current finalist and every later one unless its iterations fit in
        what is left of the budget (all ranks call it at the same iteration)."""
        if self.left_ms is None or self.done:
            return
        measured = [i for i in range(self.index) if self.times_ms[i]]
        if spent_ms is None:  # the trial iterations so far and their means, slowest rank's
            every = slowest_across_ranks(session, np.array(
                [sum(map(sum, self.times_ms)),
                 *(statistics.fmean(self.times_ms[i]) for i in measured)]))
            spent_ms, means = float(every[0]), every[1:]
        else:
            measured, means = [], np.zeros(0)
        # A finalist's iterations are priced at its prediction times the largest error the
        # finalists measured so far showed, warm-ups included (MODEL_ERROR before any has
        # run), and at most at the fp32 iteration: a slower one loses the race.
        errors = [m / self.finalists[i].predicted_ms for i, m in zip(measured, means,
                                                                     strict=True)]
        error = max(errors) if errors else MODEL_ERROR
        assert self.fp32_ms is not None
        per_iteration = min(self.finalists[self.index].predicted_ms * max(1.0, error),
                            self.fp32_ms)
        if spent_ms + per_iteration * self.steps <= self.left_ms:
            return
        self.unmeasured = {i for i in range(self.index, len(self.finalists))
                           if i not in self.profiled}
        if session.runtime.topology.rank == 0:
            log.info("trials: the start-up budget leaves %s unmeasured (%.0f of %.0f ms "
                     "spent; %d iterations of about %.0f ms do not fit)%s", ", ".join(
                         self.finalists[i].algorithm for i in sorted(self.unmeasured)),
                     spent_ms, self.left_ms, self.steps, per_iteration,
                     "; the planned strategy is kept as the model ranked it"
                     if 0 in self.unmeasured else "")
        self.index = len(self.finalists)

    @property
    def current(self) -> Any:
        """The finalist the next iteration runs."""
        return self.finalists[self.index]

    @property
    def done(self) -> bool:
        """Whether every finalist has had its iterations."""
        return self.index >= len(self.finalists)

    def record(self, seconds: float, session: Session | None = None) -> None:
        """One iteration of :attr:`current` took ``seconds``; moves on after ``steps`` of them,
        or earlier when ``session`` is given and the finalist lost the race (every rank must
        then pass its session, at the same iterations)."""
        if self.done:
            raise RuntimeError("every finalist has been measured; call choose()")
        times = self.times_ms[self.index]
        times.append(seconds * 1e3)
        if len(times) == self.steps or (session is not None and self._outpaced(session)):
            self.index += 1
            self._skip_profiled()
            if session is not None:
                self._afford(session)

    def _outpaced(self, session: Session) -> bool:
        """Whether the current finalist, at its ``_RACE_TIMED``-th timed iteration, trails the
        fastest finished one, or the profiled fp32 iterations, by over ``_RACE_FACTOR``
        (slowest ranks' measured times)."""
        times = self.times_ms[self.index]
        if ((self.index == 0 and self.fp32_ms is None) or len(times) != 1 + _RACE_TIMED
                or self.steps <= 1 + _RACE_TIMED):
            return False
        slowest = slowest_across_ranks(session, np.array(
            [self._measured(i) for i in range(self.index + 1)]))
        ahead = [*slowest[:-1], self.fp32_ms] if self.fp32_ms is not None else slowest[:-1]
        best = float(np.min(ahead))
        if slowest[-1] <= _RACE_FACTOR * best:
            return False
        self.stopped.add(self.index)
        if session.runtime.topology.rank == 0:
            log.info("trials: %s stopped after %d iterations, %.1f ms against %.1f ms of the "
                     "fastest so far", self.current.algorithm, len(times), slowest[-1], best)
        return True

    def _measured(self, i: int) -> float:
        """Finalist ``i``'s measured iteration time (:func:`settled_ms`; ``fp32_ms`` where the
        profile measured it)."""
        if i in self.profiled:
            assert self.fp32_ms is not None
            return self.fp32_ms
        return settled_ms(self.times_ms[i])

    def measured_ms(self) -> np.ndarray:
        """Per finalist, its measured iteration time (once :attr:`done`; NaN for those the
        budget left out)."""
        return np.array([np.nan if i in self.unmeasured else self._measured(i)
                         for i in range(len(self.finalists))])

    def choose(self, session: Session) -> Any:
        """The finalist with the smallest slowest-rank measured time (all ranks call it; every rank
        gets the same one). Rank 0 logs the table and writes the files described above."""
        if not self.done:
            raise RuntimeError(f"finalist {self.index + 1} of {len(self.finalists)} is still "
                               "being measured")
        measured = slowest_across_ranks(session, self.measured_ms())
        # The first minimum: a tie keeps the planned strategy, and so does a budget that
        # left every finalist unmeasured (the model's ranking stands).
        kept = 0 if 0 in self.unmeasured else int(np.nanargmin(measured))
        rt = session.runtime
        if rt.topology.rank == 0:
            log.info("trials (mean of %d iterations after a warm-up, the slowest left out; "
                     "slowest rank):\n%s", self.steps - 1, self.table(measured, kept))
            if rt.cfg.profile_out:
                self._write(Path(rt.cfg.profile_out), measured, kept)
            else:  # the choice depends on timing: say how to keep it for the next run
                log.info("the kept strategy was chosen by measured times; set "
                         "ESPRESSO_PROFILE_OUT to record it as strategy.json, which "
                         "ESPRESSO_STRATEGY reuses without profiling or trials")
        return self.finalists[kept]

    def table(self, measured: np.ndarray, kept: int) -> str:
        return table([(s.algorithm, s.predicted_ms, _ms(ms))
                      for s, ms in zip(self.finalists, measured, strict=True)],
                     self.finalists[kept].algorithm,
                     {self.finalists[i].algorithm for i in self.stopped},
                     {self.finalists[i].algorithm for i in self.profiled})

    def _write(self, out: Path, measured: np.ndarray, kept: int) -> None:
        out.mkdir(parents=True, exist_ok=True)
        entries = [{"algorithm": s.algorithm, "predicted_ms": s.predicted_ms,
                    "measured_ms": _ms(ms), "iteration_ms": times,
                    "stopped_early": i in self.stopped, "profiled": i in self.profiled,
                    "options": {name: str(o) for name, o in s.options.items()}}
                   for i, (s, ms, times) in enumerate(zip(self.finalists, measured,
                                                          self.times_ms, strict=True))]
        atomic_write_text(out / "trials.json", json.dumps(
            {"steps": self.steps, "start": self.start, "budget": self.budget,
             "budget_left_ms": self.left_ms, "kept": self.finalists[kept].algorithm,
             "finalists": entries}, indent=1) + "\n")
        self.finalists[kept].save(out / "strategy.json")
        log.info("wrote trials.json and the kept strategy to %s; ESPRESSO_STRATEGY=%s "
                 "reuses it without profiling or trials", out, out / "strategy.json")
