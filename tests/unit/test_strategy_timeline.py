"""Hand-computed timelines and cost formulas.

The cluster has 2 machines x 1 GPU and 8 Gbit/s links (1000 bytes/us) without latency, so a
flat Allreduce of n float32 elements takes 2 (p-1)/p * 4n / 1000 = 4n/1000 us (p = 2).
"""

import numpy as np
import pytest

from byteps_espresso.strategy import Cluster, CompressorCosts, Option, TensorProfile, Workload
from byteps_espresso.strategy.compressor_costs import Linear
from byteps_espresso.strategy.costs import INTER, CompressedSizes, Pricer
from byteps_espresso.strategy.timeline import Evaluator

CLUSTER = Cluster(machines=2, gpus_per_machine=1, intra_gbps=8.0, intra_latency_us=0.0,
                  inter_gbps=8.0, inter_latency_us=0.0, servers=0, cpu_threads=1,
                  h2d_gbps=8000.0)
COSTS = CompressorCosts({"fp16": {
    "gpu": {"compress": Linear(2.0, 0.0), "decompress": Linear(1.0, 0.0)},
    "cpu": {"compress": Linear(3.0, 0.0), "decompress": Linear(1.0, 0.0)},
}})
FP16 = CompressedSizes("fp16")  # 2 bytes per element, from the kernels registry
DENSE = Option.parse("Allreduce(flat)")
GPU_COMP = Option.parse("Comp(gpu) -> AllgatherC(flat) -> Decomp(gpu)")
CPU_COMP = Option.parse("Comp(cpu) -> AllgatherC(flat) -> Decomp(cpu)")
F = 5.0  # forward time, us


def timeline(tensors, options, cluster=CLUSTER):
    wl = Workload(tuple(TensorProfile(f"t{i}", n, g) for i, (n, g) in enumerate(tensors)), F)
    pricer = Pricer(cluster, "fp16", FP16, COSTS, sorted({n for n, _ in tensors}))
    ev = Evaluator(wl, pricer, list(dict.fromkeys(options)))
    choice = np.array(ev.add(options))
    tl = ev.timeline(choice)
    assert ev.iteration_us(choice) == pytest.approx(tl.iteration_us)
    return tl


def spans(tl, tensor):
    return [(t.resource, round(t.start_us, 6), round(t.end_us, 6))
            for t in tl.tasks if t.tensor == tensor]


def test_one_tensor():
    tl = timeline([(1000, 10.0)], [DENSE])
    assert spans(tl, 0) == [("inter", 10.0, 14.0)]
    assert tl.iteration_us == pytest.approx(F + 14.0)


def test_two_tensors_overlap_with_backward_and_queue_on_the_link():
    tl = timeline([(1000, 10.0), (1000, 1.0)], [DENSE, DENSE])
    assert spans(tl, 0) == [("inter", 10.0, 14.0)]
    assert tl.ready_us[1] == pytest.approx(11.0)  # ready while tensor 0 is on the link
    assert spans(tl, 1) == [("inter", 14.0, 18.0)]
    assert tl.iteration_us == pytest.approx(F + 18.0)


def test_bubble_on_the_link():
    tl = timeline([(1000, 10.0), (1000, 20.0)], [DENSE, DENSE])
    assert spans(tl, 0) == [("inter", 10.0, 14.0)]
    assert spans(tl, 1) == [("inter", 30.0, 34.0)]  # idle 14..30: a bubble
    assert tl.iteration_us == pytest.approx(F + 34.0)


def test_gpu_compression_delays_the_next_gradient():
    tl = timeline([(1000, 10.0), (1000, 1.0)], [GPU_COMP, DENSE])
    # Comp 2 us on the GPU; AllgatherC moves one 2000-byte payload (2 us); Decomp sums 2
    # payloads at 1 us each.
    assert spans(tl, 0) == [("gpu", 10.0, 12.0), ("inter", 12.0, 14.0), ("gpu", 14.0, 16.0)]
    # Backward segment 1 (1 us) cannot use the GPU during the Comp: ready at 13, not 11.
    assert tl.ready_us[1] == pytest.approx(13.0)
    assert spans(tl, 1) == [("inter", 14.0, 18.0)]
    assert tl.iteration_us == pytest.approx(F + 18.0)


def test_cpu_offload_overlaps_communication():
    copy = 4 * 1000 / (8000.0 * 125)  # d2h / h2d of 4000 bytes at 8000 Gbit/s
    tl = timeline([(1000, 10.0), (250, 1.0)], [CPU_COMP, DENSE])
    comp_end = 10.0 + 3.0 + copy
    assert spans(tl, 0) == [("cpu", 10.0, round(comp_end, 6)),
                            ("inter", round(comp_end, 6), round(comp_end + 2.0, 6)),
                            ("cpu", round(comp_end + 2.0, 6), round(comp_end + 4.0 + copy, 6))]
    # The GPU stays free, so gradient 1 is ready at 11 and its 1 us Allreduce runs while
    # tensor 0 is being compressed on the CPU.
    assert tl.ready_us[1] == pytest.approx(11.0)
    assert spans(tl, 1) == [("inter", 11.0, 12.0)]
    assert tl.iteration_us == pytest.approx(F + comp_end + 4.0 + copy)


def test_without_an_accelerator_cpu_compression_shares_the_training_device():
    """On a host that trains on its CPU, the host pool's Comp/Decomp run on the cores of the
    backward pass: they occupy the gpu resource and delay the next gradient, as GPU
    compression does, instead of overlapping it."""
    from dataclasses import replace

    from byteps_espresso.strategy import ClusterError

    copy = 4 * 1000 / (8000.0 * 125)
    tl = timeline([(1000, 10.0), (250, 1.0)], [CPU_COMP, DENSE],
                  cluster=replace(CLUSTER, host_device=True))
    comp_end = 10.0 + 3.0 + copy
    assert spans(tl, 0) == [("gpu", 10.0, round(comp_end, 6)),
                            ("inter", round(comp_end, 6), round(comp_end + 2.0, 6)),
                            ("gpu", round(comp_end + 2.0, 6), round(comp_end + 4.0 + copy, 6))]
    assert tl.ready_us[1] == pytest.approx(comp_end + 1.0)  # not 11: the cores were busy
    with pytest.raises(ClusterError, match="host_device"):
        replace(CLUSTER, host_device="yes")


def test_later_tensor_backfills_an_idle_gap():
    # tensor 0: its AllgatherC waits for a 2 us Comp; tensor 1's 1 us Allreduce is ready at 11
    # and fits in the link's idle time before 12.
    tl = timeline([(1000, 10.0), (250, 1.0)], [CPU_COMP, DENSE])
    assert spans(tl, 1)[0][1] < spans(tl, 0)[1][1]


def test_hierarchical_costs_follow_the_ring_formulas():
    cluster = Cluster(machines=4, gpus_per_machine=4, intra_gbps=80.0, intra_latency_us=2.0,
                      inter_gbps=8.0, inter_latency_us=10.0, servers=0)
    pricer = Pricer(cluster, "fp16", FP16, COSTS, [4096])
    tasks = pricer.tasks(Option.parse(
        "ReduceScatter(intra) -> Allreduce(inter) -> Allgather(intra)"))
    n_bytes = 4096 * 4
    b_intra, b_inter = 80 * 125.0, 8 * 125.0
    rs = 3 * 2.0 + 3 / 4 * n_bytes / b_intra
    # 4 inter groups (one per local rank) share the NIC, each with a quarter of the tensor
    ar = 2 * 3 * 10.0 + 2 * 3 / 4 * (n_bytes / 4) / (b_inter / 4)
    ag = 3 * 2.0 + 3 * (n_bytes / 4) / b_intra
    assert list(tasks.resource) == [2, 3, 2]
    np.testing.assert_allclose(tasks.duration[0], [rs, ar, ag])


def test_linear_fit_recovers_coefficients():
    xs = [1e3, 1e4, 1e5, 1e6]
    fit = Linear.fit(xs, [5 + 0.01 * x for x in xs])
    assert fit.a_us == pytest.approx(5, rel=1e-6) and fit.b_us == pytest.approx(0.01, rel=1e-6)
    costs = CompressorCosts.fit([{"compressor": "x", "device": d, "op": op, "numel": x,
                                  "us": 1 + 2e-3 * x} for d in ("gpu", "cpu")
                                 for op in ("compress", "decompress") for x in xs])
    assert costs.compress_us("x", "cpu", 1000) == pytest.approx(3.0)
    assert costs.decompress_us("x", "gpu", 1000, 4) == pytest.approx(12.0)


# One server with one aggregation thread; the collectives' per-hop latency is 10 us.
PS_CLUSTER = Cluster(machines=2, gpus_per_machine=1, intra_gbps=8.0, intra_latency_us=0.0,
                     inter_gbps=8.0, inter_latency_us=10.0, servers=1, server_gbps=8.0,
                     cpu_threads=1, h2d_gbps=8000.0, server_threads=1)


def _ps_tasks(cluster, costs, option):
    pricer = Pricer(cluster, "fp16", FP16, costs, [1000])
    return pricer.tasks(Option.parse(option))


def test_push_pull_uses_the_servers_own_latency_when_measured():
    base = PS_CLUSTER
    # push and pull: 4000 bytes over the NIC (4 us) and 2 pushers x 4000 bytes into one
    # server (8 us): max 8 us per direction plus the one-way latency.
    push_pull = "PushPull(flat)"
    inherited = _ps_tasks(base, COSTS, push_pull)
    assert inherited.duration[0][0] == pytest.approx(10.0 + 8.0)
    measured = _ps_tasks(base.with_(server_latency_us=3.0), COSTS, push_pull)
    assert measured.duration[0][0] == pytest.approx(3.0 + 8.0)
    assert measured.duration[0][2] == pytest.approx(3.0 + 8.0)
    assert base.ps_latency_us == 10.0 and base.with_(server_latency_us=0.0).ps_latency_us == 0.0


# 2 machines x 2 workers and 2 servers: the servers' path (2 x 8 Gbit/s) is quicker than a
# machine's 1 Gbit/s link shared by its 2 workers.
PS_2X2 = Cluster(machines=2, gpus_per_machine=2, intra_gbps=8.0, intra_latency_us=0.0,
                 inter_gbps=1.0, inter_latency_us=10.0, servers=2, server_gbps=8.0,
                 cpu_threads=1, h2d_gbps=8000.0, server_threads=1)


def _push_pull_us(cluster, option="PushPull(flat)"):
    """(push, pull) of the option's push/pull, us (its two tasks on the inter link)."""
    tasks = _ps_tasks(cluster, COSTS, option)
    push, pull = np.flatnonzero(tasks.resource == INTER)
    return tasks.duration[0][push], tasks.duration[0][pull]


def test_push_pull_on_one_host_is_priced_by_the_servers_path_alone():
    one_host = PS_2X2.with_(shared_host=True)
    for option in ("PushPull(flat)", "Comp(gpu) -> PushPullC(flat) -> Decomp(gpu)"):
        nbytes = 4000 if option.startswith("PushPull") else FP16(np.array([1000.0]))[0]
        # 2 workers x nbytes over the machine's 1 Gbit/s link (125 bytes/us)
        assert _push_pull_us(PS_2X2, option) == pytest.approx((10.0 + 2 * nbytes / 125.0,) * 2)
        # no NIC shared by a machine's workers on one host: the servers' path alone,
        # 4 pushers x nbytes into 2 servers of 1000 bytes/us
        assert _push_pull_us(one_host, option) == \
            pytest.approx((10.0 + 4 * nbytes / (2 * 1000.0),) * 2)
        apart, shared = (_ps_tasks(c, COSTS, option) for c in (PS_2X2, one_host))
        others = apart.resource != INTER
        assert np.array_equal(apart.duration[0][others], shared.duration[0][others])


def test_push_pull_bytes_for_a_machines_own_servers_stay_off_its_link():
    from byteps_espresso.strategy import ClusterError

    # a server on each machine: half of each worker's keys are its own machine's, so the
    # link carries 2 workers x 2000 of the 4000 bytes
    colocated = PS_2X2.with_(local_server_share=0.5)
    assert _push_pull_us(PS_2X2)[0] == pytest.approx(10.0 + 2 * 4000 / 125.0)
    assert _push_pull_us(colocated)[0] == pytest.approx(10.0 + 2 * 2000 / 125.0)
    # the servers' own path bounds it still: 4 pushers x 4000 bytes into 2 x 0.1 Gbit/s
    assert _push_pull_us(colocated.with_(server_gbps=0.1))[0] == \
        pytest.approx(10.0 + 4 * 4000 / (2 * 12.5))
    assert Cluster.from_dict(colocated.to_dict()) == colocated
    for bad in (1.0, -0.1, True, "half"):
        with pytest.raises(ClusterError, match="local_server_share"):
            PS_2X2.with_(local_server_share=bad)


def test_server_aggregation_uses_the_server_profile_when_present():
    cluster = PS_CLUSTER
    option = "Comp(gpu) -> PushPullC(flat) -> Decomp(gpu)"
    # Without a server profile: 2 pushers' payloads decompressed (1 us each) + 1 compress (3).
    as_cpu = _ps_tasks(cluster, COSTS, option)
    server_task = list(as_cpu.resource).index(4)
    assert as_cpu.duration[0][server_task] == pytest.approx(2 * 1.0 + 3.0)
    with_server = CompressorCosts({"fp16": {
        **COSTS.models["fp16"],
        "server": {"compress": Linear(0.5, 0.0), "decompress": Linear(0.25, 0.0)}}})
    assert with_server.server_device("fp16") == "server" and COSTS.server_device("fp16") == "cpu"
    own = _ps_tasks(cluster, with_server, option)
    assert own.duration[0][server_task] == pytest.approx(2 * 0.25 + 0.5)
    # and the JSON round trip keeps it
    again = CompressorCosts.from_dict(with_server.to_dict())
    assert again.compress_us("fp16", "server", 10) == pytest.approx(0.5)


@pytest.mark.parametrize("bad", [-1.0, "3", True])
def test_server_latency_must_be_a_number(bad):
    from byteps_espresso.strategy import ClusterError

    with pytest.raises(ClusterError, match="server_latency_us"):
        CLUSTER.with_(server_latency_us=bad)


def _named_timeline(named, options, cluster):
    wl = Workload(tuple(TensorProfile(name, n, g) for name, n, g in named), F)
    pricer = Pricer(cluster, "fp16", FP16, COSTS, sorted({n for _, n, _ in named}))
    ev = Evaluator(wl, pricer, list(dict.fromkeys(options)))
    choice = np.array(ev.add(options))
    tl = ev.timeline(choice)
    assert ev.iteration_us(choice) == pytest.approx(tl.iteration_us)
    return tl


def test_a_lane_runs_one_option_at_a_time_until_its_last_collective_is_issued():
    from byteps_espresso.strategy.cluster import lane_of

    laned = CLUSTER.with_(lanes=2)
    assert lane_of("t0", 2) == lane_of("t1", 2) != lane_of("t4", 2)
    # Same lane: tensor 1's Allreduce (ready at 11) may not backfill the link before tensor
    # 0's AllgatherC, as it does without lanes (test_later_tensor_backfills_an_idle_gap): the
    # lane runs tensor 0's Comp and issues its AllgatherC first. The executor leaves that
    # AllgatherC in flight and decodes in the waiting call, so the lane is free from its
    # issue: tensor 1 takes the link as the AllgatherC ends, before tensor 0's Decomp does.
    same = _named_timeline([("t0", 1000, 10.0), ("t1", 250, 1.0)], [CPU_COMP, DENSE], laned)
    _, gather, decomp = spans(same, 0)
    assert spans(same, 1)[0][1] == pytest.approx(gather[2]) and gather[2] < decomp[2]
    assert spans(same, 1)[0][1] > spans(_named_timeline(
        [("t0", 1000, 10.0), ("t1", 250, 1.0)], [CPU_COMP, DENSE], CLUSTER), 1)[0][1]
    # An Option whose last collective is not left in flight holds its lane to its end.
    held = Option.parse("Comp(cpu) -> GatherC(flat) -> Decomp(cpu) -> Broadcast(flat)")
    whole = _named_timeline([("t0", 1000, 10.0), ("t1", 250, 1.0)], [held, DENSE], laned)
    assert spans(whole, 1)[0][1] == pytest.approx(whole.done_us[0])
    assert whole.iteration_us == pytest.approx(F + whole.done_us[0] + 1.0)
    # Other lanes: the two Options overlap as before.
    other = _named_timeline([("t0", 1000, 10.0), ("t4", 250, 1.0)], [CPU_COMP, DENSE], laned)
    assert spans(other, 1)[0][1] < spans(other, 0)[1][1]
    unlaned = _named_timeline([("t0", 1000, 10.0), ("t1", 250, 1.0)], [CPU_COMP, DENSE],
                              CLUSTER)
    assert spans(unlaned, 1) == spans(other, 1)


def test_the_catalogue_knows_where_each_option_lets_its_lane_go():
    """hold: the first task of the in-flight step (the executor's tail), else every task;
    held (Algorithm 2's bound table): the time of the tasks before it. Without lanes nothing
    is released early."""
    held_to_end = Option.parse("Comp(cpu) -> GatherC(flat) -> Decomp(cpu) -> Broadcast(flat)")
    options = [DENSE, GPU_COMP, CPU_COMP, held_to_end]
    for cluster, released in ((CLUSTER.with_(lanes=2), True), (CLUSTER, False)):
        pricer = Pricer(cluster, "fp16", FP16, COSTS, [1000])
        ev = Evaluator(Workload((TensorProfile("t0", 1000, 1.0),), F), pricer, options)
        cat = ev.catalogue
        rows = ev.add(options)
        held = {k: ev._tail_tables(np.array([[k]]))[2][0, 0] for k in rows}
        want = [0, 1, 1, 4] if released else [1, 3, 3, 4]
        assert cat.hold[rows].tolist() == want
        for k, o in zip(rows, options, strict=True):
            tasks = pricer.tasks(o)
            assert held[k] == pytest.approx(tasks.duration[0, : cat.hold[k]].sum())
            assert cat.len[k] == len(tasks.resource)
        # with lanes a flat Allreduce holds its lane for nothing, GPU_COMP for its Comp
        assert bool(held[rows[0]] == 0.0) is released
        assert bool(held[rows[1]] < cat.total[rows[1], 0]) is released


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_lanes_must_be_a_positive_integer(bad):
    from byteps_espresso.strategy import ClusterError

    with pytest.raises(ClusterError, match="lanes"):
        CLUSTER.with_(lanes=bad)
    assert Cluster.from_dict(CLUSTER.with_(lanes=3).to_dict()).lanes == 3


def test_rooted_collectives_are_priced_as_the_transport_runs_them():
    def priced(p, lat, numel):
        cluster = Cluster(machines=1, gpus_per_machine=p, intra_gbps=8.0,
                          intra_latency_us=lat, inter_gbps=8.0, servers=0)
        return Pricer(cluster, "fp16", FP16, COSTS, [numel]).tasks(
            Option.parse("Reduce(intra) -> Broadcast(intra)")).duration[0]

    # 2 members, 10 us per message, 1000 elements (4000 bytes at 1000 bytes/us): the gather
    # and the binomial tree are one message each, 10 + 4 us.
    np.testing.assert_allclose(priced(2, 10.0, 1000), [14.0, 14.0])
    # 8 members, 1 us per message, 1000 elements (below program.REDUCE_SPLIT_BYTES): the root
    # gathers 7 whole copies (7 x 1 + 7 x 4 = 35 us); the tree's root sends log2(8) = 3 (3 + 12).
    np.testing.assert_allclose(priced(8, 1.0, 1000), [35.0, 15.0])
    # 10^6 elements: Reduce splits, a reduce-scatter then a gather of 1/8 shards; the root
    # sends 7 and receives 14 shards of 500 us (14 x 1 + 14 x 500 = 7014 us), where the gather
    # would take 7 x 1 + 7 x 4000 = 28007 us.
    np.testing.assert_allclose(priced(8, 1.0, 10**6), [7014.0, 12003.0])


def test_exchange_latencies_per_link_and_rooted_latency_each_scale_their_own_collectives():
    from dataclasses import replace

    from byteps_espresso.strategy import ClusterError

    base = Cluster(machines=2, gpus_per_machine=2, intra_gbps=8.0, intra_latency_us=500.0,
                   inter_gbps=6.0, inter_latency_us=700.0)
    sizes = CompressedSizes("randomk", {"ratio": 0.01})

    def total(cluster, text):
        return Pricer(cluster, "randomk", sizes, CompressorCosts.default(),
                      [1000]).tasks(Option.parse(text)).total[0]

    exchange = "ReduceScatter(intra) -> Allreduce(inter) -> Allgather(intra)"
    rooted = "Reduce(intra) -> Allreduce(inter) -> Broadcast(intra)"
    slow = replace(base, exchange_latency=3.0)
    # RS + AG: 1 hop each at 500 us; the inter all-reduce (2 hops at 700 us) is on the other
    # link's factor
    assert total(slow, exchange) - total(base, exchange) == pytest.approx(2 * (500 + 500))
    assert total(slow, rooted) == total(base, rooted)
    slow_inter = replace(base, inter_exchange_latency=3.0)
    for text in (exchange, rooted):  # the inter all-reduce of 2 members: 2 hops at 700 us
        assert total(slow_inter, text) - total(base, text) == pytest.approx(2 * 1400)
    # a flat ring across the machines crosses the inter link
    assert total(slow_inter, "Allreduce(flat)") > total(base, "Allreduce(flat)")
    assert total(slow, "Allreduce(flat)") == total(base, "Allreduce(flat)")
    for name in ("exchange_latency", "inter_exchange_latency"):
        with pytest.raises(ClusterError, match=name):
            replace(base, **{name: -1.0})
    assert Cluster.from_dict(slow_inter.to_dict()) == slow_inter
    # rooted_latency, the other way round: Reduce and Broadcast (1 hop each at 500 us, the
    # binomial tree of 2 members) pay it, the exchanges do not
    rooted_slow = replace(base, rooted_latency=4.0)
    assert total(rooted_slow, rooted) - total(base, rooted) == pytest.approx(3 * (500 + 500))
    assert total(rooted_slow, exchange) == total(base, exchange)
    with pytest.raises(ClusterError, match="rooted_latency"):
        replace(base, rooted_latency=-1.0)
    assert Cluster.from_dict(rooted_slow.to_dict()) == rooted_slow


def test_per_step_sums_each_step_s_tasks():
    cluster = Cluster(machines=2, gpus_per_machine=2, intra_gbps=8.0, intra_latency_us=500.0,
                      inter_gbps=6.0, inter_latency_us=700.0, servers=1, server_gbps=20.0)
    option = Option.parse("ReduceScatter(intra) -> Comp(gpu) -> PushPullC(inter) -> "
                          "Decomp(gpu) -> Allgather(intra)")
    tasks = Pricer(cluster, "randomk", CompressedSizes("randomk", {"ratio": 0.01}),
                   CompressorCosts.default(), [1000, 50_000]).tasks(option)
    steps = tasks.per_step(len(option.steps))
    assert steps.shape == (2, 5)
    np.testing.assert_allclose(steps.sum(axis=1), tasks.total)
    pushpull = tasks.duration[:, tasks.step == 2]  # push, server aggregation, pull
    assert pushpull.shape[1] == 3
    np.testing.assert_allclose(steps[:, 2], pushpull.sum(axis=1))


def test_memoized_prices_equal_a_fresh_walk_per_option():
    """The pricer shares step prefixes and per-step tasks between options; every option of
    the tree priced that way equals the option priced alone by a new pricer."""
    from byteps_espresso.strategy.tree import enumerate_options

    cluster = Cluster.preset(4, 2, "pcie", 25, servers=2)
    numels = [1, 1000, 65_536, 3_000_000]
    sizes = CompressedSizes("dgc", {"ratio": 0.01})
    costs = CompressorCosts.default()
    options = enumerate_options(cluster)
    shared = Pricer(cluster, "dgc", sizes, costs, numels)
    order = np.random.default_rng(0).permutation(len(options))
    memo = {options[k]: shared.tasks(options[k]) for k in order.tolist()}
    for option in options[::7]:
        alone = Pricer(cluster, "dgc", sizes, costs, numels).tasks(option)
        got = memo[option]
        assert np.array_equal(got.resource, alone.resource)
        assert np.array_equal(got.step, alone.step)
        assert np.array_equal(got.duration, alone.duration)


def test_forwarded_payloads_cost_their_count_on_the_wire_and_in_the_decomp():
    """A step that forwards the payloads an earlier gather left moves all of them (q times a
    payload's bytes in the same messages) and the Decomp at the end decodes all of them."""
    cluster = Cluster(machines=4, gpus_per_machine=4, intra_gbps=80.0, intra_latency_us=2.0,
                      inter_gbps=8.0, inter_latency_us=10.0, servers=0)
    pricer = Pricer(cluster, "fp16", FP16, COSTS, [4096])
    b_intra, b_inter = 80 * 125.0, 8 * 125.0
    shard, full = FP16(np.array([1024.0]))[0], FP16(np.array([4096.0]))[0]

    def durations(text):
        return pricer.tasks(Option.parse(text)).duration[0]

    # AlltoallC(intra) leaves 4 payloads of a quarter; AllgatherC(inter) (4 groups on the NIC)
    # sends all 4, and the Decomp sums 4 x 4 (COSTS: 1 us per payload decoded on the gpu)
    forwarded = durations("Comp(gpu) -> AlltoallC(intra) -> AllgatherC(inter) -> Decomp(gpu) "
                          "-> Allgather(intra)")
    np.testing.assert_allclose(forwarded[2], 3 * 10.0 + 3 * 4 * shard / (b_inter / 4))
    assert forwarded[3] == pytest.approx(16.0)
    decoded = durations("Comp(gpu) -> AlltoallC(intra) -> Decomp(gpu) -> Comp(gpu) "
                        "-> AllgatherC(inter) -> Decomp(gpu) -> Allgather(intra)")
    np.testing.assert_allclose(decoded[4], 3 * 10.0 + 3 * shard / (b_inter / 4))
    assert (decoded[2], decoded[5]) == pytest.approx((4.0, 4.0))
    # the roots gather 4 x 4 payloads across machines (one group on the NIC); both broadcasts
    # (binomial trees of log2(4) = 2 rounds) carry all 16; one Decomp of 16
    rooted = durations("Comp(gpu) -> GatherC(intra) -> GatherC(inter) -> BroadcastC(inter) "
                       "-> BroadcastC(intra) -> Decomp(gpu)")
    np.testing.assert_allclose(rooted[1:5], [3 * 2.0 + 3 * full / b_intra,
                                             3 * 10.0 + 3 * 4 * full / b_inter,
                                             2 * (10.0 + 16 * full / b_inter),
                                             2 * (2.0 + 16 * full / b_intra)])
    assert rooted[5] == pytest.approx(16.0)
