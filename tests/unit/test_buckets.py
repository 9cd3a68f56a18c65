"""Tensor fusion: greedy layouts, the fused workload, layout search and strategy files."""

from __future__ import annotations

import json

import pytest

from byteps_espresso.strategy import Cluster, Strategy, StrategyError, Workload, plan
from byteps_espresso.strategy.buckets import (
    Bucket,
    BucketError,
    MiB,
    check_layout,
    from_names,
    fuse,
    layout,
    layout_apart,
    plan_fused,
    reorder,
    singletons,
)
from byteps_espresso.strategy.workload import TensorProfile

KB = 1024


def _names(buckets):
    return [list(b.tensors) for b in buckets]


def test_layout_closes_a_bucket_before_the_cap_and_keeps_large_tensors_alone():
    tensors = [("a", 100), ("b", 100), ("c", 1000), ("d", 10), ("e", 10), ("f", 300)]
    # 800 bytes: a+b = 800 fit; c = 4000 bytes alone; d+e = 80, +f = 1280 > 800 closes.
    assert _names(layout(tensors, 800)) == [["a", "b"], ["c"], ["d", "e"], ["f"]]
    # A 400-byte first bucket: a alone, then b with nothing else (c is above the cap).
    assert _names(layout(tensors, 800, 400)) == [["a"], ["b"], ["c"], ["d", "e"], ["f"]]
    assert _names(layout(tensors, 0)) == [[n] for n, _ in tensors]
    assert _names(layout(tensors, 1 << 30)) == [[n for n, _ in tensors]]
    assert layout(tensors, 800) == layout(list(tensors), 800)  # same input, same layout


def test_bucket_names_are_the_first_member_and_how_many_follow():
    assert Bucket.of(["x"]).name == "x" and not Bucket.of(["x"]).fused
    assert Bucket.of(["x", "y", "z"]).name == "x+2"
    with pytest.raises(BucketError, match="at least one"):
        Bucket.of([])
    with pytest.raises(BucketError, match=">= 0"):
        layout([("a", 1)], -1)


def test_check_layout_names_what_is_wrong():
    order = ["a", "b", "c"]
    check_layout(layout([(n, 1) for n in order], 8), order)
    with pytest.raises(BucketError, match=r"missing \['c'\]"):
        check_layout([Bucket.of(["a", "b"])], order)
    with pytest.raises(BucketError, match=r"repeated \['b'\]"):
        check_layout([Bucket.of(["a", "b"]), Bucket.of(["b", "c"])], order)
    with pytest.raises(BucketError, match="out of backward order"):
        check_layout([Bucket.of(["b", "a"]), Bucket.of(["c"])], order)
    with pytest.raises(BucketError, match="must be named 'a\\+1'"):
        check_layout([Bucket("c", ("a", "b")), Bucket.of(["c"])], order)


def test_a_layout_is_read_back_from_its_bucket_names():
    """What a check or trials record keeps is the bucket names: they give the layout back,
    for every greedy cap and in any order, and names that do not cut the order are named."""
    wl = Workload.builtin("bert")
    order, tensors = wl.names, [(t.name, t.numel) for t in wl.tensors]
    for cap in (0, 256 * KB, MiB, 25 * MiB, 1 << 40):
        buckets = layout(tensors, cap, MiB)
        names = [b.name for b in buckets]
        assert from_names(names, order) == tuple(buckets)
        assert from_names(names[::-1], order) == tuple(buckets)
        # a layout that keeps some gradients apart (layout_apart: every third one here)
        apart = frozenset(order[::3])
        kept_apart = layout_apart(tensors, cap, MiB, apart)
        assert from_names([b.name for b in kept_apart], order, apart=apart) == kept_apart
    small = ["a", "b", "c"]
    with pytest.raises(BucketError, match=r"'x\+1' names no gradient"):
        from_names(["x+1", "c"], small)
    with pytest.raises(BucketError, match=r"'a\+z' names no gradient"):
        from_names(["a+z"], small)
    with pytest.raises(BucketError, match="missing"):
        from_names(["a+1"], small)  # c is in no bucket
    with pytest.raises(BucketError, match="repeated"):
        from_names(["a+1", "b+1"], small)


def test_fuse_sums_sizes_and_gaps_so_a_bucket_is_ready_with_its_last_member():
    wl = Workload((TensorProfile("a", 10, 5.0), TensorProfile("b", 20, 7.0),
                   TensorProfile("c", 30, 11.0)), forward_us=100.0, model="m")
    fused = fuse(wl, [Bucket.of(["a", "b"]), Bucket.of(["c"])])
    assert [(t.name, t.numel, t.ready_gap_us) for t in fused.tensors] == [
        ("a+1", 30, 12.0), ("c", 30, 11.0)]
    assert fused.backward_us == wl.backward_us and fused.forward_us == 100.0
    with pytest.raises(BucketError, match="missing"):
        fuse(wl, [Bucket.of(["a"])])


def test_plan_fused_keeps_the_fastest_layout_and_plans_each_layout_once():
    wl = Workload(tuple(TensorProfile(f"t{i}", 1000, 10.0) for i in range(8)))
    calls = []

    def predicted(fused, best_ms):  # fewer buckets are faster here, by construction
        calls.append((len(fused.tensors), best_ms))
        return float(len(fused.tensors))

    # 4,000-byte tensors: caps 0 and 1 KiB both give singletons (planned once). The fewest
    # buckets are planned first, each later layout against the best predicted before it.
    best, tried = plan_fused(wl, predicted, caps=(0, KB, 8 * KB, 64 * KB), first_cap_bytes=64 * KB)
    assert calls == [(1, None), (4, 1.0), (8, 1.0)]
    assert [(c, n) for c, n, _ in tried] == [(0, 8), (8 * KB, 4), (64 * KB, 1)]
    assert len(best) == 1 and best[0].tensors == tuple(wl.names)
    # A tie keeps the smaller cap: more buckets, more overlap.
    best, _ = plan_fused(wl, lambda fused, best_ms: 1.0, caps=(0, 64 * KB))
    assert best == singletons(wl.names)
    # With a small first bucket the greedy layouts keep two buckets at least; the layout of
    # the fewest (the largest cap for the first bucket too) is listed last.
    calls.clear()
    best, tried = plan_fused(wl, predicted, caps=(0, 64 * KB), first_cap_bytes=8 * KB)
    assert calls == [(1, None), (2, 1.0), (8, 1.0)]
    assert [(c, n) for c, n, _ in tried] == [(0, 8), (64 * KB, 2), (64 * KB, 1)]
    assert best == (Bucket.of(wl.names),)
    # The best so far is the least of those planned, whichever layout it was.
    calls.clear()
    plan_fused(wl, lambda fused, best_ms: calls.append(best_ms) or 10.0 - len(fused.tensors),
               caps=(0, 8 * KB, 64 * KB), first_cap_bytes=64 * KB)
    assert calls == [None, 9.0, 6.0]


def _many_small_tensors() -> Workload:
    # 60 gradients of 1-16K elements, ready 5 us apart (a fast GPU): the synchronization,
    # latency-bound, is exposed.
    return Workload(tuple(TensorProfile(f"layer{i}.w", 1024 * (1 + i % 16), 5.0)
                          for i in range(60)), forward_us=200.0, model="small")


@pytest.mark.parametrize(("machines", "gpus", "algorithm"),
                         [(2, 2, "fp32"), (8, 8, "fp32"), (8, 8, "espresso")])
def test_the_planner_prices_fusion_on_a_latency_bound_link(machines, gpus, algorithm):
    wl = _many_small_tensors()
    cluster = Cluster.preset(machines, gpus, "pcie", 25)

    def predicted(w, best_ms=None):
        return plan(w, cluster, "randomk", {"ratio": 0.01}, algorithm=algorithm).predicted_ms

    unfused = predicted(wl)
    best, tried = plan_fused(wl, predicted)
    assert tried[0] == (0, len(wl.tensors), pytest.approx(unfused))
    # Every message pays the links' latency: a fused layout is predicted faster and kept.
    assert min(ms for _, _, ms in tried) < unfused
    assert any(b.fused for b in best)


def test_strategies_with_buckets_round_trip_and_bad_buckets_are_named(tmp_path):
    wl = _many_small_tensors()
    buckets = layout([(t.name, t.numel) for t in wl.tensors], MiB // 8)
    s = plan(fuse(wl, buckets), Cluster.preset(2, 2, "pcie", 10), "randomk", {"ratio": 0.01})
    from dataclasses import replace

    s = replace(s, buckets=buckets)
    path = tmp_path / "s.json"
    s.save(path)
    loaded = Strategy.load(path)
    assert loaded.buckets == buckets and loaded.layout == buckets
    assert loaded.options == s.options
    assert "fusion: 60 gradients in" in loaded.summary()
    data = json.loads(path.read_text())
    data["buckets"][0] = data["buckets"][0][:-1]  # a member dropped: names no longer match
    path.write_text(json.dumps(data))
    with pytest.raises(StrategyError, match="field 'buckets'"):
        Strategy.load(path)
    data["buckets"] = "all"
    path.write_text(json.dumps(data))
    with pytest.raises(StrategyError, match="list of non-empty lists"):
        Strategy.load(path)
    # Without buckets every option is one gradient.
    plain = plan(wl, Cluster.preset(2, 2, "pcie", 10), "randomk", {"ratio": 0.01})
    assert plain.layout == singletons(wl.names) and "buckets" not in plain.to_dict()


def test_excluded_gradients_share_buckets_only_with_each_other():
    # backward order: w3 b3 w2 b2 w1 b1 (weights of 1000 floats, biases of 10)
    names = ["w3", "b3", "w2", "b2", "w1", "b1"]
    wl = Workload(tuple(TensorProfile(n, 1000 if n[0] == "w" else 10, 5.0) for n in names), 1.0)
    tensors = [(t.name, t.numel) for t in wl.tensors]
    apart = frozenset({"b3", "b2", "b1"})
    got = layout_apart(tensors, 8000, 4000, apart)  # 2 weights a bucket, a 1-weight first one
    assert [b.tensors for b in got] == [("w3",), ("w2", "w1"), ("b3", "b2", "b1")]
    assert layout_apart(tensors, 8000, 4000) == layout(tensors, 8000, 4000)
    order = [n for b in got for n in b.tensors]
    check_layout(got, order)  # consecutive runs of the new submission order
    moved = reorder(wl, order)
    # a gradient is handed over once every one before it is: b3 (ready at 10 us) waits for
    # w1 (25 us), b1 is ready at 30 us
    assert [t.name for t in moved.tensors] == order
    assert [t.ready_gap_us for t in moved.tensors] == [5.0, 10.0, 10.0, 0.0, 0.0, 5.0]
    fused = fuse(moved, got)
    assert [t.ready_gap_us for t in fused.tensors] == [5.0, 20.0, 5.0]
    with pytest.raises(BucketError, match="every gradient once"):
        reorder(wl, order[:-1])


def test_pinned_tensors_stay_uncompressed_and_the_plan_is_priced_so():
    wl = Workload.builtin("vgg16")
    cluster = Cluster.preset(8, 8, "pcie", 25)
    free = plan(wl, cluster, "randomk", {"ratio": 0.01})
    big = [n for n, o in free.options.items() if o.is_compressed][:3]
    assert big  # the free plan compresses these
    pinned = plan(wl, cluster, "randomk", {"ratio": 0.01}, pinned=frozenset(big))
    assert all(not pinned.options[n].is_compressed for n in big)
    assert pinned.predicted_ms >= free.predicted_ms - 1e-9  # a constraint cannot help
    assert pinned.baselines["all-gpu"] > free.baselines["all-gpu"]  # baselines pinned too


@pytest.mark.parametrize("within", [2.5, None])
def test_plan_bucketed_equals_planning_every_layout_in_full(monkeypatch, within):
    """The start-up path picks the layout by the algorithm's plan alone and builds the
    finalists (or the plan with its baselines) for the kept layout only; the answer is the
    same as planning every layout in full (each against the best layout planned before it,
    as plan_fused hands it over) and keeping the one whose plan is fastest (the finalists'
    first may then be faster still: a restricted run's options)."""
    from byteps_espresso.strategy import planner

    wl = _many_small_tensors()
    cluster = Cluster.preset(2, 2, "pcie", 10)
    params = {"ratio": 0.01}
    full = {}

    def plan_fully(fused, best_ms):
        out = (planner.plan_finalists(fused, cluster, "randomk", params, within=within)
               if within is not None else [plan(fused, cluster, "randomk", params)])
        full[tuple(fused.names)] = out
        alone = planner.plan_alone(fused, cluster, "randomk", params, incumbent_us=None
                                   if best_ms is None else best_ms * 1e3)[0]
        assert out[0].predicted_ms <= alone.predicted_ms + 1e-9
        return alone.predicted_ms

    want_buckets, want_tried = plan_fused(wl, plan_fully)
    want = full[tuple(b.name for b in want_buckets)]
    calls = []
    original = planner.plan_finalists

    def counted(*args, **kwargs):
        calls.append(args[0].names)
        return original(*args, **kwargs)

    monkeypatch.setattr(planner, "plan_finalists", counted)
    buckets, tried, got = planner.plan_bucketed(wl, cluster, "randomk", params, within=within)
    assert buckets == want_buckets and len(want_tried) > 1
    assert tried == [(cap, n, pytest.approx(ms, abs=1e-9)) for cap, n, ms in want_tried]
    assert [(s.algorithm, s.options, s.baselines) for s in got] == \
        [(s.algorithm, s.options, s.baselines) for s in want]
    assert [s.predicted_ms for s in got] == pytest.approx([s.predicted_ms for s in want])
    assert calls == ([fuse(wl, buckets).names] if within is not None else [])


def test_plan_fewest_buckets_plans_the_largest_cap_without_a_small_first_bucket():
    """The trials' layout finalist: every bucket up to the largest cap (no 1 MiB first one),
    the excluded gradients fused only with each other and left uncompressed, planned by the
    algorithm alone and labelled, with its layout recorded."""
    from byteps_espresso.strategy import planner
    from byteps_espresso.strategy.buckets import DEFAULT_CAP_BYTES, DEFAULT_FIRST_CAP_BYTES

    wl = _many_small_tensors()
    cluster = Cluster.preset(2, 2, "pcie", 10)
    params = {"ratio": 0.01}
    tensors = [(t.name, t.numel) for t in wl.tensors]
    apart = frozenset(wl.names[1::4])
    buckets, strategy = planner.plan_fewest_buckets(wl, cluster, "randomk", params,
                                                    apart=apart)
    assert buckets == layout_apart(tensors, DEFAULT_CAP_BYTES, None, apart)
    # fewer buckets than the greedy layout of the same cap with the small first bucket
    assert len(buckets) < len(layout_apart(tensors, DEFAULT_CAP_BYTES, DEFAULT_FIRST_CAP_BYTES,
                                           apart))
    assert strategy.algorithm == f"espresso/{planner.FEWEST_BUCKETS}"
    assert strategy.layout == buckets
    fused = fuse(reorder(wl, [n for b in buckets for n in b.tensors]), buckets)
    alone, _ = planner.plan_alone(fused, cluster, "randomk", params,
                                  pinned=frozenset(b.name for b in buckets
                                                   if set(b.tensors) <= apart))
    assert strategy.options == alone.options
    assert strategy.predicted_ms == pytest.approx(alone.predicted_ms, abs=1e-9)
    assert any(set(b.tensors) <= apart for b in buckets)
    for b in buckets:
        if set(b.tensors) <= apart:  # the excluded gradients' buckets stay uncompressed
            assert not strategy.options[b.name].is_compressed


def test_ddp_layout_is_the_greedy_layout_at_ddps_caps():
    from byteps_espresso.strategy.buckets import (
        DEFAULT_CAP_BYTES,
        DEFAULT_FIRST_CAP_BYTES,
        ddp_layout,
        layout,
        layout_apart,
    )

    tensors = [(f"t{i}", n) for i, n in enumerate([300_000, 40, 200_000, 7_000_000, 40])]
    assert ddp_layout(tensors) == layout(tensors, DEFAULT_CAP_BYTES, DEFAULT_FIRST_CAP_BYTES)
    assert ddp_layout(tensors)[0].tensors == ("t0",)  # 1.2 MB: alone in the 1 MiB first
    assert ddp_layout(tensors, 4 << 20) == layout(tensors, 4 << 20, DEFAULT_FIRST_CAP_BYTES)
    assert ddp_layout(tensors, 0) == layout(tensors, 0)  # every gradient alone
    apart = frozenset({"t1", "t4"})
    assert ddp_layout(tensors, apart=apart) == layout_apart(
        tensors, DEFAULT_CAP_BYTES, DEFAULT_FIRST_CAP_BYTES, apart)
