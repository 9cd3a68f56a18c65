"""PowerSGD over buckets (worker/lowrank.py): the real executor on the in-memory transport
against a torch oracle of PowerSGD's steps, bit for bit (both sum in rank order)."""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from byteps_espresso.kernels.powersgd import PowerSGD
from byteps_espresso.worker.executor import Executor
from byteps_espresso.worker.local_transport import LocalHub
from byteps_espresso.worker.lowrank import P_SUFFIX, Q_SUFFIX, LowRank
from byteps_espresso.worker.optimizer import Compression

from byteps_espresso.strategy.options import Option

MACHINES, LOCAL = 2, 2
WORLD = MACHINES * LOCAL
# A fused bucket: a matrix, a vector, a 3-d tensor (a matrix of 8 x 12), a matrix too small to
# shrink, then the non-finite flag element the last bucket carries.
SHAPES = {"w": torch.Size([16, 12]), "b": torch.Size([5]), "c": torch.Size([8, 3, 4]),
          "s": torch.Size([2, 2])}
MEMBERS = list(SHAPES)
PARAMS = {"rank": 2, "start_iter": 1, "seed": 7}
OPTION = Option.parse("Allreduce(flat)")


def _layout():
    offsets, at = [], 0
    for n in MEMBERS:
        offsets.append(at)
        at += math.prod(SHAPES[n])
    return offsets, at + 1  # + the flag


def _inputs(step):
    _, numel = _layout()
    g = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(numel, generator=g) for _ in range(WORLD)]


def _run(lowranks, steps, first=0):
    hub = LocalHub(MACHINES, LOCAL, timeout_s=10)
    executors = [Executor(hub.transport(r), None) for r in range(WORLD)]
    offsets, _ = _layout()
    outs = []
    with ThreadPoolExecutor(WORLD) as pool:
        for step in range(first, first + steps):
            flats = _inputs(step)
            futs = [pool.submit(lowranks[r].reduce, executors[r], OPTION, flats[r],
                                name="bucket", members=MEMBERS, offsets=offsets, step=step)
                    for r in range(WORLD)]
            outs.append([f.result(timeout=30) for f in futs])
    return outs, executors


def _oracle(steps):
    """PowerSGD's steps per member with the sums taken in rank order."""
    states = [PowerSGD(**PARAMS) for _ in range(WORLD)]
    offsets, _ = _layout()
    outs = []
    for step in range(steps):
        flats = _inputs(step)
        out = sum(flats[1:], flats[0]).clone()  # the uncompressed values' sum
        for name, at in zip(MEMBERS, offsets, strict=True):
            span = slice(at, at + math.prod(SHAPES[name]))
            if not states[0].compresses(SHAPES[name], step):
                continue
            ps = [s.start(name, f[span].view(SHAPES[name]), step)
                  for s, f in zip(states, flats, strict=True)]
            p_sum = sum(ps[1:], ps[0])
            qs = [s.middle(name, p_sum) for s in states]
            q_sum = sum(qs[1:], qs[0])
            totals = [s.finish(name, q_sum, WORLD) for s in states]
            assert all(torch.equal(t, totals[0]) for t in totals)
            out[span] = totals[0]
        outs.append(out)
    return outs


def test_a_bucket_equals_powersgds_steps_bit_for_bit():
    steps = 4
    got, _ = _run([LowRank(PARAMS, SHAPES, WORLD) for _ in range(WORLD)], steps)
    want = _oracle(steps)
    for step in range(steps):
        for r in range(WORLD):
            assert torch.equal(got[step][r], want[step]), f"step {step} rank {r}"
    # step 0 (start_iter) is the plain sum; later the vector, the small matrix and the flag
    # are summed exactly and the matrices are estimates
    exact = sum(_inputs(2)[1:], _inputs(2)[0])
    assert torch.equal(got[0][0], sum(_inputs(0)[1:], _inputs(0)[0]))
    assert torch.equal(got[2][0][192:197], exact[192:197])  # b
    assert torch.equal(got[2][0][-5:], exact[-5:])  # s and the flag
    assert not torch.allclose(got[2][0][:192], exact[:192], atol=0.1)  # w: rank 2 of 12


def test_which_members_it_compresses():
    lr = LowRank(PARAMS, SHAPES, WORLD)
    assert lr.compressed(MEMBERS, 0) == []  # start_iter
    assert lr.compressed(MEMBERS, 1) == [0, 2]  # not the vector, not 2 x 2 at rank 2


def test_the_sums_run_under_their_own_names_once_it_compresses():
    _, executors = _run([LowRank(PARAMS, SHAPES, WORLD) for _ in range(WORLD)], 3)
    sizes: dict[str, set[int]] = {}
    for _, name, numel, _ in executors[0]._bound:
        sizes.setdefault(name, set()).add(numel)
    # one size per name (a PS key keeps its length): P beside b, s and the flag; then Q
    _, numel = _layout()
    assert sizes == {"bucket": {numel}, "bucket" + P_SUFFIX: {5 + 4 + 1 + 16 * 2 + 8 * 2},
                     "bucket" + Q_SUFFIX: {12 * 2 + 12 * 2}}


def test_the_uncompressed_iterations_run_the_dense_option_and_the_sums_theirs():
    # A plan's S suits P and Q; the first start_iter iterations sum the whole bucket, which
    # the job's fp32 path does (CompressionSpec.uncompressed_sums).
    dense = Option.parse("ReduceScatter(intra) -> Allreduce(inter) -> Allgather(intra)")
    hub = LocalHub(MACHINES, LOCAL, timeout_s=10)
    executors = [Executor(hub.transport(r), None) for r in range(WORLD)]
    lowranks = [LowRank(PARAMS, SHAPES, WORLD) for _ in range(WORLD)]
    offsets, _ = _layout()
    outs = []
    with ThreadPoolExecutor(WORLD) as pool:
        for step in range(2):
            flats = _inputs(step)
            futs = [pool.submit(lowranks[r].reduce, executors[r], OPTION, flats[r],
                                name="bucket", members=MEMBERS, offsets=offsets, step=step,
                                uncompressed=dense) for r in range(WORLD)]
            outs.append([f.result(timeout=30) for f in futs])
    bound = {(str(option), name) for option, name, _, _ in executors[0]._bound}
    assert bound == {(str(dense), "bucket"), (str(OPTION), "bucket" + P_SUFFIX),
                     (str(OPTION), "bucket" + Q_SUFFIX)}
    torch.testing.assert_close(outs[0][0], sum(_inputs(0)), rtol=1e-6, atol=1e-6)
    assert all(torch.equal(o, outs[0][0]) for o in outs[0])
    # from start_iter on, what the bucket's sums alone give (the oracle of the test above)
    assert all(torch.equal(o, _run([LowRank(PARAMS, SHAPES, WORLD) for _ in range(WORLD)],
                                   1, first=1)[0][0][0]) for o in outs[1])


@pytest.mark.parametrize(("gbps", "text", "faster"), [
    (1.0, "PushPull(flat)", "fp32"),
    (0.25, "ReduceScatter(intra) -> Allreduce(inter) -> Allgather(intra)", "sums")])
def test_compression_specs_pick_the_uncompressed_iterations_option(gbps, text, faster):
    """Of a plan's sums Option and fp32's, the one the model prices faster for the whole
    bucket; the fixed scheme keeps its sums. The sums Options the LSTM's plans chose at 1
    and 0.25 Gbit/s: every worker pushing the whole dense bucket through the one server
    loses to fp32's shards; fp32's path through that server loses to a hierarchy of
    collectives on a slow link."""
    from types import SimpleNamespace

    from byteps_espresso.worker.profiler import EspressoSpec

    from byteps_espresso.strategy import Cluster
    from byteps_espresso.strategy.costs import dense_us

    cluster = Cluster(machines=2, gpus_per_machine=2, intra_gbps=3.5, intra_latency_us=600.0,
                      inter_gbps=gbps, inter_latency_us=900.0, servers=1,
                      server_gbps=1.7 * gbps, server_latency_us=700.0)
    fp32 = Option.parse("ReduceScatter(intra) -> PushPull(inter) -> Allgather(intra)")
    sums = Option.parse(text)
    numel = 226_305  # the LSTM's weight bucket and the non-finite flag
    session = SimpleNamespace(fp32=fp32, strategy=SimpleNamespace(cluster=cluster))
    want = fp32 if faster == "fp32" else sums
    other = sums if faster == "fp32" else fp32
    assert dense_us(cluster, want, numel) < dense_us(cluster, other, numel)
    assert EspressoSpec("powersgd").uncompressed_sums(session, sums, numel) == want
    # the fixed scheme's sums are its dense path already (PyTorch's hook all-reduces both)
    assert Compression.powersgd(2).uncompressed_sums(session, sums, numel) == sums
    # before a strategy is in use there is no cluster to price on
    assert EspressoSpec("powersgd").uncompressed_sums(
        SimpleNamespace(fp32=fp32, strategy=None), sums, numel) == sums


def test_the_measured_error_is_each_workers_error_feedback_over_its_input():
    lowranks = [LowRank(PARAMS, SHAPES, WORLD) for _ in range(WORLD)]
    _run(lowranks, 2)
    offsets, _ = _layout()
    spans = [(offsets[i], offsets[i] + math.prod(SHAPES[MEMBERS[i]])) for i in (0, 2)]
    carried = [{n: lr.state.error[n].reshape(-1).clone() for n in ("w", "c")} for lr in lowranks]
    for lr in lowranks:
        lr.measuring = True
    got, _ = _run(lowranks, 1, first=2)
    flats = _inputs(2)
    for r, lr in enumerate(lowranks):
        ms = [flats[r][a:b] + carried[r][n] for n, (a, b) in zip(("w", "c"), spans, strict=True)]
        err2 = sum(float(((m - got[0][r][a:b] / WORLD) ** 2).sum())
                   for m, (a, b) in zip(ms, spans, strict=True))
        norm2 = sum(float((m * m).sum()) for m in ms)
        (key, (e2, n2)), = lr.take_errors().items()
        assert key == "bucket#powersgd"
        assert e2 == pytest.approx(err2, rel=1e-6) and n2 == pytest.approx(norm2, rel=1e-6)
        assert 0 < e2 < n2  # rank 2 of 12: a real, partial error
        assert lr.take_errors() == {}


def test_a_full_rank_approximation_has_no_error():
    one = LowRank({"rank": 12, "start_iter": 0, "min_compression_rate": 0.0}, {"w": SHAPES["w"]},
                  workers=1)
    hub = LocalHub(1, 1, timeout_s=10)
    x = torch.randn(192, generator=torch.Generator().manual_seed(5))
    one.measuring = True
    out = one.reduce(Executor(hub.transport(0), None), OPTION, x, name="b", members=["w"],
                     offsets=[0], step=0)
    torch.testing.assert_close(out, x, rtol=1e-4, atol=1e-4)
    (e2, n2), = one.take_errors().values()
    assert e2 < 1e-8 * n2


def test_a_restored_state_continues_as_an_uninterrupted_run():
    whole, _ = _run([LowRank(PARAMS, SHAPES, WORLD) for _ in range(WORLD)], 4)
    first = [LowRank(PARAMS, SHAPES, WORLD) for _ in range(WORLD)]
    _run(first, 2)
    saved = [lr.state_dict() for lr in first]
    assert set(saved[0]["powersgd"]) == {"w", "c"}
    resumed = [LowRank(PARAMS, SHAPES, WORLD) for _ in range(WORLD)]
    for lr, state in zip(resumed, saved, strict=True):
        lr.load_state_dict(state, torch.device("cpu"))
    rest, _ = _run(resumed, 2, first=2)
    for step in range(2):
        for r in range(WORLD):
            assert torch.equal(rest[step][r], whole[2 + step][r])


def test_a_state_of_another_model_is_refused():
    lr = LowRank(PARAMS, SHAPES, WORLD)
    with pytest.raises(ValueError, match=r"'x'.*this model does not have"):
        lr.load_state_dict({"powersgd": {"x": {"q": torch.zeros(2, 1)}}}, torch.device("cpu"))


def test_compression_powersgd_checks_its_parameters_at_once():
    with pytest.raises(ValueError, match=r"unknown parameter.*valid parameters"):
        Compression.powersgd(2, ratio=0.1)
    with pytest.raises(ValueError, match="rank"):
        Compression.powersgd(0)
    assert Compression.powersgd(4).params["rank"] == 4
    with pytest.raises(ValueError, match=r"sums='servers'; use one of allreduce, ps"):
        Compression.powersgd(4, sums="servers")
    assert Compression.powersgd(4).sums == "allreduce"
    assert Compression.powersgd(4, sums="ps").sums == "ps"


def test_measured_costs_are_lines_in_multiply_adds_of_the_models_own_shapes():
    from byteps_espresso.worker.lowrank import measure_costs

    costs = measure_costs({"rank": 4}, [(256, 128), (64, 64, 3, 3), (512,)], torch.device("cpu"))
    assert costs.has("powersgd", "gpu") and not costs.has("powersgd", "cpu")
    small, large = (costs.compress_us("powersgd", "gpu", n) for n in (1e4, 1e8))
    # more multiply-adds never cost less (a fit through noisy timings may come out flat)
    assert 0 < small <= large < float("inf")
    assert costs.decompress_us("powersgd", "gpu", 1e8) > 0
    # a model with nothing PowerSGD compresses is still profiled (on two fallback shapes)
    assert measure_costs({"rank": 4}, [(512,)], torch.device("cpu")).has("powersgd", "gpu")
