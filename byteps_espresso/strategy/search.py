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
    1. Group the compressed tensors by (size, option).
    2. Within a group, offloading ``c`` tensors means moving the compression of the ``c``
       tensors farthest from the output layer to the CPUs (the same option, all its
       Comp/Decomp on ``cpu``).
    3. Enumerate the per-group counts and keep the best: exhaustively when the product of
       (group size + 1) is at most ``EXHAUSTIVE_LIMIT`` evaluations, else group by group with
       the others fixed, repeated until no count changes (at most ``OFFLOAD_ROUNDS``).

Refinement (ours, after Algorithm 2): each compressed tensor tries the device variants of its
option (mixed GPU/CPU placements of its Comp/Decomp steps) with the others fixed.
"""

from __future__ import annotations

import contextlib
import gc
import logging
from collections.abc import Iterator

import numpy as np

from byteps_espresso.strategy.context import PlanContext
from byteps_espresso.strategy.options import Device

__all__ = ["EXHAUSTIVE_LIMIT", "GREEDY_PASSES", "OFFLOAD_ROUNDS", "cpu_offload", "espresso",
           "gpu_greedy", "uniform_best"]

log = logging.getLogger(__name__)

# Algorithm 2 enumerates all per-group counts up to this many evaluations.
EXHAUSTIVE_LIMIT = 256
# Per-tensor passes of Algorithm 1. With the group moves one pass found the same or better
# strategies than two on the 24 workload settings and 100 random instances of
# benchmarks/plan.py (measured 2026-11-30), in less time.
GREEDY_PASSES = 1
OFFLOAD_ROUNDS = 3


def uniform_best(ctx: PlanContext, candidates: list) -> np.ndarray:  # type: ignore[type-arg]
    """The single candidate option that is fastest when every tensor uses it."""
    idx = ctx.index(candidates)
    everyone = np.arange(ctx.n_tensors)
    k, _ = ctx.evaluator.best_group(np.zeros(ctx.n_tensors, dtype=np.int64), everyone, idx,
                                    np.inf)
    return np.full(ctx.n_tensors, k, dtype=np.int64)


def gpu_greedy(ctx: PlanContext, choice: np.ndarray, device: Device = Device.GPU,
               use_bubbles: bool = True, passes: int = 1) -> np.ndarray:
    """Algorithm 1 on ``choice`` (modified copy returned)."""
    choice = choice.copy()
    fronts = ctx.fronts(device)
    evaluator = ctx.evaluator
    size_idx = evaluator.size_idx
    uncompressed = set(ctx.uncompressed_index().tolist())
    n = ctx.n_tensors
    # Sizes whose non-dominated options are all uncompressed were decided by the group moves.
    order = [i for i in ctx.visit_order if size_idx[i] in fronts.compressible]
    t_choice = _group_moves(ctx, choice, fronts.index)
    # Second start (ours): every tensor on its fastest option in isolation; keep the better.
    alone = fronts.fastest_alone[size_idx]
    t_alone = _group_moves(ctx, alone, fronts.index)
    if t_alone < t_choice - 1e-6:
        choice = alone
    for _ in range(passes):
        changed = False
        _, ready, done = evaluator.ready_done(choice)
        for i in order:
            keep = int(choice[i])
            if use_bubbles and i + 1 < n and keep in uncompressed and done[i] <= ready[i + 1]:
                continue
            cands = fronts.index[size_idx[i]]
            best_k, _ = evaluator.best_of(choice, i, _current_first(keep, cands))
            if best_k != keep:
                choice[i] = best_k
                changed = True
                _, ready, done = evaluator.ready_done(choice)
        if not changed:
            break
        # Later passes revisit only sizes down to the smallest compressed tensor: below it,
        # compression lost everywhere in this pass.
        sizes = [ctx.workload.tensors[i].numel for i in range(n)
                 if evaluator.options[choice[i]].is_compressed]
        floor = min(sizes, default=0)
        order = [i for i in order if ctx.workload.tensors[i].numel >= floor]
    return choice


def _current_first(keep: int, cands: np.ndarray) -> np.ndarray:
    """``cands`` with ``keep`` moved (or added) in front, so that ties keep the current choice;
    a candidate evaluated twice could not change the answer."""
    out = np.empty(len(cands) + 1, dtype=np.int64)
    out[0] = keep
    rest = cands[cands != keep]
    out[1:len(rest) + 1] = rest
    return out[:len(rest) + 1]


def _group_moves(ctx: PlanContext, choice: np.ndarray, front_idx: list[np.ndarray]) -> float:
    """For each size group (largest first), try giving all its tensors one option (in place);
    returns the iteration time of the resulting ``choice``.

    Tensors of one size are interchangeable for the cost model; moving them together escapes
    the plateau where compressing any single one does not shorten the iteration because the
    others still hold the link."""
    current = ctx.iteration_us(choice)
    for u, group in ctx.size_groups.items():
        best_k, current = ctx.evaluator.best_group(choice, group, front_idx[u], current)
        if best_k >= 0:
            choice[group] = best_k
    return current


def _offload_groups(ctx: PlanContext, choice: np.ndarray) -> list[tuple[np.ndarray, int]]:
    """(members farthest-from-output first, CPU option index) per (size, GPU option) group."""
    options = ctx.evaluator.options
    groups: dict[tuple[int, int], list[int]] = {}
    for i, k in enumerate(choice.tolist()):
        opt = options[k]
        if opt.is_compressed and Device.GPU in opt.devices:
            groups.setdefault((ctx.workload.tensors[i].numel, k), []).append(i)
    plans = []
    for (_, k), members in groups.items():
        target = ctx.cpu_index(k)
        if target >= 0:
            plans.append((np.array(members[::-1], dtype=np.int64), target))
    return plans


def _offloaded(choice: np.ndarray, plans: list[tuple[np.ndarray, int]],
               counts: np.ndarray) -> np.ndarray:
    """One strategy per row of ``counts``: ``choice`` with the first counts[r, g] members of
    group g moved to the group's CPU option."""
    out = np.repeat(choice[None, :], len(counts), axis=0)
    for g, (members, target) in enumerate(plans):
        for j, member in enumerate(members.tolist()):
            out[counts[:, g] > j, member] = target
    return out


def cpu_offload(ctx: PlanContext, choice: np.ndarray) -> np.ndarray:
    """Algorithm 2 on ``choice`` (modified copy returned).

    The trials of one enumeration are evaluated in one call (:meth:`Evaluator.best_row`),
    which keeps the first strictly better trial in enumeration order like a sequential loop.
    """
    plans = _offload_groups(ctx, choice) if ctx.constraints.allow_cpu else []
    if not plans:
        return choice.copy()
    sizes = [len(m) + 1 for m, _ in plans]
    counts = np.zeros(len(plans), dtype=np.int64)
    best_t = ctx.iteration_us(choice)
    if int(np.prod(sizes)) <= EXHAUSTIVE_LIMIT:
        # every combination, in itertools.product order (the last group varies fastest)
        trials = np.indices(sizes).reshape(len(sizes), -1).T
        r, best_t = ctx.evaluator.best_row(_offloaded(choice, plans, trials), best_t)
        if r >= 0:
            counts = trials[r]
        return _offloaded(choice, plans, counts[None, :])[0]
    for _ in range(OFFLOAD_ROUNDS):
        before = counts.copy()
        for g, size in enumerate(sizes):
            # this group's counts with the others fixed
            trials = np.repeat(counts[None, :], size, axis=0)
            trials[:, g] = np.arange(size)
            r, best_t = ctx.evaluator.best_row(_offloaded(choice, plans, trials), best_t)
            if r >= 0:
                counts = trials[r]
        if np.array_equal(counts, before):
            break
    return _offloaded(choice, plans, counts[None, :])[0]


def _refine_devices(ctx: PlanContext, choice: np.ndarray) -> np.ndarray:
    choice = choice.copy()
    options = ctx.evaluator.options
    for i in ctx.visit_order:
        keep = int(choice[i])
        if not options[keep].is_compressed:
            continue
        best_k, _ = ctx.evaluator.best_of(choice, i,
                                          _current_first(keep, ctx.variant_indices(keep)))
        choice[i] = best_k
    return choice


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
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
    with _gc_paused():
        return _espresso(ctx)


def _espresso(ctx: PlanContext) -> np.ndarray:
    start = uniform_best(ctx, ctx.uncompressed())
    device = ctx.primary_device()
    choice = gpu_greedy(ctx, start, device, passes=GREEDY_PASSES)
    choice = cpu_offload(ctx, choice)
    choice = _refine_devices(ctx, choice)
    log.debug("espresso: %d evaluations", ctx.evaluator.calls)
    return choice
