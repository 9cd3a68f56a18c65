"""Planning algorithms by name: Espresso and the baselines it is compared with.

Every algorithm maps a :class:`PlanContext` to a :class:`Solution` priced under the same
model. Look one up with :func:`get`; :data:`ALGORITHMS` lists them in report order.

- ``espresso``     Algorithms 1 and 2 of the paper (:mod:`search`).
- ``fp32``         no compression, hierarchical like BytePS (intra ReduceScatter, PS
                   PushPull, intra Allgather; :func:`fp32_option`), the runtime's
                   ``Compression.none``.
- ``all-gpu``      every tensor compressed on the GPU with one fixed scheme, like HiTopKComm:
                   intra ReduceScatter, inter AllgatherC, intra Allgather (flat: AllgatherC).
- ``allreduce-c``  every tensor compressed on the GPU and its payloads summed in one flat
                   all-reduce, DDP's ``fp16_compress_hook``: only for a compressor whose
                   payloads sum (fp16); the runtime checks it where its plan measures slow.
- ``allgather-c``  every tensor compressed on the GPU, its payloads all-gathered in one flat
                   collective and decoded on every rank: what a DDP communication hook for
                   a compressor whose payloads do not sum runs.
- ``hipress``      selective compression like HiPress: tensors of at least HIPRESS_MIN_NUMEL
                   elements get the GPU option that is fastest for that tensor in isolation.
- ``cpu-only``     like BytePS-Compress: intra Reduce uncompressed, CPU compression, PS
                   PushPullC, intra Broadcast; tensors under CPU_ONLY_MIN_NUMEL stay dense.
- ``upper-bound``  compressed communication with free compression and hence no contention
                   (Algorithm 1 on a model where Comp/Decomp cost nothing): a bound, not a
                   runnable strategy.
- ``bruteforce``   every combination of options; refuses more than BRUTEFORCE_LIMIT.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from byteps_espresso.strategy import search
from byteps_espresso.strategy.context import PlanContext
from byteps_espresso.strategy.options import Device, Option
from byteps_espresso.strategy.tree import sums_payloads

__all__ = ["ALGORITHMS", "BRUTEFORCE_LIMIT", "Algorithm", "BaselineUnavailable",
           "BruteforceTooLarge", "Solution", "fp32_baseline_option", "fp32_option", "get",
           "lower_bound_us", "register"]

# Bruteforce simulates at most this many strategies (about 1 s on one core for 4 tensors).
BRUTEFORCE_LIMIT = 300_000
# HiPress compresses only large tensors; 1 MB of float32 (our threshold, in elements).
HIPRESS_MIN_NUMEL = 262_144
# BytePS-Compress-like baseline: tensors under 256 KB of float32 are sent dense (our choice:
# their compression costs more than it saves).
CPU_ONLY_MIN_NUMEL = 65_536


class BaselineUnavailable(ValueError):
    """The baseline's fixed scheme is not allowed on this cluster or under the constraints."""


class BruteforceTooLarge(ValueError):
    """The exhaustive search would simulate too many strategies."""


@dataclass(frozen=True)
class Solution:
    """Per-tensor option indices into ``ctx.evaluator.options`` and their iteration time."""

    choice: np.ndarray
    iteration_us: float
    ctx: PlanContext

    @property
    def options(self) -> list[Option]:
        return [self.ctx.evaluator.options[k] for k in self.choice]


@dataclass(frozen=True)
class Algorithm:
    name: str
    help: str
    run: Callable[[PlanContext], Solution]


ALGORITHMS: dict[str, Algorithm] = {}


def register(name: str, help_text: str):  # type: ignore[no-untyped-def]
    """Decorator adding an algorithm; a repeated name is a bug."""
    def wrap(fn: Callable[[PlanContext], Solution]) -> Callable[[PlanContext], Solution]:
        if name in ALGORITHMS:
            raise ValueError(f"algorithm {name!r} is registered twice")
        ALGORITHMS[name] = Algorithm(name, help_text, fn)
        return fn
    return wrap


def get(name: str) -> Algorithm:
    """The algorithm called ``name``.

    Raises:
        ValueError: unknown name (lists the known ones).
    """
    try:
        return ALGORITHMS[name]
    except KeyError:
        raise ValueError(f"unknown algorithm {name!r}; choose one of "
                         f"{', '.join(ALGORITHMS)}") from None


def _solution(ctx: PlanContext, choice: np.ndarray) -> Solution:
    return Solution(choice, ctx.iteration_us(choice), ctx)


def _first_allowed(ctx: PlanContext, texts: list[str], what: str) -> Option:
    for text in texts:
        opt = Option.parse(text)
        if ctx.allowed(opt):
            return opt
    raise BaselineUnavailable(f"{what}: none of its schemes is allowed here ({'; '.join(texts)})")


def fp32_option(machines: int, local_size: int, servers: int,
                shared_host: bool = False) -> Option:
    """The uncompressed path, defined once: ``Compression.none``, the profiled iterations and
    the planner's ``fp32`` baseline all run it.

    BytePS's path: each machine's workers reduce-scatter the tensor, every worker pushes and
    pulls its shard through the servers (an inter-machine all-reduce without servers), and the
    workers all-gather the shards, so each machine's link carries the tensor once where a
    flat push/pull would carry it ``local_size`` times, and every worker moves
    1/local_size of it (an intra-machine Reduce to one root, then Broadcast, sends the whole
    tensor through one worker). Flat when a machine has one worker, there is one machine, or
    every machine runs on one host (``shared_host``, ``espresso-launch --local``): with no
    inter-machine link to spare, the two intra-machine steps only add latency (on loopback
    2 x 2 the flat path measured 0.84x DDP's iteration on a 5 MB MLP where the hierarchical
    one measured 1.23x; BENCHMARKS.md "Against torch DDP").
    """
    middle = "PushPull(inter)" if servers > 0 else "Allreduce(inter)"
    if local_size > 1 and machines > 1 and not shared_host:
        return Option.parse(f"ReduceScatter(intra) -> {middle} -> Allgather(intra)")
    return Option.parse("PushPull(flat)" if servers > 0 else "Allreduce(flat)")


def fp32_baseline_option(ctx: PlanContext) -> Option:
    """:func:`fp32_option` on ``ctx``'s cluster.

    Raises:
        BaselineUnavailable: the constraints do not allow it.
    """
    c = ctx.cluster
    option = fp32_option(c.machines, c.gpus_per_machine, c.servers, c.shared_host)
    if not ctx.allowed(option):
        raise BaselineUnavailable(f"fp32: its scheme {option} is not allowed here; relax the "
                                  "constraints")
    return option


def _per_tensor(ctx: PlanContext, pick: Callable[[int], Option]) -> Solution:
    options = [pick(i) for i in range(ctx.n_tensors)]
    return _solution(ctx, ctx.index(options))


@register("espresso", "Espresso: greedy GPU compression (Alg. 1) + CPU offload (Alg. 2)")
def _espresso(ctx: PlanContext) -> Solution:
    return _solution(ctx, search.espresso(ctx))


@register("fp32", "no compression, hierarchical like BytePS")
def _fp32(ctx: PlanContext) -> Solution:
    opt = fp32_baseline_option(ctx)
    return _per_tensor(ctx, lambda i: opt)


@register("all-gpu", "every tensor compressed on GPU with one scheme (HiTopKComm)")
def _all_gpu(ctx: PlanContext) -> Solution:
    opt = _first_allowed(ctx, [
        "ReduceScatter(intra) -> Comp(gpu) -> AllgatherC(inter) -> Decomp(gpu) -> Allgather(intra)",
        "Comp(gpu) -> AllgatherC(flat) -> Decomp(gpu)",
        # a low-rank compressor (PowerSGD) on every tensor, as PyTorch's hook all-reduces
        "Comp(gpu) -> Allreduce(flat) -> Decomp(gpu)"], "all-gpu")
    return _per_tensor(ctx, lambda i: opt)


@register("allreduce-c", "every tensor compressed on GPU, the payloads summed in one "
                         "all-reduce (DDP's fp16 hook; compressors whose payloads sum)")
def _allreduce_c(ctx: PlanContext) -> Solution:
    if not sums_payloads(ctx.compressor):
        raise BaselineUnavailable(f"allreduce-c: {ctx.compressor}'s payloads do not sum inside "
                                  "a collective (only fp16's do); pick another algorithm")
    opt = _first_allowed(ctx, ["Comp(gpu) -> AllreduceC(flat) -> Decomp(gpu)"], "allreduce-c")
    return _per_tensor(ctx, lambda i: opt)


@register("allgather-c", "every tensor compressed on GPU, the payloads all-gathered in one "
                         "flat collective and decoded on every rank")
def _allgather_c(ctx: PlanContext) -> Solution:
    opt = _first_allowed(ctx, ["Comp(gpu) -> AllgatherC(flat) -> Decomp(gpu)"], "allgather-c")
    return _per_tensor(ctx, lambda i: opt)


@register("hipress", "large tensors compressed on GPU, each tensor's scheme chosen alone")
def _hipress(ctx: PlanContext) -> Solution:
    dense = fp32_baseline_option(ctx)
    # HiPress runs one compressor: no mixed Options
    gpu_options = [o for o in ctx.single_device(Device.GPU) if not o.partners]
    if not any(o.is_compressed for o in gpu_options):
        raise BaselineUnavailable("hipress: no GPU compression allowed")
    alone = np.stack([ctx.pricer.tasks(o).total for o in gpu_options])  # (O, U)
    best = [gpu_options[k] for k in np.argmin(alone, axis=0)]

    def pick(i: int) -> Option:
        t = ctx.workload.tensors[i]
        return best[ctx.tensor_size_index(i)] if t.numel >= HIPRESS_MIN_NUMEL else dense
    return _per_tensor(ctx, pick)


@register("cpu-only", "intra Reduce, CPU compression, PS push/pull (BytePS-Compress)")
def _cpu_only(ctx: PlanContext) -> Solution:
    dense = fp32_baseline_option(ctx)
    comp = _first_allowed(ctx, [
        "Reduce(intra) -> Comp(cpu) -> PushPullC(inter) -> Decomp(cpu) -> Broadcast(intra)",
        "Comp(cpu) -> PushPullC(flat) -> Decomp(cpu)"], "cpu-only")
    return _per_tensor(ctx, lambda i: comp if ctx.workload.tensors[i].numel >=
                       CPU_ONLY_MIN_NUMEL else dense)


@register("upper-bound", "compressed communication with free compression, no contention")
def _upper_bound(ctx: PlanContext) -> Solution:
    free = ctx.free()
    start = search.uniform_best(free, free.uncompressed())
    choice = search.gpu_greedy(free, start, free.primary_device(), use_bubbles=False, passes=2,
                               gap=0.0)
    return Solution(choice, free.iteration_us(choice), free)


def lower_bound_us(ctx: PlanContext) -> float:
    """A lower bound of every strategy's iteration time on ``ctx``
    (:attr:`PlanContext.bound_us`, where the search stops)."""
    return ctx.bound_us


@register("bruteforce", "every combination of options (small inputs only)")
def _bruteforce(ctx: PlanContext) -> Solution:
    n_opts = len(ctx.options)
    estimate = float(n_opts) ** ctx.n_tensors
    if estimate > BRUTEFORCE_LIMIT * 1e3:  # refuse before pricing anything
        raise BruteforceTooLarge(_too_large(ctx, estimate))
    idx = ctx.index(ctx.options)
    allowed = []
    for i in range(ctx.n_tensors):  # options with identical tasks for this size are one
        u = ctx.tensor_size_index(i)
        seen: dict[tuple, int] = {}
        for k, opt in zip(idx, ctx.options, strict=True):
            p = ctx.pricer.tasks(opt)
            seen.setdefault((p.resource.tobytes(), np.round(p.duration[u], 9).tobytes()), int(k))
        allowed.append(sorted(seen.values()))
    total = math.prod(len(a) for a in allowed)
    if total > BRUTEFORCE_LIMIT:
        raise BruteforceTooLarge(_too_large(ctx, total))
    best, choice = ctx.evaluator.exhaustive(allowed)
    return Solution(choice, best, ctx)


def _too_large(ctx: PlanContext, count: float) -> str:
    return (f"bruteforce would simulate {count:.3g} strategies ({len(ctx.options)} options, "
            f"{ctx.n_tensors} tensors); the limit is {BRUTEFORCE_LIMIT}: use fewer tensors or "
            "shrink the tree with --constraint (e.g. no-cpu, max-compressions=1, flat-only)")
