"""What every search algorithm and baseline works on: the tree, the prices and the evaluator.

A :class:`PlanContext` binds one workload, cluster, compressor (with parameters and cost
profile) and constraints. It enumerates the decision tree once, prices options lazily per
distinct tensor size, and evaluates strategies (an option index per tensor) on the timeline.

Dominated options (documented in docs/strategy.md): for a tensor size, option A dominates B
when A keeps every resource busy no longer than B and its own end-to-end time (sum of its
tasks) is no longer either; the search only considers the non-dominated ones (the Pareto
front). Options identical in every task duration are deduplicated (the first kept).

The search works on evaluator indices, not Option objects: :meth:`PlanContext.fronts` (the
per-size candidates of Algorithm 1) and :meth:`PlanContext.placements` (an option's device
placements) catalogue them, in :meth:`PlanContext.prepare` or on first use.

The priced model (prices, catalogue, fronts, placements) depends on the cluster, compressor,
parameters, cost profile, constraints and the workload's distinct sizes, not on the ready
gaps or forward time: the last MODEL_CACHE_SIZE models are kept, so planning again after a
re-profile of the same model on the same cluster reuses them (:func:`clear_model_cache`
empties the cache). Planning is single-threaded: contexts share these objects.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import logging
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numba
import numpy as np

from byteps_espresso.strategy import lowrank
from byteps_espresso.strategy.cluster import Cluster
from byteps_espresso.strategy.compressor_costs import CompressorCosts
from byteps_espresso.strategy.costs import (
    RESOURCES,
    CompressedSizes,
    PricedBatch,
    Pricer,
    least_sum_warm_up,
)
from byteps_espresso.strategy.options import Device, Kind, Option, Scope, Step
from byteps_espresso.strategy.program import Form, compile_option
from byteps_espresso.strategy.timeline import Catalogue, Evaluator, index_table
from byteps_espresso.strategy.tree import (
    Constraints,
    canonical_options,
    enumerate_options,
    option_forms,
    option_set,
    sums_payloads,
)
from byteps_espresso.strategy.workload import Workload

__all__ = ["MODEL_CACHE_SIZE", "Fronts", "PlanContext", "clear_model_cache", "load_kernels",
           "pareto_front"]

log = logging.getLogger(__name__)


# Dominance tolerance: A dominates B when every entry of A is <= (1 + DOMINANCE_REL) times
# B's plus DOMINANCE_ABS_US (differences below a microsecond or 1% do not keep an option).
DOMINANCE_REL = 0.01
DOMINANCE_ABS_US = 1.0
# At most this many non-dominated compressed options per size, those with the least total
# busy time (every non-dominated uncompressed option is kept: there are few).
FRONT_LIMIT = 8
FRONT_RANK = "sum"
# Priced models kept for later plans (each: the options priced for one workload's sizes,
# a few MB at most).
MODEL_CACHE_SIZE = 8


class _Priced:
    """The prices of one (cluster, compressor, parameters, costs, sizes): what does not depend
    on the constraints, so that plans under other constraints (the restricted finalists)
    reuse it."""

    def __init__(self, pricer: Pricer, keep: tuple) -> None:
        self.pricer = pricer
        self.catalogue = Catalogue(pricer)
        self.keep = keep  # the objects whose identity is part of the key, kept alive


class _Model:
    """The priced model of one (cluster, compressor, parameters, costs, constraints, sizes)."""

    def __init__(self, priced: _Priced, constraints: Constraints) -> None:
        self.pricer = priced.pricer
        self.constraints = constraints  # restricted to the devices the cost profile has
        self.catalogue = priced.catalogue
        self.priced = priced
        self.fronts: dict = {}
        self.single: dict = {}
        self.moved: dict = {}
        self.placements: dict = {}
        self.stacked: dict = {}
        self.device_fronts: dict = {}
        self.searched: dict = {}
        self.twins: dict = {}
        self.uncompressed: list[np.ndarray] = []
        self.alone: list[np.ndarray] = []  # per size, the tree's least time alone


_MODELS: OrderedDict[tuple, _Model] = OrderedDict()
_PRICED: OrderedDict[tuple, _Priced] = OrderedDict()


def clear_model_cache() -> None:
    """Forget every priced model (the next plan prices from scratch)."""
    _MODELS.clear()
    _PRICED.clear()


def _cached(cache: OrderedDict, key: tuple, make):  # type: ignore[no-untyped-def]
    """``cache[key]``, made by ``make()`` when missing; the least recently used of more than
    MODEL_CACHE_SIZE entries is dropped."""
    got = cache.get(key)
    if got is None:
        got = cache[key] = make()
        while len(cache) > MODEL_CACHE_SIZE:
            cache.popitem(last=False)
    else:
        cache.move_to_end(key)
    return got


@numba.njit(cache=True)
def _dominated(vectors, rel, abs_us):  # pragma: no cover - compiled
    n, u_count, c_count = vectors.shape
    out = np.zeros((n, u_count), dtype=np.bool_)
    sums = np.empty(n)  # each row's sum of criteria, once per size (not once per pair)
    for u in range(u_count):
        for a in range(n):
            sums[a] = vectors[a, u].sum()
        for b in range(n):
            tb = sums[b]
            for a in range(n):
                if a == b:
                    continue
                ta = sums[a]
                if not (ta < tb or (ta == tb and a < b)):
                    continue
                close = True
                for c in range(c_count):
                    if vectors[a, u, c] > vectors[b, u, c] * (1 + rel) + abs_us:
                        close = False
                        break
                if close:
                    out[b, u] = True
                    break
    return out


def pareto_front(vectors: np.ndarray, rel: float = DOMINANCE_REL,
                 abs_us: float = DOMINANCE_ABS_US) -> np.ndarray:
    """Which rows survive, per column block: ``vectors`` is (options, sizes, criteria);
    returns a (options, sizes) mask of the rows no other row dominates for that size.

    Row a dominates row b when a <= b * (1 + rel) + abs_us in every criterion and a is
    smaller in the sum of criteria (or equal with a lower index), so exactly one of two
    near-identical rows survives.
    """
    return ~_dominated(np.ascontiguousarray(vectors, dtype=np.float64), float(rel),
                       float(abs_us))


@functools.lru_cache(maxsize=4096)
def _placements_in_tree(option: Option, cluster: Cluster, constraints: Constraints,
                        compressor: str | None = None) -> tuple[list[int], list[Option]]:
    """The device placements of ``option`` that the tree holds, as (masks, Options): bit j
    of a mask runs the j-th Comp/Decomp on the CPU. The Options are the tree's own objects
    (found by identity in later lookups). A function of the tree, so kept across models."""
    tree = canonical_options(cluster, constraints, compressor)
    where = [j for j, st in enumerate(option.steps) if st.device is not None]
    masks, options = [], []
    for mask in range(1 << len(where)):
        cand = tree.get(Option(tuple(
            st.on(Device.CPU if (mask >> where.index(j)) & 1 else Device.GPU)
            if st.device is not None else st
            for j, st in enumerate(option.steps))))
        if cand is not None:
            masks.append(mask)
            options.append(cand)
    return masks, options


@functools.lru_cache(maxsize=64)
def _single_in_tree(cluster: Cluster, constraints: Constraints, device: Device,
                    compressor: str | None = None) -> list[Option]:
    """The tree's options whose compute steps all run on ``device`` (a function of the tree,
    so kept across models; callers do not modify the list). ``compressor``: a low-rank
    compressor's tree (None: the elementwise codecs' one)."""
    return [o for o in enumerate_options(cluster, constraints, compressor)
            if o.devices <= {device}]


@functools.lru_cache(maxsize=64)
def _searched_in_tree(cluster: Cluster, constraints: Constraints, device: Device,
                      compressor: str | None = None) -> list[Option]:
    """:meth:`PlanContext.searched` of the tree (kept across models, like
    :func:`_single_in_tree`)."""
    tree = canonical_options(cluster, constraints, compressor)
    return [o for o in _single_in_tree(cluster, constraints, device, compressor)
            if _decoded_twin(o) not in tree and _one_compressor(o) not in tree]


def _decoded_twin(option: Option) -> Option | None:
    """``option`` with a ``Decomp -> Comp`` pair (on the device of the Decomp that follows)
    before every step that forwards gathered payloads; None when nothing forwards (a low-rank
    Option: nothing gathers)."""
    if lowrank.inner(option) is not None:
        return None
    ops = compile_option(option).ops
    if not any(op.forwards for op in ops):
        return None
    steps: list[Step] = []
    for op in ops:
        if op.forwards:
            device = next(o.device for o in ops[op.index:] if o.kind is Kind.DECOMP)
            codec = ops[op.index - 1].codec  # the forwarded payloads' compressor
            steps += [Step(Kind.DECOMP, device=device, codec=codec),
                      Step(Kind.COMP, device=device, codec=codec)]
        steps.append(op.step)
    return Option(tuple(steps))


def _one_compressor(option: Option) -> Option | None:
    """``option`` with every partner's Comp/Decomp on the job's compressor; None when it
    names no partner."""
    if not option.partners:
        return None
    return Option(tuple(st.with_codec(None) if st.codec is not None else st
                        for st in option.steps))


def _partner_twins(option: Option, partner: str | None) -> list[Option]:
    """``option`` with the Comps that feed an intra step (and the Decomps of their payloads)
    on ``partner``, in every non-empty combination (the tree decides which are valid)."""
    if partner is None or lowrank.inner(option) is not None:
        return []
    ops = compile_option(option).ops
    comps = [op.index for op in ops if op.kind is Kind.COMP and op.codec is None
             and ops[op.feeds].scope is Scope.INTRA]  # type: ignore[index]
    out = []
    for n in range(1, len(comps) + 1):
        for chosen in itertools.combinations(comps, n):
            out.append(Option(tuple(
                op.step.with_codec(partner)
                if (op.kind is Kind.COMP and op.index in chosen) or (
                    op.kind is Kind.DECOMP and op.origin is not None
                    and op.origin.index in chosen) else op.step
                for op in ops)))
    return out


def load_kernels() -> None:
    """Load the numba kernels a plan runs (compile them on a cold cache), once per process:
    paid once like an import, so the planner starts its clock after it."""
    if not _KERNELS:
        Evaluator.warm_up()
        pareto_front(np.zeros((1, 1, 1)))
        least_sum_warm_up()
        _KERNELS.append(True)


_KERNELS: list[bool] = []


@dataclass(frozen=True)
class Fronts:
    """Algorithm 1's candidates on one device, catalogued as evaluator indices.

    Attributes:
        index: per distinct size, the evaluator indices of its front (:meth:`PlanContext.front`,
            in the order of the candidate list).
        compressible: the sizes whose front holds a compressed option.
        fastest_alone: per size, the evaluator index of the front option with the shortest
            end-to-end time on its own (the first such one).
    """

    index: list[np.ndarray]
    compressible: frozenset[int]
    fastest_alone: np.ndarray

    @functools.cached_property
    def _table(self) -> tuple[np.ndarray, np.ndarray]:
        return index_table(self.index)

    @property
    def table(self) -> np.ndarray:
        """``index`` as one (sizes, longest front) array, -1 padded (the kernels' form)."""
        return self._table[0]

    @property
    def count(self) -> np.ndarray:
        """The length of each size's front (the valid entries of ``table``)."""
        return self._table[1]


@dataclass
class PlanContext:
    """One planning problem.

    Attributes:
        workload, cluster, compressor, params, costs, constraints: the inputs.
        options: every valid option under the constraints (the decision tree).
    """

    workload: Workload
    cluster: Cluster
    compressor: str
    params: dict[str, Any] = field(default_factory=dict)
    costs: CompressorCosts | None = None
    constraints: Constraints = field(default_factory=Constraints)
    sizes: CompressedSizes | None = None
    free_compression: bool = False
    # An iteration time (us) another candidate of the same choice already reaches (another
    # bucket layout's plan, buckets.plan_fused): Algorithm 2 searches only for offloads
    # below it (search.cpu_offload). None: no such candidate.
    incumbent_us: float | None = None

    def __post_init__(self) -> None:
        if self.costs is None:
            self.costs = CompressorCosts.default()
        # The distinct sizes the prices are vectors over: element counts, and for a low-rank
        # compressor (element count, Factors) pairs, since its sums depend on the shapes.
        self.low_rank = lowrank.is_lowrank(self.compressor)
        # what the tree depends on besides the cluster and constraints (tree.enumerate_options):
        # the compressor where its capabilities change the tree
        self._tree = self.compressor if self.low_rank or sums_payloads(self.compressor) \
            else None
        if self.low_rank:  # its parameters checked as the runtime will (no payload sizes to)
            from byteps_espresso.kernels import create_collective

            create_collective(self.compressor, **self.params)
        keys = [self._size_key(t) for t in self.workload.tensors]
        distinct = sorted(set(keys))
        self.size_index = {k: i for i, k in enumerate(distinct)}
        self._tensor_sizes = np.array([self.size_index[k] for k in keys], dtype=np.int64)
        self.numels = [k[0] for k in distinct] if self.low_rank else distinct
        given_sizes = self.sizes
        priced_key = (self.cluster, self.compressor, json.dumps(self.params, sort_keys=True),
                      id(self.costs), id(given_sizes), tuple(distinct),
                      self.free_compression)

        def make_priced() -> _Priced:
            # the kernels registry first: an unknown compressor is named as such
            sizes = given_sizes or CompressedSizes(self.compressor, self.params)
            return _Priced(Pricer(self.cluster, self.compressor, sizes, self.costs, self.numels,
                                  free_compression=self.free_compression,
                                  factors=[k[1] for k in distinct] if self.low_rank else None),
                           (self.costs, given_sizes))

        def make() -> _Model:
            priced = _cached(_PRICED, priced_key, make_priced)
            constraints = self._restrict_to_profiles(self.constraints)
            return _Model(priced, constraints)

        model = _cached(_MODELS, (*priced_key, self.constraints), make)
        self.constraints = model.constraints
        self.options: list[Option] = enumerate_options(self.cluster, self.constraints,
                                                       self._tree)
        if not self.options:
            raise ValueError("the constraints leave no valid option; relax them")
        self.pricer = model.pricer
        self.sizes = model.pricer.sizes
        self.evaluator = Evaluator(self.workload, self.pricer, [], model.catalogue,
                                   size_idx=self._tensor_sizes)
        self._model = model
        self._fronts: dict[int, tuple[Sequence[Option], list[list[Option]]]] = model.fronts
        self._single: dict[Device, list[Option]] = model.single
        self._moved: dict[tuple[Option, Device], Option] = model.moved
        self._placements: dict[int, np.ndarray] = model.placements
        self._stacked: dict[int, tuple[Sequence[Option], tuple[np.ndarray, np.ndarray]]] = \
            model.stacked
        self._device_fronts: dict[Device, Fronts] = model.device_fronts
        self._searched: dict[Device, list[Option]] = model.searched
        self._twins: dict[int, np.ndarray] = model.twins
        # The search's visit order: tensors by size, largest first; within a size, closest to
        # the output layer (backward index 0) first. size_groups: the same, per size index.
        tensors = self.workload.tensors
        self.visit_order: list[int] = sorted(range(len(tensors)),
                                             key=lambda i: (-tensors[i].numel, i))
        groups: dict[int, list[int]] = {}
        for i in self.visit_order:
            groups.setdefault(int(self._tensor_sizes[i]), []).append(i)
        self.size_groups = {u: np.array(m, dtype=np.int64) for u, m in groups.items()}

    def _size_key(self, tensor: Any) -> Any:
        """A tensor's distinct size: its element count, with its :class:`lowrank.Factors`
        for a low-rank compressor.

        Raises:
            ValueError: a low-rank compressor and a tensor whose shapes are unknown.
        """
        if not self.low_rank:
            return tensor.numel
        if tensor.shapes is None:
            raise ValueError(f"{self.compressor} needs each tensor's shape, and tensor "
                             f"{tensor.name!r} of workload {self.workload.model!r} has none: "
                             "plan on a profile the runtime wrote (ESPRESSO_PROFILE_OUT), or add "
                             "\"shapes\" to the workload file (docs/strategy.md)")
        return tensor.numel, lowrank.factors(tensor.shapes, self.params)

    def _restrict_to_profiles(self, constraints: Constraints) -> Constraints:
        """A profile measured on one device only (e.g. the worker's GPU) forbids the other;
        mixed Options need the partner's profile on the devices left (and a partner other
        than the job's compressor)."""
        assert self.costs is not None
        if constraints.partner == self.compressor:
            constraints = constraints.without_partner()
        if self.low_rank:  # its tree has no partner and no CPU step (lowrank.py)
            constraints = dataclasses.replace(constraints, partner=None, allow_cpu=False)
        if self.free_compression:
            return constraints
        known = {d for d in ("gpu", "cpu") if self.costs.has(self.compressor, d)}
        if not known:
            self.costs.compress_us(self.compressor, "gpu", 1)  # raises naming the compressor
        changes: dict[str, Any] = {}
        if constraints.partner is not None and not all(
                self.costs.has(constraints.partner, d) for d in known):
            log.info("cost profile lacks partner %s on %s: no mixed options",
                     constraints.partner, "/".join(sorted(known)))
            changes["partner"] = None
        if "cpu" not in known and constraints.allow_cpu:
            # the servers' aggregation of PushPullC runs the CPU kernels too
            changes["allow_cpu"] = False
            changes["forbid"] = constraints.forbid | {Kind.PUSH_PULL_C}
        if "gpu" not in known and constraints.allow_gpu:
            changes["allow_gpu"] = False
        if "allow_cpu" in changes or "allow_gpu" in changes:
            log.info("cost profile of %s lacks %s: those options are left out", self.compressor,
                     "cpu" if "allow_cpu" in changes else "gpu")
        if changes:
            return dataclasses.replace(constraints, **changes)
        return constraints

    def prepare(self) -> None:
        """Price the options Algorithm 1 chooses from (:meth:`searched` on the primary
        device, uncompressed ones included) for every tensor size, catalogue them for
        the search as evaluator indices (:meth:`fronts`) and load the numba kernels. The
        device placements Algorithm 2 and the refinement try, and the forwarding twins the
        last pass tries, are priced when first asked for (:meth:`placements`, :meth:`twins`):
        only those of the options the search chose."""
        load_kernels()
        self.evaluator.add(self.searched(self.primary_device()))
        self.fronts(self.primary_device())  # Algorithm 1's candidates
        self.uncompressed_index()

    def free(self) -> PlanContext:
        """The same problem with free compression (zero compress/decompress cost)."""
        return PlanContext(self.workload, self.cluster, self.compressor, self.params,
                           self.costs, self.constraints, self.sizes, free_compression=True)

    # ---- helpers shared by algorithms ------------------------------------------------------
    @property
    def n_tensors(self) -> int:
        return len(self.workload.tensors)

    def tensor_size_index(self, i: int) -> int:
        return int(self._tensor_sizes[i])

    @functools.cached_property
    def bound_us(self) -> float:
        """A lower bound of every strategy's iteration time.

        Each tensor is ready no earlier than the backward pass up to it (GPU tasks only delay
        the backward segments), and then needs at least the time alone (the sum of its tasks)
        of the fastest Option of the whole tree at its size, placements, twins and mixed
        compressors included; the iteration ends no earlier than forward + the latest of
        those, nor than forward + backward (:attr:`Evaluator.floor_us`). A strategy that
        reaches it is optimal under the model. The fastest Options are found over the tree's
        prefix tree of step settings (:meth:`Pricer.fastest_alone`), once per priced model."""
        held = self._model.alone
        if not held:
            forms = option_forms(self.cluster, self.constraints, self._tree)
            held.append(np.min([b.total.min(axis=0) for b in self.pricer.batch(self.options)],
                               axis=0) if forms is None  # a low-rank tree: 24 Options
                        else self.pricer.fastest_alone(forms))
        ev = self.evaluator
        per_tensor = ev.forward_us + np.cumsum(ev.gaps) + held[0][ev.size_idx]
        return max(ev.floor_us, float(per_tensor.max()))

    def uncompressed(self) -> list[Option]:
        return [o for o in self.single_device(Device.GPU) if not o.is_compressed]

    def uncompressed_index(self) -> np.ndarray:
        """Evaluator indices of :meth:`uncompressed` (cached)."""
        held = self._model.uncompressed
        if not held:
            held.append(self.index(self.uncompressed()))
        return held[0]

    def primary_device(self) -> Device:
        return Device.GPU if self.constraints.allow_gpu else Device.CPU

    def single_device(self, device: Device) -> list[Option]:
        """Options whose compute steps all run on ``device`` (uncompressed ones included)."""
        got = self._single.get(device)
        if got is None:
            got = self._single[device] = _single_in_tree(self.cluster, self.constraints, device,
                                                         self._tree)
        return got

    def front(self, candidates: Sequence[Option]) -> list[list[Option]]:
        """Per distinct size, the non-dominated candidates (see the module docstring)."""
        positions, _ = self._front_positions(candidates)
        return [[candidates[k] for k in pos.tolist()] for pos in positions]

    def _front_positions(self, candidates: Sequence[Option]) \
            -> tuple[list[np.ndarray], np.ndarray]:
        """:meth:`front` as positions into ``candidates`` (per size, ascending), and which
        candidates compress; cached per candidate list (by identity: lists are long)."""
        hit = self._fronts.get(id(candidates))
        if hit is not None and hit[0] is candidates:
            return hit[1]
        busy, total = self._stacks(candidates)
        keep = pareto_front(np.concatenate([busy, total[:, :, None]], axis=2))
        rank = busy.sum(axis=2) if FRONT_RANK == "sum" else busy.max(axis=2)
        compressed = np.array([o.is_compressed for o in candidates], dtype=bool)
        # Per size (column), the FRONT_LIMIT surviving compressed candidates of least rank
        # (ties: the earlier candidate), and every surviving uncompressed one.
        ranked = np.where(keep & compressed[:, None], rank, np.inf)
        best = np.argsort(ranked, axis=0, kind="stable")[:FRONT_LIMIT]
        size = np.broadcast_to(np.arange(keep.shape[1]), best.shape)
        alive = np.isfinite(np.take_along_axis(ranked, best, axis=0))
        chosen = keep & ~compressed[:, None]
        chosen[best[alive], size[alive]] = True
        _, positions = np.nonzero(chosen.T)  # by size, then position
        out = np.split(positions, np.cumsum(chosen.sum(axis=0))[:-1])
        got = (out, compressed)
        self._fronts[id(candidates)] = (candidates, got)
        return got

    def searched(self, device: Device) -> list[Option]:
        """The single-device options on ``device`` that Algorithms 1 and 2 choose from
        (cached): all but the twins of other options, where the tree under the constraints
        holds those others:

        - options that forward gathered payloads undecoded, whose twin decodes and
          re-compresses before every forwarding step. In the fronts such an option's low busy
          time (a Decomp and a Comp fewer) displaced, at FRONT_LIMIT, options the greedy went
          on to pick, and plans got slower (LSTM and VGG16 on 8 x 8, randomk 1%: 0.2-0.4%);
        - mixed options (a partner inside the machine), whose twin runs the job's compressor
          throughout. As candidates they made 4 of 42 plans of BENCHMARKS.md (b) slower
          (up to 1.9%, BERT on PCIe with efsignsgd) where 5 got faster.

        Both are tried last, as twins of the option chosen (:meth:`twins`), so a plan is never
        slower for them. Where the constraints leave the other out (``max-compressions``,
        ``max-lossy``) the twin is the only form of its scheme and stays a candidate."""
        got = self._searched.get(device)
        if got is None:
            got = self._searched[device] = _searched_in_tree(self.cluster, self.constraints,
                                                              device, self._tree)
        return got

    def twins(self, k: int) -> np.ndarray:
        """Evaluator indices of option ``k`` and of the tree's options that forward the
        gathered payloads where ``k`` decodes them and compresses again (each such
        ``Decomp -> Comp`` pair dropped, in every combination), and of those and ``k``
        with the partner compressing inside the machine (:func:`_partner_twins`); cached."""
        got = self._twins.get(k)
        if got is None:
            option = self.evaluator.options[k]
            ops = () if lowrank.inner(option) is not None else compile_option(option).ops
            pairs = [op.index for op in ops[:-1] if op.kind is Kind.DECOMP
                     and op.takes is Form.SUM and ops[op.index + 1].kind is Kind.COMP]
            tree = canonical_options(self.cluster, self.constraints, self._tree)
            forwarded = []
            for n in range(1, len(pairs) + 1):
                for drop in itertools.combinations(pairs, n):
                    gone = {j for d in drop for j in (d, d + 1)}
                    twin = tree.get(Option(tuple(st for j, st in enumerate(option.steps)
                                                 if j not in gone)))
                    if twin is not None:
                        forwarded.append(twin)
            found = forwarded + [
                twin for base in (option, *forwarded)
                for twin in map(tree.get, _partner_twins(base, self.constraints.partner))
                if twin is not None]
            got = self._twins[k] = np.concatenate([[k], self.index(found)]).astype(np.int64) \
                if found else np.array([k], dtype=np.int64)
        return got

    def fronts(self, device: Device) -> Fronts:
        """The non-dominated single-device options on ``device`` per size, among
        :meth:`searched` (cached)."""
        got = self._device_fronts.get(device)
        if got is None:
            candidates = self.searched(device)
            positions, compressed = self._front_positions(candidates)
            _, total = self._stacks(candidates)
            rows = np.array(self._rows(candidates), dtype=np.int64)
            if (rows >= 0).all():  # all catalogued (Algorithm 1's, by prepare)
                index = [rows[pos] for pos in positions]
            else:  # catalogued front by front, in this order (it numbers the options)
                index = [self.index([candidates[k] for k in pos.tolist()]) for pos in positions]
            got = self._device_fronts[device] = Fronts(
                index=index,
                compressible=frozenset(u for u, pos in enumerate(positions)
                                       if compressed[pos].any()),
                fastest_alone=np.array([front[int(np.argmin(total[pos, u]))]
                                        for u, (pos, front) in enumerate(zip(positions, index,
                                                                            strict=True))],
                                       dtype=np.int64))
        return got

    @property
    def placements_made(self) -> Mapping[int, np.ndarray]:
        """The placement tables :meth:`placements` has made so far, by option (do not
        modify them)."""
        return self._placements

    def placements(self, k: int) -> np.ndarray:
        """Evaluator indices of every device placement of option ``k``'s Comp/Decomp steps:
        entry ``mask`` runs the j-th compute step (in step order) on the CPU where bit j of
        ``mask`` is set, on the GPU elsewhere; -1 where the tree under the constraints does
        not hold that option (cached; ``k``'s own placement is among them).

        A placement changes only its compute steps' tasks (the device's resource and cost;
        the communication steps and the extents they leave do not depend on devices), so
        the placements are priced from the all-GPU and all-CPU versions of the option, task
        by task, instead of walking each one."""
        got = self._placements.get(k)
        if got is not None:
            return got
        option = self.evaluator.options[k]
        rows, options = _placements_in_tree(option, self.cluster, self.constraints, self._tree)
        gpu, cpu = self.on_device(option, Device.GPU), self.on_device(option, Device.CPU)
        where = [j for j, st in enumerate(option.steps) if st.device is not None]
        masks = np.arange(1 << len(where))
        # Where the tree holds no CPU placement (a low-rank compressor: no numba backend, and
        # no CPU cost profile to price one) the all-CPU twin is not priced.
        g = self.pricer.tasks(gpu)
        c = self.pricer.tasks(cpu) if any(rows) else g
        ordinal = np.array([where.index(j) if j in where else -1 for j in g.step.tolist()],
                           dtype=np.int64)
        on_cpu = (ordinal >= 0) & ((masks[:, None] >> np.maximum(ordinal, 0)) & 1).astype(bool)
        resource = np.where(on_cpu, c.resource, g.resource)
        duration = np.where(on_cpu[:, None, :], c.duration[None], g.duration[None])
        catalogue = self.evaluator.catalogue
        fresh = [j for j, o in enumerate(options) if o not in catalogue.index]
        if fresh:
            taken = np.array(rows, dtype=np.int64)[fresh]
            catalogue.add_batches([options[j] for j in fresh], [PricedBatch(
                np.arange(len(fresh)), resource[taken], duration[taken])])
        got = np.full(len(masks), -1, dtype=np.int64)
        got[rows] = [catalogue.index[o] for o in options]
        for idx in got[rows].tolist():  # every placement of a form shares the table
            self._placements[idx] = got
        return got

    def _stacks(self, candidates: Sequence[Option]) -> tuple[np.ndarray, np.ndarray]:
        """(busy (O, U, R), total (O, U)) of the candidates, cached per candidate list
        (by identity: hashing and comparing long lists of options costs milliseconds)."""
        hit = self._stacked.get(id(candidates))
        if hit is not None and hit[0] is candidates:
            return hit[1]
        catalogue = self.evaluator.catalogue
        rows = self._rows(candidates)
        if min(rows, default=0) >= 0:  # catalogued (Algorithm 1's): read their rows
            got = (catalogue.busy[rows], catalogue.total[rows])
        else:
            busy = np.empty((len(candidates), len(self.numels), len(RESOURCES)))
            total = np.empty((len(candidates), len(self.numels)))
            for batch in self.pricer.batch(candidates):
                busy[batch.positions] = batch.busy
                total[batch.positions] = batch.total
            got = (busy, total)
        self._stacked[id(candidates)] = (candidates, got)
        return got

    def _rows(self, candidates: Sequence[Option]) -> list[int]:
        """Each candidate's catalogue index, -1 where it is not catalogued (yet)."""
        index = self.evaluator.catalogue.index
        return [index.get(o, -1) for o in candidates]

    def index(self, options: Sequence[Option]) -> np.ndarray:
        """Evaluator indices of options (adding them when new)."""
        return np.asarray(self.evaluator.add(list(options)), dtype=np.int64)

    def iteration_us(self, choice: np.ndarray) -> float:
        return self.evaluator.iteration_us(choice)

    def allowed(self, option: Option) -> bool:
        return option in option_set(self.cluster, self.constraints, self._tree)

    def on_device(self, option: Option, device: Device) -> Option:
        """The same option with every Comp/Decomp moved to ``device``."""
        key = (option, device)
        got = self._moved.get(key)
        if got is None:
            got = self._moved[key] = Option(tuple(
                s.on(device) if s.device is not None else s for s in option.steps))
        return got
