"""Hand-computed timelines and cost formulas.

The cluster has 2 machines x 1 GPU and 8 Gbit/s links (1000 bytes/us) without latency, so a
flat Allreduce of n float32 elements takes 2 (p-1)/p * 4n / 1000 = 4n/1000 us (p = 2).
"""

import numpy as np
import pytest

from byteps_espresso.strategy import Cluster, CompressorCosts, Option, TensorProfile, Workload
from byteps_espresso.strategy.compressor_costs import Linear
from byteps_espresso.strategy.costs import CompressedSizes, Pricer
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
