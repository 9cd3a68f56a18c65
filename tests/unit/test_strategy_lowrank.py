"""PowerSGD in the planner: its tree, sizes, prices, plans and strategy files
(byteps_espresso/strategy/lowrank.py)."""

from __future__ import annotations

import numpy as np
import pytest

from byteps_espresso.strategy import (
    Cluster,
    CompressorCosts,
    Strategy,
    StrategyError,
    Workload,
    plan,
)
from byteps_espresso.strategy.buckets import Bucket, fuse
from byteps_espresso.strategy.context import PlanContext
from byteps_espresso.strategy.costs import GPU, CompressedSizes, Pricer
from byteps_espresso.strategy.lowrank import Factors, factors, inner, is_lowrank, wrap
from byteps_espresso.strategy.options import Device, Kind, Option, OptionError
from byteps_espresso.strategy.tree import Constraints, enumerate_options, validate
from byteps_espresso.strategy.workload import TensorProfile, WorkloadError

CLUSTER = Cluster.preset(2, 2, "pcie", 1)
PARAMS = {"rank": 4}


def _costs(per_mac_us: float = 2e-4, launch_us: float = 20.0) -> CompressorCosts:
    """A PowerSGD profile: t = launch + per_mac x multiply-adds, both ops."""
    samples = [{"compressor": "powersgd", "device": "gpu", "op": op, "numel": n,
                "us": launch_us + per_mac_us * n}
               for op in ("compress", "decompress") for n in (1e4, 1e7)]
    return CompressorCosts.fit(samples, note="test")


def _workload(tensors: list[tuple[str, tuple[int, ...], float]]) -> Workload:
    return Workload(tuple(TensorProfile(n, int(np.prod(s)), gap, (s,)) for n, s, gap in tensors),
                    20_000.0, "toy")


TOY = _workload([("out.bias", (2000,), 0.0), ("out.weight", (2000, 128), 500.0),
                 ("lstm.w", (512, 256), 3000.0), ("emb", (2000, 64), 2000.0)])


# ---- the tree ---------------------------------------------------------------------------------
def test_tree_is_the_dense_options_and_each_wrapped():
    dense = enumerate_options(CLUSTER, Constraints(max_compressions=0))
    tree = enumerate_options(CLUSTER, Constraints(), "powersgd")
    assert tree == [*dense, *(wrap(o) for o in dense)]
    for option in tree:
        validate(option, CLUSTER, "powersgd")
        assert not option.uses_cpu and not option.partners
        assert not any(s.kind.is_compressed for s in option.steps)
    # one lossy compression each: the runtime's default max-lossy=1 keeps all of them
    assert enumerate_options(CLUSTER, Constraints(max_lossy=1), "powersgd") == tree
    # constraints prune it as any tree
    assert enumerate_options(CLUSTER, Constraints(allow_gpu=False), "powersgd") == dense
    no_ps = enumerate_options(CLUSTER, Constraints(forbid={Kind.PUSH_PULL}), "powersgd")
    assert len(no_ps) < len(tree) and not any(o.uses_servers for o in no_ps)


@pytest.mark.parametrize("text, why", [
    ("ReduceScatter(intra) -> Comp(gpu) -> Allreduce(inter) -> Decomp(gpu) -> Allgather(intra)",
     "compresses the whole tensor"),
    ("Comp(gpu) -> AllgatherC(flat) -> Decomp(gpu)", "compresses the whole tensor"),
    ("Comp(gpu) -> PushPullC(flat) -> Decomp(gpu)", "compresses the whole tensor"),
    ("Comp(cpu) -> Allreduce(flat) -> Decomp(cpu)", "training device only"),
    ("Comp(gpu) -> ReduceScatter(flat) -> Decomp(gpu)", "never closed"),
])
def test_options_powersgd_cannot_follow_are_refused_with_the_reason(text, why):
    with pytest.raises(OptionError, match=why):
        validate(Option.parse(text), CLUSTER, "powersgd")


def test_an_elementwise_codec_refuses_the_wrapped_form():
    wrapped = Option.parse("Comp(gpu) -> Allreduce(flat) -> Decomp(gpu)")
    validate(wrapped, CLUSTER, "powersgd")
    with pytest.raises(OptionError):
        validate(wrapped, CLUSTER, "topk")
    assert is_lowrank("powersgd") and not is_lowrank("topk") and not is_lowrank("nope")
    assert inner(wrapped) == Option.parse("Allreduce(flat)")
    assert inner(Option.parse("Comp(gpu) -> AllgatherC(flat) -> Decomp(gpu)")) is None
    with pytest.raises(OptionError, match="uncompressed"):
        wrap(wrapped)


# ---- sizes -------------------------------------------------------------------------------------
def test_factors_by_hand():
    # (2000, 128) at rank 4: P 2000 x 4, Q 128 x 4; a conv weight is 16 x 36; a vector and a
    # 3 x 2 matrix (which would not shrink by 2) travel in the first sum as they are
    got = factors([(2000, 128), (16, 4, 3, 3), (2000,), (3, 2)], PARAMS)
    assert got == Factors(p=2000 * 4 + 16 * 4 + 2000 + 6, q=128 * 4 + 36 * 4,
                          mac_p=2000 * 128 * 4 + 16 * 36 * 4,
                          mac_q=2000 * 128 * 4 + 2000 * 16 + 16 * 36 * 4 + 16 * 16,
                          mac_r=2000 * 128 * 4 + 16 * 36 * 4)
    # rank above the matrix's sides: r = min(n, m, rank)
    assert factors([(8, 3)], {"rank": 8, "min_compression_rate": 0.5}).q == 3 * 3
    assert factors([(64,)], PARAMS) == Factors(64, 0, 0, 0, 0)


def test_workload_shapes_are_checked_round_trip_and_fuse():
    assert Workload.from_dict(TOY.to_dict()) == TOY
    assert TOY.tensors[1].shapes == ((2000, 128),)
    with pytest.raises(WorkloadError, match="hold 6 elements, its numel says 7"):
        TensorProfile("w", 7, 0.0, ((3, 2),))
    with pytest.raises(WorkloadError, match="positive integers"):
        TensorProfile("w", 6, 0.0, ((3, -2),))
    fused = fuse(TOY, [Bucket.of(["out.bias", "out.weight"]), Bucket.of(["lstm.w", "emb"])])
    assert [t.shapes for t in fused.tensors] == [((2000,), (2000, 128)),
                                                 ((512, 256), (2000, 64))]


# ---- prices ------------------------------------------------------------------------------------
def test_a_wrapped_option_is_priced_as_it_runs():
    ctx = PlanContext(TOY, CLUSTER, "powersgd", PARAMS, _costs())
    costs, pricer = ctx.costs, ctx.pricer
    dense = Option.parse("ReduceScatter(intra) -> Allreduce(inter) -> Allgather(intra)")
    tasks = pricer.tasks(wrap(dense))
    f = pricer.factors
    sizes = CompressedSizes("powersgd")
    first, second = (Pricer(CLUSTER, "powersgd", sizes, costs, n, free_compression=True)
                     .tasks(dense) for n in ([x.p for x in f], [x.q for x in f]))
    compressing = np.array([x.q > 0 for x in f], dtype=float)
    mac = {k: np.array([getattr(x, k) for x in f], dtype=float)
           for k in ("mac_p", "mac_q", "mac_r")}
    want = np.concatenate([
        (costs.compress_us("powersgd", "gpu", mac["mac_p"]) * compressing)[:, None],
        first.duration,
        (costs.compress_us("powersgd", "gpu", mac["mac_q"]) * compressing)[:, None],
        second.duration * compressing[:, None],
        (costs.decompress_us("powersgd", "gpu", mac["mac_r"]) * compressing)[:, None]], axis=1)
    np.testing.assert_array_equal(tasks.duration, want)
    assert tasks.resource.tolist() == [GPU, *first.resource, GPU, *second.resource, GPU]
    assert tasks.step.tolist() == [0, *(first.step + 1), 0, *(second.step + 1), 4]
    # a vector: nothing to compress, so the wrapped option costs what its dense steps cost
    u = ctx.tensor_size_index(0)
    assert f[u].q == 0
    np.testing.assert_allclose(tasks.total[u], pricer.tasks(dense).total[u])
    with pytest.raises(ValueError, match="no step moves its payloads"):
        sizes(np.array([100.0]))


def test_distinct_sizes_follow_shapes_and_a_shapeless_workload_is_refused():
    same_numel = _workload([("a", (256, 64), 0.0), ("b", (16384,), 100.0),
                            ("c", (64, 256), 100.0)])
    ctx = PlanContext(same_numel, CLUSTER, "powersgd", PARAMS, _costs())
    idx = [ctx.tensor_size_index(i) for i in range(3)]
    assert len(set(idx)) == 3 and ctx.numels == [16384] * 3
    shapeless = Workload((TensorProfile("a", 100, 0.0),), 1.0, "shapeless")
    with pytest.raises(ValueError, match=r"needs each tensor's shape.*'a'"):
        PlanContext(shapeless, CLUSTER, "powersgd", PARAMS, _costs())


# ---- plans -------------------------------------------------------------------------------------
def test_plan_compresses_the_matrices_where_the_link_is_slow_and_not_where_compute_is():
    tree = set(enumerate_options(CLUSTER, Constraints(), "powersgd"))
    cheap = plan(TOY, CLUSTER, "powersgd", PARAMS, costs=_costs())
    assert set(cheap.options.values()) <= tree
    assert set(cheap.compressed_tensors) == {"out.weight", "lstm.w", "emb"}
    assert not cheap.options["out.bias"].is_compressed
    assert cheap.predicted_ms < cheap.baselines["fp32"]
    # products a thousand times slower than the link saves: nothing is worth compressing
    dear = plan(TOY, Cluster.preset(2, 2, "nvlink", 100), "powersgd", PARAMS,
                costs=_costs(per_mac_us=0.2))
    assert dear.compressed_tensors == []
    assert dear.predicted_ms <= dear.baselines["fp32"]


def test_strategy_files_round_trip_and_are_validated_for_their_compressor(tmp_path):
    s = plan(TOY, CLUSTER, "powersgd", PARAMS, costs=_costs())
    path = tmp_path / "s.json"
    s.save(path)
    loaded = Strategy.load(path)
    assert loaded.options == s.options and loaded.workload == s.workload
    data = s.to_dict()
    data["compressor"] = {"name": "topk", "params": {"ratio": 0.01}}
    with pytest.raises(StrategyError, match=r"options\.out\.weight"):
        Strategy.from_dict(data, "edited")


def test_the_cpu_placement_of_a_wrapped_option_is_never_priced():
    ctx = PlanContext(TOY, CLUSTER, "powersgd", PARAMS, _costs())
    ctx.prepare()
    k = int(ctx.index([wrap(Option.parse("Allreduce(flat)"))])[0])
    got = ctx.placements(k)
    assert got[0] == k and (got[1:] == -1).all()
    assert Device.CPU not in ctx.evaluator.options[k].devices
