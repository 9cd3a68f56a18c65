"""The iteration timeline: every tensor's tasks list-scheduled on the resources they occupy.

Model (one representative worker per machine; all workers are symmetric):

- Backward computation runs on the ``gpu`` resource: gradient ``i`` is ready once segment
  ``i`` (``ready_gap_us``) has run. GPU ``Comp``/``Decomp`` tasks occupy the same resource,
  so each one pushes every later backward segment back by its duration (segments flow around
  the tasks already placed) -- GPU compression delays later gradients.
- Tensors are taken in backward order and their tasks in option order; each task starts at
  the earliest time >= the end of the task before it (or the gradient's ready time) at which
  its resource is idle for its whole duration (insertion list scheduling: a later tensor may
  use an idle gap before an earlier tensor's later task). Resources: ``gpu``, ``cpu`` (the
  host thread pool, d2h/h2d copies included), ``intra`` link, ``inter`` link (machine NIC;
  also flat collectives across machines), ``server`` (PS aggregation).
- Lanes, when the cluster sets ``lanes`` (a profile measured by the runtime does): the
  executor runs each tensor's Option on one lane thread
  (:func:`~byteps_espresso.strategy.cluster.lane_of` its name), one Option at a time in
  submission order, until it issues the Option's in-flight step
  (:attr:`~byteps_espresso.strategy.program.Program.in_flight`: its last collective, issued
  ``async_op``, the Decomp after it run by the waiting call) or to its end; so a tensor's
  first task starts no earlier than that issue (or end) of the previous Option on its lane
  (:attr:`Catalogue.hold`). Without ``lanes`` (the presets), only the resources order the
  tasks.
- Iteration time = forward time + max(end of backward, end of the last task).

The scheduling kernel is compiled with numba (cached on disk); the search evaluates
thousands of strategies through :meth:`Evaluator.iteration_us` and :meth:`Evaluator.best_of`.
A :class:`Schedule` carries the trace of its run (after each tensor, what the rest of the run
depends on: ``_trace_state``); best_of starts its candidates from the traced state before
their tensor and stops simulating a candidate once its state is the traced one again, or
the traced one shifted in time (see SHIFT_TOL).

Example:
    >>> ev = Evaluator(workload, pricer, options)
    >>> ev.iteration_us(np.zeros(len(workload.tensors), dtype=np.int64))
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numba
import numpy as np

from byteps_espresso.strategy.cluster import lane_of
from byteps_espresso.strategy.costs import GPU, RESOURCES, PricedBatch, Pricer, StepTasks
from byteps_espresso.strategy.options import Option
from byteps_espresso.strategy.workload import Workload

__all__ = ["Catalogue", "Evaluator", "Schedule", "Task", "Timeline", "index_table"]


# A task may start in an idle gap before the last BACKFILL_WINDOW busy intervals of its
# resource at the earliest; older gaps are treated as gone (bounds the scan per task).
BACKFILL_WINDOW = 16
# A traced schedule (Evaluator.schedule) keeps, per tensor and resource, at most this many busy
# intervals ahead of the backward (bounds the tracing work per tensor); a state with more is
# not traced and best_of never follows the trace there: only its speed depends on these two.
TRACE_DEPTH = 32
# Room for traced intervals per tensor and resource, on average; past it, the later tensors'
# states are not traced (as if deeper than TRACE_DEPTH).
TRACE_ROOM = 4
# A run that does not record may also follow a trace from a state that is the traced one
# shifted in time (its backward ends delta later or sooner, and so does every busy interval
# after it): every later tensor is then scheduled as traced, delta later. Shifted times are
# computed along other chains of additions, so they match to within this many microseconds
# (float64 rounding of iterations up to about 1e6 us is about 1e-10 us per operation); the
# search's own tie tolerance is the same 1e-6 us.
SHIFT_TOL = 1e-6

# Scalars the kernels pass to one another. A literal (0, -1, False) in a call between numba
# functions is typed as that literal value, and each distinct literal compiles the callee once
# more (_advance was compiled four times, 1-5 s each on a cold cache); these typed values keep
# one compiled version per callee. The exception is _advance's ``record``: the calls that never
# record pass a literal False, so that one second version of _advance drops the recording
# branches from its inner loop (Algorithm 2's branch and bound on BERT ran 1.6x slower with a
# run-time flag). ``follow`` is a run-time flag (typed _NO where a call never follows): it
# costs the branch and bound at most 2% of its instructions (callgrind, BERT on 8 x 8 PCIe +
# 25 Gbit/s with efsignsgd) and keeps _advance at two compiled versions.
_I0 = np.int64(0)
_NONE = np.int64(-1)
_NO = np.bool_(False)
_YES = np.bool_(True)


@numba.njit(cache=True)
def _advance(starts, ends, count, acc, gaps, size_idx, lane, choice, j0, j1, oi, ok, cat_len,  # noqa: PLR0912, PLR0915, PLR0917
             cat_hold, cat_res, cat_dur, forward, best_t, best_s, tol, record, task_start,
             task_end, out, follow, trace):  # pragma: no cover - compiled
    """Schedule tensors j0..j1-1 (tensor oi uses option ok instead of choice[oi]): per
    tensor, (1) its backward segment, then per task (2) the earliest fitting start on its
    resource and (3) the insertion of its busy interval; when following a trace, (4) whether
    the state after the tensor is the traced one (or, not recording, the traced one shifted).

    Steps (1)-(4) are written out here rather than called: a call that passes arrays costs
    two atomic reference-count updates per array (numba's NRT_incref and NRT_decref, also
    with inline="always"). With (1)-(3) in their own functions a warm ResNet101 plan took
    1.35x the CPU time, and with (4) in its own function Algorithm 1 took 10-15% more
    (BENCHMARKS.md, "Kernels without reference counting"; 2026-12-03).

    acc = [backward end, last task end, sum of tensor done times]. Returns False (and stops)
    as soon as the run cannot beat (best_t, best_s) lexicographically: a lower bound of its
    iteration time, forward + max(backward so far + the backward still to run, last),
    exceeds best_t + tol, or that bound already rules out a shorter time and the partial sum
    of done times reached best_s - tol (done times only add up).

    record: write each task's start and end, and the trace of the run into ``out``
    (:func:`_trace_state`). follow: ``trace`` is the trace of ``choice`` itself (but for
    tensor oi); from the first tensor i >= oi after which this run's state is the traced one
    (step 4) every later tensor is scheduled as traced, so its done time is read
    from the trace instead of simulated (the sums, maxima and bounds still run in the same
    order: the same floats as simulating; the busy intervals and lanes are left as they were
    at that tensor, and a recording run copies the rest of its trace, not its tasks). A run
    that does not record also stops at a state that is the traced one shifted by delta (to
    within SHIFT_TOL): every later tensor is then ready and done delta after its traced
    times, equal to a simulation's to within about SHIFT_TOL (other chains of roundings).
    """
    bwd = acc[0]
    last = acc[1]
    sdone = acc[2]
    # the arrays of the traces, taken out of their tuples once (an item of a tuple per tensor
    # costs its reference counting, as a call does: see above)
    ready_out, done_out = out[0], out[1]
    ready_tr, lanes_tr, cnt_tr, off_tr, iv_tr = trace[0], trace[2], trace[3], trace[4], trace[5]
    rest = 0.0  # backward still to run after tensor i: bwd + rest bounds the final backward
    for i in range(j0, gaps.shape[0]):
        rest += gaps[i]
    for i in range(j0, j1):
        rest -= gaps[i]
        # (1) the backward segment of tensor i from bwd on, flowing around the GPU tasks: the
        # first GPU interval ending after bwd (binary search), then through the gaps
        n = count[0]
        lo, hi = 0, n
        while lo < hi:
            mid = (lo + hi) // 2
            if ends[0, mid] <= bwd:
                lo = mid + 1
            else:
                hi = mid
        idx = lo
        remaining = gaps[i]
        while remaining > 0.0:
            if idx < n and starts[0, idx] < bwd + remaining:
                if starts[0, idx] > bwd:
                    remaining -= starts[0, idx] - bwd
                bwd = max(bwd, ends[0, idx])
                idx += 1
            else:
                bwd += remaining
                remaining = 0.0
        t = bwd
        if lane[i] >= 0:  # the lane runs one Option at a time, in submission order
            t = max(t, acc[3 + lane[i]])
        o = ok if i == oi else choice[i]
        u = size_idx[i]
        if record:
            ready_out[i] = bwd
        hold = cat_hold[o]
        free = t  # when the lane is free again: once the in-flight step is issued, or at the end
        for j in range(cat_len[o]):
            if j == hold:
                free = t
            d = cat_dur[o, u, j]
            if d > 0.0:
                # (2) task j at the earliest start >= t where its resource r is idle for d
                r = cat_res[o, j]
                n = count[r]
                # The first interval ending after t, searched back from the last one: only the
                # last BACKFILL_WINDOW gaps may be back-filled, so the scan stops there (the
                # same index as a binary search over all intervals clamped to the window, in
                # fewer steps: most tasks go after every busy interval or into the last gaps).
                floor = max(n - BACKFILL_WINDOW, 0)
                idx = n
                while idx > floor and ends[r, idx - 1] > t:
                    idx -= 1
                if idx > 0 and idx == floor and ends[r, idx - 1] > t:
                    t = ends[r, idx - 1]
                while idx < n and starts[r, idx] < t + d:
                    t = max(t, ends[r, idx])
                    idx += 1
                # (3) insert [t, t + d), merged with the intervals it touches, so that a
                # backlogged resource is one interval and the scan above stays short
                end = t + d
                joins_prev = idx > 0 and ends[r, idx - 1] == t
                joins_next = idx < n and starts[r, idx] == end
                if joins_prev and joins_next:
                    ends[r, idx - 1] = ends[r, idx]
                    for k in range(idx, n - 1):
                        starts[r, k] = starts[r, k + 1]
                        ends[r, k] = ends[r, k + 1]
                    count[r] = n - 1
                elif joins_prev:
                    ends[r, idx - 1] = end
                elif joins_next:
                    starts[r, idx] = t
                else:
                    for k in range(n, idx, -1):
                        starts[r, k] = starts[r, k - 1]
                        ends[r, k] = ends[r, k - 1]
                    starts[r, idx] = t
                    ends[r, idx] = end
                    count[r] = n + 1
            if record:
                task_start[i, j] = t
            t += d
            if record:
                task_end[i, j] = t
        if record:
            done_out[i] = t
        if lane[i] >= 0:
            acc[3 + lane[i]] = free if hold < cat_len[o] else t
        if record:
            _trace_state(starts, ends, count, acc, bwd, i, out)
        sdone += t
        last = max(last, t)
        if _beaten(forward + max(bwd + rest, last), sdone, best_t, best_s, tol):
            _keep(acc, bwd, last, sdone)
            return False
        if follow and i >= oi and (not record or bwd == ready_tr[i]):
            # (4) whether this run's state after tensor i is the traced one (_trace_state),
            # or (not recording) the traced one shifted by delta, to within SHIFT_TOL: the
            # lanes' free times clipped to bwd (a lane free before bwd delays nothing), and
            # per resource the busy intervals ending after bwd, their starts clipped to it
            delta = bwd - ready_tr[i]
            slack = 0.0 if delta == 0.0 else SHIFT_TOL
            same = True
            for q in range(lanes_tr.shape[1]):
                if abs(max(acc[3 + q], bwd) - (max(lanes_tr[i, q], ready_tr[i]) + delta)) \
                        > slack:
                    same = False
                    break
            pos = off_tr[i]
            r = 0
            while same and r < count.shape[0]:
                m = cnt_tr[i, r]
                k = count[r] - m
                if m < 0 or k < 0 or (k > 0 and ends[r, k - 1] > bwd):
                    same = False
                q = 0
                while same and q < m:
                    if abs(ends[r, k + q] - (iv_tr[pos, 1] + delta)) > slack or \
                            abs(max(starts[r, k + q], bwd) - (iv_tr[pos, 0] + delta)) > slack:
                        same = False
                    pos += 1
                    q += 1
                r += 1
            if not same:
                continue
            if record:  # the rest of the run is the trace's
                _copy_trace(out, trace, i + 1, j1)
            return _replay(acc, gaps, i + 1, j1, rest, bwd, last, sdone, forward, best_t,
                           best_s, tol, trace, delta)
    _keep(acc, bwd, last, sdone)
    return True


@numba.njit(cache=True)
def _beaten(low, sdone, best_t, best_s, tol):  # pragma: no cover - compiled
    """Whether a run whose iteration is at least ``low`` (sum of done times so far
    ``sdone``) cannot beat the best one: _advance's and _replay's cut-off."""
    return low > best_t + tol or (low >= best_t - tol and sdone >= best_s - tol)


@numba.njit(cache=True)
def _keep(acc, bwd, last, sdone):  # pragma: no cover - compiled
    """Store a run's accumulators where it stopped: backward end, last done, sum of done."""
    acc[0] = bwd
    acc[1] = last
    acc[2] = sdone


@numba.njit(cache=True)
def _replay(acc, gaps, j0, j1, rest, bwd, last, sdone, forward, best_t, best_s, tol,  # noqa: PLR0917
            trace, delta):  # pragma: no cover - compiled
    """_advance's accumulators and bound over tensors j0..j1-1 scheduled as ``trace`` has
    them (its ready and done times, each + delta), in _advance's order of operations."""
    for m in range(j0, j1):
        rest -= gaps[m]
        bwd = trace[0][m] + delta
        t = trace[1][m] + delta
        sdone += t
        last = max(last, t)
        if _beaten(forward + max(bwd + rest, last), sdone, best_t, best_s, tol):
            _keep(acc, bwd, last, sdone)
            return False
    _keep(acc, bwd, last, sdone)
    return True


@numba.njit(cache=True)
def _trace_state(starts, ends, count, acc, bwd, i, out):  # pragma: no cover  # noqa: PLR0917
    """Record what the rest of a run depends on once tensor i is scheduled: the lanes' free
    times and, per resource, the busy intervals that end after the backward end ``bwd``,
    their starts clipped to it. Later tasks start at bwd or later, and where such a task
    goes (_advance: the intervals ending after its earliest start, counted from the last
    for the back-fill window; the backward segments the same) reads nothing else, so two
    runs with the same record at tensor i schedule every later tensor alike. At most
    TRACE_DEPTH intervals per resource are kept; a state with more is not traced (count -1:
    never followed).

    out = (ready, done, lanes (n, lanes), count (n, resources), offset (n + 1,),
    intervals (capacity, 2)): tensor i's intervals are intervals[offset[i]:offset[i + 1]],
    resource by resource."""
    lanes, cnt, off, iv = out[2], out[3], out[4], out[5]
    for q in range(lanes.shape[1]):
        lanes[i, q] = acc[3 + q]
    pos = off[i]
    for r in range(count.shape[0]):
        k = count[r]
        while k > 0 and count[r] - k <= TRACE_DEPTH and ends[r, k - 1] > bwd:
            k -= 1
        m = count[r] - k
        if m > TRACE_DEPTH or pos + m > iv.shape[0]:
            cnt[i, r] = -1
            continue
        cnt[i, r] = m
        for q in range(k, count[r]):
            iv[pos, 0] = max(starts[r, q], bwd)
            iv[pos, 1] = ends[r, q]
            pos += 1
    off[i + 1] = pos


@numba.njit(cache=True)
def _copy_trace(out, trace, j0, j1):  # pragma: no cover - compiled
    """Tensors j0..j1-1 of ``trace`` into ``out`` (whose tensors before j0 are recorded)."""
    cnt, off, iv = out[3], out[4], out[5]
    pos = off[j0]
    src0 = trace[4][j0]
    if pos + trace[4][j1] - src0 <= iv.shape[0]:
        # Every state fits: the entries of the loop below, copied as whole blocks (tensor by
        # tensor, a reschedule near the end of ResNet101's 314 tensors took ~30 us, most of it
        # this copy).
        out[0][j0:j1] = trace[0][j0:j1]
        out[1][j0:j1] = trace[1][j0:j1]
        out[2][j0:j1] = trace[2][j0:j1]
        cnt[j0:j1] = trace[3][j0:j1]
        for m in range(j0 + 1, j1 + 1):
            off[m] = trace[4][m] - src0 + pos
        iv[pos:off[j1]] = trace[5][src0:trace[4][j1]]
        return
    for m in range(j0, j1):
        out[0][m] = trace[0][m]
        out[1][m] = trace[1][m]
        out[2][m] = trace[2][m]
        src = trace[4][m]
        for r in range(cnt.shape[1]):
            k = trace[3][m, r]
            if k < 0 or pos + k > iv.shape[0]:
                cnt[m, r] = -1
            else:
                cnt[m, r] = k
                iv[pos:pos + k] = trace[5][src:src + k]
                pos += k
            src += max(k, 0)
        off[m + 1] = pos


@numba.njit(cache=True)
def _resimulate(gaps, size_idx, lane, choice, i, cat_len, cat_hold, cat_res,  # noqa: PLR0917
                cat_dur, n_res, task_start, task_end, out, old):  # pragma: no cover - compiled
    """Simulate and trace ``choice`` into ``out``, where the traced ``old`` is the schedule of
    the same strategy but for tensor i: the tensors before i are copied from it, and the run
    from i on starts from its state before i and follows it (_advance)."""
    starts, ends, count, acc = _schedule_state(n_res, _capacity(choice, cat_len), lane)
    j0 = _I0
    if i > 0 and _from_trace(starts, ends, count, acc, i - 1, old):
        _copy_trace(out, old, _I0, i)
        j0 = i
    _advance(starts, ends, count, acc, gaps, size_idx, lane, choice, j0, gaps.shape[0], i,
             choice[i], cat_len, cat_hold, cat_res, cat_dur, 0.0, np.inf, np.inf, 0.0, _YES,
             task_start, task_end, out, _YES, old)
    return acc[0], acc[1], acc[2]


@numba.njit(cache=True)
def _from_trace(starts, ends, count, acc, i, trace):  # pragma: no cover  # noqa: PLR0917
    """The state after tensor i as ``trace`` recorded it (:func:`_trace_state`: what every
    later tensor's schedule depends on), with the accumulators as _advance has them there;
    False (nothing changed) where the state was not traced."""
    cnt, off, iv = trace[3], trace[4], trace[5]
    for r in range(count.shape[0]):
        if cnt[i, r] < 0:
            return False
    pos = off[i]
    for r in range(count.shape[0]):
        m = cnt[i, r]
        for q in range(m):
            starts[r, q] = iv[pos, 0]
            ends[r, q] = iv[pos, 1]
            pos += 1
        count[r] = m
    last = 0.0
    sdone = 0.0
    for m in range(i + 1):  # in _advance's order: the same floats
        t = trace[1][m]
        sdone += t
        last = max(last, t)
    acc[0] = trace[0][i]
    acc[1] = last
    acc[2] = sdone
    for q in range(trace[2].shape[1]):
        acc[3 + q] = trace[2][i, q]
    return True


@numba.njit(cache=True)
def _capacity(choice, cat_len):  # pragma: no cover - compiled
    cap = 1
    for i in range(choice.shape[0]):
        cap += cat_len[choice[i]]
    return cap + cat_len.max()


@numba.njit(cache=True)
def _schedule_state(n_res, cap, lane):  # pragma: no cover - compiled
    """Empty per-resource busy intervals (starts, ends, count) and the accumulators: backward
    end, last task end, sum of done times, then each lane's free time."""
    return (np.empty((n_res, cap)), np.empty((n_res, cap)), np.zeros(n_res, dtype=np.int64),
            np.zeros(3 + max(lane.max() + 1, 0)))


@numba.njit(cache=True)
def _run_room(n_res, n, cat_len, lane):  # pragma: no cover - compiled
    """_schedule_state with room for any strategy of n tensors (at least _capacity), for
    runs that reuse it (the candidates of _best_group and the rows of _best_row: allocated
    per run, Algorithm 1's group moves took 1.15-1.3x as long on LSTM, VGG16 and ResNet101;
    2026-12-03)."""
    return _schedule_state(n_res, 1 + (n + 1) * cat_len.max(), lane)


@numba.njit(cache=True)
def _simulate(gaps, size_idx, lane, choice, cat_len, cat_hold, cat_res, cat_dur, n_res, record,  # noqa: PLR0917
              task_start, task_end, out):  # pragma: no cover - compiled
    cap = _capacity(choice, cat_len)
    starts, ends, count, acc = _schedule_state(n_res, cap, lane)
    _advance(starts, ends, count, acc, gaps, size_idx, lane, choice, _I0, gaps.shape[0], _NONE,
             _I0, cat_len, cat_hold, cat_res, cat_dur, 0.0, np.inf, np.inf, 0.0, record, task_start,
             task_end, out, _NO, out)
    return acc[0], acc[1], acc[2]


@numba.njit(cache=True)
def _no_trace():  # pragma: no cover - compiled
    """A trace tuple for runs that neither record nor follow one (the types of a real one)."""
    return (np.zeros(1), np.zeros(1), np.zeros((1, 1)), np.zeros((1, 1), dtype=np.int64),
            np.zeros(2, dtype=np.int64), np.zeros((1, 2)))


@numba.njit(cache=True)
def _best_of(gaps, size_idx, lane, choice, i, cands, cat_len, cat_hold, cat_res,  # noqa: PLR0917
             cat_dur, n_res, forward, tol, k0, t0, s0, follow,
             trace):  # pragma: no cover - compiled
    """Best candidate option for tensor i, others fixed: lexicographic (iteration time,
    sum of done times) against the incumbent k0 with its (t0, s0) (k0 = -1, t0 = s0 = inf:
    none); the state before i is made once and copied per candidate. follow: ``trace`` is
    choice's own (Evaluator.schedule); the state before i is then the one traced there
    (when it is, else the prefix is simulated), and a candidate's run stops simulating once
    its state is the traced one (_advance)."""
    cap = _capacity(choice, cat_len)
    starts, ends, count, acc = _schedule_state(n_res, cap, lane)
    dummy = np.zeros((1, 1))
    none = _no_trace()
    n = gaps.shape[0]
    if not (follow and i > 0 and _from_trace(starts, ends, count, acc, i - 1, trace)):
        _advance(starts, ends, count, acc, gaps, size_idx, lane, choice, _I0, i, _NONE, _I0,
                 cat_len, cat_hold, cat_res, cat_dur, 0.0, np.inf, np.inf, 0.0, False, dummy, dummy,
                 none, _NO, none)
    s2 = np.empty((n_res, cap))
    e2 = np.empty((n_res, cap))
    c2 = np.empty(n_res, dtype=np.int64)
    a2 = np.empty(acc.shape[0])
    best_k = k0
    best_t = t0
    best_s = s0
    for c in range(cands.shape[0]):
        for r in range(n_res):
            s2[r, :count[r]] = starts[r, :count[r]]
            e2[r, :count[r]] = ends[r, :count[r]]
        c2[:] = count
        a2[:] = acc
        ok = _advance(s2, e2, c2, a2, gaps, size_idx, lane, choice, i, n, i, cands[c], cat_len,
                      cat_hold, cat_res, cat_dur, forward, best_t, best_s, tol, False, dummy, dummy,
                      none, follow, trace)
        if not ok:
            continue
        t = forward + max(a2[0], a2[1])
        if t < best_t - tol or (t <= best_t + tol and a2[2] < best_s - tol):
            best_k = cands[c]
            best_t = t
            best_s = a2[2]
    return best_k, best_t, best_s


@numba.njit(cache=True)
def _greedy_pass(gaps, size_idx, lane, choice, order, plain, front, front_len, bubbles,  # noqa: PLR0917
                 cat_len, cat_hold, cat_res, cat_dur, n_res, forward, tol, t0, s0, trace, spare,
                 task_start, task_end, stop):  # pragma: no cover - compiled
    """Algorithm 1's pass over the tensors of ``order`` (search.gpu_greedy), each with the
    others fixed: skipped where ``bubbles`` and it is uncompressed (``plain`` per option) and
    synchronized before the next gradient is ready; else _best_of over its size's front
    (front[u, :front_len[u]]) but its own option, against its own option's schedule (t0,
    s0, ``trace``); a different winner is taken and the schedule retraced (_resimulate, into
    ``spare``: the two traces swap). The pass ends once the iteration time is at most
    ``stop``. ``choice`` is changed in place. Returns (whether anything changed, the
    candidate runs and reschedules)."""
    n = gaps.shape[0]
    cands = np.empty(max(front.shape[1], 1), dtype=np.int64)
    runs = 0
    changed = False
    for q in range(order.shape[0]):
        if t0 <= stop:
            break
        i = order[q]
        keep = choice[i]
        if bubbles and i + 1 < n and plain[keep] and trace[1][i] <= trace[0][i + 1]:
            continue
        u = size_idx[i]
        m = 0
        for c in range(front_len[u]):
            if front[u, c] != keep:
                cands[m] = front[u, c]
                m += 1
        k, _, _ = _best_of(gaps, size_idx, lane, choice, i, cands[:m], cat_len, cat_hold, cat_res,
                           cat_dur, n_res, forward, tol, keep, t0, s0, _YES, trace)
        runs += m
        if k != keep:
            choice[i] = k
            changed = True
            bwd, last, sdone = _resimulate(gaps, size_idx, lane, choice, i, cat_len, cat_hold,
                                           cat_res, cat_dur, n_res, task_start, task_end, spare,
                                           trace)
            runs += 1
            trace, spare = spare, trace
            t0 = forward + max(bwd, last)
            s0 = sdone
    return changed, runs


@numba.njit(cache=True)
def _refine_pass(gaps, size_idx, lane, choice, order, q0, taken_step, compressed, ptab, prow,  # noqa: PLR0912, PLR0915, PLR0917
                 cpu_front, cpu_front_len, cat_len, cat_hold, cat_res, cat_dur, n_res, forward,
                 tol, t0, s0, trace, spare, task_start, task_end,
                 stop):  # pragma: no cover - compiled
    """The device refinement (search._refine_devices) over the tensors order[q0:], each with
    the others fixed, against its own schedule (t0, s0, ``trace``; a taken candidate is
    retraced into ``spare`` and the two swap, as in _greedy_pass). ``choice`` is changed in
    place. A compressed tensor tries the sorted union of its option's placements
    (ptab[prow[k]], -1 padded) and the compressed options of its size's host front
    (cpu_front[u, :cpu_front_len[u]]); an uncompressed one, unless synchronized before the
    next gradient is ready, that whole front. A
    tensor that took a compressed option outside its option's placements then tries that
    option's placements (``taken_step``: resume there for order[q0]).

    Placement tables are made by the caller (they may price options), so where one is not
    yet known (prow < 0) the pass stops and names it. Returns (option whose table is
    wanted or -1 when the pass is over, q, taken_step, runs, t0, s0, whether the current
    trace is ``spare``)."""
    n = gaps.shape[0]
    cands = np.empty(ptab.shape[1] + cpu_front.shape[1] + 1, dtype=np.int64)
    runs = 0
    swapped = False
    for q in range(q0, order.shape[0]):
        i = order[q]
        u = size_idx[i]
        placed = _NONE  # the ptab row of the tensor's option where it is compressed
        step = 1 if q == q0 and taken_step else 0
        while step < 2:
            keep = choice[i]
            m = 0
            if step == 1:  # the placements of the option it took
                row = prow[keep]
                for c in range(ptab.shape[1]):
                    if ptab[row, c] >= 0 and ptab[row, c] != keep:
                        cands[m] = ptab[row, c]
                        m += 1
            elif t0 <= stop:
                return _NONE, order.shape[0], False, runs, t0, s0, swapped
            elif compressed[keep]:
                placed = prow[keep]
                if placed < 0:
                    return keep, q, False, runs, t0, s0, swapped
                for c in range(ptab.shape[1]):
                    if ptab[placed, c] >= 0:
                        cands[m] = ptab[placed, c]
                        m += 1
                for c in range(cpu_front_len[u]):
                    if compressed[cpu_front[u, c]]:
                        cands[m] = cpu_front[u, c]
                        m += 1
                cands[:m].sort()
                kept = 0  # np.union1d's order, without the incumbent (best_of's candidates)
                for c in range(m):
                    if cands[c] != keep and (kept == 0 or cands[c] != cands[kept - 1]):
                        cands[kept] = cands[c]
                        kept += 1
                m = kept
            elif i + 1 < n and trace[1][i] <= trace[0][i + 1]:
                break  # Algorithm 1's bubble rule: nothing waits for it
            else:
                for c in range(cpu_front_len[u]):
                    if cpu_front[u, c] != keep:
                        cands[m] = cpu_front[u, c]
                        m += 1
            k, _, _ = _best_of(gaps, size_idx, lane, choice, i, cands[:m], cat_len, cat_hold,
                               cat_res, cat_dur, n_res, forward, tol, keep, t0, s0, _YES, trace)
            runs += m
            if k != keep:
                choice[i] = k
                bwd, last, sdone = _resimulate(gaps, size_idx, lane, choice, i, cat_len,
                                               cat_hold, cat_res, cat_dur, n_res, task_start,
                                               task_end, spare, trace)
                runs += 1
                trace, spare = spare, trace
                swapped = not swapped
                t0 = forward + max(bwd, last)
                s0 = sdone
            # a compressed option outside the tensor's placements: its own placements next
            inside = step == 1 or not compressed[k]
            if placed >= 0:
                for c in range(ptab.shape[1]):
                    inside = inside or ptab[placed, c] == k
            if inside:
                break
            if prow[k] < 0:
                return k, q, True, runs, t0, s0, swapped
            step = 1
    return _NONE, order.shape[0], False, runs, t0, s0, swapped


@numba.njit(cache=True)
def _time_below(gaps, size_idx, lane, work, cat_len, cat_hold, cat_res, cat_dur, forward, bound,  # noqa: PLR0917
                follow, trace, first, last, state, dummy, none):  # pragma: no cover - compiled
    """Iteration time of ``work`` if it is below ``bound``, else inf (the run stops as soon as
    its lower bound reaches ``bound``). follow: ``trace`` is the trace of a strategy that
    differs from ``work`` only at tensors first..last; the run starts from its state before
    ``first`` (where traced) and follows it after ``last`` (_advance). state: the caller's
    room for the run (_run_room), emptied here; dummy and none: unused outputs."""
    starts, ends, count, acc = state
    count[:] = 0
    acc[:] = 0.0
    j0 = _I0
    if follow and first > 0 and _from_trace(starts, ends, count, acc, first - 1, trace):
        j0 = first
    ok = _advance(starts, ends, count, acc, gaps, size_idx, lane, work, j0, gaps.shape[0], last,
                  work[max(last, 0)], cat_len, cat_hold, cat_res, cat_dur, forward, bound, -np.inf,
                  0.0, False, dummy, dummy, none, follow, trace)
    if ok:
        t = forward + max(acc[0], acc[1])
        if t < bound:
            return t
    return np.inf


@numba.njit(cache=True)
def _best_group(gaps, size_idx, lane, choice, members, cands, cat_len, cat_hold,  # noqa: PLR0917
                cat_res, cat_dur, n_res, forward, current, tol, follow,
                trace):  # pragma: no cover - compiled
    """The candidate that, given to every tensor in ``members`` (others as in choice), gives
    an iteration time below current - tol, the lowest such; (-1, current) if none does.
    follow: ``trace`` is choice's own (_time_below)."""
    work = choice.copy()
    best_k = -1
    best_t = current
    if cands.shape[0] == 0:  # nothing to run (nor room to make: the catalogue may be empty)
        return best_k, best_t
    first, last = members.min(), members.max()
    state = _run_room(n_res, gaps.shape[0], cat_len, lane)
    dummy = np.zeros((1, 1))
    none = _no_trace()
    for c in range(cands.shape[0]):
        for m in range(members.shape[0]):
            work[members[m]] = cands[c]
        t = _time_below(gaps, size_idx, lane, work, cat_len, cat_hold, cat_res, cat_dur, forward,
                        best_t - tol, follow, trace, first, last, state, dummy, none)
        if t < best_t - tol:
            best_k = cands[c]
            best_t = t
    return best_k, best_t


@numba.njit(cache=True)
def _group_pass(gaps, size_idx, lane, choice, members, members_len, front, front_len, cat_len,  # noqa: PLR0917
                cat_hold, cat_res, cat_dur, n_res, forward, tol, trace, spare, task_start,
                task_end, stop):  # pragma: no cover - compiled
    """Algorithm 1's group moves (search._group_moves): for each group g in turn (its tensors
    members[g, :members_len[g]], all of one size u), until the iteration time is at most
    ``stop``, the candidate of front[u, :front_len[u]] that, given to all its tensors, gives
    the shortest
    iteration below the current one (_best_group, following the current schedule's trace,
    which is retraced after each move into ``trace``/``spare`` in turn). ``choice`` is
    changed in place. Returns (the iteration time of ``choice``, the runs)."""
    bwd, last, _ = _simulate(gaps, size_idx, lane, choice, cat_len, cat_hold, cat_res, cat_dur,
                             n_res, _YES, task_start, task_end, trace)
    t0 = forward + max(bwd, last)
    runs = 1
    for g in range(members.shape[0]):
        if t0 <= stop:
            break
        group = members[g, :members_len[g]]
        u = size_idx[group[0]]
        k, _ = _best_group(gaps, size_idx, lane, choice, group, front[u, :front_len[u]], cat_len,
                           cat_hold, cat_res, cat_dur, n_res, forward, t0, tol, _YES, trace)
        runs += front_len[u]
        if k >= 0:
            for m in range(group.shape[0]):
                choice[group[m]] = k
            bwd, last, _ = _simulate(gaps, size_idx, lane, choice, cat_len, cat_hold, cat_res,
                                     cat_dur, n_res, _YES, task_start, task_end, spare)
            runs += 1
            trace, spare = spare, trace
            t0 = forward + max(bwd, last)
    return t0, runs


@numba.njit(cache=True)
def _best_row(gaps, size_idx, lane, rows, cat_len, cat_hold, cat_res, cat_dur,  # noqa: PLR0917
              n_res, forward, current, tol):  # pragma: no cover - compiled
    """The first row (a strategy) of the lowest iteration time below current - tol, taken in
    order as a running best; (-1, current) if none is below."""
    best_r = -1
    best_t = current
    if rows.shape[0] == 0:
        return best_r, best_t
    state = _run_room(n_res, gaps.shape[0], cat_len, lane)
    dummy = np.zeros((1, 1))
    none = _no_trace()
    for r in range(rows.shape[0]):
        t = _time_below(gaps, size_idx, lane, rows[r], cat_len, cat_hold, cat_res, cat_dur, forward,
                        best_t - tol, _NO, none, _I0, _NONE, state, dummy, none)
        if t < best_t - tol:
            best_r = r
            best_t = t
    return best_r, best_t


@numba.njit(cache=True)
def _exhaustive(gaps, size_idx, lane, allowed, n_allowed, cat_len, cat_hold,  # noqa: PLR0917
                cat_res, cat_dur, n_res, forward):  # pragma: no cover - compiled
    """Every combination of allowed[i, :n_allowed[i]]; returns (best time, best choice)."""
    n = gaps.shape[0]
    digit = np.zeros(n, dtype=np.int64)
    choice = np.empty(n, dtype=np.int64)
    best_choice = np.empty(n, dtype=np.int64)
    dummy = np.zeros((1, 1))
    none = _no_trace()
    best = np.inf
    while True:
        for i in range(n):
            choice[i] = allowed[i, digit[i]]
        bwd, last, _ = _simulate(gaps, size_idx, lane, choice, cat_len, cat_hold, cat_res, cat_dur,
                                 n_res, _NO, dummy, dummy, none)
        t = forward + max(bwd, last)
        if t < best - 1e-9:
            best = t
            best_choice[:] = choice
        k = n - 1
        while k >= 0:
            digit[k] += 1
            if digit[k] < n_allowed[k]:
                break
            digit[k] = 0
            k -= 1
        if k < 0:
            break
    return best, best_choice


@numba.njit(cache=True)
def _save(lv, starts, ends, count, acc, s_st, s_en, s_ct, s_ac):  # pragma: no cover  # noqa: PLR0917
    width = count.max()
    s_st[lv, :, :width] = starts[:, :width]
    s_en[lv, :, :width] = ends[:, :width]
    s_ct[lv] = count
    s_ac[lv] = acc


@numba.njit(cache=True)
def _restore(lv, starts, ends, count, acc, s_st, s_en, s_ct, s_ac):  # pragma: no cover  # noqa: PLR0917
    count[:] = s_ct[lv]
    acc[:] = s_ac[lv]
    width = count.max()
    starts[:, :width] = s_st[lv, :, :width]
    ends[:, :width] = s_en[lv, :, :width]


@numba.njit(cache=True)
def _placement_masks(i, tunit, tbits, switched, masks):  # pragma: no cover - compiled
    """Tensor i's placement masks still open (the switched units' steps on the CPU, any
    subset of the others) into ``masks``; returns how many."""
    fixed = 0
    free = 0
    for k in range(tunit.shape[1]):
        u = tunit[i, k]
        if u >= 0:
            if switched[u]:
                fixed |= tbits[i, k]
            else:
                free |= 1 << k
    m = 0
    s = free
    while True:
        mask = fixed
        for k in range(tunit.shape[1]):
            if (s >> k) & 1:
                mask |= tbits[i, k]
        masks[m] = mask
        m += 1
        if s == 0:
            break
        s = (s - 1) & free
    return m


@numba.njit(cache=True)
def _tail_bound(starts, ends, count, acc, gaps, lane, j, tunit, tbits, table, switched,  # noqa: PLR0912, PLR0917
                busy, total, held, cum, forward, bound, masks):  # pragma: no cover - compiled
    """A lower bound of the iteration time of every completion once tensors ..j-1 are
    scheduled (``switched``: the units already on the CPU); inf where none can get below
    ``bound``. Tensor i >= j is ready at acc[0] + (cum[i] - cum[j - 1]) at the earliest
    (cum: the cumulative backward segments) and takes a placement mask that table[i] allows
    with the switched units' steps on the CPU; busy (n, M, R), total (n, M) and held (n, M:
    the tasks before the in-flight step, the least time it keeps its lane) per mask.
    One pass over the remaining tensors, last first:

    1. A placement is excluded where even alone it cannot finish below ``bound``: ready at
       the earliest, its time alone, or (with lanes) its time held plus the shortest time in
       which the later tensors of its lane, which wait for the lane, end.
    2. Each resource must still run what is placed after tensor j's ready time plus, per
       later tensor, its least busy time over the placements left (the GPU also the
       backward segments after j).
    3. Each lane runs its remaining tensors in order, each no earlier than its ready time
       and no earlier than the one before it let the lane go: from any of them on, the lane
       ends no earlier than its start plus the longer of its shortest time alone and its
       shortest time held plus that bound for the next; and no tensor starts before the
       lane's free time (without lanes: each tensor alone).

    masks (2^Q,): work space."""
    n = gaps.shape[0]
    base = acc[0] - (cum[j] - gaps[j])  # + cum[i]: tensor i's earliest ready time
    n_lanes = acc.shape[0] - 3
    n_res = busy.shape[2]
    after = np.zeros(max(n_lanes, 1))  # per lane, the least time from its next start to its end
    need = np.zeros(n_res)
    need[GPU] = cum[n - 1] - cum[j]
    least = np.empty(n_res)
    low = 0.0
    for i in range(n - 1, j - 1, -1):
        q = lane[i]
        later = after[q] if q >= 0 else 0.0
        lim = bound - forward - base - cum[i]
        if tunit[i, 0] < 0:  # not offloadable: its one option
            short = total[i, 0]
            hold = held[i, 0]
            if max(short, hold + later) >= lim:
                return np.inf
            for r in range(n_res):
                need[r] += busy[i, 0, r]
        else:
            short = np.inf
            hold = np.inf
            least[:] = np.inf
            m = _placement_masks(i, tunit, tbits, switched, masks)
            for k in range(m):
                mask = masks[k]
                if table[i, mask] >= 0 and max(total[i, mask], held[i, mask] + later) < lim:
                    short = min(short, total[i, mask])
                    hold = min(hold, held[i, mask])
                    for r in range(n_res):
                        least[r] = min(least[r], busy[i, mask, r])
            if short == np.inf:
                return np.inf
            for r in range(n_res):
                need[r] += least[r]
        if q >= 0:
            after[q] = max(short, hold + later)
            low = max(low, base + cum[i] + after[q])
        else:
            low = max(low, base + cum[i] + short)
    for q in range(n_lanes):
        low = max(low, acc[3 + q] + after[q])
    ready = base + cum[j]
    for r in range(n_res):
        k = count[r] - 1
        while k >= 0 and ends[r, k] > ready:
            need[r] += ends[r, k] - max(starts[r, k], ready)
            k -= 1
        low = max(low, ready + need[r])
    return forward + low


@numba.njit(cache=True)
def _offload_search(gaps, size_idx, lane, choice, tunit, tbits, table, n_units, cat_len,  # noqa: PLR0912, PLR0915, PLR0917
                    cat_hold, cat_res, cat_dur, n_res, forward, best_t, tol, node_limit, busy,
                    total, held, cum):  # pragma: no cover - compiled
    """Branch and bound over Algorithm 2's traversal: each unit (a set of Comp/Decomp steps of
    a group of tensors, members in backward order) is switched to the CPU at one member, and
    then stays switched for every later member (offloading ``c`` of a group = its last ``c``
    members). Tensor i's placement is the OR of tbits[i, q] over its switched units tunit[i, q];
    table[i, mask] is the option of that placement (-1: not allowed).

    Depth-first in backward order; the schedule of the prefix is kept per branching tensor and
    restored for each sibling, and a branch is cut as soon as a lower bound shows it cannot get
    strictly below the best time so far: _advance's, and at each branching tensor j
    _tail_bound's (resources, lanes and the placements still open to tensors j..: busy
    (n, M, R) and total (n, M) per placement mask of table, cum the cumulative backward
    segments). Returns (best time, best choice, nodes, complete): complete is False when
    node_limit nodes were visited first."""
    n = gaps.shape[0]
    cap = _capacity(choice, cat_len) + cat_len.max()
    starts, ends, count, acc = _schedule_state(n_res, cap, lane)
    nxt = np.full(n + 1, n, dtype=np.int64)  # first branching tensor >= i
    for i in range(n - 1, -1, -1):
        nxt[i] = i if tunit[i, 0] >= 0 else nxt[i + 1]
    levels = 1
    for i in range(n):
        if tunit[i, 0] >= 0:
            levels += 1
    s_st = np.empty((levels, n_res, cap))
    s_en = np.empty((levels, n_res, cap))
    s_ct = np.empty((levels, n_res), dtype=np.int64)
    s_ac = np.empty((levels, acc.shape[0]))
    lv_b = np.zeros(levels, dtype=np.int64)
    lv_free = np.zeros(levels, dtype=np.int64)
    lv_next = np.zeros(levels, dtype=np.int64)
    lv_sub = np.zeros(levels, dtype=np.int64)
    switched = np.zeros(max(n_units, 1), dtype=np.bool_)
    work = choice.copy()
    best_choice = choice.copy()
    dummy = np.zeros((1, 1))
    none = _no_trace()
    q_max = tunit.shape[1]
    masks = np.empty(1 << q_max, dtype=np.int64)
    depth = _I0
    nodes = 0
    j0, j1 = _I0, nxt[0]
    while True:
        # (A) schedule tensors j0..j1-1 (their options fixed), open a level at branch j1
        nodes += 1
        ok = _advance(starts, ends, count, acc, gaps, size_idx, lane, work, j0, j1, _NONE, _I0,
                      cat_len, cat_hold, cat_res, cat_dur, forward, best_t, -np.inf, tol, False,
                      dummy, dummy, none, _NO, none)
        if ok and j1 == n:
            t = forward + max(acc[0], acc[1])
            if t < best_t - tol:
                best_t = t
                best_choice[:] = work
        elif ok and _tail_bound(starts, ends, count, acc, gaps, lane, j1, tunit, tbits, table,
                                switched, busy, total, held, cum, forward, best_t - tol,
                                masks) < best_t - tol:
            _save(depth, starts, ends, count, acc, s_st, s_en, s_ct, s_ac)
            free = 0
            for q in range(q_max):
                u = tunit[j1, q]
                if u >= 0 and not switched[u]:
                    free |= 1 << q
            lv_b[depth] = j1
            lv_free[depth] = free
            lv_next[depth] = 0
            lv_sub[depth] = 0
            depth += 1
        if nodes >= node_limit:
            return best_t, best_choice, nodes, False
        # (B) the next sibling of the deepest open level
        found = False
        while depth > 0 and not found:
            lv = depth - 1
            b = lv_b[lv]
            for q in range(q_max):  # undo the previous sibling's switches
                if (lv_sub[lv] >> q) & 1:
                    switched[tunit[b, q]] = False
            lv_sub[lv] = 0
            s = lv_next[lv]
            free = lv_free[lv]
            while s < (1 << q_max) and (s & ~free) != 0:
                s += 1
            if s >= (1 << q_max):
                depth -= 1
                continue
            lv_next[lv] = s + 1
            mask = 0
            for q in range(q_max):
                u = tunit[b, q]
                if u >= 0 and (switched[u] or (s >> q) & 1):
                    mask |= tbits[b, q]
            opt = table[b, mask]
            if opt < 0:
                continue
            for q in range(q_max):
                if (s >> q) & 1:
                    switched[tunit[b, q]] = True
            lv_sub[lv] = s
            _restore(lv, starts, ends, count, acc, s_st, s_en, s_ct, s_ac)
            work[b] = opt
            j0, j1 = b, nxt[b + 1]
            found = True
        if not found:
            return best_t, best_choice, nodes, True


@dataclass(frozen=True)
class Task:
    """One scheduled task: which tensor and step, where, when (microseconds)."""

    tensor: int
    step: int
    resource: str
    start_us: float
    end_us: float


@dataclass(frozen=True)
class Timeline:
    """A simulated iteration.

    Attributes:
        iteration_us: forward + max(backward end, last task end).
        forward_us / backward_end_us / comm_end_us: the parts of that maximum.
        ready_us / done_us: per tensor, gradient ready and fully synchronized.
        tasks: every task, in tensor then step order.
        options: the option of each tensor.
    """

    iteration_us: float
    forward_us: float
    backward_end_us: float
    comm_end_us: float
    ready_us: np.ndarray
    done_us: np.ndarray
    tasks: tuple[Task, ...]
    options: tuple[Option, ...]


def index_table(rows: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """``rows`` (index arrays) as one (rows, longest) int64 array, -1 padded (at least
    1 x 1), and each row's length: the kernels' form of a list of index arrays."""
    lengths = np.array([len(r) for r in rows], dtype=np.int64)
    table = np.full((max(len(rows), 1), max(lengths.max(initial=0), 1)), -1, dtype=np.int64)
    for k, r in enumerate(rows):
        table[k, : len(r)] = r
    return table, lengths


def _new_trace(n: int, lanes: int) -> tuple:  # type: ignore[type-arg]
    """Room for the trace of a run of n tensors (see ``_trace_state``)."""
    n_res = len(RESOURCES)
    return (np.zeros(n), np.zeros(n), np.zeros((n, lanes)), np.zeros((n, n_res), dtype=np.int64),
            np.zeros(n + 1, dtype=np.int64), np.empty((n * n_res * TRACE_ROOM, 2)))


class Schedule(NamedTuple):
    """A simulated strategy, as the search compares and follows it.

    Attributes:
        iteration_us / sum_done_us: the iteration time and the sum of the tensors'
            synchronized times, the (time, tie-break) pair :meth:`Evaluator.best_of` compares.
        ready_us / done_us: per tensor, gradient ready and fully synchronized.
        trace: the state after each tensor that best_of follows (``_trace_state``).
    """

    iteration_us: float
    sum_done_us: float
    ready_us: np.ndarray
    done_us: np.ndarray
    trace: tuple  # type: ignore[type-arg]


class Catalogue:
    """Priced options as the arrays the kernels read, shared by every evaluator of workloads
    with the same distinct sizes on the same pricer (a strategy is a catalogue index per
    tensor). Options are only ever added, so indices stay valid.

    Attributes:
        options / index: the options in catalogue order, and option -> index.
        res (O, L) / dur (O, U, L) / len (O,): each option's task resources, durations per
            distinct size and task count (rows past ``len(options)`` are spare capacity).
        hold (O,): where the cluster models lanes, the task at which the option lets its
            lane go: the first of its in-flight step (:attr:`Program.in_flight`), whose
            issue frees the lane, or ``len`` (the lane is held to the end).
        busy (O, U, R) / total (O, U): each option's busy time per resource and its time
            alone (:class:`StepTasks`), for the bounds of Algorithm 2.
    """

    def __init__(self, pricer: Pricer):
        self.pricer = pricer
        self.options: list[Option] = []
        self.index: dict[Option, int] = {}
        self.res = np.zeros((0, 1), dtype=np.int64)
        self.dur = np.zeros((0, len(pricer.numels), 1))
        self.len = np.zeros(0, dtype=np.int64)
        self.hold = np.zeros(0, dtype=np.int64)
        self.busy = np.zeros((0, len(pricer.numels), len(RESOURCES)))
        self.total = np.zeros((0, len(pricer.numels)))
        self._compressed = np.zeros(0, dtype=np.bool_)

    @property
    def compressed(self) -> np.ndarray:
        """(O,) whether each option is compressed (:attr:`Option.is_compressed`), extended
        as options are added."""
        have = self._compressed
        if len(have) < len(self.options):
            self._compressed = have = np.concatenate([have, np.array(
                [o.is_compressed for o in self.options[len(have):]], dtype=np.bool_)])
        return have

    def add(self, options: Sequence[Option],
            priced: Sequence[StepTasks] | None = None) -> list[int]:
        """Add options and return their indices; ``priced`` gives their tasks (in the order of
        ``options``) when the caller has them, else the pricer prices them now, in one batch
        (:meth:`Pricer.batch`). The arrays grow by doubling, so adding options one group at
        a time stays linear."""
        index = self.index
        new = [o for o in dict.fromkeys(options) if o not in index]
        if new:
            if priced is not None:
                given = dict(zip(options, priced, strict=True))
                batches = [PricedBatch(np.array([k]), p.resource[None], p.duration[None])
                           for k, p in enumerate(given[o] for o in new)]
            else:
                batches = self.pricer.batch(new)
            self.add_batches(new, batches)
        return [index[o] for o in options]

    def add_batches(self, new: Sequence[Option], batches: Sequence[PricedBatch]) -> None:
        """Append ``new`` options (none catalogued yet, no repeats), priced as ``batches``
        (positions into ``new``), in the order of ``new``."""
        n_old = len(self.options)
        n_all = n_old + len(new)
        width = max(self.res.shape[1], *(b.resource.shape[1] for b in batches))
        if n_all > self.res.shape[0] or width > self.res.shape[1]:
            rows = max(n_all, 2 * self.res.shape[0], 64)
            res = np.zeros((rows, width), dtype=np.int64)
            dur = np.zeros((rows, len(self.pricer.numels), width))
            lens = np.zeros(rows, dtype=np.int64)
            hold = np.zeros(rows, dtype=np.int64)
            busy = np.zeros((rows, *self.busy.shape[1:]))
            total = np.zeros((rows, self.total.shape[1]))
            res[:n_old, : self.res.shape[1]] = self.res[:n_old]
            dur[:n_old, :, : self.dur.shape[2]] = self.dur[:n_old]
            lens[:n_old] = self.len[:n_old]
            hold[:n_old] = self.hold[:n_old]
            busy[:n_old] = self.busy[:n_old]
            total[:n_old] = self.total[:n_old]
            self.res, self.dur, self.len, self.hold = res, dur, lens, hold
            self.busy, self.total = busy, total
        lanes = bool(self.pricer.cluster.lanes)
        for b in batches:
            rows = n_old + b.positions
            n_tasks = b.resource.shape[1]
            self.res[rows, :n_tasks] = b.resource
            self.dur[rows, :, :n_tasks] = b.duration
            self.len[rows] = n_tasks
            self.busy[rows] = b.busy
            self.total[rows] = b.total
            self.hold[rows] = [self.pricer.lane_hold(new[k], n_tasks)
                               for k in b.positions.tolist()] if lanes else n_tasks
        self.index.update(zip(new, range(n_old, n_all), strict=True))
        self.options.extend(new)


class Evaluator:
    """Fast iteration-time evaluation of per-tensor choices among a fixed option list.

    Args:
        workload: tensors and ready gaps.
        pricer: prices options for the workload's distinct sizes.
        options: the candidate options; a strategy is an index into them per tensor.
        catalogue: the priced options to share (default: a new one for ``pricer``).
        size_idx: each tensor's index among the pricer's distinct sizes (default: by element
            count; a low-rank compressor's sizes also depend on shapes, ``PlanContext``).
    """

    def __init__(self, workload: Workload, pricer: Pricer, options: Sequence[Option],
                 catalogue: Catalogue | None = None, size_idx: np.ndarray | None = None):
        self.workload = workload
        self.pricer = pricer
        if size_idx is None:  # each tensor's distinct size, by element count
            uniq = {int(n): i for i, n in enumerate(pricer.numels)}
            try:
                size_idx = np.array([uniq[t.numel] for t in workload.tensors], dtype=np.int64)
            except KeyError as exc:
                raise ValueError(f"the pricer lacks tensor size {exc.args[0]}") from None
        self.size_idx = np.asarray(size_idx, dtype=np.int64)
        self.gaps = np.array([t.ready_gap_us for t in workload.tensors], dtype=np.float64)
        lanes = pricer.cluster.lanes
        # Each tensor's executor lane, or -1 everywhere when the cluster sets no lane count.
        self.lane = np.array([lane_of(t.name, lanes) if lanes else -1
                              for t in workload.tensors], dtype=np.int64)
        # the lanes a trace records
        self._lanes = max(int(self.lane.max()) + 1, 0) if len(self.lane) else 0
        self.forward_us = workload.forward_time_us
        self.catalogue = catalogue if catalogue is not None else Catalogue(pricer)
        self.add(options)
        self.calls = 0
        self._dummy = np.zeros((1, 1))  # unused outputs of unrecorded runs
        self._no_trace = _no_trace()

    @property
    def options(self) -> list[Option]:
        return self.catalogue.options

    @property
    def index(self) -> dict[Option, int]:
        return self.catalogue.index

    @property
    def _res(self) -> np.ndarray:
        return self.catalogue.res

    @property
    def _dur(self) -> np.ndarray:
        return self.catalogue.dur

    @property
    def _len(self) -> np.ndarray:
        return self.catalogue.len

    @property
    def _hold(self) -> np.ndarray:
        return self.catalogue.hold

    def add(self, options: Sequence[Option],
            priced: Sequence[StepTasks] | None = None) -> list[int]:
        """Add options to the catalogue (:meth:`Catalogue.add`) and return their indices."""
        return self.catalogue.add(options, priced)

    def _run(self, choice: np.ndarray):  # type: ignore[no-untyped-def]
        """Simulate ``choice`` recording every task and the trace best_of follows."""
        n = len(self.gaps)
        width = self._res.shape[1]
        n_res = len(RESOURCES)
        ts = np.zeros((n, width))
        te = np.zeros((n, width))
        trace = _new_trace(n, self._lanes)
        bwd, last, sdone = _simulate(self.gaps, self.size_idx, self.lane, choice, self._len,
                                     self._hold, self._res, self._dur, n_res, True, ts, te, trace)
        self.calls += 1
        return bwd, last, sdone, ts, te, trace

    def exhaustive(self, allowed: Sequence[Sequence[int]]) -> tuple[float, np.ndarray]:
        """The fastest combination of per-tensor option indices (every one is simulated)."""
        width = max(len(a) for a in allowed)
        table = np.zeros((len(allowed), width), dtype=np.int64)
        for i, a in enumerate(allowed):
            table[i, : len(a)] = a
        counts = np.array([len(a) for a in allowed], dtype=np.int64)
        best, choice = _exhaustive(self.gaps, self.size_idx, self.lane, table, counts, self._len,
                                   self._hold, self._res, self._dur, len(RESOURCES),
                                   self.forward_us)
        self.calls += int(np.prod(counts.astype(np.float64)))
        return float(best), choice

    def best_of(self, choice: np.ndarray, i: int, candidates: np.ndarray,
                tol: float = 1e-6, current: tuple[float, float] | Schedule | None = None) \
            -> tuple[int, float]:
        """The candidate option index for tensor ``i`` (others as in ``choice``) with the
        lowest (iteration time, sum of synchronized times), earlier candidates winning ties.

        ``current``: ``choice``'s own :meth:`schedule` (or its first two fields, the iteration
        time and the sum of synchronized times); then ``choice[i]`` is the incumbent that every
        candidate must beat (ties keep it) and is not simulated again. With the whole
        Schedule, a candidate's run stops simulating at the first tensor after which its
        state is the schedule's, or the schedule's shifted in time (the rest is read from its
        trace: the same answer, sooner; after a shift, times equal to within SHIFT_TOL).
        Returns (index, iteration time)."""
        cands = np.asarray(candidates, dtype=np.int64)
        choice = np.asarray(choice, dtype=np.int64)
        k0, t0, s0 = -1, np.inf, np.inf
        trace = current.trace if isinstance(current, Schedule) else None
        if current is not None:
            k0, t0, s0 = int(choice[i]), current[0], current[1]
            cands = cands[cands != k0]
        k, t, _ = _best_of(self.gaps, self.size_idx, self.lane, choice, i, cands, self._len,
                           self._hold, self._res, self._dur, len(RESOURCES), self.forward_us, tol,
                           k0, float(t0), float(s0), trace is not None,
                           trace if trace is not None else self._no_trace)
        self.calls += len(cands)
        return int(k), float(t)

    def greedy_pass(self, choice: np.ndarray, order: np.ndarray, *, front: np.ndarray,
                    front_len: np.ndarray, plain: np.ndarray, bubbles: bool,
                    current: Schedule, tol: float = 1e-6, stop_us: float = -np.inf) -> bool:
        """One pass of Algorithm 1 over the tensors of ``order`` in one kernel call, the same
        as this loop, bit for bit (``choice`` is changed in place; returns whether it was)::

            for i in order:
                if current.iteration_us <= stop_us:
                    break
                keep = choice[i]
                if bubbles and i + 1 < n and plain[keep] \\
                        and current.done_us[i] <= current.ready_us[i + 1]:
                    continue
                k, _ = self.best_of(choice, i, front[u, :front_len[u]], tol, current)
                if k != keep:
                    choice[i] = k
                    current = self.reschedule(choice, i, current)

        (u: tensor i's size index; ``plain``: per catalogued option, whether it is
        uncompressed). Called one by one, the best_of and reschedule calls of a warm
        ResNet101 plan spent about 3 ms in Python and argument conversion. ``current``'s
        trace becomes the kernel's work space: do not follow it afterwards."""
        n = len(self.gaps)
        width = self._res.shape[1]
        changed, runs = _greedy_pass(
            self.gaps, self.size_idx, self.lane, choice, np.asarray(order, dtype=np.int64),
            plain, front, front_len, bool(bubbles), self._len, self._hold, self._res, self._dur,
            len(RESOURCES), self.forward_us, tol, float(current.iteration_us),
            float(current.sum_done_us), current.trace, _new_trace(n, self._lanes),
            np.empty((n, width)), np.empty((n, width)), float(stop_us))
        self.calls += int(runs)
        return bool(changed)

    def refine_devices(self, choice: np.ndarray, order: Sequence[int], *,
                       placements: Callable[[int], np.ndarray],
                       made: Mapping[int, np.ndarray], cpu_front: np.ndarray,
                       cpu_front_len: np.ndarray, current: Schedule, tol: float = 1e-6,
                       stop_us: float = -np.inf) -> None:
        """The device refinement (search._refine_devices) over the tensors of ``order``,
        mostly in one kernel call (``_refine_pass``); ``choice`` is changed in place, the
        same as this loop, bit for bit::

            for i in order:
                if current.iteration_us <= stop_us:
                    break
                keep = choice[i]
                if options[keep].is_compressed:
                    placed = placements(keep)[placements(keep) >= 0]
                    candidates = np.union1d(placed, cpu_compressed[u])
                elif i + 1 < n and current.done_us[i] <= current.ready_us[i + 1]:
                    continue
                else:
                    placed, candidates = [], cpu_front[u]
                current = take_best(i, candidates, current)
                taken = choice[i]
                if options[taken].is_compressed and taken not in placed:
                    table = placements(taken)
                    current = take_best(i, table[table >= 0], current)

        (u: tensor i's size index; cpu_front[u]: cpu_front[u, :cpu_front_len[u]], the host
        front as ``Fronts.table`` and ``Fronts.count`` hold it; cpu_compressed[u]: its
        compressed options, in order; take_best: :meth:`best_of` with ``current``, and
        :meth:`reschedule` where it changed). ``placements(k)``: option k's placement table
        (PlanContext.placements), asked for in the loop's order, since it may add options;
        ``made``: the tables made before (by option), used without asking.
        Called one by one, the best_of and reschedule calls of a warm UGATIT plan spent
        about 2 ms in Python and argument conversion. ``current``'s trace becomes the kernel's
        work space: do not follow it afterwards."""
        n = len(self.gaps)
        order = np.asarray(order, dtype=np.int64)
        work = np.asarray(choice, dtype=np.int64)
        compressed = self.catalogue.compressed
        tables: list[np.ndarray] = []
        prow = np.full(len(self.options), -1, dtype=np.int64)
        rows: dict[int, int] = {}  # id of a made table -> its row (a form's share one)
        for k, table in made.items():
            row = rows.setdefault(id(table), len(tables))
            if row == len(tables):
                tables.append(table)
            prow[k] = row
        q, taken_step, runs = 0, False, 0
        t0, s0 = float(current.iteration_us), float(current.sum_done_us)
        trace, spare = current.trace, _new_trace(n, self._lanes)
        while True:
            need, q, taken_step, more, t0, s0, swapped = _refine_pass(
                self.gaps, self.size_idx, self.lane, work, order, q, taken_step,
                compressed, index_table(tables)[0], prow, cpu_front, cpu_front_len, self._len,
                self._hold, self._res, self._dur, len(RESOURCES), self.forward_us, tol, t0, s0,
                trace, spare, np.empty((n, self._res.shape[1])),
                np.empty((n, self._res.shape[1])), float(stop_us))
            runs += int(more)
            if swapped:
                trace, spare = spare, trace
            if need < 0:
                break
            table = placements(int(need))  # may catalogue options: the arrays grow
            grown = len(self.options) - len(prow)
            if grown:
                compressed = self.catalogue.compressed
                prow = np.concatenate([prow, np.full(grown, -1, dtype=np.int64)])
            prow[table[table >= 0]] = len(tables)
            tables.append(table)
        if work is not choice:
            choice[:] = work
        self.calls += runs

    @staticmethod
    def warm_up() -> None:
        """Load (or compile) the kernels a plan runs. The exhaustive ones (bruteforce, the
        check of Algorithm 2) load on first use: a plan never runs them."""
        one = np.zeros(1, dtype=np.int64)
        lane = np.full(1, -1, dtype=np.int64)
        res = np.zeros((1, 1), dtype=np.int64)
        dur = np.ones((1, 1, 1))
        lens = np.ones(1, dtype=np.int64)
        none = _no_trace()
        n_res = len(RESOURCES)
        _simulate(np.ones(1), one, lane, one, lens, lens, res, dur, n_res, True,
                  np.zeros((1, 1)), np.zeros((1, 1)), _new_trace(1, 0))
        _best_of(np.ones(1), one, lane, one, 0, one, lens, lens, res, dur, n_res, 0.0, 1e-6,
                 -1, np.inf, np.inf, True, none)
        _greedy_pass(np.ones(1), one, lane, one.copy(), one, np.ones(1, dtype=np.bool_),
                     np.zeros((1, 1), dtype=np.int64), one, True, lens, lens, res, dur, n_res,
                     0.0, 1e-6, np.inf, np.inf, _new_trace(1, 0), _new_trace(1, 0),
                     np.zeros((1, 1)), np.zeros((1, 1)), -np.inf)
        _resimulate(np.ones(1), one, lane, one, 0, lens, lens, res, dur, n_res,
                    np.zeros((1, 1)), np.zeros((1, 1)), _new_trace(1, 0), _new_trace(1, 0))
        _refine_pass(np.ones(1), one, lane, one.copy(), one, 0, False, np.ones(1, dtype=np.bool_),
                     np.zeros((1, 1), dtype=np.int64), np.zeros(1, dtype=np.int64),
                     np.zeros((1, 1), dtype=np.int64), one, lens, lens, res, dur, n_res, 0.0,
                     1e-6, np.inf, np.inf,
                     _new_trace(1, 0), _new_trace(1, 0), np.zeros((1, 1)), np.zeros((1, 1)),
                     -np.inf)
        _best_group(np.ones(1), one, lane, one, one, one, lens, lens, res, dur, n_res, 0.0,
                    np.inf, 1e-6, True, none)
        _group_pass(np.ones(1), one, lane, one.copy(), np.zeros((1, 1), dtype=np.int64), one,
                    np.zeros((1, 1), dtype=np.int64), one, lens, lens, res, dur, n_res, 0.0,
                    1e-6, _new_trace(1, 0), _new_trace(1, 0), np.zeros((1, 1)),
                    np.zeros((1, 1)), -np.inf)
        _offload_search(np.ones(1), one, lane, one, np.zeros((1, 1), dtype=np.int64),
                        np.ones((1, 1), dtype=np.int64), np.zeros((1, 2), dtype=np.int64), 1,
                        lens, lens, res, dur, n_res, 0.0, np.inf, 1e-6, 10,
                        np.zeros((1, 2, n_res)), np.zeros((1, 2)), np.zeros((1, 2)), np.ones(1))

    def best_group(self, choice: np.ndarray, members: np.ndarray, candidates: np.ndarray,
                   current: float | Schedule, tol: float = 1e-6) -> tuple[int, float]:
        """The candidate option that, given to all ``members`` at once, gives the shortest
        iteration below ``current - tol``; returns (index, time), or (-1, current).
        ``current``: an iteration time, or ``choice``'s own :meth:`schedule`, whose trace the
        runs then follow (as :meth:`best_of` does: the same answer, sooner)."""
        cands = np.asarray(candidates, dtype=np.int64)
        trace = current.trace if isinstance(current, Schedule) else None
        bound = current.iteration_us if isinstance(current, Schedule) else current
        k, t = _best_group(self.gaps, self.size_idx, self.lane, np.asarray(choice, dtype=np.int64),
                           np.asarray(members, dtype=np.int64), cands, self._len, self._hold,
                           self._res, self._dur, len(RESOURCES), self.forward_us, float(bound), tol,
                           trace is not None, trace if trace is not None else self._no_trace)
        self.calls += len(cands)
        return int(k), float(t)

    def group_moves(self, choice: np.ndarray, groups: Sequence[np.ndarray], *,
                    front: np.ndarray, front_len: np.ndarray, tol: float = 1e-6,
                    stop_us: float = -np.inf) -> float:
        """Algorithm 1's group moves (search._group_moves) in one kernel call, the same as
        this loop, bit for bit (``choice`` is changed in place; returns its iteration
        time)::

            now = self.schedule(choice)
            for members in groups:
                if now.iteration_us <= stop_us:
                    break
                u = self.size_idx[members[0]]
                k, _ = self.best_group(choice, members, front[u, :front_len[u]], now, tol)
                if k >= 0:
                    choice[members] = k
                    now = self.schedule(choice)

        (``groups``: the tensors of one size each; ``front``/``front_len``: the candidates
        per size, as ``Fronts.table`` and ``Fronts.count`` hold them.)"""
        n = len(self.gaps)
        members, members_len = index_table(groups)
        width = self._res.shape[1]
        work = np.asarray(choice, dtype=np.int64)
        t, runs = _group_pass(self.gaps, self.size_idx, self.lane, work, members, members_len,
                              front, front_len, self._len, self._hold, self._res, self._dur,
                              len(RESOURCES), self.forward_us, tol, _new_trace(n, self._lanes),
                              _new_trace(n, self._lanes), np.empty((n, width)),
                              np.empty((n, width)), float(stop_us))
        if work is not choice:
            choice[:] = work
        self.calls += int(runs)
        return float(t)

    def best_offload(self, choice: np.ndarray, tunit: np.ndarray, tbits: np.ndarray, *,
                     table: np.ndarray, n_units: int, current: float, tol: float = 1e-6,
                     node_limit: int = 1 << 62) -> tuple[np.ndarray, float, int, bool]:
        """The fastest strategy of Algorithm 2's traversal (see ``_offload_search``) that is
        strictly below ``current - tol``, else ``choice``. Returns (strategy, time, nodes
        visited, complete); it is the traversal's optimum whenever ``complete``."""
        t, best, nodes, complete = _offload_search(
            self.gaps, self.size_idx, self.lane, np.asarray(choice, dtype=np.int64),
            np.ascontiguousarray(tunit, dtype=np.int64),
            np.ascontiguousarray(tbits, dtype=np.int64),
            np.ascontiguousarray(table, dtype=np.int64), int(n_units), self._len, self._hold,
            self._res, self._dur, len(RESOURCES), self.forward_us, float(current), tol,
            int(node_limit), *self._tail_tables(table))
        self.calls += int(nodes)
        return best, float(t), int(nodes), bool(complete)

    def _tail_tables(self, table: np.ndarray) \
            -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The bound tables of ``_offload_search`` for tensors whose options are table[i]
        (entries >= 0): busy (n, M, R), total (n, M) and held (n, M) per placement mask, and
        the cumulative backward segments (n,). Only the allowed masks are looked up (the
        bounds read no other; the rest stays 0): most tensors allow one, and gathering every
        mask took UGATIT's plans 0.6-1.5 ms (148 tensors x 256 masks)."""
        i, mask = np.nonzero(table >= 0)
        cat = self.catalogue
        busy = np.zeros((*table.shape, cat.busy.shape[2]))
        total = np.zeros(table.shape)
        held = np.zeros(table.shape)
        rows, sizes = table[i, mask], self.size_idx[i]
        busy[i, mask] = cat.busy[rows, sizes]
        total[i, mask] = cat.total[rows, sizes]
        # the time of the tasks before each option's in-flight step (Catalogue.hold)
        before = np.arange(cat.dur.shape[2])[None, :] < cat.hold[rows][:, None]
        held[i, mask] = np.where(before, cat.dur[rows, sizes], 0.0).sum(axis=1)
        return busy, total, held, np.cumsum(self.gaps)

    def best_row(self, rows: np.ndarray, current: float, tol: float = 1e-6) \
            -> tuple[int, float]:
        """The first of ``rows`` (one strategy per row) with the shortest iteration below
        ``current - tol``; returns (row, time), or (-1, current). The same answer as
        evaluating the rows in order and keeping a running best, in one call."""
        rows = np.ascontiguousarray(rows, dtype=np.int64)
        r, t = _best_row(self.gaps, self.size_idx, self.lane, rows, self._len, self._hold,
                         self._res, self._dur, len(RESOURCES), self.forward_us, current, tol)
        self.calls += len(rows)
        return int(r), float(t)

    @property
    def floor_us(self) -> float:
        """No strategy's iteration is shorter: forward + the whole backward pass (tasks on the
        GPU only delay the backward segments; communication only adds after them)."""
        return self.forward_us + float(np.sum(self.gaps))

    def iteration_us(self, choice: np.ndarray) -> float:
        """Iteration time of ``choice`` (option index per tensor), microseconds."""
        bwd, last, _ = _simulate(self.gaps, self.size_idx, self.lane,
                                 np.asarray(choice, dtype=np.int64), self._len, self._hold,
                                 self._res, self._dur, len(RESOURCES), False, self._dummy,
                                 self._dummy, self._no_trace)
        self.calls += 1
        return self.forward_us + max(bwd, last)

    def ready_done(self, choice: np.ndarray) -> tuple[float, np.ndarray, np.ndarray]:
        """(iteration time, gradient ready times, synchronized times) per tensor."""
        got = self.schedule(choice)
        return got.iteration_us, got.ready_us, got.done_us

    def schedule(self, choice: np.ndarray) -> Schedule:
        """The :class:`Schedule` of ``choice``: its first two fields are what :meth:`best_of`
        compares, bit for bit."""
        bwd, last, sdone, _, _, trace = self._run(np.asarray(choice, dtype=np.int64))
        return Schedule(self.forward_us + max(bwd, last), sdone, trace[0], trace[1], trace)

    def reschedule(self, choice: np.ndarray, i: int, old: Schedule) -> Schedule:
        """The :class:`Schedule` of ``choice`` where ``old`` is the schedule of the same
        strategy but for tensor ``i`` (equal to :meth:`schedule`, bit for bit): the tensors
        before i are old's, and the rest is simulated from old's traced state before i until
        the run's state is old's again (as :meth:`best_of` follows a trace)."""
        choice = np.asarray(choice, dtype=np.int64)
        n = len(self.gaps)
        width = self._res.shape[1]
        trace = _new_trace(n, self._lanes)
        bwd, last, sdone = _resimulate(self.gaps, self.size_idx, self.lane, choice, int(i),
                                       self._len, self._hold, self._res, self._dur, len(RESOURCES),
                                       np.empty((n, width)), np.empty((n, width)), trace,
                                       old.trace)
        self.calls += 1
        return Schedule(self.forward_us + max(bwd, last), sdone, trace[0], trace[1], trace)

    def timeline(self, choice: np.ndarray) -> Timeline:
        """The full schedule of ``choice`` (for reports and plots)."""
        choice = np.asarray(choice, dtype=np.int64)
        bwd, last, _, ts, te, trace = self._run(choice)
        ready, done = trace[0], trace[1]
        tasks = []
        for i, o in enumerate(choice):
            priced = self.pricer.tasks(self.options[o])
            for j in range(int(self._len[o])):
                tasks.append(Task(i, int(priced.step[j]), RESOURCES[int(self._res[o, j])],
                                  float(ts[i, j]), float(te[i, j])))
        return Timeline(self.forward_us + max(bwd, last), self.forward_us, float(bwd),
                        float(last), ready, done, tuple(tasks),
                        tuple(self.options[o] for o in choice))


assert RESOURCES[GPU] == "gpu"
