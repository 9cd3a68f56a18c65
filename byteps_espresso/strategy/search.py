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
import itertools
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


def _visit_order(ctx: PlanContext) -> list[int]:
    tensors = ctx.workload.tensors
    return sorted(range(len(tensors)), key=lambda i: (-tensors[i].numel, i))


def gpu_greedy(ctx: PlanContext, choice: np.ndarray, device: Device = Device.GPU,
               use_bubbles: bool = True, passes: int = 1) -> np.ndarray:
    """Algorithm 1 on ``choice`` (modified copy returned)."""
    choice = choice.copy()
    candidates = ctx.single_device(device)
    fronts = ctx.front(candidates)
    front_idx = [ctx.index(f) for f in fronts]
    uncompressed = {ctx.evaluator.index[o] for o in ctx.uncompressed()
                    if o in ctx.evaluator.index}
    n = ctx.n_tensors
    # Sizes whose non-dominated options are all uncompressed were decided by the group moves.
    compressible = {u for u, f in enumerate(fronts) if any(o.is_compressed for o in f)}
    order = [i for i in _visit_order(ctx) if ctx.tensor_size_index(i) in compressible]
    _group_moves(ctx, choice, front_idx)
    # Second start (ours): every tensor on its fastest option in isolation; keep the better.
    alone = _isolated_best(ctx, candidates, fronts)
    _group_moves(ctx, alone, front_idx)
    if ctx.iteration_us(alone) < ctx.iteration_us(choice) - 1e-6:
        choice = alone
    for _ in range(passes):
        changed = False
        _, ready, done = ctx.evaluator.ready_done(choice)
        for i in order:
            if use_bubbles and i + 1 < n and choice[i] in uncompressed and done[i] <= ready[i + 1]:
                continue
            keep = choice[i]
            cands = front_idx[ctx.tensor_size_index(i)]
            best_k, _ = ctx.evaluator.best_of(choice, i,
                                              np.concatenate([[keep], cands[cands != keep]]))
            if best_k != keep:
                choice[i] = best_k
                changed = True
                _, ready, done = ctx.evaluator.ready_done(choice)
        if not changed:
            break
        # Later passes revisit only sizes down to the smallest compressed tensor: below it,
        # compression lost everywhere in this pass.
        sizes = [ctx.workload.tensors[i].numel for i in range(n)
                 if ctx.evaluator.options[choice[i]].is_compressed]
        floor = min(sizes, default=0)
        order = [i for i in order if ctx.workload.tensors[i].numel >= floor]
    return choice


def _isolated_best(ctx: PlanContext, candidates: list, fronts: list[list]) -> np.ndarray:  # type: ignore[type-arg]
    """Per tensor, the front option with the shortest end-to-end time on its own."""
    _, total = ctx._stacks(candidates)
    position = {o: k for k, o in enumerate(candidates)}
    best = []
    for u, front in enumerate(fronts):
        rows = [position[o] for o in front]
        best.append(front[int(np.argmin(total[rows, u]))])
    idx = ctx.index(best)
    sizes = [ctx.tensor_size_index(i) for i in range(ctx.n_tensors)]
    return idx[sizes]


def _group_moves(ctx: PlanContext, choice: np.ndarray, front_idx: list[np.ndarray]) -> None:
    """For each size group (largest first), try giving all its tensors one option (in place).

    Tensors of one size are interchangeable for the cost model; moving them together escapes
    the plateau where compressing any single one does not shorten the iteration because the
    others still hold the link."""
    members: dict[int, list[int]] = {}
    for i in _visit_order(ctx):
        members.setdefault(ctx.tensor_size_index(i), []).append(i)
    current = ctx.iteration_us(choice)
    for u, group in members.items():
        best_k, current = ctx.evaluator.best_group(choice, np.array(group), front_idx[u],
                                                   current)
        if best_k >= 0:
            choice[group] = best_k


def _offload_groups(ctx: PlanContext, choice: np.ndarray) -> list[tuple[list[int], int]]:
    """(members farthest-from-output first, CPU option index) per (size, GPU option) group."""
    options = ctx.evaluator.options
    groups: dict[tuple[int, int], list[int]] = {}
    for i, k in enumerate(choice):
        opt = options[k]
        if opt.is_compressed and Device.GPU in opt.devices:
            groups.setdefault((ctx.workload.tensors[i].numel, int(k)), []).append(i)
    plans = []
    for (_, k), members in groups.items():
        cpu_opt = ctx.on_device(options[k], Device.CPU)
        if ctx.allowed(cpu_opt):
            plans.append((sorted(members, reverse=True), int(ctx.index([cpu_opt])[0])))
    return plans


def cpu_offload(ctx: PlanContext, choice: np.ndarray) -> np.ndarray:
    """Algorithm 2 on ``choice`` (modified copy returned)."""
    plans = _offload_groups(ctx, choice) if ctx.constraints.allow_cpu else []
    if not plans:
        return choice.copy()

    def apply(counts: tuple[int, ...]) -> np.ndarray:
        out = choice.copy()
        for (members, target), c in zip(plans, counts, strict=True):
            out[members[:c]] = target
        return out

    sizes = [len(m) + 1 for m, _ in plans]
    counts: tuple[int, ...] = tuple(0 for _ in plans)
    best_t = ctx.iteration_us(choice)
    if int(np.prod(sizes)) <= EXHAUSTIVE_LIMIT:
        trials = itertools.product(*(range(s) for s in sizes))
        for trial in trials:
            t = ctx.iteration_us(apply(trial))
            if t < best_t - 1e-6:
                counts, best_t = trial, t
        return apply(counts)
    for _ in range(OFFLOAD_ROUNDS):
        before = counts
        for g, size in enumerate(sizes):
            for c in range(size):
                trial = (*counts[:g], c, *counts[g + 1:])
                t = ctx.iteration_us(apply(trial))
                if t < best_t - 1e-6:
                    counts, best_t = trial, t
        if counts == before:
            break
    return apply(counts)


def _refine_devices(ctx: PlanContext, choice: np.ndarray) -> np.ndarray:
    choice = choice.copy()
    for i in _visit_order(ctx):
        opt = ctx.evaluator.options[choice[i]]
        if not opt.is_compressed:
            continue
        variants = ctx.index(ctx.device_variants(opt))
        best_k, _ = ctx.evaluator.best_of(choice, i, np.concatenate([[choice[i]], variants]))
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
