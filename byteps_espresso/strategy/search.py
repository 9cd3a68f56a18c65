"""Espresso's search: Algorithm 1 (GPU compression, greedy) then Algorithm 2 (CPU offload).

Algorithm 1 (``gpu_greedy``)
    1. Start from the best uniform uncompressed strategy.
    2. Group moves (ours): for each group of equal-size tensors, largest first, try giving
       the whole group each non-dominated option at once. The same from a second start,
       every tensor on its fastest option in isolation; continue from the better one.
    3. Visit tensors grouped by size, largest first; within a size, closest to the output
       layer first (backward index 0 first).
    4. Skip tensors of sizes where no compressed option is non-dominated (their scheme was
       set by the group move), and an uncompressed tensor whose synchronization ends before
       the next gradient is ready (a bubble follows it: nothing later waits for it, so
       compressing it cannot shorten the iteration); re-checked on the current timeline
       before every decision.
    5. Otherwise try every non-dominated single-device option for its size (see
       :mod:`context`) with all other tensors fixed and keep the one with the lowest
       (iteration time, sum of synchronized times); ties keep the current choice.
    6. Repeat (GREEDY_PASSES passes at most, while something changes) over the tensors at
       least as large as the smallest compressed one.

Algorithm 2 (``cpu_offload``)
    1. Group the compressed all-GPU tensors by (size, option).
    2. Within a group, offloading ``c`` tensors means moving the compression of the ``c``
       tensors farthest from the output layer to the CPUs (the same option, all its
       Comp/Decomp on ``cpu``).
    3. Return the optimum over every combination of per-group counts, the paper's traversal
       (``offload_exhaustive`` simulates each one), found by a branch and bound over the
       tensors in backward order (:meth:`Evaluator.best_offload`): the same optimum, with the
       prefix schedule shared among siblings and branches cut by lower bounds.

Every phase stops once the iteration time is within :data:`OPTIMALITY_GAP` of the floor that
no strategy beats (forward + backward, :attr:`Evaluator.floor_us`), or at the lower bound no
strategy beats (:attr:`PlanContext.bound_us`: the plan is then optimal under the model):
Algorithm 1 before its next group move or decision, and Algorithm 2 and the refinements are
then skipped. Where the first start's group moves end within twice the gap, Algorithm 1
first continues from that start alone, and tries the second start only if that does not
reach the gap.

Refinement (ours, after Algorithm 2): each tensor with the others fixed tries every device
placement of its option's Comp/Decomp steps, one step at a time or together (so every Option
of the tree, mixed devices included, can be chosen), and the non-dominated compressed all-CPU
options of its size (host compression of another scheme: on BERT, 8 x 8 PCIe + 25 Gbit/s with
efsignsgd, 6.8% above the upper bound instead of 8.8% with the placements alone); an
uncompressed tensor not followed by a bubble tries the non-dominated all-CPU options of its
size. A tensor that took another option then tries its placements.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import logging
import math
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from byteps_espresso.strategy.context import Fronts, PlanContext
from byteps_espresso.strategy.options import Device

__all__ = ["GREEDY_PASSES", "INCUMBENT_AFTER", "INCUMBENT_NODES", "OFFLOAD_NODE_LIMIT",
           "OPTIMALITY_GAP", "OffloadUnits", "cpu_offload", "espresso", "gc_paused",
           "gpu_greedy", "offload_exhaustive", "offload_units", "stop_us", "uniform_best"]

log = logging.getLogger(__name__)

# Algorithm 2's branch and bound stops after this many search nodes (one node: one tensor
# placement scheduled on a restored prefix). Far above what the 8 x 8 workloads of
# benchmarks/plan.py need, with or without lanes (its table (d) lists the nodes: at most
# 35,138 there, BERT on PCIe + 25 Gbit/s with efsignsgd and 2 lanes, measured 2026-12-02);
# a stop is logged.
OFFLOAD_NODE_LIMIT = 2_000_000
# Nodes after which Algorithm 2, planning one of several bucket layouts, looks only for
# offloads below the best other layout's time (PlanContext.incumbent_us). Above the 35,138
# nodes the 8 x 8 workloads need at most, so that each layout's search stays exact where it is
# cheap. Without the cut, on layouts whose offloads all end within about 1% of each other
# (communication-bound iterations: ResNet50, BERT or UGATIT on 2 x 2 workers with lanes at
# 1 Gbit/s) a layout's search ran to OFFLOAD_NODE_LIMIT, 1.4-4.5 s each; ResNet50 with fp16
# gained 0.01% from its offloads on the one such layout whose search ended
# (BENCHMARKS.md, "Bucket layouts planned against the best so far").
INCUMBENT_AFTER = 50_000
# The nodes of that second search at most (a stop is logged, as OFFLOAD_NODE_LIMIT's), as many
# as the first: on the 40 start-up plans of benchmarks/plan.py (g) (LSTM, VGG16, ResNet50,
# BERT, UGATIT x 1 and 10 Gbit/s x random-k, DGC, EFSignSGD, fp16; 2 x 2 workers with lanes)
# 50,000 gave the same layouts, finalists and predicted times as 200,000, bit for bit, in
# 11.7 s instead of 25.0 s in all (BERT with fp16 at 10 Gbit/s: 1.0 s instead of 2.8). With
# lanes freed at the in-flight issue the lanes bound little and most such searches stop at
# the limit (BENCHMARKS.md, "A lane is free once its Option's in-flight collective is
# issued"). 200,000 had changed nothing against OFFLOAD_NODE_LIMIT on 30 of those plans
# before (BENCHMARKS.md, "Bucket layouts planned against the best so far").
INCUMBENT_NODES = 50_000
# Per-tensor passes of Algorithm 1. With the group moves one pass found the same or better
# strategies than two on the 24 workload settings and 100 random instances of
# benchmarks/plan.py (measured 2026-11-30), in less time.
GREEDY_PASSES = 1
# The search stops once the iteration is at most (1 + OPTIMALITY_GAP) x the floor no strategy
# beats (Evaluator.floor_us): what it could still gain is then below 0.1% of an iteration, far
# inside the cost model's own error (its predictions of trained iterations are 15-45% off,
# BENCHMARKS.md "End-to-end"). Without it, on workloads that already end near the floor
# (ResNet50/101 and VGG16 on NVLink + 100 Gbit/s: 0.02-0.07% above it) most of a plan traded
# tie-breaks of the sum of synchronized times for a gain of at most 0.01% of the iteration.
OPTIMALITY_GAP = 1e-3
# A plan within this relative distance of the lower bound (PlanContext.bound_us) is at it:
# the bound and a simulated iteration sum the same task times in other orders, which moves
# the last digits (benchmarks/plan.py --bound, 2026-12-03: the 19 plans at the bound are
# within 2.2e-16 of it, relative). Unlike OPTIMALITY_GAP, stopping there gives up nothing:
# no strategy is faster.
BOUND_ROUNDING = 1e-9
# Rounds of offload_descent at most (each round: every pair of units).
OFFLOAD_ROUNDS = 4


def uniform_best(ctx: PlanContext, candidates: list) -> np.ndarray:  # type: ignore[type-arg]
    """The single candidate option that is fastest when every tensor uses it."""
    idx = ctx.index(candidates)
    everyone = np.arange(ctx.n_tensors)
    k, _ = ctx.evaluator.best_group(np.zeros(ctx.n_tensors, dtype=np.int64), everyone, idx,
                                    np.inf)
    return np.full(ctx.n_tensors, k, dtype=np.int64)


def stop_us(ctx: PlanContext, gap: float | None = None, *, bound: bool = True,
            at: float | None = None) -> float:
    """The iteration time at which the search stops: within ``gap`` (default
    :data:`OPTIMALITY_GAP`) of the floor no strategy beats, or at the lower bound no strategy
    beats (:attr:`PlanContext.bound_us`, up to rounding: the plan is then optimal under the
    model); ``gap`` 0: never, the search runs to its end.

    The bound prices the whole tree's step settings (about a millisecond on a cold model),
    which plans that stop at the floor never pay: ``bound=False`` gives the floor's stop
    alone, and so does an iteration time ``at`` that the search reached within it."""
    gap = OPTIMALITY_GAP if gap is None else gap
    if gap <= 0:
        return -math.inf
    floor = ctx.evaluator.floor_us * (1.0 + gap)
    if not bound or (at is not None and at <= floor):
        return floor
    return max(floor, ctx.bound_us * (1.0 + BOUND_ROUNDING))


def gpu_greedy(ctx: PlanContext, choice: np.ndarray, device: Device = Device.GPU,
               use_bubbles: bool = True, passes: int = 1, *, gap: float | None = None) \
        -> np.ndarray:
    """Algorithm 1 on ``choice`` (modified copy returned), stopping within ``gap`` (default
    :data:`OPTIMALITY_GAP`) of the floor or at the lower bound (:func:`stop_us`)."""
    choice = choice.copy()
    gap = OPTIMALITY_GAP if gap is None else gap
    fronts = ctx.fronts(device)
    evaluator = ctx.evaluator
    size_idx = evaluator.size_idx
    n = ctx.n_tensors
    # Sizes whose non-dominated options are all uncompressed were decided by the group moves.
    order = [i for i in ctx.visit_order if size_idx[i] in fronts.compressible]
    plain = np.zeros(len(evaluator.options), dtype=np.bool_)
    plain[ctx.uncompressed_index()] = True

    def greedy(choice: np.ndarray) -> np.ndarray:
        visit = order
        for _ in range(passes):
            # steps 4 and 5 over ``visit``, in one kernel call (Evaluator.greedy_pass); ties
            # keep the current option, whose time the schedule already holds
            changed = evaluator.greedy_pass(choice, np.array(visit, dtype=np.int64),
                                            front=fronts.table, front_len=fronts.count,
                                            plain=plain, bubbles=use_bubbles,
                                            current=evaluator.schedule(choice), stop_us=stop)
            if not changed:
                break
            # Later passes revisit only sizes down to the smallest compressed tensor: below
            # it, compression lost everywhere in this pass.
            sizes = [ctx.workload.tensors[i].numel for i in range(n)
                     if evaluator.options[choice[i]].is_compressed]
            smallest = min(sizes, default=0)
            visit = [i for i in visit if ctx.workload.tensors[i].numel >= smallest]
        return choice

    # The first start's group moves stop at the floor's gap only: compute-bound workloads
    # end there without pricing the bound.
    t_choice = _group_moves(ctx, choice, fronts, stop_us(ctx, gap, bound=False))
    stop = stop_us(ctx, gap, at=t_choice)
    if t_choice <= stop:
        return choice
    ahead = None
    if t_choice <= stop_us(ctx, 2 * gap):
        # Within twice the gap the passes from this start alone usually reach the gap, and
        # then spare the second start's group moves (ResNet101 on 8 x 8 PCIe + 25 Gbit/s with
        # randomk: about 7 of a 15 ms plan). Where they do not, the plan is the one without
        # this shortcut: the same passes run from the better start.
        ahead = greedy(choice.copy())
        if ctx.iteration_us(ahead) <= stop:
            return ahead
    # Second start (ours): every tensor on its fastest option in isolation; keep the better.
    alone = fronts.fastest_alone[size_idx]
    if _group_moves(ctx, alone, fronts, stop) < t_choice - 1e-6:
        return greedy(alone)
    return ahead if ahead is not None else greedy(choice)


def _group_moves(ctx: PlanContext, choice: np.ndarray, fronts: Fronts, stop: float) -> float:
    """For each size group (largest first), try giving all its tensors one option of its
    size's front (in place), until the iteration time is at most ``stop``; returns the
    iteration time of the resulting ``choice``.

    Tensors of one size are interchangeable for the cost model; moving them together escapes
    the plateau where compressing any single one does not shorten the iteration because the
    others still hold the link."""
    return ctx.evaluator.group_moves(choice, list(ctx.size_groups.values()),
                                     front=fronts.table, front_len=fronts.count, stop_us=stop)


@dataclass(frozen=True)
class OffloadUnits:
    """Algorithm 2's traversal as tables for :meth:`Evaluator.best_offload`.

    Attributes:
        tunit: (tensors, Q) the units of each tensor, -1 padded (no unit: not offloadable).
        tbits: (tensors, Q) the compute steps (bit j: the j-th Comp/Decomp) each unit moves.
        table: (tensors, 2^m) the option of each placement mask (-1: not in the tree).
        members: per unit, its tensors in backward order.
    """

    tunit: np.ndarray
    tbits: np.ndarray
    table: np.ndarray
    members: list[list[int]]

    @property
    def combinations(self) -> int:
        """How many strategies the exhaustive traversal simulates: prod(members + 1)."""
        return math.prod(len(m) + 1 for m in self.members)


def offload_units(ctx: PlanContext, choice: np.ndarray, per_step: bool = False) -> OffloadUnits:
    """The groups of Algorithm 2 for ``choice``: tensors of one size with one all-GPU
    compressed option form a group; per_step makes each of the option's Comp/Decomp steps a
    unit of its own (offloaded independently, as the paper offloads compression operations),
    else the group is one unit moving all its steps (the option's all-CPU twin)."""
    options = ctx.evaluator.options
    n = ctx.n_tensors
    groups: dict[tuple[int, int], list[int]] = {}
    for i, k in enumerate(choice.tolist()):
        opt = options[k]
        if opt.is_compressed and opt.devices == {Device.GPU} and ctx.constraints.allow_cpu:
            groups.setdefault((ctx.workload.tensors[i].numel, k), []).append(i)
    entries: dict[int, list[tuple[int, int]]] = {}
    tables: dict[int, np.ndarray] = {}
    members: list[list[int]] = []
    for (_, k), group in groups.items():
        table = ctx.placements(k)
        m = len(table).bit_length() - 1
        masks = [1 << j for j in range(m)] if per_step else [(1 << m) - 1]
        masks = [b for b in masks if table[b] >= 0]  # the step alone may not be allowed
        if not per_step and not masks:
            continue
        for bits in masks:
            unit = len(members)
            members.append(group)
            for i in group:
                entries.setdefault(i, []).append((unit, bits))
                tables[i] = table
    width = max((len(e) for e in entries.values()), default=0)
    tunit = np.full((n, max(width, 1)), -1, dtype=np.int64)
    tbits = np.zeros((n, max(width, 1)), dtype=np.int64)
    table = np.full((n, max((len(t) for t in tables.values()), default=1)), -1, dtype=np.int64)
    table[:, 0] = choice
    for i, units in entries.items():
        tunit[i, : len(units)] = [u for u, _ in units]
        tbits[i, : len(units)] = [b for _, b in units]
        table[i, : len(tables[i])] = tables[i]
    return OffloadUnits(tunit, tbits, table, members)


def cpu_offload(ctx: PlanContext, choice: np.ndarray, per_step: bool = False) -> np.ndarray:
    """Algorithm 2 on ``choice`` (modified copy returned): the optimum of the traversal of
    per-unit offload counts (:func:`offload_units`), found by branch and bound
    (:meth:`Evaluator.best_offload`) instead of simulating every combination.

    With ``ctx.incumbent_us`` (another bucket layout's plan) a search that has not ended
    after :data:`INCUMBENT_AFTER` nodes starts again, looking only below the better of its
    best so far and that time: it then cuts against the other layout from its first node.
    Within that many nodes it is the search without one, exact: a layout whose offloads
    alone do not beat the other may still win after the refinements that follow (BERT,
    2 x 2 workers at 10 Gbit/s, efsignsgd: cut from the first node, the 17 buckets that win
    at 106.69 ms lost to 199 at 107.17)."""
    units = offload_units(ctx, choice, per_step)
    if not units.members:
        return choice.copy()
    search_below = functools.partial(ctx.evaluator.best_offload, choice, units.tunit,
                                     units.tbits, table=units.table,
                                     n_units=len(units.members))
    incumbent = ctx.incumbent_us
    best, t, nodes, complete = search_below(
        current=ctx.iteration_us(choice),
        node_limit=OFFLOAD_NODE_LIMIT if incumbent is None else INCUMBENT_AFTER)
    if not complete and incumbent is not None:
        below, t_below, more, complete = search_below(current=min(t, incumbent),
                                                      node_limit=INCUMBENT_NODES)
        nodes += more
        if t_below < t:
            best = below
    if not complete:
        # Cut against another layout, a stop is the bounded search working as designed (a
        # start-up plan at 1 Gbit/s logged several); alone, the plan may be short of optimal.
        log.log(logging.WARNING if incumbent is None else logging.INFO,
                "Algorithm 2 stopped after %d nodes (%s): its strategy is the best found, not "
                "proven optimal", nodes,
                "OFFLOAD_NODE_LIMIT" if incumbent is None else "INCUMBENT_NODES")
    return best


def offload_exhaustive(ctx: PlanContext, choice: np.ndarray, per_step: bool = False) \
        -> tuple[np.ndarray, float]:
    """Algorithm 2 as the paper states it: simulate every combination of per-unit counts
    (offloading ``c`` of a unit moves its steps of the unit's last ``c`` members to the CPU)
    and keep the first fastest. For checking :func:`cpu_offload`; as slow as it sounds."""
    units = offload_units(ctx, choice, per_step)
    current = ctx.iteration_us(choice)
    if not units.members:
        return choice.copy(), current
    counts = np.indices([len(m) + 1 for m in units.members]).reshape(len(units.members), -1).T
    rows = _strategies(units, counts)
    r, t = ctx.evaluator.best_row(rows, current)
    return (rows[r].copy() if r >= 0 else choice.copy()), t


def _strategies(units: OffloadUnits, counts: np.ndarray) -> np.ndarray:
    """One strategy per row of ``counts`` (per-unit offload counts): each unit's steps move
    to the CPU on its last counts[r, u] members. A combination the tree lacks (a placement
    not allowed) keeps the first allowed strategy instead, which the caller already has."""
    masks = np.zeros((len(counts), units.tunit.shape[0]), dtype=np.int64)
    for u, group in enumerate(units.members):
        for pos, i in enumerate(group):
            q = int(np.flatnonzero(units.tunit[i] == u)[0])
            moved = counts[:, u] >= len(group) - pos  # among the last counts[u] members
            masks[moved, i] |= units.tbits[i, q]
    rows = np.take_along_axis(units.table, masks.T, axis=1).T
    bad = (rows < 0).any(axis=1)
    rows[bad] = units.table[:, 0]
    return np.ascontiguousarray(rows)


def offload_descent(ctx: PlanContext, choice: np.ndarray, units: OffloadUnits) \
        -> tuple[np.ndarray, float]:
    """Pairwise descent over the per-unit counts: every pair of units tries all its count
    pairs with the other counts fixed (a unit alone when it is the only one), keeping the
    first strictly better, until a round changes nothing."""
    n_units = len(units.members)
    sizes = [len(m) + 1 for m in units.members]
    counts = np.zeros(n_units, dtype=np.int64)
    best_t = ctx.iteration_us(choice)
    pairs = [(u, v) for u in range(n_units) for v in range(u + 1, n_units)] or [(0, 0)]
    for _ in range(OFFLOAD_ROUNDS):
        before = counts.copy()
        for u, v in pairs:
            grid = np.indices((sizes[u], sizes[v])).reshape(2, -1).T
            trials = np.repeat(counts[None, :], len(grid), axis=0)
            trials[:, u] = grid[:, 0]
            trials[:, v] = grid[:, 1]
            r, best_t = ctx.evaluator.best_row(_strategies(units, trials), best_t)
            if r >= 0:
                counts = trials[r]
        if np.array_equal(counts, before):
            break
    return _strategies(units, counts[None, :])[0], best_t


def _refine_devices(ctx: PlanContext, choice: np.ndarray, stop: float) -> np.ndarray:
    """Each tensor, in visit order, with the others fixed: a compressed one tries every device
    placement of its option's Comp/Decomp steps (:meth:`PlanContext.placements`) and the
    non-dominated all-CPU options of its size (host compression may pay more on another
    scheme, e.g. compressing a reduce-scattered part); an uncompressed one tries those all-CPU
    options (compression that did not pay on the GPU, where it would have delayed the backward
    pass, may pay on the host). A tensor that took another option then tries its
    placements."""
    choice = choice.copy()
    if not ctx.constraints.allow_cpu or not ctx.constraints.allow_gpu:
        return choice
    evaluator = ctx.evaluator
    # the host front's compressed options (Algorithm 1 weighed a compressed tensor against
    # the uncompressed ones) are what the kernel tries beside a compressed tensor's placements
    cpu_front = ctx.fronts(Device.CPU)
    evaluator.refine_devices(choice, ctx.visit_order, placements=ctx.placements,
                             made=ctx.placements_made, cpu_front=cpu_front.table,
                             cpu_front_len=cpu_front.count, current=evaluator.schedule(choice),
                             stop_us=stop)
    return choice


def _refine_twins(ctx: PlanContext, choice: np.ndarray, stop: float) -> np.ndarray:
    """Each compressed tensor, in visit order, with the others fixed: its option or one of
    its twins, which forward the gathered payloads where it decodes and re-compresses, or
    compress inside the machine with the partner (:meth:`PlanContext.twins`; Algorithms 1
    and 2 leave those out where the option they are twins of is allowed, see
    :meth:`PlanContext.searched`). Only a faster strategy is kept. Stops once the iteration
    time is at most ``stop``."""
    choice = choice.copy()
    options = ctx.evaluator.options
    now = ctx.evaluator.schedule(choice)  # (time, sum of synchronized times, ...)
    for i in ctx.visit_order:
        if now[0] <= stop:
            break
        keep = int(choice[i])
        if not options[keep].is_compressed:
            continue
        table = ctx.twins(keep)
        if len(table) < 2:
            continue
        now = _take_best(ctx, choice, i, table, now)
        taken = int(choice[i])
        if taken != keep and options[taken].partners and ctx.constraints.allow_cpu \
                and ctx.constraints.allow_gpu:
            # the partner's steps may pay on the other device (the devices Algorithm 2 and
            # the device refinement chose were for the job's compressor there)
            placed = ctx.placements(taken)
            now = _take_best(ctx, choice, i, placed[placed >= 0], now)
    return choice


def _take_best(ctx: PlanContext, choice: np.ndarray, i: int, candidates: np.ndarray,
               now: tuple) -> tuple:
    """Tensor ``i`` on the best of ``candidates`` with the others fixed (``choice`` is
    changed in place; a tie keeps the current option); returns the schedule of ``choice``
    (``now`` when nothing changed)."""
    best_k, _ = ctx.evaluator.best_of(choice, i, candidates, current=now)
    if best_k == choice[i]:
        return now
    choice[i] = best_k
    return ctx.evaluator.reschedule(choice, i, now)


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Pause Python's cyclic garbage collector (restored after): the search allocates many
    small containers, and a collection would traverse the whole decision tree's objects."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def espresso(ctx: PlanContext) -> np.ndarray:
    """Algorithm 1, Algorithm 2, then the device refinement; returns option indices."""
    with gc_paused():
        return _espresso(ctx)


def _espresso(ctx: PlanContext) -> np.ndarray:
    start = uniform_best(ctx, ctx.uncompressed())
    device = ctx.primary_device()
    choice = gpu_greedy(ctx, start, device, passes=GREEDY_PASSES)
    t = ctx.iteration_us(choice)
    stop = stop_us(ctx, at=t)
    if t > stop:
        choice = cpu_offload(ctx, choice)
        choice = _refine_devices(ctx, choice, stop)
        choice = _refine_twins(ctx, choice, stop)
    log.debug("espresso: %d evaluations", ctx.evaluator.calls)
    return choice
