"""Step costs: every step of an Option priced as tasks on the timeline's resources.

Communication uses alpha-beta models of what the transport runs (``worker/transport.py``
over gloo): time = messages x latency ``a`` + bytes / bandwidth ``B``, both counted at the
busiest member of a group of ``p`` members holding ``n`` bytes each (shards ``s`` and
payloads ``c`` padded to the largest member's, as the transport pads them):

    Allreduce (ring)             2(p-1) a + 2 (p-1)/p n / B     (Patarasuk & Yuan, JPDC 2009)
    ReduceScatter (all-to-all)    (p-1) a +   (p-1)   s / B     (s = ceil(n/p) elements)
    Allgather (ring, shard s)     (p-1) a +   (p-1)   s / B
    AllgatherC (payload c)        (p-1) a +   (p-1)   c / B
    AlltoallC (pairwise, chunk c) (p-1) a +   (p-1)   c / B
    Reduce (gather to the root)   (p-1) a +   (p-1)   n / B     (the root sums in rank order)
      p > 2, n >= 64 KiB:        2(p-1) a + 2 (p-1)   s / B     (reduce-scatter + gather)
    GatherC (to the root)         (p-1) a +   (p-1)   c / B
    Broadcast(C) (binomial tree)  log2(p) (a + n / B)            (gloo/broadcast.cc)

A compressed step that forwards the ``q`` payloads an earlier gather left (``Op.forwards``:
``q`` = the product of those groups' sizes) moves ``q c`` bytes per member in the same
messages, and the ``Decomp`` after it decodes every payload (``Op.payloads``).
    PushPull(C) (PS)      per direction a + max(k n / B_nic, W n / (S B_server)), twice,
                          plus the servers' aggregation (W pushers, S servers, k pushers
                          per machine)

``Reduce`` is priced as the transport runs it (``program.reduce_splits``): a gather to the
root, or for more than 2 members and large tensors Rabenseifner's reduce-scatter + gather of
the summed shards; both sum in group-rank order, so the result equals the reference
interpreter bit for bit.
:meth:`Pricer.wire` lists the (messages, bytes) terms per step; tests/unit/test_wire.py
counts what the transport sends for every collective at p = 2, 4, 8 and compares.

Bandwidth ``B`` per scope: ``intra`` the intra link; ``inter`` the machine NIC divided by the
``k`` inter groups that use it at once (all local ranks after a divisible intra step, only
local rank 0 after Reduce/GatherC); ``flat`` the slower of both (one ring crosses each NIC
once per direction), except AlltoallC/GatherC/PushPull whose cross-machine bytes are counted
explicitly on the shared NIC.

Compute steps use the :class:`CompressorCosts` profile. GPU steps run on the training device.
CPU steps add a device->host copy of the dense input (Comp) or a host->device copy of the
dense result (Decomp) over ``h2d_gbps``, and share the machine's ``cpu_threads`` among the
``k`` local workers doing the same step at once (one thread's time x k / threads). When the
workers train on the host's CPU (``Cluster.host_device``) CPU steps occupy the ``gpu``
resource, whose cores they share.

Each step becomes one task on one resource (PushPull: push on the NIC, aggregation on the
servers, pull on the NIC). Durations are vectors over the workload's distinct tensor sizes.

A low-rank compressor's Option ``Comp(gpu) -> S -> Decomp(gpu)`` (``lowrank.py``) is priced as
it runs: ``P_w = M_w Q`` on the training device, ``S`` on the first sum's elements (the
uncompressed members and every ``P``), the orthogonalization and ``Q_w = M_w^T P^``, ``S``
again on the ``Q``s, then the reconstruction. Its distinct sizes are (element count,
:class:`~byteps_espresso.strategy.lowrank.Factors`) pairs, and its compute lines are in
multiply-adds.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numba
import numpy as np

from byteps_espresso.strategy.cluster import Cluster
from byteps_espresso.strategy.compressor_costs import CompressorCosts
from byteps_espresso.strategy.lowrank import Factors, inner, is_lowrank
from byteps_espresso.strategy.options import Device, Kind, Option, Scope, Step
from byteps_espresso.strategy.program import (
    RULES,
    Op,
    Program,
    compile_option,
    payload_count,
    reduce_splits,
    shard_numel,
)
from byteps_espresso.strategy.tree import Placements

__all__ = [
    "CPU",
    "EXCHANGES",
    "GPU",
    "INTER",
    "INTRA",
    "RESOURCES",
    "SERVER",
    "CompressedSizes",
    "PricedBatch",
    "Pricer",
    "StepTasks",
    "busy_per_resource",
    "bytes_per_us",
    "dense_us",
    "least_sum_warm_up",
    "link_of",
]

# Timeline resources (row order of the Gantt chart).
GPU, CPU, INTRA, INTER, SERVER = range(5)
RESOURCES = ("gpu", "cpu", "intra", "inter", "server")
FLOAT32_BYTES = 4
# Collectives in which every member sends and receives: Cluster.exchange_latency applies on
# the intra link, Cluster.inter_exchange_latency on the inter link (Cluster.rooted_latency to
# the other collectives).
EXCHANGES = frozenset({Kind.ALLREDUCE, Kind.ALLREDUCE_C, Kind.REDUCE_SCATTER, Kind.ALLGATHER,
                       Kind.ALLGATHER_C, Kind.ALLTOALL_C})
_ONE_HOT = np.eye(len(RESOURCES))


def link_of(cluster: Cluster, scope: Scope) -> int:
    """The link (``INTRA`` or ``INTER``) a collective in ``scope`` is priced on: a flat
    ring crosses the machines' links when there is more than one machine."""
    if scope is Scope.INTER or (scope is Scope.FLAT and cluster.machines > 1):
        return INTER
    return INTRA


def bytes_per_us(gbps: float) -> float:
    """Gbit/s -> bytes per microsecond (1 Gbit/s = 125 bytes/us)."""
    return gbps * 1e9 / 8 / 1e6


class CompressedSizes:
    """Exact payload bytes per element count, from the kernels registry (memoized). A
    low-rank compressor has no per-element payload (its Options sum dense factors, which
    the pricer sizes from :class:`Factors`): asking for one raises."""

    def __init__(self, compressor: str, params: dict | None = None,
                 nbytes: Callable[[int], int] | None = None) -> None:
        if nbytes is None and is_lowrank(compressor):
            nbytes = _no_payload
        elif nbytes is None:
            from byteps_espresso.kernels import create

            nbytes = create(compressor, backend="numba", **(params or {})).compressed_nbytes
        self.compressor = compressor
        self._nbytes = nbytes
        self._cache: dict[int, int] = {}
        self._vectors: dict[bytes, np.ndarray] = {}

    def __call__(self, numels: np.ndarray) -> np.ndarray:
        key = numels.tobytes()
        got = self._vectors.get(key)
        if got is None:
            got = np.empty(len(numels), dtype=np.float64)
            for i, n in enumerate(numels):
                k = int(n)
                size = self._cache.get(k)
                if size is None:
                    size = self._cache[k] = int(self._nbytes(k)) if k > 0 else 0
                got[i] = size
            self._vectors[key] = got
        return got


def _no_payload(numel: int) -> int:
    raise ValueError("a low-rank compressor's Options sum dense factors: no step moves its "
                     "payloads (tree.enumerate_options with compressor= prunes them)")


@dataclass(frozen=True)
class StepTasks:
    """An option's tasks: resource, owning step index and duration per distinct size."""

    resource: np.ndarray  # (L,) int64
    step: np.ndarray  # (L,) int64: index into option.steps
    duration: np.ndarray  # (U, L) float64 microseconds

    @functools.cached_property
    def busy(self) -> np.ndarray:
        """(U, R) total busy time per resource."""
        return self.duration @ _ONE_HOT[self.resource]

    @functools.cached_property
    def total(self) -> np.ndarray:
        """(U,) sum of the task durations: the option's time with nothing else running."""
        return self.duration.sum(axis=1)

    def per_step(self, steps: int) -> np.ndarray:
        """(U, steps) each step's task durations summed (compute steps: their one task)."""
        out = np.zeros((self.duration.shape[0], steps))
        np.add.at(out, (slice(None), self.step), self.duration)
        return out


def dense_us(cluster: Cluster, option: Option, numel: int) -> float:
    """Microseconds of the uncompressed ``option`` for one tensor of ``numel`` float32
    elements with nothing else running (no compressor takes part).

    Raises:
        ValueError: ``option`` compresses.
    """
    if option.is_compressed:
        raise ValueError(f"{option} compresses; dense_us prices uncompressed Options")
    pricer = Pricer(cluster, "none", CompressedSizes("none", nbytes=_no_payload),
                    CompressorCosts.default(), [numel], free_compression=True)
    return float(pricer.tasks(option).total[0])


def _ceil_div(a: np.ndarray, p: int) -> np.ndarray:
    return np.ceil(a / p)


def _log2(p: int) -> int:
    return max(1, math.ceil(math.log2(p))) if p > 1 else 0


class Pricer:
    """Prices options for one workload's distinct sizes on one cluster with one compressor
    (and the partner compressors that mixed Options name on their steps, ``Comp(gpu,fp16)``).

    Args:
        cluster: the machines and links.
        compressor: registry name (its cost profile must be in ``costs``).
        sizes: payload bytes per element count.
        costs: compression cost profiles (a partner's too, to price Options that use it).
        numels: the distinct tensor sizes (element counts) to price.
        partner_sizes: payload bytes per partner (default: from the kernels registry).
        factors: for a low-rank compressor, each distinct size's :class:`Factors` (aligned
            with ``numels``, which may then repeat an element count); None: it is not one.
    """

    def __init__(self, cluster: Cluster, compressor: str, sizes: CompressedSizes,
                 costs: CompressorCosts, numels: Sequence[int], *,
                 free_compression: bool = False,
                 partner_sizes: dict[str, CompressedSizes] | None = None,
                 factors: Sequence[Factors] | None = None):
        self.cluster = cluster
        self.compressor = compressor
        self.sizes = sizes
        self.costs = costs
        self.numels = np.asarray(numels, dtype=np.float64)
        self.free_compression = free_compression
        self._memo: dict[Option, StepTasks] = {}
        self._partner_sizes: dict[str, CompressedSizes] = dict(partner_sizes or {})
        self._prefix: dict[tuple[int, ...], tuple] = {}
        self._ops: dict[tuple, tuple] = {}
        # The task table: every step setting's tasks priced once, one row per task
        # (resource, duration per size), and each setting's first row (-1: not priced).
        self._res = np.zeros(0, dtype=np.int64)
        self._dur = np.zeros((0, len(self.numels)))
        self._first = np.zeros(0, dtype=np.int64)
        c = cluster
        self._b_intra = bytes_per_us(c.intra_gbps)
        self._b_inter = bytes_per_us(c.inter_gbps)
        self._b_server = bytes_per_us(c.server_gbps) if c.servers else 0.0
        self._b_h2d = bytes_per_us(c.h2d_gbps)
        self._multi = c.machines > 1
        self._groups = {Scope.FLAT: c.world_size, Scope.INTRA: c.gpus_per_machine,
                        Scope.INTER: c.machines}
        self._extents: dict[tuple[Scope, ...], np.ndarray] = {}
        self.factors = None if factors is None else list(factors)
        self._rounds: tuple[Pricer, Pricer] | None = None  # the low-rank sums' pricers
        if not free_compression and not costs.has(compressor):
            costs.compress_us(compressor, "gpu", 1)  # raises, naming the compressor

    # ---- public -----------------------------------------------------------------------------
    def tasks(self, option: Option) -> StepTasks:
        """The option's tasks (memoized), read from the task table (:meth:`batch`)."""
        got = self._memo.get(option)
        if got is None and self._low_rank(option):
            got = self._memo[option] = self._price_lowrank(option)
        elif got is None:
            (priced,) = self.batch((option,))
            got = self._memo[option] = StepTasks(
                priced.resource[0], np.array(_task_layout(option)[2], dtype=np.int64),
                priced.duration[0])
        return got

    def batch(self, options: Sequence[Option]) -> list[PricedBatch]:
        """The tasks of ``options`` as arrays, one :class:`PricedBatch` per task count
        (positions into ``options``), equal bit for bit to :meth:`walk`'s.

        Each task is a row of the task table: one task of one step setting (what a step's
        tasks depend on, :func:`_setting`), priced the first time any option needs it and
        shared by every option with that setting; an option's prices are a gather of its
        rows, a few array operations over (options x tasks x sizes) per batch instead of a
        walk per option."""
        if self.factors is not None and any(map(self._low_rank, options)):
            return self._batch_low_rank(options)
        used, groups = _batch_layout(tuple(options))
        self._price_settings(used)
        out = []
        for positions, settings, parts in groups:
            rows = self._first[settings] + parts  # (B, L)
            out.append(PricedBatch(positions, self._res[rows],
                                   np.ascontiguousarray(self._dur[rows].transpose(0, 2, 1))))
        return out

    def lane_hold(self, option: Option, n_tasks: int) -> int:
        """How many of the option's ``n_tasks`` tasks its executor lane runs before it is
        free: those before the in-flight step (:attr:`Program.in_flight`: the executor
        issues it ``async_op`` and runs the compute steps after it in the waiting call), or
        all of them. A low-rank compressor's Options run their own path and hold it."""
        if self._low_rank(option):
            return n_tasks
        tail = compile_option(option).in_flight
        return n_tasks if tail is None else _task_layout(option)[2].index(tail)

    def fastest_alone(self, forms: Sequence[Placements]) -> np.ndarray:
        """Per size (U,), the least time alone (the sum of its tasks' durations) of any Option
        of ``forms`` (``tree.option_forms``: not a low-rank tree): what :meth:`batch` would
        give as the minimum of every option's ``total``, without gathering every option's
        tasks. Each step setting is summed once, then each prefix of the options' prefix
        tree of settings (:func:`_step_trie`, cached per ``forms`` object) in one kernel."""
        trie = _step_trie(forms)
        self._price_settings(trie.settings)
        first = self._first[trie.settings]
        alone = self._dur[first]
        for part in (1, 2):  # PushPull's push, aggregation and pull (_tasks_of)
            more = trie.tasks > part
            alone[more] += self._dur[first[more] + part]
        per_setting = np.zeros((len(self._first), len(self.numels)))
        per_setting[trie.settings] = alone
        return _least_sum(trie.parent, trie.setting, trie.ends, per_setting)

    def _low_rank(self, option: Option) -> bool:
        """Whether ``option`` is a low-rank compressor's ``Comp -> S -> Decomp``."""
        return self.factors is not None and option.is_compressed

    def _batch_low_rank(self, options: Sequence[Option]) -> list[PricedBatch]:
        """:meth:`batch` of a list holding low-rank Options: the uncompressed ones from the
        task table, the others by :meth:`_price_lowrank`, grouped by task count alike."""
        dense = np.array([k for k, o in enumerate(options) if not self._low_rank(o)],
                         dtype=np.int64)
        out = [PricedBatch(dense[b.positions], b.resource, b.duration)
               for b in (self.batch([options[k] for k in dense]) if len(dense) else [])]
        by_len: dict[int, list[int]] = {}
        for k, option in enumerate(options):
            if self._low_rank(option):
                by_len.setdefault(len(self.tasks(option).resource), []).append(k)
        for positions in by_len.values():
            priced = [self.tasks(options[k]) for k in positions]
            out.append(PricedBatch(np.array(positions, dtype=np.int64),
                                   np.stack([p.resource for p in priced]),
                                   np.stack([p.duration for p in priced])))
        return out

    def _price_settings(self, settings: np.ndarray) -> None:
        """Price the step settings not in the task table yet (their example steps)."""
        known = len(_SETTINGS.example)
        if len(self._first) < known:
            self._first = np.concatenate([self._first,
                                          np.full(known - len(self._first), -1, np.int64)])
        missing = settings[self._first[settings] < 0]
        if not len(missing):
            return
        examples = [_SETTINGS.example[m] for m in missing.tolist()]
        compute = [k for k, (_, op) in enumerate(examples) if op.kind.is_compute]
        if compute:  # every Comp/Decomp at once
            self._first[missing[compute]] = len(self._res) + np.arange(len(compute))
            resource, duration = self._compute_all([examples[k] for k in compute])
            self._res = np.concatenate([self._res, resource])
            self._dur = np.concatenate([self._dur, duration])
        first = len(self._res)
        resources: list[int] = []
        durations: list[np.ndarray] = []
        for k, (prog, op) in enumerate(examples):
            if op.kind.is_compute:
                continue
            tasks = self._comm(prog, op)
            assert len(tasks) == _tasks_of(op.kind), op.step  # _task_layout's count
            self._first[missing[k]] = first + len(resources)
            for task in tasks:
                resources.append(task.resource)
                durations.append(task.duration)
        if resources:
            self._res = np.concatenate([self._res, np.array(resources, dtype=np.int64)])
            self._dur = np.concatenate([self._dur, np.stack(durations)])

    def _compute_all(self, steps: Sequence[tuple[Program, Op]]) \
            -> tuple[np.ndarray, np.ndarray]:
        """:meth:`_compute` of S Comp/Decomp steps at once, any kind, device and compressor:
        their (S,) resources and (S, U) durations. Per-step values are (S, 1) columns and
        each element goes through the same operations as in :meth:`_compute`:
        ``count x (a + b x numel)``, then on the CPU ``x share + copy``."""
        ops = [op for _, op in steps]
        comp = np.array([op.kind is Kind.COMP for op in ops])[:, None]
        extent = np.stack([self.extent(op.shards) for op in ops])
        chunks = _column([self._group(op.chunks) if op.chunks is not None else 1
                          for op in ops])
        pieces = np.stack([self.extent(op.piece_shards) if op.piece_shards is not None
                           else extent[k] for k, op in enumerate(ops)])
        numel = np.where(comp, _ceil_div(extent, chunks), pieces)  # type: ignore[arg-type]
        count = np.where(comp, chunks, _column([
            payload_count(op.payloads, self._group) for op in ops]))
        if self.free_compression:
            work = np.zeros_like(numel)
        else:
            models = [self.costs.model(op.codec or self.compressor,
                                       op.device.value,  # type: ignore[union-attr]
                                       "compress" if op.kind is Kind.COMP else "decompress")
                      for op in ops]
            work = count * (_column([m.a_us for m in models])
                            + _column([m.b_us for m in models]) * numel)
        on_gpu = np.array([op.device is Device.GPU for op in ops])
        host = GPU if self.cluster.host_device else CPU
        resource = np.where(on_gpu, GPU, host).astype(np.int64)
        if self.free_compression:
            return resource, work
        share = _column([self._active(prog, op) / self.cluster.cpu_threads
                         for prog, op in steps])
        copy = extent * FLOAT32_BYTES / self._b_h2d
        return resource, np.where(on_gpu[:, None], work, work * share + copy)

    def sizes_of(self, codec: str | None) -> CompressedSizes:
        """Payload bytes of the job's compressor (None) or of the partner ``codec``."""
        if codec is None:
            return self.sizes
        got = self._partner_sizes.get(codec)
        if got is None:
            got = self._partner_sizes[codec] = CompressedSizes(codec)
        return got

    # ---- the walk ---------------------------------------------------------------------------
    def _group(self, scope: Scope) -> int:
        return self._groups[scope]

    def _link(self, scope: Scope, k: int) -> tuple[float, float, int]:
        """(bytes/us, latency us, resource) of a ring in ``scope`` with k groups per NIC."""
        c = self.cluster
        if link_of(c, scope) == INTRA:
            return self._b_intra, c.intra_latency_us, INTRA
        if scope is Scope.INTER:
            return self._b_inter / k, c.inter_latency_us, INTER
        return min(self._b_intra, self._b_inter), c.inter_latency_us, INTER

    def walk(self, option: Option) -> StepTasks:
        """The option's tasks by walking its compiled program step by step (the reference
        that :meth:`tasks` and :meth:`batch` equal; tests compare them). The tasks after
        every prefix are memoized, so options sharing a prefix share its pricing."""
        if self._low_rank(option):
            return self._price_lowrank(option)
        prog = compile_option(option)
        codes = tuple(_CODES[s] for s in option.steps)
        tasks: tuple = ()
        for i, op in enumerate(prog.ops):
            # Comp's cost depends on the next step (chunks before AlltoallC): mark it in
            # the key with a negative code so it never equals the next prefix.
            key = (*codes[: i + 1], -1 - codes[i + 1]) if op.kind is Kind.COMP \
                else codes[: i + 1]
            hit = self._prefix.get(key)
            if hit is not None:
                tasks = hit
                continue
            tasks = tasks + tuple((r, i, d) for r, d in self._op_tasks(prog, op))
            self._prefix[key] = tasks
        return StepTasks(np.array([t[0] for t in tasks], dtype=np.int64),
                         np.array([t[1] for t in tasks], dtype=np.int64),
                         np.stack([t[2] for t in tasks], axis=1))

    def _price_lowrank(self, option: Option) -> StepTasks:
        """``Comp -> S -> Decomp`` of a low-rank compressor: P's products, ``S`` on the first
        sum, the orthogonalization and Q's products, ``S`` on the Qs, the reconstruction (a
        bucket with nothing to compress runs ``S`` once: its second round and products are
        zero)."""
        dense = inner(option)
        assert dense is not None and self.factors is not None, f"{option} is not low-rank"
        if self._rounds is None:
            f = self.factors
            self._rounds = tuple(  # type: ignore[assignment]
                Pricer(self.cluster, self.compressor, self.sizes, self.costs, numels,
                       free_compression=True)
                for numels in ([x.p for x in f], [x.q for x in f]))
        first, second = (r.tasks(dense) for r in self._rounds)  # type: ignore[union-attr]
        f = self.factors
        compressing = np.array([x.q > 0 for x in f], dtype=np.float64)
        last = len(option.steps) - 1

        def work(op: str, macs: list[int]) -> np.ndarray:
            dev = option.steps[0 if op == "compress" else last].device.value  # type: ignore
            n = np.array(macs, dtype=np.float64)
            if self.free_compression:
                return np.zeros_like(n)
            cost = self.costs.compress_us if op == "compress" else self.costs.decompress_us
            return cost(self.compressor, dev, n) * compressing

        compute = [work("compress", [x.mac_p for x in f]),
                   work("compress", [x.mac_q for x in f]), work("decompress", [x.mac_r for x in f])]
        return StepTasks(
            np.concatenate([[GPU], first.resource, [GPU], second.resource, [GPU]]).astype(np.int64),
            np.concatenate([[0], first.step + 1, [0], second.step + 1, [last]]).astype(np.int64),
            np.concatenate([compute[0][:, None], first.duration, compute[1][:, None],
                            second.duration * compressing[:, None], compute[2][:, None]],
                           axis=1))

    def _op_tasks(self, prog: Program, op: Op) -> tuple[tuple[int, np.ndarray], ...]:
        """(resource, duration) of ``op``'s tasks, memoized by what they depend on
        (:func:`_setting`). Options that differ in their prefix share them."""
        key = _setting(prog, op)
        got = self._ops.get(key)
        if got is None:
            got = self._ops[key] = (self._compute(prog, op),) if op.kind.is_compute else \
                tuple((t.resource, t.duration) for t in self._comm(prog, op))
        return got

    def wire(self, option: Option) -> list[tuple[int, float, np.ndarray]]:
        """(step index, messages, bytes) at the busiest member of each collective step's
        group, as charged (``messages x latency + bytes / bandwidth``); PS steps and the
        flat AlltoallC/GatherC across machines (two links) are left out. Tests compare these
        with what the transport sends."""
        prog = compile_option(option)
        out = []
        for op in prog.ops:
            if not op.kind.is_compute:
                out += [(op.index, t.msgs, t.nbytes) for t in self._comm(prog, op)
                        if t.nbytes is not None]
        return out

    def extent(self, shards: Sequence[Scope]) -> np.ndarray:
        """Elements held per worker on the shard path ``shards`` (the largest shard;
        memoized: do not modify it)."""
        key = tuple(shards)
        got = self._extents.get(key)
        if got is None:
            got = self._extents[key] = shard_numel(self.numels, key, self._group)
        return got

    def _before(self, prog: Program, op: Op) -> Op | None:
        return prog.ops[op.index - 1] if op.index else None

    def _active(self, prog: Program, op: Op) -> int:
        """Workers per machine holding data when ``op`` starts: all of them, or one while a
        Reduce/GatherC is open."""
        prev = self._before(prog, op)
        return 1 if prev is not None and prev.rooted else self.cluster.gpus_per_machine

    def _compute(self, prog: Program, op: Op) -> tuple[int, np.ndarray]:
        dev = op.device.value  # type: ignore[union-attr]
        extent = self.extent(op.shards)
        compressor = op.codec or self.compressor
        if op.kind is Kind.COMP:
            chunks = self._group(op.chunks) if op.chunks is not None else 1
            numel, count = _ceil_div(extent, chunks), chunks
            work = (np.zeros_like(numel) if self.free_compression else
                    count * self.costs.compress_us(compressor, dev, numel))
        else:
            assert op.piece_shards is not None
            numel = self.extent(op.piece_shards)
            count = payload_count(op.payloads, self._group)
            work = (np.zeros_like(numel) if self.free_compression else
                    self.costs.decompress_us(compressor, dev, numel, count))
        copy = extent * FLOAT32_BYTES / self._b_h2d
        if op.device is Device.GPU:
            return GPU, work
        # Without an accelerator the host pool shares its cores with the training device.
        host = GPU if self.cluster.host_device else CPU
        if self.free_compression:
            return host, work
        share = self._active(prog, op) / self.cluster.cpu_threads
        return host, work * share + copy

    def _comm(self, prog: Program, op: Op) -> list[_Task]:
        scope = op.scope
        assert scope is not None
        p = self._group(scope)
        active = self._active(prog, op)
        bw, lat, resource = self._link(scope, active)
        # (the PS kinds price their own path's latency, Cluster.ps_latency_us)
        c = self.cluster
        if op.kind in EXCHANGES:
            lat *= c.inter_exchange_latency if resource == INTER else c.exchange_latency
        else:
            lat *= c.rooted_latency
        prev = self._before(prog, op)
        e = self.extent(prev.shards if prev is not None else ())
        comm = _Comm(p, bw, lat, resource, scope, e, e * FLOAT32_BYTES, active,
                     self.sizes_of(op.codec), payload_count(op.forwards, self._group))
        return _COMM_MODELS[op.kind](self, comm)


@dataclass(frozen=True)
class PricedBatch:
    """Options of one task count priced together (:meth:`Pricer.batch`).

    Attributes:
        positions: (B,) where each option stands in the list priced.
        resource: (B, L) each task's resource.
        duration: (B, U, L) each task's duration per distinct size, microseconds.
    """

    positions: np.ndarray
    resource: np.ndarray
    duration: np.ndarray

    @functools.cached_property
    def busy(self) -> np.ndarray:
        """(B, U, R) total busy time per resource (:attr:`StepTasks.busy` of each option)."""
        return busy_per_resource(self.resource, self.duration)

    @functools.cached_property
    def total(self) -> np.ndarray:
        """(B, U) each option's time alone (:attr:`StepTasks.total`)."""
        return self.duration.sum(axis=2)


def busy_per_resource(resource: np.ndarray, duration: np.ndarray) -> np.ndarray:
    """(B, U, R) busy time per resource of options with tasks on ``resource`` (B, L) lasting
    ``duration`` (B, U, L): the product with the one-hot resource matrices, as
    :attr:`StepTasks.busy` computes it for one option."""
    return np.matmul(duration, _ONE_HOT[resource])


def _setting(prog: Program, op: Op) -> tuple:
    """What a step's tasks depend on: the step, the extents it works on and whether a rooted
    step before it left one worker per machine holding data (``Pricer._active``)."""
    prev = prog.ops[op.index - 1] if op.index else None
    return (op.step, op.codec, op.shards, op.chunks, op.piece_shards, op.payloads,
            op.forwards, prev is not None and bool(prev.rooted),
            prev.shards if prev is not None else ())


class _Settings:
    """Every step setting seen, numbered on first sight, with an example (program, op) to
    price it from. Settings depend on the programs alone, so every pricer shares them."""

    def __init__(self) -> None:
        self.ids: dict[tuple, int] = {}
        self.example: list[tuple[Program, Op]] = []

    def of(self, prog: Program, op: Op) -> int:
        key = _setting(prog, op)
        got = self.ids.get(key)
        if got is None:
            got = self.ids[key] = len(self.example)
            self.example.append((prog, op))
        return got


_SETTINGS = _Settings()


def _tasks_of(kind: Kind) -> int:
    """Tasks of a step: PushPull(C) pushes, aggregates and pulls; any other step is one."""
    return 3 if kind in (Kind.PUSH_PULL, Kind.PUSH_PULL_C) else 1


@functools.lru_cache(maxsize=16384)
def _task_layout(option: Option) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """Per task of the option: its step setting, its place among the setting's tasks and
    its step index (cached per Option; a function of the program alone)."""
    prog = compile_option(option)
    settings: list[int] = []
    parts: list[int] = []
    steps: list[int] = []
    for op in prog.ops:
        setting = _SETTINGS.of(prog, op)
        for j in range(_tasks_of(op.kind)):
            settings.append(setting)
            parts.append(j)
            steps.append(op.index)
    return tuple(settings), tuple(parts), tuple(steps)


class _StepTrie(NamedTuple):
    """Options as a prefix tree of their steps' settings; node 0 is the empty prefix and
    every node's parent comes before it."""

    settings: np.ndarray  # the settings the options use
    tasks: np.ndarray  # the task count of each of ``settings``
    parent: np.ndarray  # per node (node 0: itself)
    setting: np.ndarray  # per node, its last step's setting (node 0: unused)
    ends: np.ndarray  # each option's last node


# Prefix trees kept, per tree (its forms held here, so their id stays their own).
_TRIES: OrderedDict[int, tuple[Sequence[Placements], _StepTrie]] = OrderedDict()
TRIE_CACHE_SIZE = 16
# Above any number of step settings (a few hundred in the largest tree), so that one integer
# names a (node, setting) edge of the prefix tree.
_TRIE_STRIDE = 1 << 20


def _step_trie(forms: Sequence[Placements]) -> _StepTrie:
    """The prefix tree of the Options of ``forms`` (``tree.option_forms``; cached by
    identity). The whole tree at 8 x 8 with servers, 7,576 Options of 74,768 tasks, is
    16,149 step prefixes.

    Only one Option per form (235 in that tree) is compiled: a program does not depend on
    where its Comp/Decomp steps run, so another placement's steps have the same settings but
    for their own ``step`` (:func:`_setting`). Compiling every Option instead costs about
    0.9 s in a fresh process."""
    hit = _TRIES.get(id(forms))
    if hit is not None and hit[0] is forms:
        return hit[1]
    rows = []
    for group in forms:
        first = group.options[0]
        prog = compile_option(first)
        row = np.array([_SETTINGS.of(prog, op) for op in prog.ops], dtype=np.int64)
        placed = np.tile(row, (len(group.options), 1))
        for j, i in enumerate(group.markers):
            op = prog.ops[i]
            devices = [combo[j] for combo in group.devices]
            for device in set(devices):
                if device is not op.device:
                    at = [r for r, d in enumerate(devices) if d is device]
                    placed[at, i] = _SETTINGS.of(prog, dataclasses.replace(
                        op, step=op.step.on(device)))
        rows.append(placed)
    width = max(r.shape[1] for r in rows)
    settings = np.full((sum(len(r) for r in rows), width), -1, dtype=np.int64)
    top = 0
    for r in rows:
        settings[top: top + len(r), : r.shape[1]] = r
        top += len(r)
    # Level by level: each option's node at depth d is its (node at d - 1, setting) pair's.
    node = np.zeros(len(settings), dtype=np.int64)
    parent, setting, nodes = [np.zeros(1, dtype=np.int64)], [np.zeros(1, dtype=np.int64)], 1
    for depth in range(width):
        live = settings[:, depth] >= 0
        edges, index = np.unique(node[live] * _TRIE_STRIDE + settings[live, depth],
                                 return_inverse=True)
        node[live] = nodes + index
        parent.append(edges // _TRIE_STRIDE)
        setting.append(edges % _TRIE_STRIDE)
        nodes += len(edges)
    used = np.unique(settings[settings >= 0])
    trie = _StepTrie(used, np.array([_tasks_of(_SETTINGS.example[s][1].kind) for s in used],
                                    dtype=np.int64),
                     np.concatenate(parent), np.concatenate(setting), node)
    _TRIES[id(forms)] = (forms, trie)
    if len(_TRIES) > TRIE_CACHE_SIZE:
        _TRIES.popitem(last=False)
    return trie


@numba.njit(cache=True)
def _least_sum(parent: np.ndarray, setting: np.ndarray, ends: np.ndarray,
               per_setting: np.ndarray) -> np.ndarray:
    """Per size, the least sum over the prefix tree's options of their steps' values
    (``per_setting`` (settings, U)): each prefix's sum from its parent's, in node order."""
    n, sizes = len(parent), per_setting.shape[1]
    total = np.zeros((n, sizes))
    for node in range(1, n):
        for u in range(sizes):
            total[node, u] = total[parent[node], u] + per_setting[setting[node], u]
    least = np.full(sizes, np.inf)
    for node in ends:
        for u in range(sizes):
            least[u] = min(least[u], total[node, u])
    return least


def least_sum_warm_up() -> None:
    """Load (or compile) the kernel of :meth:`Pricer.fastest_alone`."""
    one = np.zeros(1, dtype=np.int64)
    _least_sum(one, one, one, np.zeros((1, 1)))


@functools.lru_cache(maxsize=256)
def _batch_layout(options: tuple[Option, ...]) \
        -> tuple[np.ndarray, list[tuple[np.ndarray, np.ndarray, np.ndarray]]]:
    """The settings ``options`` use, and per task count L (positions, settings (B, L), task
    within the setting (B, L)); cached per option list (the tree's lists recur)."""
    layouts = [_task_layout(o) for o in options]
    by_len: dict[int, list[int]] = {}
    for pos, (settings, _, _) in enumerate(layouts):
        by_len.setdefault(len(settings), []).append(pos)
    groups = [(np.array(positions, dtype=np.int64),
               np.array([layouts[p][0] for p in positions], dtype=np.int64),
               np.array([layouts[p][1] for p in positions], dtype=np.int64))
              for positions in by_len.values()]
    used = np.unique(np.concatenate([g[1].ravel() for g in groups])) if groups else \
        np.zeros(0, dtype=np.int64)
    return used, groups


def _column(values: Sequence[float]) -> np.ndarray:
    """(S, 1) column of per-step values, broadcast against (S, U) arrays."""
    return np.array(values)[:, None]


class _Comm(NamedTuple):
    """One communication step's setting: group size, link and current extent."""

    p: int  # group size
    bw: float  # bytes/us of the ring's bottleneck link
    lat: float  # per-message latency, us
    r: int  # resource
    scope: Scope
    e: np.ndarray  # extent, elements
    dense: np.ndarray  # extent, bytes of float32
    active: int  # workers per machine holding data
    sizes: CompressedSizes  # payload bytes of the compressor whose payloads move here
    q: int = 1  # payloads each member moves (an earlier gather's, forwarded)

    def task(self, msgs: float | np.ndarray, nbytes: np.ndarray) -> list[_Task]:
        """A collective on the group's link: ``msgs`` latencies + ``nbytes`` over it."""
        return [_Task(self.r, msgs * self.lat + nbytes / self.bw, msgs, nbytes)]


class _Task(NamedTuple):
    resource: int
    duration: np.ndarray  # us
    msgs: float | np.ndarray = 0.0  # messages at the busiest member (per size for Reduce)
    nbytes: np.ndarray | None = None  # bytes at the busiest member


# ---- one function per communication kind -------------------------------------------------------
# What the transport runs (worker/transport.py over gloo), at the group's busiest member:
# messages sent or received there, and bytes sent or received there. Shards and payloads are
# padded to the largest member's, as the transport pads them.
def _allreduce(pr: Pricer, c: _Comm) -> list[_Task]:
    # ring: reduce-scatter then all-gather, 2 (p-1) messages of n/p (Patarasuk & Yuan)
    return c.task(2 * (c.p - 1), 2 * (c.p - 1) / c.p * c.dense)


def _allreduce_c(pr: Pricer, c: _Comm) -> list[_Task]:
    # the ring all-reduce of the payload's arrays in their own dtype (sums inside the ring)
    return c.task(2 * (c.p - 1), 2 * (c.p - 1) / c.p * c.sizes(c.e))


def _reduce_scatter(pr: Pricer, c: _Comm) -> list[_Task]:
    # all-to-all of padded shards: p-1 messages of one shard each
    return c.task(c.p - 1, (c.p - 1) * _ceil_div(c.e, c.p) * FLOAT32_BYTES)


def _allgather(pr: Pricer, c: _Comm) -> list[_Task]:
    # ring all-gather of the (padded) shards held now
    return c.task(c.p - 1, (c.p - 1) * c.dense)


def _allgather_c(pr: Pricer, c: _Comm) -> list[_Task]:
    return c.task(c.p - 1, (c.p - 1) * c.q * c.sizes(c.e))


def _alltoall_c(pr: Pricer, c: _Comm) -> list[_Task]:
    payload = c.sizes(_ceil_div(c.e, c.p))
    if c.scope is Scope.FLAT and pr._multi:
        g, n = pr.cluster.gpus_per_machine, pr.cluster.world_size
        t = np.maximum((g - 1) * payload / pr._b_intra, g * (n - g) * payload / pr._b_inter)
        return [_Task(c.r, (c.p - 1) * c.lat + t)]
    return c.task(c.p - 1, (c.p - 1) * payload)


def _tree(c: _Comm, nbytes: np.ndarray) -> list[_Task]:
    """A binomial tree from the root (gloo's broadcast): the root sends log2(p) messages,
    each carrying all ``nbytes``."""
    return c.task(_log2(c.p), _log2(c.p) * nbytes)


def _reduce(pr: Pricer, c: _Comm) -> list[_Task]:
    # the transport's rule (program.reduce_splits): a gather of the whole extent to the root
    # (p-1 messages of n), or for p > 2 and large extents a reduce-scatter then a gather of
    # the summed shards (the root sends p-1 shards and receives 2 (p-1))
    split = np.array([reduce_splits(c.p, int(b)) for b in c.dense])
    shard = _ceil_div(c.e, c.p) * FLOAT32_BYTES
    msgs = np.where(split, 2 * (c.p - 1), c.p - 1).astype(np.float64)
    return c.task(msgs, np.where(split, 2 * (c.p - 1) * shard, (c.p - 1) * c.dense))


def _broadcast(pr: Pricer, c: _Comm) -> list[_Task]:
    return _tree(c, c.dense)


def _broadcast_c(pr: Pricer, c: _Comm) -> list[_Task]:
    return _tree(c, c.q * c.sizes(c.e))


def _gather_c(pr: Pricer, c: _Comm) -> list[_Task]:
    payload = c.q * c.sizes(c.e)
    if c.scope is Scope.FLAT and pr._multi:
        g, n = pr.cluster.gpus_per_machine, pr.cluster.world_size
        t = np.maximum((g - 1) * payload / pr._b_intra, (n - g) * payload / pr._b_inter)
        return [_Task(c.r, (c.p - 1) * c.lat + t)]
    return c.task(c.p - 1, (c.p - 1) * payload)


def _ps_tasks(pr: Pricer, c: _Comm, nbytes: np.ndarray,
              server_us: np.ndarray) -> list[_Task]:
    cl = pr.cluster
    k = c.active
    pushers = cl.world_size if c.scope is Scope.FLAT else cl.machines * k
    nic = k * nbytes * cl.link_share / pr._b_inter
    srv = pushers * nbytes / (cl.servers * pr._b_server)
    one_way = cl.ps_latency_us + np.maximum(nic, srv)
    return [_Task(INTER, one_way), _Task(SERVER, server_us), _Task(INTER, one_way.copy())]


def _pushers_keys(pr: Pricer, c: _Comm) -> tuple[int, int]:
    cl = pr.cluster
    if c.scope is Scope.FLAT:
        return cl.world_size, 1
    return cl.machines * c.active, c.active


def _push_pull(pr: Pricer, c: _Comm) -> list[_Task]:
    cl = pr.cluster
    pushers, keys = _pushers_keys(pr, c)
    work = pr.costs.dense_sum(pushers * c.e) * keys / (cl.servers * cl.server_threads)
    return _ps_tasks(pr, c, c.dense, work)


def _push_pull_c(pr: Pricer, c: _Comm) -> list[_Task]:
    cl = pr.cluster
    pushers, keys = _pushers_keys(pr, c)
    if pr.free_compression:
        work = np.zeros_like(c.e)
    else:
        dev = pr.costs.server_device(pr.compressor)
        per_key = (pr.costs.decompress_us(pr.compressor, dev, c.e, pushers)
                   + pr.costs.compress_us(pr.compressor, dev, c.e))
        work = per_key * keys / (cl.servers * cl.server_threads)
    return _ps_tasks(pr, c, pr.sizes(c.e), work)


class _Codes(dict):
    """Every step as a small integer (fast prefix keys), numbered on first sight."""

    def __missing__(self, step: Step) -> int:
        code = self[step] = len(self)
        return code


_CODES: dict[Step, int] = _Codes()

_COMM_MODELS = {
    Kind.ALLREDUCE: _allreduce,
    Kind.ALLREDUCE_C: _allreduce_c,
    Kind.REDUCE_SCATTER: _reduce_scatter,
    Kind.ALLGATHER: _allgather,
    Kind.ALLGATHER_C: _allgather_c,
    Kind.ALLTOALL_C: _alltoall_c,
    Kind.REDUCE: _reduce,
    Kind.BROADCAST: _broadcast,
    Kind.BROADCAST_C: _broadcast_c,
    Kind.GATHER_C: _gather_c,
    Kind.PUSH_PULL: _push_pull,
    Kind.PUSH_PULL_C: _push_pull_c,
}
assert set(_COMM_MODELS) == {k for k in RULES if not k.is_compute}
