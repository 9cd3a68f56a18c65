"""Tensor fusion: gradients that become ready close together travel as one bucket.

A *bucket* is a run of consecutive gradients in backward order, synchronized as one flat
float32 tensor with one Option, as DDP's buckets and Horovod's fusion buffer do. One
collective (or one PS round) per bucket instead of one per gradient removes the per-message
latency and the per-Option software cost that dominate models with many small tensors; the
price is that a bucket starts when its last gradient is ready, so it overlaps less of the
backward pass. The planner weighs the two in the same timeline: a bucket is one tensor of the
fused :class:`~byteps_espresso.strategy.workload.Workload`, ready when its last member is,
and :func:`plan_fused` plans each candidate layout and keeps the fastest predicted.

A layout is greedy, like DDP's: walk the gradients in backward order and close a bucket when
the next gradient would take it past the cap (a gradient larger than the cap is a bucket of
its own). Every rank builds the same layout from the same order and sizes; strategy files
record it (``Strategy.buckets``).

Example:
    >>> wl = Workload.builtin("bert")
    >>> buckets = layout([(t.name, t.numel) for t in wl.tensors], 25 * MiB, MiB)
    >>> fused = fuse(wl, buckets)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from byteps_espresso.strategy.workload import TensorProfile, Workload

__all__ = ["CANDIDATE_CAPS", "DEFAULT_CAP_BYTES", "DEFAULT_FIRST_CAP_BYTES", "Bucket",
           "BucketError", "MiB", "check_layout", "ddp_layout", "fewest", "from_names", "fuse",
           "fuse_apart", "layout", "layout_apart", "plan_fused", "reorder", "singletons"]

MiB = 1 << 20
# DDP's defaults (torch.nn.parallel.DistributedDataParallel: bucket_cap_mb=25, and the
# first bucket capped at dist._DEFAULT_FIRST_BUCKET_BYTES = 1 MiB so that communication
# starts early in backward), in bytes of float32 gradients.
DEFAULT_CAP_BYTES = 25 * MiB
DEFAULT_FIRST_CAP_BYTES = 1 * MiB
# The caps the planner prices (bytes; 0 = no fusion, every gradient alone): from one bucket
# per gradient up to DDP's default, each 4x the last, so that the search stays a handful of
# plans (each a few ms) while covering latency-bound and bandwidth-bound links alike.
CANDIDATE_CAPS = (0, 256 * 1024, MiB, 4 * MiB, DEFAULT_CAP_BYTES)
_FLOAT32_BYTES = 4


class BucketError(ValueError):
    """A bucket layout does not partition the model's gradients in backward order."""


@dataclass(frozen=True)
class Bucket:
    """Consecutive gradients (backward order) synchronized as one flat tensor.

    Attributes:
        name: the bucket's name: its only tensor's name, or ``first+N`` for a bucket of
            ``first`` and ``N`` more (PS keys and iteration counters hang off it).
        tensors: the member gradients' names, in backward order.
    """

    name: str
    tensors: tuple[str, ...]

    @classmethod
    def of(cls, tensors: Sequence[str]) -> Bucket:
        if not tensors:
            raise BucketError("a bucket needs at least one tensor")
        members = tuple(tensors)
        name = members[0] if len(members) == 1 else f"{members[0]}+{len(members) - 1}"
        return cls(name, members)

    @property
    def fused(self) -> bool:
        return len(self.tensors) > 1


def singletons(names: Sequence[str]) -> tuple[Bucket, ...]:
    """Every gradient in a bucket of its own (no fusion)."""
    return tuple(Bucket.of([n]) for n in names)


def layout(tensors: Sequence[tuple[str, int]], cap_bytes: int,
           first_cap_bytes: int | None = None) -> tuple[Bucket, ...]:
    """Greedy buckets over ``(name, numel)`` in backward order.

    Args:
        tensors: the gradients in backward order, with their element counts.
        cap_bytes: a bucket closes before the gradient that would take it past this many
            float32 bytes; 0: no fusion.
        first_cap_bytes: the first bucket's cap (default ``cap_bytes``); small, so that the
            first collective starts early in backward.

    Returns:
        The buckets, in backward order; the same on every rank for the same input.
    """
    if cap_bytes < 0 or (first_cap_bytes is not None and first_cap_bytes < 0):
        raise BucketError(f"bucket caps must be >= 0 bytes, got {cap_bytes}, {first_cap_bytes}")
    if cap_bytes == 0:
        return singletons([n for n, _ in tensors])
    out: list[Bucket] = []
    current: list[str] = []
    size = 0
    limit = cap_bytes if first_cap_bytes is None else first_cap_bytes
    for name, numel in tensors:
        nbytes = numel * _FLOAT32_BYTES
        if current and size + nbytes > limit:
            out.append(Bucket.of(current))
            current, size, limit = [], 0, cap_bytes
        current.append(name)
        size += nbytes
    if current:
        out.append(Bucket.of(current))
    return tuple(out)


def ddp_layout(tensors: Sequence[tuple[str, int]], cap_bytes: int | None = None,
               apart: frozenset[str] = frozenset()) -> tuple[Bucket, ...]:
    """DDP's buckets over ``tensors`` (backward order): :func:`layout_apart` with a cap of
    ``cap_bytes`` (default DEFAULT_CAP_BYTES, 25 MiB) and a first bucket of at most
    DEFAULT_FIRST_CAP_BYTES (1 MiB); a cap of 0: every gradient alone."""
    cap = DEFAULT_CAP_BYTES if cap_bytes is None else cap_bytes
    return layout_apart(tensors, cap, min(DEFAULT_FIRST_CAP_BYTES, cap) if cap else None, apart)


def layout_apart(tensors: Sequence[tuple[str, int]], cap_bytes: int,
                 first_cap_bytes: int | None = None,
                 apart: frozenset[str] = frozenset()) -> tuple[Bucket, ...]:
    """:func:`layout`, with the gradients in ``apart`` fused only with each other.

    Gradients kept out of compression (``Compression.espresso(exclude=...)``) must not share
    a bucket with compressed ones: each kind gets its own greedy layout, and the buckets of
    both are merged in the order their last members become ready. Their members in that order
    are the new submission order (a gradient waits for its bucket anyway), and the layout
    cuts it into consecutive runs; :func:`reorder` gives the workload in that order.
    """
    if not apart:
        return layout(tensors, cap_bytes, first_cap_bytes)
    position = {name: i for i, (name, _) in enumerate(tensors)}
    kept = layout([t for t in tensors if t[0] not in apart], cap_bytes, first_cap_bytes)
    alone = layout([t for t in tensors if t[0] in apart], cap_bytes, first_cap_bytes)
    return tuple(sorted(kept + alone, key=lambda b: position[b.tensors[-1]]))


def fewest(tensors: Sequence[tuple[str, int]], caps: Sequence[int],
           apart: frozenset[str] = frozenset()) -> tuple[Bucket, ...]:
    """The layout with the fewest buckets of ``caps``: the largest cap for every bucket, the
    first too (:func:`layout_apart`)."""
    return layout_apart(tensors, max(caps), None, apart)


def reorder(workload: Workload, order: Sequence[str]) -> Workload:
    """``workload`` with its gradients submitted in ``order`` (a permutation of its names).

    A gradient is handed over once every gradient before it in ``order`` is ready, so each
    one's ready time becomes the latest ready time up to it; the gaps follow from those.

    Raises:
        BucketError: ``order`` is not a permutation of the workload's names.
    """
    if sorted(order) != sorted(workload.names):
        raise BucketError(f"a submission order of {workload.model} must name every gradient "
                          "once")
    ready, at = {}, 0.0
    for t in workload.tensors:
        at += t.ready_gap_us
        ready[t.name] = at
    by_name = {t.name: t for t in workload.tensors}
    tensors, latest = [], 0.0
    for name in order:
        now = max(latest, ready[name])
        tensors.append(TensorProfile(name, by_name[name].numel, now - latest,
                                     by_name[name].shapes))
        latest = now
    return Workload(tuple(tensors), workload.forward_us, workload.model, workload.source)


def check_layout(buckets: Sequence[Bucket], order: Sequence[str], where: str = "buckets") -> None:
    """Check that ``buckets`` cut ``order`` (backward order) into consecutive runs.

    Raises:
        BucketError: a gradient in no bucket or in two, buckets out of order, or a bucket
            name that is also a gradient's name but not that bucket's only member.
    """
    flat = [n for b in buckets for n in b.tensors]
    if flat != list(order):
        missing = sorted(set(order) - set(flat))
        extra = sorted({n for n in flat if flat.count(n) > 1} | (set(flat) - set(order)))
        detail = "; ".join(x for x in (f"missing {missing[:3]}" if missing else "",
                                       f"unknown or repeated {extra[:3]}" if extra else "")
                           if x) or "members out of backward order"
        raise BucketError(f"{where}: the buckets must list every gradient once, in backward "
                          f"order ({detail})")
    names = set(order)
    for b in buckets:
        if b.name != Bucket.of(b.tensors).name or (b.fused and b.name in names):
            raise BucketError(f"{where}: bucket {b.name!r} must be named "
                              f"{Bucket.of(b.tensors).name!r} (its first member and how many "
                              "follow), and that name must not be a gradient's own")


def from_names(names: Sequence[str], order: Sequence[str], where: str = "buckets",
               apart: frozenset[str] = frozenset()) -> tuple[Bucket, ...]:
    """The layout whose buckets are named ``names`` (:meth:`Bucket.of`'s ``first`` or
    ``first+N``, in any order) over the gradients of ``order`` (backward order): what a record
    that keeps only the bucket names (``check.json``, ``trials.json``) ran. A bucket is its
    first gradient and the N that follow it in ``order``; with ``apart``
    (:func:`layout_apart`), the N that follow it of its own kind (in ``apart`` or not), and
    the buckets are in the order their last members become ready.

    Raises:
        BucketError: a name that is no gradient and no ``first+N`` of one, or buckets that do
            not hold every gradient once.
    """
    at = {n: i for i, n in enumerate(order)}
    runs = {kind: [n for n in order if (n in apart) is kind] for kind in (False, True)}
    place = {n: i for run in runs.values() for i, n in enumerate(run)}
    out = []
    for name in names:
        first, more = name, "0"
        if name not in at:
            first, _, more = name.rpartition("+")
        if first not in at or not more.isdigit():
            raise BucketError(f"{where}: {name!r} names no gradient (a bucket is named after "
                              "its first gradient, first+N when N more follow it)")
        run, start = runs[first in apart], place[first]
        out.append(Bucket.of(run[start: start + 1 + int(more)]))
    out.sort(key=lambda b: at[b.tensors[-1]])
    members = [n for b in out for n in b.tensors]
    if sorted(members) != sorted(order):
        check_layout(out, order, where)  # names what is missing or repeated
    return tuple(out)


def fuse(workload: Workload, buckets: Sequence[Bucket]) -> Workload:
    """The workload the planner sees: one tensor per bucket, ready with its last member.

    Raises:
        BucketError: ``buckets`` do not cut the workload's backward order (see
            :func:`check_layout`).
    """
    check_layout(buckets, workload.names, f"buckets of {workload.model}")
    by_name = {t.name: t for t in workload.tensors}
    tensors = tuple(
        TensorProfile(b.name, sum(by_name[n].numel for n in b.tensors),
                      float(sum(by_name[n].ready_gap_us for n in b.tensors)),
                      _member_shapes([by_name[n] for n in b.tensors]))
        for b in buckets)
    return Workload(tensors, workload.forward_us, workload.model, workload.source)


def fuse_apart(workload: Workload, buckets: Sequence[Bucket],
               apart: frozenset[str] = frozenset()) -> Workload:
    """The workload the planner sees for a layout of :func:`layout_apart` with ``apart``: the
    gradients submitted in the layout's order where ``apart`` moved some (:func:`reorder`),
    then fused (:func:`fuse`)."""
    if apart:
        workload = reorder(workload, [n for b in buckets for n in b.tensors])
    return fuse(workload, buckets)


def _member_shapes(members: Sequence[TensorProfile]) -> tuple[tuple[int, ...], ...] | None:
    """The shapes of a bucket's members in buffer order (None when one is unknown)."""
    if any(t.shapes is None for t in members):
        return None
    return tuple(s for t in members for s in t.shapes)  # type: ignore[union-attr]


def plan_fused(workload: Workload, plan_one: Callable[[Workload, float | None], float],
               caps: Sequence[int] = CANDIDATE_CAPS,
               first_cap_bytes: int = DEFAULT_FIRST_CAP_BYTES,
               apart: frozenset[str] = frozenset()) \
        -> tuple[tuple[Bucket, ...], list[tuple[int, int, float]]]:
    """The layout whose plan is predicted fastest, among the greedy layouts of ``caps`` and
    the layout with the fewest buckets (the largest cap for every bucket, the first too).

    The small first bucket starts the first gradients' synchronization early, under the
    backward pass; where that pass is short, each bucket's collectives cost more than the
    overlap gains (the LSTM of examples/train.py at 1 Gbit/s on the emulated cluster, 2 x 2
    workers on 2 cores: its greedy three buckets measured 32.6 ms an iteration, the fewest,
    two, 25.9; BENCHMARKS.md, "Fewer buckets, measured").

    The layouts are planned from the fewest buckets to the most: the fewer the buckets, the
    faster their plan, and each later one is planned against the best predicted so far
    (``plan_one``'s second argument; the planner's :attr:`PlanContext.incumbent_us`), which
    spares the search of the slow layouts (the unfused ones, with the most gradients).

    Args:
        workload: the per-gradient profile (backward order).
        plan_one: plans a fused workload, given the best predicted time of the layouts
            planned before it (None for the first), returning its predicted iteration time.
        caps: bucket caps to try (bytes); layouts that two caps produce alike are planned once.
        first_cap_bytes: the first bucket's cap, for every ``cap`` above it.
        apart: gradients fused only with each other (:func:`layout_apart`).

    Returns:
        (the kept layout, [(cap, buckets, predicted) for each distinct layout: the greedy
        ones by cap, then the fewest]); a tie keeps the earlier of that list (more buckets,
        more overlap).
    """
    tensors = [(t.name, t.numel) for t in workload.tensors]
    candidates = [(cap, layout_apart(tensors, cap, min(first_cap_bytes, cap) if cap else None,
                                     apart)) for cap in sorted(caps)]
    candidates.append((max(caps), fewest(tensors, caps, apart)))
    distinct = {buckets: cap for cap, buckets in reversed(candidates)}  # the first cap of each
    predicted: dict[tuple[Bucket, ...], float] = {}
    for buckets in sorted(distinct, key=len):
        predicted[buckets] = plan_one(fuse_apart(workload, buckets, apart),
                                      min(predicted.values(), default=None))
    listed = list(dict.fromkeys(buckets for _, buckets in candidates))
    best = min(listed, key=predicted.__getitem__)  # the first of equals: more buckets
    return best, [(distinct[b], len(b), predicted[b]) for b in listed]
