"""The reference interpreter: the oracle of the executor tests, checked against plain sums."""

import numpy as np
import pytest
import torch
from byteps_espresso.worker.codecs import CodecPair
from byteps_espresso.worker.layout import Extent, split
from byteps_espresso.worker.reference import Reference, ServerModel
from byteps_espresso.worker.transport import pack, packed_nbytes, unpack

from byteps_espresso.strategy.options import Option, OptionError

UNCOMPRESSED = [
    "Allreduce(flat)", "ReduceScatter(flat) -> Allgather(flat)", "Reduce(flat) -> Broadcast(flat)",
    "PushPull(flat)", "ReduceScatter(intra) -> PushPull(inter) -> Allgather(intra)",
    "Reduce(intra) -> Allreduce(inter) -> Broadcast(intra)",
    "ReduceScatter(intra) -> ReduceScatter(inter) -> Allgather(inter) -> Allgather(intra)",
]


def _inputs(numel, world=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(numel, generator=g) for _ in range(world)]


@pytest.mark.parametrize("option", UNCOMPRESSED)
@pytest.mark.parametrize("numel", [1, 5, 64, 1001])
def test_uncompressed_options_give_the_sum_on_every_worker(option, numel):
    xs = _inputs(numel)
    outs = Reference(3, 2).run(Option.parse(option), xs, name="w", step=0)
    true = sum(x.double() for x in xs)
    for out in outs:
        np.testing.assert_allclose(out.numpy(), true.numpy(), rtol=1e-5, atol=1e-6)
        assert torch.equal(out, outs[0])


@pytest.mark.parametrize("option", [
    "Comp(gpu) -> AllgatherC(flat) -> Decomp(gpu)",
    "Comp(cpu) -> AlltoallC(intra) -> Decomp(gpu) -> Comp(gpu) -> AllgatherC(inter) "
    "-> Decomp(cpu) -> Allgather(intra)",
    "Reduce(intra) -> Comp(gpu) -> PushPullC(inter) -> Decomp(cpu) -> Broadcast(intra)",
    "Comp(gpu) -> GatherC(intra) -> Decomp(gpu) -> Comp(cpu) -> AllgatherC(inter) "
    "-> Decomp(cpu) -> Comp(cpu) -> BroadcastC(intra) -> Decomp(cpu)",
    "ReduceScatter(intra) -> Comp(cpu) -> AllgatherC(inter) -> Decomp(cpu) -> Comp(gpu) "
    "-> AllgatherC(intra) -> Decomp(gpu)",
])
def test_fp16_options_are_close_to_the_sum(option):
    xs = _inputs(333)
    codecs = [CodecPair("fp16") for _ in range(6)]
    ref = Reference(3, 2, codecs, server=ServerModel(CodecPair("fp16")),
                    partition_bytes=400)
    outs = ref.run(Option.parse(option), xs, name="w", step=0)
    true = sum(x.double() for x in xs)
    np.testing.assert_allclose(outs[0].numpy(), true.numpy(), rtol=1e-2, atol=2e-2)
    assert all(torch.equal(o, outs[0]) for o in outs)


@pytest.mark.parametrize("option", [
    "Comp(gpu) -> Allreduce(flat)",               # dense collective on a payload
    "ReduceScatter(intra) -> Allreduce(flat)",     # members hold different extents
    "Reduce(intra) -> Allreduce(flat)",            # some members hold nothing
    "Allgather(intra)",                            # nothing to close
    "ReduceScatter(intra)",                        # ends on a shard
    "Comp(gpu) -> AllgatherC(flat)",               # ends compressed
    "Decomp(gpu) -> Allreduce(flat)",              # nothing to decompress
    "Comp(gpu) -> GatherC(intra) -> Decomp(gpu) -> Comp(cpu) -> BroadcastC(intra) "
    "-> Decomp(cpu)",                              # sums one machine only
])
def test_invalid_options_raise(option):
    ref = Reference(2, 2, [CodecPair("fp16") for _ in range(4)])
    with pytest.raises(OptionError):
        ref.run(Option.parse(option), _inputs(10, world=4), name="w", step=0)


@pytest.mark.parametrize("numel", [0, 1, 3, 8, 1001])
@pytest.mark.parametrize("parts", [1, 2, 3, 4])
def test_split_matches_tensor_split(numel, parts):
    shards = split(Extent(5, numel), parts)
    x = torch.arange(numel)
    expected = [len(c) for c in torch.tensor_split(x, parts)]
    assert [s.numel for s in shards] == expected
    assert shards[0].offset == 5 and shards[-1].end == 5 + numel


def test_pack_unpack_round_trip_with_alignment():
    payload = (np.arange(3, dtype=np.float16), torch.arange(5, dtype=torch.int32),
               np.array([7], dtype=np.uint8))
    spec = ((np.dtype(np.float16), 3), (np.dtype(np.int32), 5), (np.dtype(np.uint8), 1))
    buf = pack(payload, spec, packed_nbytes(spec) + 16, torch.device("cpu"))
    back = unpack(buf, spec)
    for a, b in zip(payload, back, strict=True):
        assert np.array_equal(np.asarray(a), b.numpy())
    with pytest.raises(ValueError, match="layout"):
        pack(payload[:2], spec, 64, torch.device("cpu"))


def test_pack_writes_every_byte_of_its_slice_and_no_other():
    payload = (np.arange(3, dtype=np.float16), np.array([7], dtype=np.uint8))
    spec = ((np.dtype(np.float16), 3), (np.dtype(np.uint8), 1))
    width = packed_nbytes(spec) + 8
    send = torch.full((3 * width,), 0xAB, dtype=torch.uint8)  # what an empty buffer may hold
    pack(payload, spec, width, torch.device("cpu"), out=send[width:2 * width])
    mine = send[width:2 * width]
    assert mine[:6].view(torch.float16).tolist() == [0.0, 1.0, 2.0]
    assert mine[6:8].tolist() == [0, 0] and mine[8] == 7  # the gap before the next array
    assert (mine[9:] == 0).all()  # the gap after the last one, to the slice's end
    assert (send[:width] == 0xAB).all() and (send[2 * width:] == 0xAB).all()
