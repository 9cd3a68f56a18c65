"""The compiled program is what every interpreter runs: forms, extents and pairs per step kind.

Three interpreters read :func:`compile_option`: the executor (here over the in-memory
transport, ranks as threads), the reference interpreter (every group visited explicitly,
extents cut by its own handlers) and the pricer (the largest shard per step). For Options
that together use every step kind, each one's forms and extents after every step must be
the program's.
"""

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from byteps_espresso.worker.codecs import CodecPair
from byteps_espresso.worker.executor import Executor
from byteps_espresso.worker.layout import Extent, split
from byteps_espresso.worker.local_transport import LocalHub
from byteps_espresso.worker.reference import Reference, ServerModel
from byteps_espresso.worker.topology import Topology

from byteps_espresso.strategy import Cluster, CompressorCosts, enumerate_options, validate
from byteps_espresso.strategy.costs import CompressedSizes, Pricer
from byteps_espresso.strategy.options import Kind, Option, OptionError, Scope
from byteps_espresso.strategy.program import (
    RULES,
    Form,
    Pairing,
    compile_option,
    payload_count,
)

MACHINES, LOCAL = 2, 3  # intra groups of 3, inter groups of 2: uneven shards
OPTIONS = [
    "Allreduce(flat)",
    "ReduceScatter(intra) -> Allreduce(inter) -> Allgather(intra)",
    "Reduce(intra) -> ReduceScatter(inter) -> Allgather(inter) -> Broadcast(intra)",
    "Comp(gpu) -> AlltoallC(intra) -> Decomp(gpu) -> Comp(cpu) -> AllgatherC(inter) "
    "-> Decomp(cpu) -> Allgather(intra)",
    "ReduceScatter(flat) -> Comp(gpu) -> AllgatherC(flat) -> Decomp(gpu)",
    "Comp(gpu) -> GatherC(flat) -> Decomp(gpu) -> Comp(gpu) -> BroadcastC(flat) -> Decomp(gpu)",
    "Reduce(intra) -> Comp(cpu) -> GatherC(inter) -> Decomp(cpu) -> Comp(gpu) "
    "-> BroadcastC(inter) -> Decomp(gpu) -> Broadcast(intra)",
    "ReduceScatter(intra) -> PushPull(inter) -> Allgather(intra)",
    "Comp(gpu) -> AlltoallC(intra) -> Decomp(gpu) -> Comp(cpu) -> PushPullC(inter) "
    "-> Decomp(cpu) -> Allgather(intra)",
    # a payload all-reduce (the interpreters run fp16, whose payloads sum)
    "Comp(cpu) -> AllreduceC(flat) -> Decomp(gpu)",
    "ReduceScatter(intra) -> Comp(gpu) -> AllreduceC(inter) -> AllgatherC(intra) -> Decomp(cpu)",
]
# Gathered payloads forwarded undecoded through the next compressed step(s): every step kind
# that forwards (summing AllgatherC, GatherC, BroadcastC), once and twice in a row.
FORWARDED = [
    "Comp(gpu) -> GatherC(flat) -> BroadcastC(flat) -> Decomp(gpu)",
    "Comp(gpu) -> AlltoallC(intra) -> AllgatherC(inter) -> Decomp(cpu) -> Allgather(intra)",
    "Comp(cpu) -> GatherC(intra) -> AllgatherC(inter) -> BroadcastC(intra) -> Decomp(gpu)",
    "Comp(gpu) -> GatherC(intra) -> GatherC(inter) -> BroadcastC(inter) -> BroadcastC(intra) "
    "-> Decomp(gpu)",
    "Comp(gpu) -> AlltoallC(intra) -> GatherC(inter) -> BroadcastC(inter) -> Decomp(gpu) "
    "-> Comp(gpu) -> AllgatherC(intra) -> Decomp(gpu)",
    "Reduce(intra) -> Comp(gpu) -> AllgatherC(inter) -> BroadcastC(intra) -> Decomp(gpu)",
]
OPTIONS += FORWARDED
NUMELS = [2, 11, 301]  # fewer elements than members (empty shards), odd, larger


def test_the_cases_cover_every_step_kind_and_the_tables_cover_every_kind():
    used = {s.kind for o in OPTIONS for s in Option.parse(o).steps}
    assert used == set(Kind)
    assert set(RULES) == set(Kind)


def _extent(topo: Topology, numel: int, shards) -> Extent:
    ext = Extent(0, numel)
    for scope in shards:
        ext = split(ext, topo.size(scope))[topo.index(scope)]
    return ext


def _expected(op, topo: Topology) -> Form:
    """The form rank ``topo.rank`` holds after ``op`` (the program's, or NONE asleep)."""
    if any(topo.index(s) != 0 for s in op.sleepers):
        return Form.NONE
    if op.opens is not None and op.opens.pairing is Pairing.ROOTED and topo.index(op.scope):
        return Form.NONE
    return op.makes


def _observed(value) -> str:
    """The executor's value, classified: dense, none, one payload, or one per member."""
    if value is None:
        return "none"
    if isinstance(value, torch.Tensor):
        return "dense"
    assert isinstance(value, list)
    return "members" if value and isinstance(value[0], list) else "payload"


_CLASS = {Form.DENSE: "dense", Form.NONE: "none", Form.PAYLOAD: "payload",
          Form.CHUNKS: "members", Form.SUM: "members", Form.CONCAT: "members"}


@pytest.mark.parametrize("numel", NUMELS)
@pytest.mark.parametrize("text", [o for o in OPTIONS if "PushPull" not in o])
def test_the_executor_holds_the_programs_forms_and_extents(text, numel):
    option, prog = Option.parse(text), compile_option(Option.parse(text))
    hub = LocalHub(MACHINES, LOCAL, timeout_s=10)
    world = MACHINES * LOCAL
    seen: list[list] = [[] for _ in range(world)]
    executors = []
    for r in range(world):
        ex = Executor(hub.transport(r), CodecPair("fp16"))
        ex.trace = lambda i, v, r=r: seen[r].append((i, v))
        executors.append(ex)
    xs = [torch.randn(numel) for _ in range(world)]
    with ThreadPoolExecutor(world) as pool:
        for f in [pool.submit(executors[r].run, option, xs[r], name="w", step=0)
                  for r in range(world)]:
            f.result(timeout=30)
    for r in range(world):
        topo = hub.topology.with_rank(r)
        assert [i for i, _ in seen[r]] == list(range(len(prog)))
        for (i, value), op in zip(seen[r], prog.ops, strict=True):
            form = _expected(op, topo)
            assert _observed(value) == _CLASS[form], f"rank {r} after step {i} {op.step}"
            ext = _extent(topo, numel, op.shards)
            if form is Form.DENSE:
                assert value.numel() == ext.numel, f"rank {r} after step {i} {op.step}"
            elif form is Form.PAYLOAD:
                assert len(value) == (1 if ext.numel else 0) or op.origin.ps
            elif form is not Form.NONE:
                count = topo.size(op.chunks) if op.chunks else payload_count(op.payloads,
                                                                             topo.size)
                assert len(value) == count, f"rank {r} after step {i} {op.step}"


def _reference_trace(text: str, numel: int) -> dict:
    world = MACHINES * LOCAL
    ref = Reference(MACHINES, LOCAL, [CodecPair("fp16") for _ in range(world)],
                    ServerModel(CodecPair("fp16")), partition_bytes=64)
    got: dict = {}
    ref.run(Option.parse(text), [torch.randn(numel) for _ in range(world)], name="w", step=0,
            trace=lambda i, r, form, ext: got.__setitem__((i, r), (form, ext)))
    return got


@pytest.mark.parametrize("numel", NUMELS)
@pytest.mark.parametrize("text", OPTIONS)
def test_the_reference_and_the_pricer_hold_the_programs_forms_and_extents(text, numel):
    prog = compile_option(Option.parse(text))
    got = _reference_trace(text, numel)
    topo = Topology(MACHINES, LOCAL)
    cluster = Cluster.preset(MACHINES, LOCAL, "pcie", 10, servers=1)
    pricer = Pricer(cluster, "fp16", CompressedSizes("fp16"),
                    CompressorCosts.default(), [numel])
    for op in prog.ops:
        held = []
        for r in range(topo.world_size):
            form, ext = got[op.index, r]
            here = topo.with_rank(r)
            assert form is _expected(op, here), f"rank {r} after step {op.index} {op.step}"
            if form is not Form.NONE:
                assert ext == _extent(here, numel, op.shards), f"rank {r}, step {op.index}"
                held.append(ext.numel)
        # the pricer charges every step for the largest shard any member holds
        np.testing.assert_array_equal(pricer.extent(op.shards), [max(held)])


def test_every_option_of_the_tree_compiles_and_pairs_as_the_tree_says():
    for option in enumerate_options(Cluster.preset(2, 2, "pcie", 10, servers=1)):
        prog = compile_option(option)
        assert all((op.opens is None) == (RULES[op.kind].opens is None) for op in prog.ops)
        for pair in prog.pairs:
            assert prog.ops[pair.close].closes == pair
            assert option.steps[pair.open].scope is option.steps[pair.close].scope


def test_forwarded_payloads_are_counted_through_every_gather():
    """A forwarding step sends the list the gather before it left; the Decomp at the end
    decodes one payload per member of every gathering group."""
    topo = Topology(MACHINES, LOCAL)
    prog = compile_option(Option.parse(FORWARDED[3]))
    # Comp, GatherC(intra), GatherC(inter), BroadcastC(inter), BroadcastC(intra), Decomp
    assert [op.makes for op in prog.ops] == [Form.PAYLOAD, Form.SUM, Form.SUM, Form.SUM,
                                            Form.SUM, Form.DENSE]
    assert [op.forwards for op in prog.ops] == [(), (), (Scope.INTRA,), *[(Scope.INTRA,
                                                Scope.INTER)] * 2, ()]
    decomp = prog.ops[-1]
    assert decomp.takes is Form.SUM and decomp.payloads == (Scope.INTRA, Scope.INTER)
    assert payload_count(decomp.payloads, topo.size) == LOCAL * MACHINES
    # a gather of one payload forwards nothing
    assert prog.ops[1].forwards == () and prog.ops[1].payloads == (Scope.INTRA,)


@pytest.mark.parametrize(("text", "why"), [
    # a closing AllgatherC concatenates one payload per shard
    ("Comp(gpu) -> AlltoallC(flat) -> AllgatherC(flat) -> Decomp(gpu)", "concatenates one"),
    # the servers sum one payload per pusher
    ("Comp(gpu) -> AlltoallC(intra) -> PushPullC(inter) -> Decomp(gpu) -> Allgather(intra)",
     "servers sum one payload"),
    # AlltoallC splits the chunks of a Comp
    ("Comp(gpu) -> GatherC(intra) -> AlltoallC(inter) -> Decomp(gpu) -> Allgather(inter) "
     "-> Broadcast(intra)", "cannot forward"),
    # gathered shards are decoded at once
    ("Reduce(intra) -> ReduceScatter(inter) -> Comp(gpu) -> AllgatherC(inter) "
     "-> BroadcastC(intra) -> Decomp(gpu)", "decoded at once"),
])
def test_what_cannot_forward_gathered_payloads_says_why(text, why):
    option = Option.parse(text)
    with pytest.raises(OptionError, match=why):
        compile_option(option)
    with pytest.raises(OptionError, match=why):
        validate(option)


@pytest.mark.parametrize("text", [
    "Allgather(flat)",  # nothing to close
    "ReduceScatter(flat) -> Broadcast(flat)",  # closes the wrong pairing
    "ReduceScatter(intra) -> Allgather(inter)",  # closes the wrong scope
    "Reduce(flat)",  # never closed
    "Comp(gpu) -> Decomp(gpu)",  # Comp without a communication step
    "Comp(gpu) -> Allreduce(flat) -> Decomp(gpu)",  # a dense step on a payload
    "Comp(gpu) -> AllgatherC(flat)",  # ends compressed
])
def test_invalid_options_fail_to_compile_and_to_validate(text):
    option = Option.parse(text)
    with pytest.raises(OptionError):
        compile_option(option)
    with pytest.raises(OptionError):
        validate(option)
