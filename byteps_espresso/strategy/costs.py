"""Step costs: every step of an Option priced as tasks on the timeline's resources.

Communication uses alpha-beta models (time = latency terms + bytes / bandwidth) with the
standard long-message algorithms of Thakur, Rabenseifner and Gropp, "Optimization of
Collective Communication Operations in MPICH" (IJHPCA 2005), for a group of ``p`` members,
``n`` bytes per member and per-hop latency ``a``:

    Allreduce (ring)              2(p-1) a + 2 (p-1)/p n / B     (Patarasuk & Yuan, JPDC 2009)
    ReduceScatter (ring)           (p-1) a +   (p-1)/p n / B
    Allgather (ring, shard s)      (p-1) a +   (p-1)   s / B
    AllgatherC (payload c)         (p-1) a +   (p-1)   c / B
    AlltoallC (pairwise, chunk c)  (p-1) a +   (p-1)   c / B
    Reduce                      min(2 log2(p) a + 2 (p-1)/p n / B,  (Rabenseifner)
                                    log2(p) (a + n / B))             (binomial tree)
    Broadcast(C)                min((log2(p) + p-1) a + 2 (p-1)/p n / B,  (van de Geijn)
                                    log2(p) (a + n / B))             (binomial tree)
    GatherC (binomial, to root)  log2(p) a +   (p-1)   c / B_root
    PushPull(C) (PS)      per direction a + max(k n / B_nic, W n / (S B_server)), twice,
                          plus the servers' aggregation (W pushers, S servers, k pushers
                          per machine)

Rooted collectives take the cheaper of the long-message algorithm and the binomial tree, as
collective libraries choose by size (Thakur et al. give both): for small messages and groups
the tree's log2(p) hops win. The executor's own collectives are trees for small groups: gloo's
broadcast is a binomial tree (gloo/broadcast.cc) and ``Reduce`` is a gather to the root (one
hop for p = 2). With the long-message formulas alone, a Reduce -> PushPull -> Broadcast plan on
2 x 2 workers was predicted at 63.3 ms and ran at 49.1 ms (benchmarks/calibrate.py's data).

Bandwidth ``B`` per scope: ``intra`` the intra link; ``inter`` the machine NIC divided by the
``k`` inter groups that use it at once (all local ranks after a divisible intra step, only
local rank 0 after Reduce/GatherC); ``flat`` the slower of both (one ring crosses each NIC
once per direction), except AlltoallC/GatherC/PushPull whose cross-machine bytes are counted
explicitly on the shared NIC.

Compute steps use the :class:`CompressorCosts` profile. GPU steps run on the training device.
CPU steps add a device->host copy of the dense input (Comp) or a host->device copy of the
dense result (Decomp) over ``h2d_gbps``, and share the machine's ``cpu_threads`` among the
``k`` local workers doing the same step at once (one thread's time x k / threads).

Each step becomes one task on one resource (PushPull: push on the NIC, aggregation on the
servers, pull on the NIC). Durations are vectors over the workload's distinct tensor sizes.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from byteps_espresso.strategy.cluster import Cluster
from byteps_espresso.strategy.compressor_costs import CompressorCosts
from byteps_espresso.strategy.options import Device, Kind, Option, Scope, Step
from byteps_espresso.strategy.tree import FAMILIES, PAIRS

__all__ = [
    "CPU",
    "EXCHANGES",
    "GPU",
    "INTER",
    "INTRA",
    "RESOURCES",
    "SERVER",
    "CompressedSizes",
    "Pricer",
    "StepTasks",
    "bytes_per_us",
]

# Timeline resources (row order of the Gantt chart).
GPU, CPU, INTRA, INTER, SERVER = range(5)
RESOURCES = ("gpu", "cpu", "intra", "inter", "server")
FLOAT32_BYTES = 4
# Collectives in which every member sends and receives: Cluster.exchange_latency applies.
EXCHANGES = frozenset({Kind.ALLREDUCE, Kind.REDUCE_SCATTER, Kind.ALLGATHER, Kind.ALLGATHER_C,
                       Kind.ALLTOALL_C})
_ONE_HOT = np.eye(len(RESOURCES))


def bytes_per_us(gbps: float) -> float:
    """Gbit/s -> bytes per microsecond (1 Gbit/s = 125 bytes/us)."""
    return gbps * 1e9 / 8 / 1e6


class CompressedSizes:
    """Exact payload bytes per element count, from the kernels registry (memoized)."""

    def __init__(self, compressor: str, params: dict | None = None,
                 nbytes: Callable[[int], int] | None = None) -> None:
        if nbytes is None:
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


def _ceil_div(a: np.ndarray, p: int) -> np.ndarray:
    return np.ceil(a / p)


def _log2(p: int) -> int:
    return max(1, math.ceil(math.log2(p))) if p > 1 else 0


class Pricer:
    """Prices options for one workload's distinct sizes on one cluster with one compressor.

    Args:
        cluster: the machines and links.
        compressor: registry name (its cost profile must be in ``costs``).
        sizes: payload bytes per element count.
        costs: compression cost profiles.
        numels: the distinct tensor sizes (element counts) to price.
    """

    def __init__(self, cluster: Cluster, compressor: str, sizes: CompressedSizes,
                 costs: CompressorCosts, numels: Sequence[int], *,
                 free_compression: bool = False):
        self.cluster = cluster
        self.compressor = compressor
        self.sizes = sizes
        self.costs = costs
        self.numels = np.asarray(numels, dtype=np.float64)
        self.free_compression = free_compression
        self._memo: dict[Option, StepTasks] = {}
        self._prefix: dict[tuple[int, ...], tuple[_WalkState, tuple]] = {}
        c = cluster
        self._b_intra = bytes_per_us(c.intra_gbps)
        self._b_inter = bytes_per_us(c.inter_gbps)
        self._b_server = bytes_per_us(c.server_gbps) if c.servers else 0.0
        self._b_h2d = bytes_per_us(c.h2d_gbps)
        self._multi = c.machines > 1
        if not free_compression and not costs.has(compressor):
            costs.compress_us(compressor, "gpu", 1)  # raises, naming the compressor

    # ---- public -----------------------------------------------------------------------------
    def tasks(self, option: Option) -> StepTasks:
        """The option's tasks (memoized)."""
        got = self._memo.get(option)
        if got is None:
            got = self._memo[option] = self._price(option)
        return got

    # ---- the walk ---------------------------------------------------------------------------
    def _group(self, scope: Scope) -> int:
        c = self.cluster
        return {Scope.FLAT: c.world_size, Scope.INTRA: c.gpus_per_machine,
                Scope.INTER: c.machines}[scope]

    def _link(self, scope: Scope, k: int) -> tuple[float, float, int]:
        """(bytes/us, latency us, resource) of a ring in ``scope`` with k groups per NIC."""
        c = self.cluster
        if scope is Scope.INTRA:
            return self._b_intra, c.intra_latency_us, INTRA
        if scope is Scope.INTER:
            return self._b_inter / k, c.inter_latency_us, INTER
        if self._multi:
            return min(self._b_intra, self._b_inter), c.inter_latency_us, INTER
        return self._b_intra, c.intra_latency_us, INTRA

    def _price(self, option: Option) -> StepTasks:
        """Walk the steps; the walk state and tasks after every prefix are memoized, so
        options sharing a prefix (most of the tree) share its pricing."""
        steps = option.steps
        codes = tuple(_CODES[s] for s in steps)
        state = _WalkState(extent=self.numels, active=self.cluster.gpus_per_machine)
        tasks: tuple = ()
        for i, step in enumerate(steps):
            nxt = steps[i + 1] if i + 1 < len(steps) else None
            # Comp's cost depends on the next step (chunks before AlltoallC): mark it in
            # the key with a negative code so it never equals the next prefix.
            key = (*codes[: i + 1], -1 - codes[i + 1]) if step.kind is Kind.COMP \
                else codes[: i + 1]
            hit = self._prefix.get(key)
            if hit is not None:
                state, tasks = hit
                continue
            state = state.copy()
            if step.kind.is_compute:
                new = (self._compute(step, nxt, state),)
            else:
                new = tuple(self._comm(step, state))
            tasks = tasks + tuple((r, i, d) for r, d in new)
            self._prefix[key] = (state, tasks)
        return StepTasks(np.array([t[0] for t in tasks], dtype=np.int64),
                         np.array([t[1] for t in tasks], dtype=np.int64),
                         np.stack([t[2] for t in tasks], axis=1))

    def _compute(self, step: Step, nxt: Step | None, st: _WalkState) -> tuple[int, np.ndarray]:
        dev = step.device.value  # type: ignore[union-attr]
        if step.kind is Kind.COMP:
            chunks = self._group(nxt.scope) if nxt is not None and \
                nxt.kind is Kind.ALLTOALL_C else 1  # type: ignore[arg-type]
            numel, count = _ceil_div(st.extent, chunks), chunks
            work = (np.zeros_like(numel) if self.free_compression else
                    count * self.costs.compress_us(self.compressor, dev, numel))
            copy = st.extent * FLOAT32_BYTES / self._b_h2d
        else:
            numel, count = st.pending
            work = (np.zeros_like(numel) if self.free_compression else
                    self.costs.decompress_us(self.compressor, dev, numel, count))
            copy = st.extent * FLOAT32_BYTES / self._b_h2d
        if step.device is Device.GPU:
            return GPU, work
        if self.free_compression:
            return CPU, work
        share = st.active / self.cluster.cpu_threads
        return CPU, work * share + copy

    def _comm(self, step: Step, st: _WalkState) -> list[tuple[int, np.ndarray]]:
        scope = step.scope
        assert scope is not None
        p = self._group(scope)
        bw, lat, resource = self._link(scope, st.active)
        if step.kind in EXCHANGES:
            lat *= self.cluster.exchange_latency
        comm = _Comm(p, bw, lat, resource, scope, st.extent, st.extent * FLOAT32_BYTES)
        return _COMM_MODELS[step.kind](self, st, comm)


@dataclass
class _WalkState:
    extent: np.ndarray  # elements held per worker (vector over sizes)
    active: int  # workers per machine holding data (G, or 1 after Reduce/GatherC)
    pending: tuple[np.ndarray, int] = (np.zeros(0), 0)  # (numel per payload, payloads)
    stack: list | None = None  # open divisible steps: (family, extent, active)

    def copy(self) -> _WalkState:
        return _WalkState(self.extent, self.active, self.pending,
                          None if self.stack is None else list(self.stack))

    def push(self, fam: str, scope: Scope) -> None:
        if self.stack is None:
            self.stack = []
        self.stack.append((fam, self.extent, self.active, scope))

    def pop(self) -> tuple[str, np.ndarray, int, Scope]:
        assert self.stack
        return self.stack.pop()

    def closes_scatter(self, scope: Scope) -> bool:
        """Whether an AllgatherC of ``scope`` closes an open scatter (tree.py's rule)."""
        return bool(self.stack) and self.stack[-1][0] == "scatter" and self.stack[-1][3] is scope


class _Comm(NamedTuple):
    """One communication step's setting: group size, link and current extent."""

    p: int  # group size
    bw: float  # bytes/us of the ring's bottleneck link
    lat: float  # per-hop latency, us
    r: int  # resource
    scope: Scope
    e: np.ndarray  # extent, elements
    dense: np.ndarray  # extent, bytes of float32


# ---- one function per communication kind -------------------------------------------------------
# Each returns [(resource, duration vector)] and updates the walk state (extent, pending...).
def _allreduce(pr: Pricer, st: _WalkState, c: _Comm) -> list[tuple[int, np.ndarray]]:
    return [(c.r, 2 * (c.p - 1) * c.lat + 2 * (c.p - 1) / c.p * c.dense / c.bw)]


def _reduce_scatter(pr: Pricer, st: _WalkState, c: _Comm) -> list[tuple[int, np.ndarray]]:
    st.push("scatter", c.scope)
    st.extent = _ceil_div(c.e, c.p)
    return [(c.r, (c.p - 1) * c.lat + (c.p - 1) / c.p * c.dense / c.bw)]


def _allgather(pr: Pricer, st: _WalkState, c: _Comm) -> list[tuple[int, np.ndarray]]:
    _, full, _, _ = st.pop()
    st.extent = full
    return [(c.r, (c.p - 1) * c.lat + (c.p - 1) * c.dense / c.bw)]


def _allgather_c(pr: Pricer, st: _WalkState, c: _Comm) -> list[tuple[int, np.ndarray]]:
    closes = st.closes_scatter(c.scope)
    payload = pr.sizes(c.e)
    st.pending = (c.e, c.p)
    if closes:
        _, full, _, _ = st.pop()
        st.extent = full
    return [(c.r, (c.p - 1) * c.lat + (c.p - 1) * payload / c.bw)]


def _alltoall_c(pr: Pricer, st: _WalkState, c: _Comm) -> list[tuple[int, np.ndarray]]:
    chunk = _ceil_div(c.e, c.p)
    payload = pr.sizes(chunk)
    st.push("scatter", c.scope)
    st.extent = chunk
    st.pending = (chunk, c.p)
    if c.scope is Scope.FLAT and pr._multi:
        g, n = pr.cluster.gpus_per_machine, pr.cluster.world_size
        t = np.maximum((g - 1) * payload / pr._b_intra, g * (n - g) * payload / pr._b_inter)
        return [(c.r, (c.p - 1) * c.lat + t)]
    return [(c.r, (c.p - 1) * c.lat + (c.p - 1) * payload / c.bw)]


def _tree(c: _Comm, nbytes: np.ndarray) -> np.ndarray:
    """A binomial tree over the group: log2(p) hops, each carrying all ``nbytes``."""
    return _log2(c.p) * (c.lat + nbytes / c.bw)


def _reduce(pr: Pricer, st: _WalkState, c: _Comm) -> list[tuple[int, np.ndarray]]:
    st.push("reduce", c.scope)
    st.active = 1
    long = 2 * _log2(c.p) * c.lat + 2 * (c.p - 1) / c.p * c.dense / c.bw
    return [(c.r, np.minimum(long, _tree(c, c.dense)))]


def _broadcast_time(c: _Comm, nbytes: np.ndarray) -> np.ndarray:
    long = (_log2(c.p) + c.p - 1) * c.lat + 2 * (c.p - 1) / c.p * nbytes / c.bw
    return np.minimum(long, _tree(c, nbytes))


def _broadcast(pr: Pricer, st: _WalkState, c: _Comm) -> list[tuple[int, np.ndarray]]:
    _, _, active, _ = st.pop()
    st.active = active
    return [(c.r, _broadcast_time(c, c.dense))]


def _broadcast_c(pr: Pricer, st: _WalkState, c: _Comm) -> list[tuple[int, np.ndarray]]:
    _, _, active, _ = st.pop()
    st.active = active
    st.pending = (c.e, 1)
    return [(c.r, _broadcast_time(c, pr.sizes(c.e)))]


def _gather_c(pr: Pricer, st: _WalkState, c: _Comm) -> list[tuple[int, np.ndarray]]:
    payload = pr.sizes(c.e)
    st.push("reduce", c.scope)
    st.active = 1
    st.pending = (c.e, c.p)
    if c.scope is Scope.FLAT and pr._multi:
        g, n = pr.cluster.gpus_per_machine, pr.cluster.world_size
        t = np.maximum((g - 1) * payload / pr._b_intra, (n - g) * payload / pr._b_inter)
    else:
        t = (c.p - 1) * payload / c.bw
    return [(c.r, _log2(c.p) * c.lat + t)]


def _ps_tasks(pr: Pricer, st: _WalkState, c: _Comm, nbytes: np.ndarray,
              server_us: np.ndarray) -> list[tuple[int, np.ndarray]]:
    cl = pr.cluster
    k = st.active
    pushers = cl.world_size if c.scope is Scope.FLAT else cl.machines * k
    nic = k * nbytes / pr._b_inter
    srv = pushers * nbytes / (cl.servers * pr._b_server)
    one_way = cl.ps_latency_us + np.maximum(nic, srv)
    return [(INTER, one_way), (SERVER, server_us), (INTER, one_way.copy())]


def _pushers_keys(pr: Pricer, st: _WalkState, c: _Comm) -> tuple[int, int]:
    cl = pr.cluster
    if c.scope is Scope.FLAT:
        return cl.world_size, 1
    return cl.machines * st.active, st.active


def _push_pull(pr: Pricer, st: _WalkState, c: _Comm) -> list[tuple[int, np.ndarray]]:
    cl = pr.cluster
    pushers, keys = _pushers_keys(pr, st, c)
    work = pr.costs.dense_sum(pushers * c.e) * keys / (cl.servers * cl.server_threads)
    return _ps_tasks(pr, st, c, c.dense, work)


def _push_pull_c(pr: Pricer, st: _WalkState, c: _Comm) -> list[tuple[int, np.ndarray]]:
    cl = pr.cluster
    pushers, keys = _pushers_keys(pr, st, c)
    if pr.free_compression:
        work = np.zeros_like(c.e)
    else:
        dev = pr.costs.server_device(pr.compressor)
        per_key = (pr.costs.decompress_us(pr.compressor, dev, c.e, pushers)
                   + pr.costs.compress_us(pr.compressor, dev, c.e))
        work = per_key * keys / (cl.servers * cl.server_threads)
    st.pending = (c.e, 1)
    return _ps_tasks(pr, st, c, pr.sizes(c.e), work)


# Every step as a small integer (fast prefix keys).
_CODES: dict[Step, int] = {}
for _kind in Kind:
    for _arg in (Device if _kind.is_compute else Scope):
        _step = Step(_kind, device=_arg) if _kind.is_compute else Step(_kind, scope=_arg)
        _CODES[_step] = len(_CODES)

_COMM_MODELS = {
    Kind.ALLREDUCE: _allreduce,
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
assert set(_COMM_MODELS) == {k for k in Kind if not k.is_compute}
assert set(PAIRS) <= set(FAMILIES)
