"""The start-up profile: ready times to a Workload (one rank's, or the slowest rank's)."""

import numpy as np
import pytest
from byteps_espresso.worker.profiler import (
    ready_offsets,
    workload_from_offsets,
    workload_from_ready_times,
)

NUMEL = {"a": 10, "b": 20, "c": 30}


def test_ready_offsets_are_microseconds_since_the_iteration_start():
    ready = [{"a": 1.001, "b": 1.003}, {"a": 2.002, "b": 2.004, "c": 2.005}]
    off = ready_offsets(ready, [1.0, 2.0, 3.0], list(NUMEL))
    np.testing.assert_allclose(off[1], [2000.0, 4000.0, 5000.0])
    np.testing.assert_allclose(off[0][:2], [1000.0, 3000.0])
    assert np.isnan(off[0][2])  # c unseen in iteration 0


def test_ready_offsets_have_one_row_per_profiled_iteration():
    # A rank whose hooks saw nothing in the last iteration still reports it (as NaN), so the
    # rows line up with the other ranks' when they are gathered.
    off = ready_offsets([{"a": 1.001}], [1.0, 2.0, 3.0], ["a"])
    assert off.shape == (2, 1) and np.isnan(off[1, 0])


def test_workload_medians_skip_the_warm_up_and_iterations_missing_a_gradient():
    # columns a, b, c; iteration 0 is the warm-up, iteration 2 misses c
    off = np.array([[900.0, 9000.0, 9100.0],
                    [1000.0, 1300.0, 1600.0],
                    [1000.0, 1200.0, np.nan],
                    [1100.0, 1300.0, 1800.0]])
    wl = workload_from_offsets(off, list(NUMEL), NUMEL)
    assert [t.name for t in wl.tensors] == ["a", "b", "c"]
    assert wl.forward_us == pytest.approx(1050.0)  # median of 1000 and 1100
    assert [t.ready_gap_us for t in wl.tensors] == pytest.approx([0.0, 250.0, 400.0])


def test_the_slowest_rank_sets_each_gradient_s_readiness():
    # Rank 1 lags by 500 us on b: a collective on b completes only then.
    rank0 = np.array([[1000.0, 1200.0, 1300.0]] * 2)
    rank1 = np.array([[1000.0, 1700.0, 1750.0]] * 2)
    wl = workload_from_offsets(np.maximum(rank0, rank1), list(NUMEL), NUMEL)
    assert [t.ready_gap_us for t in wl.tensors] == pytest.approx([0.0, 700.0, 50.0])


def test_backward_order_comes_from_the_ready_times_and_gaps_never_go_negative():
    ready = [{"c": 1.001, "b": 1.002, "a": 1.004}] * 2
    wl = workload_from_ready_times(ready, [1.0, 1.0, 1.0], NUMEL)
    assert [t.name for t in wl.tensors] == ["c", "b", "a"]
    assert [t.ready_gap_us for t in wl.tensors] == pytest.approx([0.0, 1000.0, 2000.0])


def test_no_complete_iteration_is_a_clear_error():
    with pytest.raises(ValueError, match="ESPRESSO_PROFILE_STEPS"):
        workload_from_offsets(np.full((2, 3), np.nan), list(NUMEL), NUMEL)


def test_a_written_profile_reads_back(tmp_path):
    from byteps_espresso.worker.profiler import _write_profile, read_profile

    from byteps_espresso.strategy import Cluster, CompressorCosts, Workload, plan

    workload = Workload.builtin("lstm")
    cluster = Cluster.preset(2, 2, "pcie", 10.0, lanes=2)
    costs = CompressorCosts.default()
    strategy = plan(workload, cluster, "randomk", {"ratio": 0.01}, costs=costs)
    _write_profile(tmp_path, workload, cluster, costs, strategy)
    got = read_profile(tmp_path)
    assert got[0].to_dict() == workload.to_dict()
    assert got[1] == cluster
    assert got[2].to_dict() == costs.to_dict()


# ---- latency in training: the profiled steps' own times ------------------------------------
_NUMELS = [512, 2_000, 32_768, 256_000]


def _probed(servers: int = 1):
    from byteps_espresso.strategy import Cluster

    return Cluster(machines=2, gpus_per_machine=2, intra_gbps=8.0, intra_latency_us=500.0,
                   inter_gbps=6.0, inter_latency_us=700.0, servers=servers,
                   server_gbps=20.0 if servers else 0.0,
                   server_latency_us=400.0 if servers else None)


def _step_prices(cluster, option):
    from byteps_espresso.strategy import CompressorCosts
    from byteps_espresso.strategy.costs import CompressedSizes, Pricer

    tasks = Pricer(cluster, "randomk", CompressedSizes("randomk", {"ratio": 0.01}),
                   CompressorCosts.default(), _NUMELS).tasks(option)
    return tasks.per_step(len(option.steps))


def _fit(cluster, option, measured):
    from byteps_espresso.worker.profiler import in_training_latency

    from byteps_espresso.strategy import CompressorCosts

    return in_training_latency(cluster, option, _NUMELS, measured, compressor="randomk",
                               params={"ratio": 0.01}, costs=CompressorCosts.default())


@pytest.mark.parametrize(("text", "servers", "truth", "expected"), [
    ("ReduceScatter(intra) -> PushPull(inter) -> Allgather(intra)", 1,
     {"exchange_latency": 3.0, "server_latency_us": 800.0}, {"exchange": 3.0, "ps": 2.0}),
    ("ReduceScatter(intra) -> Allreduce(inter) -> Allgather(intra)", 0,
     {"exchange_latency": 2.5, "inter_exchange_latency": 4.0},
     {"exchange": 2.5, "inter_exchange": 4.0}),
])
def test_in_training_latency_recovers_the_latencies_the_steps_took(text, servers, truth,
                                                                   expected):
    from dataclasses import replace

    from byteps_espresso.strategy import Option

    option = Option.parse(text)
    probed = _probed(servers)
    measured = _step_prices(replace(probed, **truth), option)
    fitted, factors = _fit(probed, option, measured)
    assert factors == pytest.approx(expected)
    np.testing.assert_allclose(_step_prices(fitted, option), measured, rtol=1e-9)
    # per-hop latencies and bandwidths stay the probes'; only the factors moved
    assert (fitted.intra_latency_us, fitted.inter_latency_us, fitted.inter_gbps) == (
        probed.intra_latency_us, probed.inter_latency_us, probed.inter_gbps)


def test_the_intra_exchanges_factor_leaves_the_inter_link_as_probed():
    """BytePS' path exchanges only inside the machines: their factor does not reach an
    exchange over the inter link, which no profiled step measured (applied to it, the intra
    factor priced an fp16 ``AllreduceC(flat)`` plan at 2.7x what it ran at)."""
    from dataclasses import replace

    from byteps_espresso.strategy import Option

    option = Option.parse("ReduceScatter(intra) -> PushPull(inter) -> Allgather(intra)")
    probed = _probed()
    fitted, factors = _fit(probed, option, _step_prices(replace(probed, exchange_latency=4.0),
                                                        option))
    assert factors == pytest.approx({"exchange": 4.0, "ps": 1.0})
    assert fitted.inter_exchange_latency == 1.0
    for text in ("Allreduce(flat)", "Comp(gpu) -> AllgatherC(inter) -> Decomp(gpu)"):
        np.testing.assert_array_equal(_step_prices(fitted, Option.parse(text)),
                                      _step_prices(probed, Option.parse(text)))
    intra = Option.parse("Allreduce(intra)")
    assert (_step_prices(fitted, intra) > _step_prices(probed, intra)).all()


def test_on_one_host_both_links_exchanges_share_their_factor():
    """Every machine on one host: the flat path's exchanges price the loopback both links
    are, so the intra exchanges take the factor they were fitted to as well."""
    from dataclasses import replace

    from byteps_espresso.strategy import Option

    option = Option.parse("Allreduce(flat)")
    probed = replace(_probed(0), shared_host=True)
    fitted, factors = _fit(probed, option, _step_prices(
        replace(probed, inter_exchange_latency=3.0), option))
    assert factors == pytest.approx({"exchange": 3.0, "inter_exchange": 3.0})
    assert fitted.exchange_latency == pytest.approx(3.0)
    assert fitted.inter_exchange_latency == pytest.approx(3.0)


def test_in_training_latency_ignores_unmeasured_steps_and_keeps_the_probes_as_a_floor():
    from dataclasses import replace

    from byteps_espresso.strategy import Option

    option = Option.parse("ReduceScatter(intra) -> PushPull(inter) -> Allgather(intra)")
    probed = _probed()
    nothing = np.full((len(_NUMELS), 3), np.nan)
    fitted, factors = _fit(probed, option, nothing)
    assert factors == {} and fitted.exchange_latency == 1.0
    assert fitted.server_latency_us == probed.server_latency_us
    faster = np.zeros((len(_NUMELS), 3))  # steps faster than their bandwidth part alone
    fitted, factors = _fit(probed, option, faster)
    # the paused probes' latency is the least a step pays in training
    assert factors == {"exchange": 1.0, "ps": 1.0} and fitted.exchange_latency == 1.0
    assert fitted.server_latency_us == probed.server_latency_us
    half = _step_prices(replace(probed, exchange_latency=0.5,
                                server_latency_us=probed.server_latency_us / 2), option)
    assert _fit(probed, option, half)[1] == {"exchange": 1.0, "ps": 1.0}


def test_in_training_latency_follows_the_latency_bound_steps():
    """The LSTM's buckets at 1 Gbit/s: a small bucket whose steps are mostly latency, two
    large ones mostly bandwidth. In training every step pays 5x the probes' latency and the
    large steps' bytes move 30% faster than the probes read: the fit still finds the 5. The
    median of each step's (measured - rest) / latency, which it replaced, read the PS path's
    latency as gone (the large push/pulls are two of three), as it did in training runs."""
    from dataclasses import replace

    from byteps_espresso.worker.profiler import in_training_latency

    from byteps_espresso.strategy import Cluster, CompressorCosts, Option
    from byteps_espresso.strategy.costs import CompressedSizes, Pricer

    numels = [3_024, 256_000, 226_304]
    option = Option.parse("ReduceScatter(intra) -> PushPull(inter) -> Allgather(intra)")
    probed = Cluster(machines=2, gpus_per_machine=2, intra_gbps=4.0, intra_latency_us=500.0,
                     inter_gbps=1.0, inter_latency_us=700.0, servers=1, server_gbps=2.0,
                     server_latency_us=450.0)

    def prices(cluster):
        return Pricer(cluster, "randomk", CompressedSizes("randomk", {"ratio": 0.01}),
                      CompressorCosts.default(), numels).tasks(option).per_step(3)

    slow = prices(replace(probed, exchange_latency=5.0, server_latency_us=5 * 450.0))
    latency = slow - prices(replace(probed, exchange_latency=0.0, server_latency_us=0.0))
    measured = slow.copy()
    measured[1:] -= 0.3 * (slow[1:] - latency[1:])  # the large steps' bytes 30% faster
    fitted, factors = in_training_latency(probed, option, numels, measured,
                                          compressor="randomk", params={"ratio": 0.01},
                                          costs=CompressorCosts.default())
    assert factors == pytest.approx({"exchange": 5.0, "ps": 5.0}, rel=0.05)
    assert fitted.server_latency_us == pytest.approx(5 * 450.0, rel=0.05)
    ratios = (measured - (slow - latency)) / (latency / 5)
    assert np.median(ratios[:, 1]) < 1  # the push/pulls' median ratio


@pytest.mark.parametrize("sizes", [(256, 1 << 20), (256, 1 << 13), (1 << 10, 1 << 16)])
def test_probe_times_at_any_two_sizes_invert_to_the_link_that_made_them(sizes):
    from byteps_espresso.worker.profiler import _cluster
    from byteps_espresso.worker.topology import Topology

    topo = Topology(2, 2, 0, 0)  # 2 machines x 2 workers: groups of 2 on both scopes
    truth = {"intra": (30.0, 40.0), "inter": (120.0, 1.0)}  # (latency us, Gbit/s)
    server_lat, per_worker_gbps = 200.0, 0.5
    times = {}
    for n in sizes:
        for path, (a, gbps) in truth.items():  # ring all-reduce of 2: 2 hops, n/2 x 2 each
            times[(path, n)] = 2 * a + n * 32 / (gbps * 1e3)
        times[("ps", n)] = 2 * server_lat + 2 * n * 32 / (per_worker_gbps * 1e3)
    c = _cluster(topo, 1, 2, times, 10.0, lanes=2)
    assert (c.intra_latency_us, c.intra_gbps) == pytest.approx(truth["intra"])
    assert (c.inter_latency_us, c.inter_gbps) == pytest.approx(truth["inter"])
    assert c.server_latency_us == pytest.approx(server_lat)
    assert c.server_gbps == pytest.approx(per_worker_gbps * 4)  # 4 workers through 1 server


def test_a_large_probe_no_slower_than_the_small_one_gives_a_bandwidth_bound():
    from byteps_espresso.worker.profiler import _invert

    # 1 MiB in 1.51 ms after 2.72 ms for 256 floats (a loopback run): at least 5.6 Gbit/s
    latency, gbps = _invert(2720.0, 1510.0, 2, 1.0, n_small=256, n_large=1 << 18)
    assert gbps == pytest.approx((1 << 18) * 32 / 1510.0 / 1e3)
    assert latency == pytest.approx((2720.0 - 256 * 32 / (gbps * 1e3)) / 2)


def test_one_inter_group_per_machine_probes_and_only_its_ranks_build_the_cluster():
    """Of the inter groups that share each machine's NIC only local rank 0's probes, so it
    measures the whole NIC (the cost model divides it among the groups); every machine's
    intra group probes. A rank without inter probes cannot build the cluster."""
    from byteps_espresso.worker.profiler import _cluster, _probes
    from byteps_espresso.worker.topology import Topology

    from byteps_espresso.strategy.options import Scope

    probing = {(m, r): (_probes(Topology(2, 3, m, r), Scope.INTRA),
                        _probes(Topology(2, 3, m, r), Scope.INTER))
               for m in range(2) for r in range(3)}
    assert probing == {(m, r): (True, r == 0) for m in range(2) for r in range(3)}
    assert not _probes(Topology(1, 4, 0, 0), Scope.INTER)  # one machine: no inter link
    assert not _probes(Topology(4, 1, 2, 0), Scope.INTRA)  # one worker per machine
    intra_only = {("intra", 256): 10.0, ("intra", 1 << 18): 100.0}
    with pytest.raises(ValueError, match="no inter link probes on this rank"):
        _cluster(Topology(2, 2, 0, 1), 0, 2, intra_only, 10.0, lanes=2)


@pytest.mark.parametrize("lanes", [1, 2, 3])
def test_probing_rounds_come_first_and_the_lanes_take_turns(lanes):
    from byteps_espresso.worker.profiler import _PROBE_ROUNDS, probe_lanes

    rounds = max(_PROBE_ROUNDS, lanes)
    timed = [probe_lanes(it, lanes) for it in range(rounds)]
    assert all(len(t) == 1 for t in timed)  # one lane at a time: the links are not split
    assert {t[0] for t in timed} == set(range(lanes))  # every lane is timed
    assert [probe_lanes(it, lanes) for it in range(rounds, rounds + 3)] == [()] * 3


def test_the_compressor_budget_times_the_widest_span_first_then_stops():
    from byteps_espresso.worker.profiler import _within_budget

    sizes = [4096, 64, 1 << 20, 512, 64, 1 << 16]
    assert list(_within_budget(sizes, None)) == [64, 1 << 20, 512, 4096, 1 << 16]
    # Over budget from the start: still the two the fit needs, the smallest and the largest.
    assert list(_within_budget(sizes, 0.0)) == [64, 1 << 20]
    assert list(_within_budget([7], 0.0)) == [7]


def _ps_times(option_text, sizes, latency_us, per_worker_gbps):
    """Step times (buckets x steps) of an fp32 Option whose PushPull moves each worker's
    shard at ``per_worker_gbps`` after ``latency_us`` each way; NaN elsewhere."""
    from byteps_espresso.strategy.options import Kind, Option

    option = Option.parse(option_text)
    shard = 2 if option.steps[0].kind is Kind.REDUCE_SCATTER else 1  # local size 2
    out = np.full((len(sizes), len(option.steps)), np.nan)
    col = next(i for i, st in enumerate(option.steps) if st.kind is Kind.PUSH_PULL)
    for j, n in enumerate(sizes):
        out[j, col] = 2 * latency_us + 2 * np.ceil(n / shard) * 32 / (per_worker_gbps * 1e3)
    return option, out


@pytest.mark.parametrize("option_text", ["ReduceScatter(intra) -> PushPull(inter) -> "
                                         "Allgather(intra)", "PushPull(flat)"])
def test_the_profiled_push_pulls_invert_to_the_server_link_that_made_them(option_text):
    """The fp32 path's own push/pulls give the PS bandwidth, each at the extent a worker moves
    (its ReduceScatter shard, or the whole bucket on the flat path), and the small probe
    the latency: the inversion finds the link that made both."""
    from byteps_espresso.worker.profiler import (
        _PROBE_SMALL,
        _cluster,
        ps_from_traffic,
        traffic_times,
    )
    from byteps_espresso.worker.topology import Topology

    topo = Topology(2, 2, 0, 0)
    sizes = [3_024, 258_000, 227_328]
    latency, gbps = 300.0, 0.8
    option, steps_us = _ps_times(option_text, sizes, latency, gbps)
    assert ps_from_traffic(option, sizes, topo.size)
    ps = traffic_times(option, sizes, steps_us, topo.size)
    shard = 2 if "ReduceScatter" in option_text else 1
    assert sorted(n for _, n in ps) == sorted(-(-n // shard) for n in sizes)
    probe = 2 * latency + 2 * _PROBE_SMALL * 32 / (gbps * 1e3)
    times = {("intra", 256): 10.0, ("intra", 1 << 18): 100.0, ("inter", 256): 10.0,
             ("inter", 1 << 18): 1000.0, ("ps", _PROBE_SMALL): probe} | ps
    c = _cluster(topo, 1, 2, times, 10.0, lanes=2)
    assert c.server_latency_us == pytest.approx(latency)
    assert c.server_gbps == pytest.approx(gbps * 4)  # 4 workers through 1 server


def test_push_pulls_too_small_or_absent_leave_the_ps_path_to_the_probes():
    from byteps_espresso.worker.profiler import _TRAFFIC_MIN, ps_from_traffic, traffic_times
    from byteps_espresso.worker.topology import Topology

    from byteps_espresso.strategy.options import Option

    size = Topology(2, 2, 0, 0).size
    hierarchical = Option.parse("ReduceScatter(intra) -> PushPull(inter) -> Allgather(intra)")
    # A worker moves half of a bucket after the ReduceScatter: twice the minimum is needed.
    assert not ps_from_traffic(hierarchical, [2 * _TRAFFIC_MIN - 2], size)
    assert ps_from_traffic(hierarchical, [2 * _TRAFFIC_MIN], size)
    assert ps_from_traffic(Option.parse("PushPull(flat)"), [_TRAFFIC_MIN], size)
    collectives = Option.parse("ReduceScatter(intra) -> Allreduce(inter) -> Allgather(intra)")
    assert not ps_from_traffic(collectives, [1 << 24], size)
    assert traffic_times(hierarchical, [1 << 20], None, size) == {}
    unseen = np.full((1, 3), np.nan)  # no push/pull was timed
    assert traffic_times(hierarchical, [1 << 20], unseen, size) == {}


def test_fit_latency_fits_each_kind_over_every_run():
    """Runs of two Options (the kept strategy's buckets): every step took its price on a
    cluster with 2x the exchanges' latency, 5x the rooted collectives' and 3x the PS path's;
    one factor per kind is fitted over all of them, and the steps' prices on the fitted
    cluster are what they took."""
    from dataclasses import replace

    from byteps_espresso.worker.profiler import fit_latency

    from byteps_espresso.strategy import CompressorCosts, Option

    probed = _probed()
    truth = replace(probed, exchange_latency=2.0, inter_exchange_latency=4.0,
                    rooted_latency=5.0, server_latency_us=3 * probed.server_latency_us)
    options = [Option.parse("Reduce(intra) -> PushPull(inter) -> Broadcast(intra)"),
               Option.parse("ReduceScatter(intra) -> Allreduce(inter) -> Allgather(intra)")]
    runs = [(o, n, row) for o in options for n, row in zip(_NUMELS, _step_prices(truth, o),
                                                           strict=True)]
    fitted, factors = fit_latency(probed, runs, compressor="randomk", params={"ratio": 0.01},
                                  costs=CompressorCosts.default(),
                                  kinds=("exchange", "inter_exchange", "rooted", "ps"))
    assert factors == pytest.approx({"exchange": 2.0, "inter_exchange": 4.0, "rooted": 5.0,
                                     "ps": 3.0})
    for o in options:
        np.testing.assert_allclose(_step_prices(fitted, o), _step_prices(truth, o), rtol=1e-9)


def _costs_times(costs, factor: dict[str, float]):
    """``costs`` with every compressor's lines on each device of ``factor`` scaled by it."""
    from dataclasses import replace

    from byteps_espresso.strategy.compressor_costs import Linear

    return replace(costs, models={
        name: {device: {op: Linear(m.a_us * factor.get(device, 1.0),
                                   m.b_us * factor.get(device, 1.0))
                        for op, m in lines.items()} for device, lines in per_device.items()}
        for name, per_device in costs.models.items()})


def test_fit_compute_scales_each_device_s_lines_to_what_its_steps_took():
    """Runs whose compression on the training device took 3x its price and on the host 1.5x
    (the kernels share their cores in training): one factor per device, and every step's
    price on the fitted profile is what it took; communication steps do not move them."""
    from byteps_espresso.worker.profiler import fit_compute, step_prices

    from byteps_espresso.strategy import CompressorCosts, Option
    from byteps_espresso.strategy.costs import CompressedSizes

    probed, costs = _probed(), CompressorCosts.default()
    truth = _costs_times(costs, {"gpu": 3.0, "cpu": 1.5})
    options = [Option.parse("Comp(gpu) -> AllgatherC(flat) -> Decomp(gpu)"),
               Option.parse("ReduceScatter(intra) -> Comp(cpu) -> AllgatherC(inter) "
                            "-> Decomp(cpu) -> Allgather(intra)")]
    sizes = CompressedSizes("randomk", {"ratio": 0.01})

    def prices(c, o):  # type: ignore[no-untyped-def]
        return step_prices(probed, o, _NUMELS, compressor="randomk", sizes=sizes, costs=c)

    runs = [(o, n, row) for o in options for n, row in zip(_NUMELS, prices(truth, o),
                                                           strict=True)]
    fitted, factors = fit_compute(probed, runs, compressor="randomk",
                                  params={"ratio": 0.01}, costs=costs)
    # the host's steps also copy the tensor to and from the device: that part does not scale
    assert factors == pytest.approx({"gpu": 3.0, "cpu": 1.5})
    for o in options:
        np.testing.assert_allclose(prices(fitted, o), prices(truth, o), rtol=1e-9)
    assert fitted.dense_sum == costs.dense_sum


def test_fit_compute_gives_a_device_no_step_ran_the_largest_factor_and_never_speeds_up():
    """Only the training device's kernels were timed, at 2x: the host's lines scale 2x too
    (a re-plan must not flee to a device no step checked); steps faster than their price
    leave the profile as it was; no compute step at all, nothing fitted."""
    from byteps_espresso.worker.profiler import fit_compute, step_prices

    from byteps_espresso.strategy import CompressorCosts, Option
    from byteps_espresso.strategy.costs import CompressedSizes

    probed, costs = _probed(), CompressorCosts.default()
    option = Option.parse("Comp(gpu) -> AllgatherC(flat) -> Decomp(gpu)")
    sizes = CompressedSizes("randomk", {"ratio": 0.01})
    kwargs = {"compressor": "randomk", "params": {"ratio": 0.01}, "costs": costs}
    for factor, want in ((2.0, 2.0), (0.5, 1.0)):
        took = step_prices(probed, option, _NUMELS, compressor="randomk", sizes=sizes,
                           costs=_costs_times(costs, {"gpu": factor}))
        fitted, factors = fit_compute(probed, list(zip([option] * len(_NUMELS), _NUMELS, took,
                                                       strict=True)), **kwargs)
        assert factors == pytest.approx({"gpu": want})
        assert fitted.compress_us("randomk", "cpu", 10_000) == pytest.approx(
            want * costs.compress_us("randomk", "cpu", 10_000))
    plain = Option.parse("Allreduce(flat)")
    took = step_prices(probed, plain, _NUMELS, compressor="randomk", sizes=sizes, costs=costs)
    assert fit_compute(probed, [(plain, _NUMELS[0], took[0])], **kwargs) == (costs, {})


def test_fit_latency_gives_the_kinds_no_step_ran_the_largest_factor():
    """With ``unmeasured`` a plan priced on the refitted cluster cannot favour a kind no
    step checked: the exchanges, which the BytePS path does not run, take the larger of the
    rooted (4x) and PS (1.5x) factors."""
    from dataclasses import replace

    from byteps_espresso.worker.profiler import fit_latency

    from byteps_espresso.strategy import CompressorCosts, Option

    probed = _probed()
    truth = replace(probed, rooted_latency=4.0, server_latency_us=1.5 * probed.server_latency_us)
    option = Option.parse("Reduce(intra) -> PushPull(inter) -> Broadcast(intra)")
    runs = [(option, n, row) for n, row in zip(_NUMELS, _step_prices(truth, option), strict=True)]
    kwargs = {"compressor": "randomk", "params": {"ratio": 0.01},
              "costs": CompressorCosts.default(), "kinds": ("exchange", "rooted", "ps")}
    fitted, factors = fit_latency(probed, runs, unmeasured=True, **kwargs)
    assert factors == pytest.approx({"rooted": 4.0, "ps": 1.5})
    assert fitted.exchange_latency == pytest.approx(4.0)
    assert fit_latency(probed, runs, **kwargs)[0].exchange_latency == 1.0


def test_a_plan_on_the_fp32_path_keeps_an_fp32_finalist_on_the_profiled_buckets():
    """plan_finalists drops fp32 where the plan is the fp32 path on the planned buckets (its
    duplicate); on the profiled iterations' buckets it is another strategy, so the finalists
    keep it there, for the trials and the check's fall-back."""
    from dataclasses import replace
    from types import SimpleNamespace

    from byteps_espresso.worker.profiler import EspressoSpec

    from byteps_espresso.strategy import Cluster, CompressorCosts, TensorProfile, Workload
    from byteps_espresso.strategy.baselines import fp32_option
    from byteps_espresso.strategy.buckets import CANDIDATE_CAPS, Bucket, singletons
    from byteps_espresso.strategy.planner import plan_bucketed

    workload = Workload(tuple(TensorProfile(f"t{i}", 100_000, 50.0) for i in range(6)),
                        forward_us=1000.0)
    cluster = Cluster.preset(2, 2, "pcie", 10.0, servers=1, shared_host=True)
    costs = CompressorCosts.default()
    planned, _, finalists = plan_bucketed(workload, cluster, "randomk", {"ratio": 0.01},
                                          within=float("inf"), costs=costs)
    # the profiled iterations' buckets: others than the plan's
    one = (Bucket.of(workload.names),)
    profiled = one if planned != one else singletons(workload.names)
    path = fp32_option(2, 2, 1, shared_host=True)
    on_path = replace(finalists[0], options=dict.fromkeys(finalists[0].options, path))
    others = [s for s in finalists[1:] if s.algorithm != "fp32"]
    spec = EspressoSpec("randomk", {"ratio": 0.01})
    got = spec._laid_out([on_path, *others], planned, profile=SimpleNamespace(layout=profiled),
                         workload=workload, cluster=cluster, costs=costs,
                         apart=frozenset(), caps=CANDIDATE_CAPS)
    fp32 = [s for s in got if s.algorithm == "fp32"]
    assert len(fp32) == 1 and fp32[0].layout == profiled
    assert set(fp32[0].options.values()) == {path}
    # with an fp32 finalist already there, none is added
    again = spec._laid_out(got, planned, profile=SimpleNamespace(layout=profiled),
                           workload=workload, cluster=cluster, costs=costs, apart=frozenset(),
                           caps=CANDIDATE_CAPS)
    assert [s.algorithm for s in again].count("fp32") == 1


def test_the_hook_plan_joins_the_finalists_for_fp16_only_with_excluded_gradients_apart():
    """For a compressor whose payloads sum the finalists end with DDP's fp16-hook plan on
    the profiled buckets (allreduce-c, the check's first fall-back); with an exclude= list
    its buckets are DDP's caps over each kind alone, the excluded ones' uncompressed. Other
    compressors get none (their all-gather plan measured slower, BENCHMARKS.md)."""
    from byteps_espresso.worker.optimizer import HOOK_PLAN
    from byteps_espresso.worker.profiler import EspressoSpec

    from byteps_espresso.strategy import Cluster, CompressorCosts, TensorProfile, Workload
    from byteps_espresso.strategy.baselines import fp32_option
    from byteps_espresso.strategy.buckets import CANDIDATE_CAPS, Bucket

    sizes = [300_000, 40, 200_000, 40, 100_000]  # backward order; the 40s are "biases"
    workload = Workload(tuple(TensorProfile(f"t{i}", n, 50.0) for i, n in enumerate(sizes)),
                        forward_us=1000.0)
    cluster = Cluster.preset(2, 2, "pcie", 1.0, servers=1)
    costs = CompressorCosts.default()
    profiled = (Bucket.of(["t0", "t1"]), Bucket.of(["t2", "t3", "t4"]))  # mixes both kinds
    summed = "Comp(gpu) -> AllreduceC(flat) -> Decomp(gpu)"

    def hooked(compressor, apart):
        spec = EspressoSpec(compressor)
        return spec._hook_plan([], workload, cluster, costs, apart=apart, layout=profiled,
                               caps=CANDIDATE_CAPS)

    (alone,) = hooked("fp16", frozenset())
    assert alone.algorithm == HOOK_PLAN and alone.layout == profiled
    assert {str(o) for o in alone.options.values()} == {summed}
    apart = frozenset({"t1", "t3"})
    (kept,) = hooked("fp16", apart)
    # DDP's 1 MiB first bucket holds t0 (1.2 MB) alone
    assert {b.tensors for b in kept.layout} == {("t0",), ("t2", "t4"), ("t1", "t3")}
    dense = str(fp32_option(2, 2, 1))
    assert {n: str(o) for n, o in kept.options.items()} == {"t0": summed, "t2+1": summed,
                                                            "t1+1": dense}
    assert hooked("efsignsgd", frozenset()) == []
    # a finalist with the same options and buckets already: none added
    spec = EspressoSpec("fp16")
    assert spec._hook_plan([alone], workload, cluster, costs, apart=frozenset(),
                           layout=profiled, caps=CANDIDATE_CAPS) == []
