"""Price what runs: the cost model's message and byte terms equal what the transport sends.

For every collective the executor issues, at p = 2, 4 and 8 members, the executor runs over
the in-memory transport with traffic counting on (``LocalHub(count_traffic=True)``: each
collective's messages of the algorithm DistTransport runs over gloo, with its padding and
payload packing); :meth:`Pricer.wire` gives the (messages, bytes) the model charges for the
same steps at the group's busiest member. They must be equal.
"""

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from byteps_espresso.worker.codecs import CodecPair
from byteps_espresso.worker.executor import Executor
from byteps_espresso.worker.local_transport import LocalHub
from byteps_espresso.worker.transport import packed_nbytes

from byteps_espresso.strategy import Cluster, CompressorCosts
from byteps_espresso.strategy.costs import CompressedSizes, Pricer
from byteps_espresso.strategy.options import Kind, Option

OPTIONS = [
    "Allreduce(flat)",
    "ReduceScatter(flat) -> Allgather(flat)",
    "Reduce(flat) -> Broadcast(flat)",
    "Comp(gpu) -> AllgatherC(flat) -> Decomp(gpu)",
    "Comp(gpu) -> AlltoallC(flat) -> Decomp(gpu) -> Comp(gpu) -> AllgatherC(flat) -> Decomp(gpu)",
    "Comp(gpu) -> GatherC(flat) -> Decomp(gpu) -> Comp(gpu) -> BroadcastC(flat) -> Decomp(gpu)",
    "ReduceScatter(flat) -> Comp(gpu) -> AllgatherC(flat) -> Decomp(gpu)",
    # the broadcast forwards the p payloads the gather left: p times the bytes
    "Comp(gpu) -> GatherC(flat) -> BroadcastC(flat) -> Decomp(gpu)",
]
# Only a compressor whose payloads sum (fp16) runs it: its own test below.
PAYLOAD_ALLREDUCE = "Comp(gpu) -> AllreduceC(flat) -> Decomp(gpu)"
# PushPull/PushPullC go through the PS, not the transport (their model is the servers').
TRANSPORT_KINDS = {k for k in Kind if not k.is_compute} - {Kind.PUSH_PULL, Kind.PUSH_PULL_C}


def test_the_cases_cover_every_collective_of_the_transport():
    assert {s.kind for o in [*OPTIONS, PAYLOAD_ALLREDUCE] for s in Option.parse(o).steps
            if not s.kind.is_compute} == TRANSPORT_KINDS


def _sent(option: Option, p: int, numel: int, codec_name: str) -> list:
    hub = LocalHub(1, p, timeout_s=10, count_traffic=True)
    executors = [Executor(hub.transport(r), CodecPair(codec_name)) for r in range(p)]
    with ThreadPoolExecutor(p) as pool:
        for f in [pool.submit(ex.run, option, torch.randn(numel), name="w", step=0)
                  for ex in executors]:
            f.result(timeout=30)
    return hub.traffic


@pytest.mark.parametrize("codec_name", ["fp16", "topk"])
# 20000 floats (80 KB) is above program.REDUCE_SPLIT_BYTES: Reduce splits at p > 2
@pytest.mark.parametrize("numel", [1000, 4099, 20000])
@pytest.mark.parametrize("p", [2, 4, 8])
@pytest.mark.parametrize("text", OPTIONS)
def test_the_model_charges_the_messages_and_bytes_the_transport_sends(text, p, numel, codec_name):
    option = Option.parse(text)
    sent = _sent(option, p, numel, codec_name)
    codec = CodecPair(codec_name)
    # payload bytes as they travel: packed, every array 8-byte aligned
    sizes = CompressedSizes(codec_name, nbytes=lambda n: packed_nbytes(codec.spec(n)))
    cluster = Cluster(machines=1, gpus_per_machine=p, intra_gbps=10.0, intra_latency_us=5.0,
                      inter_gbps=10.0, servers=0)
    charged = Pricer(cluster, codec_name, sizes, CompressorCosts.default(), [numel]).wire(option)
    assert len(sent) == len(charged)
    for got, (i, msgs, nbytes) in zip(sent, charged, strict=True):
        where = f"step {i} {option.steps[i]} ({got.collective})"
        assert got.members == p
        np.testing.assert_array_equal(np.broadcast_to(msgs, (1,)), [got.msgs], err_msg=where)
        np.testing.assert_allclose(nbytes, [got.nbytes], rtol=1e-12, err_msg=where)


@pytest.mark.parametrize("numel", [1000, 4099, 20000])
@pytest.mark.parametrize("p", [2, 4, 8])
def test_a_payload_allreduce_is_charged_the_ring_of_its_own_bytes(p, numel):
    """AllreduceC all-reduces the payload's arrays as they are, not packed: the model's own
    payload sizes (2 bytes an element for fp16) in a ring of 2 (p - 1) messages."""
    option = Option.parse(PAYLOAD_ALLREDUCE)
    sent = _sent(option, p, numel, "fp16")
    cluster = Cluster(machines=1, gpus_per_machine=p, intra_gbps=10.0, intra_latency_us=5.0,
                      inter_gbps=10.0, servers=0)
    charged = Pricer(cluster, "fp16", CompressedSizes("fp16"), CompressorCosts.default(),
                     [numel]).wire(option)
    assert [(t.collective, t.msgs) for t in sent] == [("allreduce_payload", 2 * (p - 1))]
    (_, msgs, nbytes), = charged
    assert msgs == 2 * (p - 1)
    np.testing.assert_allclose(nbytes, [sent[0].nbytes], rtol=1e-12)
    np.testing.assert_allclose(nbytes, [2 * (p - 1) / p * 2 * numel], rtol=1e-12)


MIXED = [
    "Comp(gpu,fp16) -> AlltoallC(intra) -> Decomp(gpu,fp16) -> Comp(gpu) -> AllgatherC(inter) "
    "-> Decomp(gpu) -> Comp(gpu,fp16) -> AllgatherC(intra) -> Decomp(gpu,fp16)",
    "Comp(gpu,fp16) -> GatherC(intra) -> Decomp(gpu,fp16) -> Comp(gpu) -> GatherC(inter) "
    "-> Decomp(gpu) -> Broadcast(inter) -> Comp(gpu,fp16) -> BroadcastC(intra) "
    "-> Decomp(gpu,fp16)",
]


def _packed(name: str) -> CompressedSizes:
    codec = CodecPair(name)
    return CompressedSizes(name, nbytes=lambda n: packed_nbytes(codec.spec(n)))


@pytest.mark.parametrize("numel", [1000, 4099])
@pytest.mark.parametrize("layout", [(2, 2), (2, 4)])
@pytest.mark.parametrize("text", MIXED)
def test_mixed_options_charge_each_compressors_bytes(text, layout, numel):
    """fp16 inside the machine, topk between machines: each step moves (and is charged)
    the bytes of the compressor whose payloads it carries."""
    machines, local = layout
    option = Option.parse(text)
    hub = LocalHub(machines, local, timeout_s=10, count_traffic=True)
    world = machines * local
    executors = [Executor(hub.transport(r), CodecPair("topk"),
                          partners={"fp16": CodecPair("fp16")}) for r in range(world)]
    with ThreadPoolExecutor(world) as pool:
        for f in [pool.submit(ex.run, option, torch.randn(numel), name="w", step=0)
                  for ex in executors]:
            f.result(timeout=30)
    cluster = Cluster(machines=machines, gpus_per_machine=local, intra_gbps=10.0,
                      intra_latency_us=5.0, inter_gbps=10.0, servers=0)
    pricer = Pricer(cluster, "topk", _packed("topk"), CompressorCosts.default(), [numel],
                    partner_sizes={"fp16": _packed("fp16")})
    charged = pricer.wire(option)
    # the hub records each group's collective once, in whatever order the threads get there;
    # no two steps here share a collective and scope, so the busiest group of each is the
    # step's (what the model charges)
    busiest: dict = {}
    for t in hub.traffic:
        key = (t.collective, t.scope)
        got = busiest.get(key)
        busiest[key] = t if got is None else max(got, t, key=lambda g: (g.nbytes, g.msgs))
    assert len(busiest) == len(charged)
    sent = sorted((t.scope.value, int(t.msgs), float(t.nbytes)) for t in busiest.values())
    want = sorted((option.steps[i].scope.value, int(np.max(msgs)), float(np.max(nbytes)))
                  for i, msgs, nbytes in charged)
    assert sent == want
