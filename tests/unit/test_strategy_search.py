"""Search quality against bruteforce, baselines, and pricing/simulating the whole tree."""

from collections.abc import Callable

import numpy as np
import pytest

from byteps_espresso.strategy import (
    Cluster,
    Constraints,
    TensorProfile,
    Workload,
    baselines,
    costs,
    search,
)
from byteps_espresso.strategy.context import PlanContext, clear_model_cache, pareto_front
from byteps_espresso.strategy.instances import random_instance
from byteps_espresso.strategy.options import Device
from byteps_espresso.strategy.tree import option_forms

COMPRESSOR = "randomk"
PARAMS = {"ratio": 0.01}


def test_every_option_is_priced_and_simulated():
    wl = Workload((TensorProfile("a", 3_000_000, 500.0), TensorProfile("b", 1000, 10.0)), 100.0)
    ctx = PlanContext(wl, Cluster.preset(4, 4, "pcie", 25), COMPRESSOR, PARAMS)
    idx = ctx.index(ctx.options)
    assert len(idx) == len(ctx.options) == 7576  # 2,776 with the job's compressor only
    for k in idx:
        t = ctx.iteration_us(np.full(2, k))
        assert np.isfinite(t) and t >= wl.forward_time_us + wl.backward_us


def test_espresso_matches_bruteforce_on_small_instances():
    ratios = []
    for seed in range(12):
        inst = random_instance(seed)
        ctx = PlanContext(inst.workload, inst.cluster, COMPRESSOR, PARAMS,
                          constraints=inst.constraints)
        found = baselines.get("espresso").run(ctx).iteration_us
        best = baselines.get("bruteforce").run(ctx).iteration_us
        assert found >= best - 1e-6
        ratios.append(found / best)
    assert max(ratios) <= 1.02
    assert sum(r <= 1 + 1e-9 for r in ratios) >= 10


def test_bruteforce_refuses_large_inputs():
    wl = Workload(tuple(TensorProfile(f"t{i}", 1 << 20, 100.0) for i in range(6)))
    ctx = PlanContext(wl, Cluster.preset(2, 2), COMPRESSOR, PARAMS)
    with pytest.raises(baselines.BruteforceTooLarge, match="--constraint"):
        baselines.get("bruteforce").run(ctx)


def test_baselines_run_and_espresso_is_not_slower():
    wl = Workload.builtin("lstm")
    ctx = PlanContext(wl, Cluster.preset(8, 8, "pcie", 25), COMPRESSOR, PARAMS)
    times = {name: baselines.get(name).run(ctx).iteration_us
             for name in ("espresso", "fp32", "all-gpu", "hipress", "cpu-only")}
    assert all(times["espresso"] <= t + 1e-6 for t in times.values())
    bound = baselines.get("upper-bound").run(ctx).iteration_us
    assert bound <= times["espresso"] + 1e-6
    fp32 = baselines.get("fp32").run(ctx).options
    assert {str(o) for o in fp32} == {
        "ReduceScatter(intra) -> PushPull(inter) -> Allgather(intra)"}


@pytest.mark.parametrize(("machines", "local", "servers", "shared"),
                         [(2, 2, 1, False), (8, 8, 8, False), (4, 1, 2, False),
                          (1, 4, 1, False), (2, 2, 0, False), (3, 1, 0, False),
                          (2, 2, 1, True), (2, 2, 0, True)])
def test_compression_none_runs_the_fp32_baseline(machines, local, servers, shared):
    from byteps_espresso.worker.session import fp32_option
    from byteps_espresso.worker.topology import Topology

    cluster = Cluster.preset(machines, local, "pcie", 25, servers=servers)
    ctx = PlanContext(Workload.builtin("lstm"), cluster.with_(shared_host=shared),
                      COMPRESSOR, PARAMS)
    planned = set(baselines.get("fp32").run(ctx).options)
    assert planned == {fp32_option(Topology(machines, local), servers, shared)}
    hierarchical = local > 1 and machines > 1 and not shared
    assert next(iter(planned)).is_hierarchical == hierarchical


@pytest.mark.parametrize(("compressor", "params", "name", "scheme"), [
    ("fp16", {}, "allreduce-c", "Comp(gpu) -> AllreduceC(flat) -> Decomp(gpu)"),
    ("efsignsgd", {}, "allgather-c", "Comp(gpu) -> AllgatherC(flat) -> Decomp(gpu)"),
    ("randomk", {"ratio": 0.01}, "allgather-c", "Comp(gpu) -> AllgatherC(flat) -> Decomp(gpu)"),
    ("fp16", {}, "allgather-c", "Comp(gpu) -> AllgatherC(flat) -> Decomp(gpu)")])
def test_the_hook_baselines_compress_every_tensor_in_one_flat_collective(
        compressor, params, name, scheme):
    """What a DDP communication hook runs (the runtime's check falls back to it)."""
    ctx = PlanContext(Workload.builtin("lstm"), Cluster.preset(2, 2, "pcie", 1), compressor,
                      params)
    solution = baselines.get(name).run(ctx)
    assert {str(o) for o in solution.options} == {scheme}
    assert solution.iteration_us == pytest.approx(ctx.iteration_us(solution.choice))


def test_allreduce_c_needs_payloads_that_sum():
    ctx = PlanContext(Workload.builtin("lstm"), Cluster.preset(2, 2), COMPRESSOR, PARAMS)
    with pytest.raises(baselines.BaselineUnavailable, match=r"do not sum.*only fp16"):
        baselines.get("allreduce-c").run(ctx)


def test_unavailable_baseline_and_unknown_algorithm():
    ctx = PlanContext(Workload.builtin("lstm"), Cluster.preset(2, 2, servers=0), COMPRESSOR, PARAMS)
    with pytest.raises(baselines.BaselineUnavailable):
        baselines.get("cpu-only").run(ctx)
    with pytest.raises(ValueError, match="choose one of"):
        baselines.get("greedy")
    with pytest.raises(ValueError, match="relax"):
        PlanContext(Workload.builtin("lstm"), Cluster.preset(2, 2), COMPRESSOR, PARAMS,
                    constraints=Constraints(forbid=frozenset(
                        k for k in __import__("byteps_espresso.strategy", fromlist=["Kind"]).Kind
                        if not k.is_compute)))


def test_pareto_front_keeps_exactly_the_non_dominated_rows():
    v = np.array([[[1.0, 5.0]], [[2.0, 2.0]], [[3.0, 3.0]], [[1.0, 5.0]]])
    keep = pareto_front(v, rel=0.0, abs_us=0.0)
    assert keep[:, 0].tolist() == [True, True, False, False]


def test_profile_of_one_device_restricts_the_tree():
    from byteps_espresso.strategy import CompressorCosts, CostsError, Kind, plan
    from byteps_espresso.strategy.compressor_costs import Linear

    gpu_only = CompressorCosts({"randomk": {"gpu": {"compress": Linear(20.0, 1e-6),
                                                    "decompress": Linear(20.0, 1e-6)}}})
    s = plan(Workload.builtin("lstm"), Cluster.preset(2, 2), COMPRESSOR, PARAMS, costs=gpu_only)
    assert not s.constraints.allow_cpu and Kind.PUSH_PULL_C in s.constraints.forbid
    assert not any(o.uses_cpu for o in s.options.values())
    with pytest.raises(CostsError, match="no cost profile for compressor 'topk'"):
        plan(Workload.builtin("lstm"), Cluster.preset(2, 2), "topk", costs=gpu_only)


def test_best_row_matches_a_sequential_running_best():
    ctx = PlanContext(Workload.builtin("lstm"), Cluster.preset(4, 4, "pcie", 25), COMPRESSOR,
                      PARAMS)
    rng = np.random.default_rng(0)
    idx = ctx.index(ctx.single_device(ctx.primary_device()))
    rows = rng.choice(idx, size=(40, ctx.n_tensors))
    rows[7] = rows[3]  # a tie: the first of the two is kept
    times = [ctx.iteration_us(r) for r in rows]
    for current in (np.inf, float(np.median(times)), min(times) - 1.0):
        want_r, want_t = -1, current
        for r, t in enumerate(times):
            if t < want_t - 1e-6:
                want_r, want_t = r, t
        assert ctx.evaluator.best_row(rows, current) == (want_r, pytest.approx(want_t))


def test_search_catalogue_agrees_with_the_options():
    ctx = PlanContext(Workload.builtin("lstm"), Cluster.preset(4, 4, "pcie", 25), COMPRESSOR,
                      PARAMS)
    ctx.prepare()
    options = ctx.evaluator.options
    fronts = ctx.fronts(ctx.primary_device())
    for u, front in enumerate(ctx.front(ctx.searched(ctx.primary_device()))):
        assert [options[k] for k in fronts.index[u]] == front
        assert (u in fronts.compressible) == any(o.is_compressed for o in front)
        assert options[fronts.fastest_alone[u]] in front
    for opt in ctx.searched(Device.GPU):
        if not opt.is_compressed:
            continue
        k = ctx.evaluator.index[opt]
        table = ctx.placements(k)
        assert table[0] == k and options[table[-1]] == ctx.on_device(opt, Device.CPU)
        assert len(table) == 1 << sum(s.device is not None for s in opt.steps)


def test_priced_model_is_shared_across_plans_and_replans():
    from dataclasses import replace

    wl = Workload.builtin("lstm")
    cluster = Cluster.preset(4, 4, "pcie", 25)
    clear_model_cache()
    first = PlanContext(wl, cluster, COMPRESSOR, PARAMS)
    a = baselines.get("espresso").run(first)
    again = PlanContext(wl, cluster, COMPRESSOR, PARAMS)
    assert again.pricer is first.pricer
    b = baselines.get("espresso").run(again)
    assert b.options == a.options and b.iteration_us == a.iteration_us
    # a re-profile: other ready gaps, the same sizes; the model is reused, the times are new
    reprofiled = Workload(tuple(replace(t, ready_gap_us=2.5 * t.ready_gap_us + 100.0)
                                for t in wl.tensors), 1000.0)
    warm = PlanContext(reprofiled, cluster, COMPRESSOR, PARAMS)
    assert warm.pricer is first.pricer
    w = baselines.get("espresso").run(warm)
    clear_model_cache()
    cold = PlanContext(reprofiled, cluster, COMPRESSOR, PARAMS)
    assert cold.pricer is not first.pricer
    c = baselines.get("espresso").run(cold)
    assert w.options == c.options and w.iteration_us == pytest.approx(c.iteration_us)
    other = PlanContext(wl, Cluster.preset(4, 4, "pcie", 10), COMPRESSOR, PARAMS)
    assert other.pricer is not cold.pricer  # another cluster, another model


def test_prices_are_shared_across_constraints_and_plans_equal_cold_ones():
    """The restricted finalists reuse the prices of the plan before them; each plan equals
    the same plan made from an empty cache."""
    from byteps_espresso.strategy.context import clear_model_cache

    wl = Workload.builtin("lstm")
    cluster = Cluster.preset(4, 4, "pcie", 25)
    kinds = (Constraints(), Constraints(allow_gpu=False), Constraints(allow_cpu=False))
    clear_model_cache()
    shared = [PlanContext(wl, cluster, COMPRESSOR, PARAMS, constraints=c) for c in kinds]
    assert shared[1].pricer is shared[0].pricer and shared[2].pricer is shared[0].pricer
    got = [baselines.get("espresso").run(ctx) for ctx in shared]
    for constraints, solution in zip(kinds, got, strict=True):
        clear_model_cache()
        alone = baselines.get("espresso").run(
            PlanContext(wl, cluster, COMPRESSOR, PARAMS, constraints=constraints))
        assert solution.options == alone.options
        assert solution.iteration_us == alone.iteration_us


@pytest.mark.parametrize("seed", range(4))
def test_best_of_against_the_incumbent_equals_simulating_it_first(seed):
    """best_of(current=...) starts from the schedule's own (time, sum of synchronized times)
    instead of simulating the current option: the same choice and time."""
    rng = np.random.default_rng(seed)
    wl = Workload.builtin("bert")
    ctx = PlanContext(wl, Cluster.preset(8, 8, "pcie", 25), "efsignsgd", {})
    ctx.prepare()
    fronts = ctx.fronts(Device.GPU)
    ev = ctx.evaluator
    choice = np.array([rng.choice(fronts.index[u]) for u in ev.size_idx], dtype=np.int64)
    now = ev.schedule(choice)
    assert now[0] == ev.iteration_us(choice)
    for i in rng.choice(ctx.n_tensors, size=12, replace=False).tolist():
        cands = fronts.index[ev.size_idx[i]]
        keep = int(choice[i])
        first = np.array([keep, *[k for k in cands.tolist() if k != keep]], dtype=np.int64)
        assert ev.best_of(choice, i, cands, current=now[:2]) == ev.best_of(choice, i, first)


def test_forwarding_options_are_searched_where_their_decoding_twin_is_not_allowed():
    """Algorithms 1 and 2 choose from the options that decode and re-compress where the
    constraints allow them, and from their forwarding twins only where not; the last pass
    tries the twins of the options chosen."""
    from byteps_espresso.strategy import Option

    wl = Workload((TensorProfile("a", 3_000_000, 500.0), TensorProfile("b", 1000, 10.0)), 100.0)
    cluster = Cluster.preset(2, 2, "pcie", 25)
    decoded = Option.parse("Comp(gpu) -> GatherC(intra) -> Decomp(gpu) -> Comp(gpu) "
                           "-> AllgatherC(inter) -> Decomp(gpu) -> Comp(gpu) -> BroadcastC(intra) "
                           "-> Decomp(gpu)")
    forwarded = Option.parse("Comp(gpu) -> GatherC(intra) -> AllgatherC(inter) "
                             "-> BroadcastC(intra) -> Decomp(gpu)")
    ctx = PlanContext(wl, cluster, COMPRESSOR, PARAMS)
    searched = set(ctx.searched(Device.GPU))
    assert decoded in searched and forwarded not in searched
    assert forwarded in set(ctx.single_device(Device.GPU))
    twins = [ctx.evaluator.options[k] for k in ctx.twins(int(ctx.index([decoded])[0]))]
    assert twins[0] == decoded and forwarded in twins
    once = PlanContext(wl, cluster, COMPRESSOR, PARAMS,
                       constraints=Constraints.parse(["max-compressions=1"]))
    assert forwarded in set(once.searched(Device.GPU))
    assert baselines.get("espresso").run(once).iteration_us > 0


def test_mixed_compressors_are_reached_and_never_slow_a_plan():
    """Mixed Options (fp16 inside the machine) enter the search as twins of the option chosen
    (PlanContext.searched, twins): a plan with them is never slower than without, and on
    UGATIT over NVLink + 100 Gbit/s with efsignsgd some tensors take one."""
    from byteps_espresso.strategy import Workload
    from byteps_espresso.strategy.planner import plan

    cluster = Cluster.preset(8, 8, "nvlink", 100)
    wl = Workload.builtin("ugatit")
    mixed = plan(wl, cluster, "efsignsgd")
    alone = plan(wl, cluster, "efsignsgd", constraints=Constraints(partner=None))
    assert mixed.predicted_ms < alone.predicted_ms
    assert any(o.partners for o in mixed.options.values())
    assert not any(o.partners for o in alone.options.values())
    rng = np.random.default_rng(3)
    for _ in range(5):
        numels = rng.integers(1_000, 4_000_000, size=4)
        small = Workload(tuple(TensorProfile(f"t{i}", int(n), float(rng.uniform(50, 2000)))
                               for i, n in enumerate(numels)), 100.0)
        got = plan(small, Cluster.preset(4, 4, "pcie", 25), "randomk", {"ratio": 0.01})
        without = plan(small, Cluster.preset(4, 4, "pcie", 25), "randomk", {"ratio": 0.01},
                       constraints=Constraints(partner=None))
        assert got.predicted_ms <= without.predicted_ms + 1e-9


def _prepared(model, intra, gbps, compressor, lanes):  # type: ignore[no-untyped-def]
    """A prepared PlanContext of a built-in model at 8 x 8 (``lanes``: None for no limit)."""
    cluster = Cluster.preset(8, 8, intra, gbps)
    if lanes:
        cluster = cluster.with_(lanes=lanes)
    ctx = PlanContext(Workload.builtin(model), cluster, compressor,
                      {} if compressor == "efsignsgd" else PARAMS)
    ctx.prepare()
    return ctx


@pytest.mark.parametrize(("model", "intra", "gbps", "compressor", "lanes"), [
    ("bert", "pcie", 25, "efsignsgd", None),
    ("resnet101", "nvlink", 100, "dgc", None),
    ("ugatit", "pcie", 25, "randomk", 2),
    ("gpt2", "nvlink", 100, "randomk", 3),
])
def test_following_the_schedule_s_trace_gives_every_candidate_s_floats(model, intra, gbps,
                                                                      compressor, lanes):
    """A candidate's run started from the traced state before its tensor, and read from the
    trace once its state is the traced one (or the traced one shifted in time), ends with the
    same (time, sum of synchronized times) as simulating the whole strategy, to within
    SHIFT_TOL per tensor; best_of given the Schedule chooses as best_of given its first two
    fields does (and best_group as given the time). Rescheduling from the old schedule gives
    the new one's times bit for bit: it follows exact states only."""
    from byteps_espresso.strategy import timeline as tl

    rng = np.random.default_rng(len(model))
    ctx = _prepared(model, intra, gbps, compressor, lanes)
    ev = ctx.evaluator
    gpu, cpu = ctx.fronts(Device.GPU).index, ctx.fronts(Device.CPU).index
    choice = np.array([rng.choice(gpu[u]) for u in ev.size_idx], dtype=np.int64)
    now = ev.schedule(choice)
    for i in rng.choice(ctx.n_tensors, size=20, replace=False).tolist():
        u = ev.size_idx[i]
        cands = np.unique(np.concatenate([gpu[u], cpu[u]]))  # GPU work that differs or not
        for k in cands.tolist():
            args = (ev.gaps, ev.size_idx, ev.lane, choice, i, np.array([k]), ev._len, ev._hold,
                    ev._res, ev._dur, len(tl.RESOURCES), ev.forward_us, 1e-6, -1, np.inf, np.inf)
            got_k, got_t, got_s = tl._best_of(*args, True, now.trace)
            work = choice.copy()
            work[i] = k
            alone = ev.schedule(work)
            assert got_k == k
            assert abs(got_t - alone.iteration_us) <= tl.SHIFT_TOL
            assert abs(got_s - alone.sum_done_us) <= tl.SHIFT_TOL * ctx.n_tensors
            again = ev.reschedule(work, i, now)
            assert again[:2] == alone[:2]
            assert np.array_equal(again.ready_us, alone.ready_us)
            assert np.array_equal(again.done_us, alone.done_us)
        (got_k, got_t), (want_k, want_t) = (ev.best_of(choice, i, cands, current=now),
                                            ev.best_of(choice, i, cands, current=now[:2]))
        assert got_k == want_k
        assert abs(got_t - want_t) <= tl.SHIFT_TOL
    for u, group in ctx.size_groups.items():  # the group moves follow it the same way
        cands = np.unique(np.concatenate([gpu[u], cpu[u]]))
        (got_k, got_t), (want_k, want_t) = (ev.best_group(choice, group, cands, now),
                                            ev.best_group(choice, group, cands,
                                                          now.iteration_us))
        assert got_k == want_k
        assert abs(got_t - want_t) <= tl.SHIFT_TOL


def test_a_candidate_run_stops_at_the_traced_state_shifted_in_time():
    """A candidate that changes the GPU's work moves every later gradient; where the links
    then catch up, its state after some tensor is the traced one shifted by that delay, and
    its run reads the rest from the trace: fewer busy intervals than a full run leaves,
    with the full run's times to within SHIFT_TOL."""
    from byteps_espresso.strategy import timeline as tl

    ctx = _prepared("ugatit", "pcie", 25, "efsignsgd", None)
    ev = ctx.evaluator
    n = ctx.n_tensors
    gpu = ctx.fronts(Device.GPU).index
    choice = search.espresso(ctx)
    now = ev.schedule(choice)
    dummy, none = np.zeros((1, 1)), tl._no_trace()
    shifted = 0
    for i in range(0, n, 7):
        for k in gpu[ev.size_idx[i]].tolist():
            runs = []
            for follow in (True, False):
                starts, ends, count, acc = tl._schedule_state(
                    len(tl.RESOURCES), tl._capacity(choice, ev._len), ev.lane)
                if i > 0 and not tl._from_trace(starts, ends, count, acc, i - 1, now.trace):
                    break  # not traced there (TRACE_DEPTH)
                tl._advance(starts, ends, count, acc, ev.gaps, ev.size_idx, ev.lane, choice, i,
                            n, i, k, ev._len, ev._hold, ev._res, ev._dur, ev.forward_us, np.inf,
                            np.inf, 0.0, False, dummy, dummy, none, follow,
                            now.trace if follow else none)
                runs.append((int(count.sum()), acc[:3].copy()))
            if len(runs) < 2:
                continue
            (followed, got), (full, want) = runs
            assert np.all(np.abs(got - want) <= tl.SHIFT_TOL * np.array([1, 1, n]))
            if followed < full and got[0] != now.ready_us[-1]:
                shifted += 1  # stopped early, and not at the traced state itself
    assert shifted > 0


@pytest.mark.parametrize(("model", "intra", "gbps", "compressor", "lanes", "bubbles"), [
    ("vgg16", "pcie", 25, "efsignsgd", None, True),
    ("resnet101", "nvlink", 100, "dgc", None, False),
    ("ugatit", "pcie", 25, "randomk", 2, True),
    ("bert", "nvlink", 100, "randomk", 3, True),
])
def test_greedy_pass_equals_best_of_and_reschedule_per_tensor(model, intra, gbps, compressor,  # noqa: PLR0917
                                                             lanes, bubbles):
    """Evaluator.greedy_pass, one kernel call, takes the options that best_of and reschedule
    called per tensor from Python take, from a random start (so that many tensors move)."""
    rng = np.random.default_rng(len(model) + len(compressor))
    ctx = _prepared(model, intra, gbps, compressor, lanes)
    ev = ctx.evaluator
    fronts = ctx.fronts(Device.GPU)
    start = np.array([rng.choice(fronts.index[u]) for u in ev.size_idx], dtype=np.int64)
    order = rng.permutation(ctx.n_tensors)[: max(ctx.n_tensors // 2, 1)]
    plain = np.zeros(len(ev.options), dtype=np.bool_)
    plain[ctx.uncompressed_index()] = True

    def loop(stop: float) -> tuple[np.ndarray, tuple, int]:
        want = start.copy()
        now = ev.schedule(want)
        moves = 0
        for i in order.tolist():
            if now.iteration_us <= stop:
                break
            keep = int(want[i])
            if bubbles and i + 1 < ctx.n_tensors and plain[keep] and \
                    now.done_us[i] <= now.ready_us[i + 1]:
                continue
            k, _ = ev.best_of(want, i, fronts.index[ev.size_idx[i]], current=now)
            if k != keep:
                want[i] = k
                moves += 1
                now = ev.reschedule(want, i, now)
        return want, now[:2], moves

    full, end, moves = loop(-np.inf)
    # a stop halfway between the start and the pass's end cuts the pass short
    stop = (ev.schedule(start).iteration_us + end[0]) / 2
    cut, cut_end, cut_moves = loop(stop)
    assert 0 < cut_moves < moves  # the checks mean something
    for want, now, stop_us in ((full, end, -np.inf), (cut, cut_end, stop)):
        got = start.copy()
        changed = ev.greedy_pass(got, order, front=fronts.table, front_len=fronts.count,
                                 plain=plain, bubbles=bubbles, current=ev.schedule(got),
                                 stop_us=stop_us)
        assert changed
        assert np.array_equal(got, want)
        assert ev.schedule(got)[:2] == now


@pytest.mark.parametrize(("model", "intra", "gbps", "compressor"), [
    ("resnet50", "pcie", 25, "randomk"),
    ("vgg16", "nvlink", 100, "efsignsgd"),
    ("resnet101", "pcie", 25, "randomk"),  # the first start's passes reach the gap
    ("bert", "nvlink", 100, "randomk"),  # the bound above the floor: the embedding last
    ("gpt2", "nvlink", 100, "dgc"),
])
def test_the_search_stops_near_the_floor_or_at_the_lower_bound(model, intra, gbps, compressor,
                                                               monkeypatch):
    """Within the optimality gap of the floor, or at the lower bound no strategy beats (up
    to rounding), the search stops: within the gap of what the search finds without
    stopping (the same plan's time at the bound), with fewer simulations."""
    ctx = _prepared(model, intra, gbps, compressor, None)
    floor, bound = ctx.evaluator.floor_us, ctx.bound_us
    calls = ctx.evaluator.calls
    gapped = ctx.iteration_us(search.espresso(ctx))
    gapped_calls = ctx.evaluator.calls - calls
    monkeypatch.setattr(search, "OPTIMALITY_GAP", 0.0)
    calls = ctx.evaluator.calls
    exact = ctx.iteration_us(search.espresso(ctx))
    assert floor <= bound <= exact + 1e-6  # rounding: a plan at the bound
    assert exact <= gapped + 1e-6
    if bound > floor * (1 + 1e-3):  # only the bound stops: the optimum's time
        assert gapped == pytest.approx(exact, rel=1e-9)
    else:
        assert gapped <= floor * (1 + 1e-3)
    assert gapped_calls < (ctx.evaluator.calls - calls) / 1.5


@pytest.mark.parametrize("seed", range(8))
def test_the_stops_change_no_plan_of_random_instances(seed, monkeypatch):
    """Small instances rarely end near the floor; where they reach the lower bound the plan
    is optimal, so the search plans as fast a strategy as without stopping, and the same
    one where it does not stop."""
    inst = random_instance(seed)
    ctx = PlanContext(inst.workload, inst.cluster, COMPRESSOR, PARAMS,
                      constraints=inst.constraints)
    ctx.prepare()
    gapped = search.espresso(ctx)
    stopped = ctx.iteration_us(gapped) <= search.stop_us(ctx)
    monkeypatch.setattr(search, "OPTIMALITY_GAP", 0.0)
    exact = search.espresso(ctx)
    assert ctx.iteration_us(gapped) == pytest.approx(ctx.iteration_us(exact), rel=1e-9)
    assert stopped or np.array_equal(gapped, exact)


@pytest.mark.parametrize("seed", range(6))
def test_the_lower_bound_is_below_the_optimum(seed):
    """baselines.lower_bound_us never exceeds the best strategy (bruteforce, over the whole
    tree, mixed-device options included)."""
    inst = random_instance(seed)
    ctx = PlanContext(inst.workload, inst.cluster, COMPRESSOR, PARAMS,
                      constraints=inst.constraints)
    best = baselines.get("bruteforce").run(ctx).iteration_us
    bound = baselines.lower_bound_us(ctx)
    assert ctx.evaluator.floor_us <= bound <= best + 1e-6


@pytest.mark.parametrize(("model", "compressor", "servers", "constraints"), [
    ("lstm", "randomk", 0, []), ("bert", "efsignsgd", 8, []), ("ugatit", "dgc", 8, []),
    ("gpt2", "randomk", 8, ["no-cpu"]), ("vgg16", "dgc", 8, ["max-compressions=1"]),
])
def test_the_fastest_option_alone_is_the_least_total_of_the_tree(model, compressor, servers,
                                                                constraints):
    """Pricer.fastest_alone (the prefix tree of step settings built from one compiled Option
    per form, one kernel) equals the least time alone of every Option of the tree, each
    compiled and priced, at every size."""
    cluster = Cluster.preset(8, 8, "pcie", 25, servers=servers)
    params = {} if compressor == "efsignsgd" else {"ratio": 0.01}
    ctx = PlanContext(Workload.builtin(model), cluster, compressor, params,
                      constraints=Constraints.parse(constraints))
    forms = option_forms(ctx.cluster, ctx.constraints, ctx._tree)
    want = np.min([b.total.min(axis=0) for b in ctx.pricer.batch(ctx.options)], axis=0)
    got = ctx.pricer.fastest_alone(forms)
    np.testing.assert_allclose(got, want, rtol=1e-12)
    assert costs._step_trie(forms) is costs._step_trie(forms)  # built once per tree


def test_a_plan_can_reach_the_lower_bound():
    """GPT-2 on NVLink + 100 Gbit/s: the plan's iteration is the lower bound (its embedding,
    ready last, synchronized by the fastest Option at its size): optimal under the model.
    The bound is above the floor there, so this checks its per-tensor term."""
    ctx = _prepared("gpt2", "nvlink", 100, "randomk", None)
    bound = baselines.lower_bound_us(ctx)
    found = ctx.iteration_us(search.espresso(ctx))
    assert bound > ctx.evaluator.floor_us * 1.001
    assert found == pytest.approx(bound, rel=1e-9)


def test_a_plan_at_the_floor_stops_at_once():
    """ResNet101 on NVLink + 100 Gbit/s synchronizes every gradient inside the backward pass
    uncompressed: the uniform start is within the gap of the floor, and the search stops
    there instead of trading tie-breaks of the synchronized times, without pricing the lower
    bound it does not need."""
    ctx = _prepared("resnet101", "nvlink", 100, "dgc", None)
    start = search.uniform_best(ctx, ctx.uncompressed())
    assert ctx.iteration_us(start) <= search.stop_us(ctx, bound=False)
    before = ctx.evaluator.calls
    got = search.espresso(ctx)
    assert np.array_equal(got, start)
    # the uniform start's candidates and two simulations of it, nothing searched after
    assert ctx.evaluator.calls - before <= len(ctx.uncompressed()) + 2
    assert "bound_us" not in vars(ctx)  # functools.cached_property: never computed


def test_group_and_row_searches_with_nothing_to_run():
    """No candidates (no rows): the incumbent stands, even before anything is catalogued
    (the upper-bound baseline's uniform start under constraints that leave no option)."""
    from byteps_espresso.strategy.timeline import Evaluator

    ctx = PlanContext(Workload.builtin("lstm"), Cluster.preset(2, 2), "randomk", PARAMS)
    ctx.prepare()
    empty = Evaluator(ctx.workload, ctx.evaluator.pricer, [])
    n = ctx.n_tensors
    assert empty.best_group(np.zeros(n, dtype=np.int64), np.arange(n),
                            np.zeros(0, dtype=np.int64), 7.0) == (-1, 7.0)
    assert empty.best_row(np.zeros((0, n), dtype=np.int64), 5.0) == (-1, 5.0)


@pytest.mark.parametrize(("model", "intra", "gbps", "compressor", "lanes"), [
    ("vgg16", "pcie", 25, "efsignsgd", None),
    ("ugatit", "pcie", 25, "randomk", 2),
    ("bert", "pcie", 25, "dgc", None),
    ("resnet50", "nvlink", 100, "efsignsgd", 3),
])
def test_refine_devices_equals_best_of_and_reschedule_per_tensor(model, intra, gbps, compressor,
                                                                lanes):
    """Evaluator.refine_devices, mostly one kernel call, takes the options that the device
    refinement's loop of best_of and reschedule calls takes from Python (search.py before
    the kernel), makes the placement tables in the same order (so it catalogues the same
    options under the same indices) and counts the same evaluations; from a random start of
    GPU options (so that many tensors move), with and without a stop halfway, each run on
    an empty priced-model cache."""
    rng = np.random.default_rng(len(model) + len(compressor))
    clear_model_cache()
    start_ctx = _prepared(model, intra, gbps, compressor, lanes)
    fronts = start_ctx.fronts(Device.GPU)
    start = np.array([rng.choice(fronts.index[u]) for u in start_ctx.evaluator.size_idx],
                     dtype=np.int64)
    first = start_ctx.evaluator.schedule(start).iteration_us

    def cold() -> tuple[PlanContext, list, Callable[[int], np.ndarray]]:
        """A context on an empty cache, its CPU fronts made, and placements that records
        each table the first time it is made."""
        clear_model_cache()
        ctx = _prepared(model, intra, gbps, compressor, lanes)
        ctx.fronts(Device.CPU)
        made: list = []
        seen: set = set()

        def placements(k: int) -> np.ndarray:
            table = ctx.placements(k)
            if id(table) not in seen:
                seen.add(id(table))
                made.append(ctx.evaluator.options[k])
            return table

        return ctx, made, placements

    def loop(stop: float) -> tuple:
        ctx, made, placements = cold()
        ev = ctx.evaluator
        options = ev.options
        cpu_front = ctx.fronts(Device.CPU).index
        cpu_compressed = [f[[options[k].is_compressed for k in f.tolist()]] for f in cpu_front]
        want = start.copy()
        now = ev.schedule(want)
        calls, moves, second = ev.calls, 0, 0
        for i in ctx.visit_order:
            if now.iteration_us <= stop:
                break
            keep = int(want[i])
            u = ev.size_idx[i]
            if options[keep].is_compressed:
                table = placements(keep)
                placed = table[table >= 0]
                candidates = np.union1d(placed, cpu_compressed[u])
            elif i + 1 < ctx.n_tensors and now.done_us[i] <= now.ready_us[i + 1]:
                continue
            else:
                placed, candidates = np.zeros(0, dtype=np.int64), cpu_front[u]
            k, _ = ev.best_of(want, i, candidates, current=now)
            if k != keep:
                want[i] = k
                moves += 1
                now = ev.reschedule(want, i, now)
            if options[k].is_compressed and k not in placed:
                table = placements(k)
                k2, _ = ev.best_of(want, i, table[table >= 0], current=now)
                second += 1
                if k2 != k:
                    want[i] = k2
                    moves += 1
                    now = ev.reschedule(want, i, now)
        return want, now[:2], ev.calls - calls, made, moves, second

    full = loop(-np.inf)
    stop = (first + full[1][0]) / 2
    cut = loop(stop)
    # the checks mean something: tensors moved, some to options outside their placements
    assert full[4] > 0 and 0 < cut[4] < full[4] and full[5] > 0
    for (want, now_want, calls_want, made_want, *_), stop_us in ((full, -np.inf), (cut, stop)):
        ctx, made, placements = cold()
        for again in (False, True):
            # again: a context on the same model, whose tables are made (``made``): none
            # is asked for
            if again:
                ctx = _prepared(model, intra, gbps, compressor, lanes)
                made.clear()
            ev = ctx.evaluator
            got = start.copy()
            current = ev.schedule(got)
            before = ev.calls
            cpu_front = ctx.fronts(Device.CPU)
            ev.refine_devices(got, ctx.visit_order, placements=placements,
                              made=ctx.placements_made, cpu_front=cpu_front.table,
                              cpu_front_len=cpu_front.count, current=current, stop_us=stop_us)
            assert ev.calls - before == calls_want
            assert np.array_equal(got, want)
            assert ev.schedule(got)[:2] == now_want
            assert made == ([] if again else made_want)


@pytest.mark.parametrize(("model", "intra", "gbps", "compressor", "lanes"), [
    ("vgg16", "pcie", 25, "efsignsgd", None),
    ("ugatit", "pcie", 25, "randomk", 2),
    ("bert", "nvlink", 100, "dgc", 3),
])
def test_group_moves_equal_best_group_and_schedule_per_group(model, intra, gbps, compressor,
                                                             lanes):
    """Evaluator.group_moves, one kernel call, gives every size group the option that
    best_group and schedule called per group from Python give it (search.py before the
    kernel), and counts the same evaluations; from a random start, with and without a stop
    halfway."""
    rng = np.random.default_rng(len(model) * len(compressor))
    ctx = _prepared(model, intra, gbps, compressor, lanes)
    ev = ctx.evaluator
    fronts = ctx.fronts(Device.GPU)
    start = np.array([rng.choice(fronts.index[u]) for u in ev.size_idx], dtype=np.int64)
    groups = list(ctx.size_groups.items())

    def loop(stop: float) -> tuple[np.ndarray, float, int, int]:
        want = start.copy()
        calls = ev.calls
        now = ev.schedule(want)
        moves = 0
        for u, members in groups:
            if now.iteration_us <= stop:
                break
            k, _ = ev.best_group(want, members, fronts.index[u], now)
            if k >= 0:
                want[members] = k
                moves += 1
                now = ev.schedule(want)
        return want, now.iteration_us, ev.calls - calls, moves

    full = loop(-np.inf)
    stop = (ev.schedule(start).iteration_us + full[1]) / 2
    cut = loop(stop)
    assert 0 < cut[3] < full[3]  # the checks mean something
    for (want, t_want, calls_want, _), stop_us in ((full, -np.inf), (cut, stop)):
        got = start.copy()
        calls = ev.calls
        t = ev.group_moves(got, [m for _, m in groups], front=fronts.table,
                           front_len=fronts.count, stop_us=stop_us)
        assert np.array_equal(got, want)
        assert t == t_want
        assert ev.calls - calls == calls_want
