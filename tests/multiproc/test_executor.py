"""Every Option of a covering set runs on 2 emulated machines x 2 workers (gloo, loopback).

For each case (Option x tensor size x compressor, two iterations so error feedback and
per-step seeds matter) every worker must end bit-identical, equal to the reference
interpreter, and uncompressed Options must equal the true sum within fp32 tolerance.

Covering set: every scheme (indivisible Allreduce/AllgatherC; divisible ReduceScatter +
Allgather, Reduce + Broadcast, AlltoallC + AllgatherC, GatherC + BroadcastC; mixes of
compressed and dense halves) in flat and hierarchical (intra + inter) paths, every
compute step on both devices, AllgatherC both summing (indivisible) and concatenating
(closing a divisible step), and gathered payloads forwarded undecoded through a summing
AllgatherC, a GatherC or a BroadcastC (the tree-covering cases tell them apart by form).
Sizes include 1 (empty shards), odd and non-multiple sizes, and one above the size where a
flat Reduce splits into a reduce-scatter and a gather.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from byteps_espresso.worker.codecs import CodecPair
from byteps_espresso.worker.reference import Reference, ServerModel

from byteps_espresso.strategy.options import Kind, Option, Scope

MACHINES, LOCAL = 2, 2
WORLD = MACHINES * LOCAL

UNCOMPRESSED = [
    "Allreduce(flat)",
    "ReduceScatter(flat) -> Allgather(flat)",
    "Reduce(flat) -> Broadcast(flat)",
    "ReduceScatter(intra) -> Allreduce(inter) -> Allgather(intra)",
    "Reduce(intra) -> Allreduce(inter) -> Broadcast(intra)",
    "ReduceScatter(intra) -> ReduceScatter(inter) -> Allgather(inter) -> Allgather(intra)",
    "Reduce(intra) -> Reduce(inter) -> Broadcast(inter) -> Broadcast(intra)",
    "PushPull(flat)",
    "ReduceScatter(intra) -> PushPull(inter) -> Allgather(intra)",
    "Reduce(intra) -> PushPull(inter) -> Broadcast(intra)",
]

COMPRESSED = [
    "Comp(gpu) -> AllgatherC(flat) -> Decomp(gpu)",
    "Comp(cpu) -> AllgatherC(flat) -> Decomp(cpu)",
    "Comp(gpu) -> AlltoallC(flat) -> Decomp(gpu) -> Comp(gpu) -> AllgatherC(flat) -> Decomp(gpu)",
    "Comp(cpu) -> AlltoallC(flat) -> Decomp(gpu) -> Comp(cpu) -> AllgatherC(flat) -> Decomp(cpu)",
    "Comp(gpu) -> AlltoallC(flat) -> Decomp(cpu) -> Allgather(flat)",
    "Comp(gpu) -> GatherC(flat) -> Decomp(cpu) -> Comp(gpu) -> BroadcastC(flat) -> Decomp(gpu)",
    "Comp(cpu) -> GatherC(flat) -> Decomp(gpu) -> Broadcast(flat)",
    "ReduceScatter(flat) -> Comp(gpu) -> AllgatherC(flat) -> Decomp(gpu)",
    "Reduce(flat) -> Comp(cpu) -> BroadcastC(flat) -> Decomp(gpu)",
    "ReduceScatter(intra) -> Comp(gpu) -> AllgatherC(inter) -> Decomp(gpu) -> Allgather(intra)",
    "Comp(gpu) -> AlltoallC(intra) -> Decomp(gpu) -> Comp(cpu) -> AllgatherC(inter) "
    "-> Decomp(cpu) -> Allgather(intra)",
    "Reduce(intra) -> Comp(gpu) -> GatherC(inter) -> Decomp(gpu) -> Comp(cpu) "
    "-> BroadcastC(inter) -> Decomp(cpu) -> Broadcast(intra)",
    "Comp(cpu) -> GatherC(intra) -> Decomp(cpu) -> Comp(gpu) -> AlltoallC(inter) -> Decomp(gpu) "
    "-> Comp(gpu) -> AllgatherC(inter) -> Decomp(gpu) -> Comp(gpu) -> BroadcastC(intra) "
    "-> Decomp(gpu)",
    "ReduceScatter(intra) -> Comp(cpu) -> AllgatherC(inter) -> Decomp(cpu) -> Comp(gpu) "
    "-> AllgatherC(intra) -> Decomp(gpu)",
    "Comp(gpu) -> AlltoallC(intra) -> Decomp(gpu) -> Allreduce(inter) -> Comp(cpu) "
    "-> AllgatherC(intra) -> Decomp(gpu)",
    "Comp(cpu) -> PushPullC(flat) -> Decomp(cpu)",
    "Comp(gpu) -> PushPullC(flat) -> Decomp(gpu)",
    "Reduce(intra) -> Comp(cpu) -> PushPullC(inter) -> Decomp(cpu) -> Broadcast(intra)",
    "Comp(gpu) -> AlltoallC(intra) -> Decomp(gpu) -> Comp(cpu) -> PushPullC(inter) "
    "-> Decomp(cpu) -> Allgather(intra)",
    "ReduceScatter(intra) -> Comp(gpu) -> PushPullC(inter) -> Decomp(cpu) -> Comp(gpu) "
    "-> AllgatherC(intra) -> Decomp(gpu)",
    # fp16's payloads summed inside the collective (AllreduceC)
    "Comp(gpu) -> AllreduceC(flat) -> Decomp(gpu)",
    "Comp(cpu) -> AllreduceC(flat) -> Decomp(gpu)",
    "ReduceScatter(intra) -> Comp(cpu) -> AllreduceC(inter) -> Decomp(cpu) -> Allgather(intra)",
    "ReduceScatter(intra) -> Comp(gpu) -> AllreduceC(inter) -> AllgatherC(intra) -> Decomp(gpu)",
    "Reduce(intra) -> Comp(gpu) -> AllreduceC(inter) -> BroadcastC(intra) -> Decomp(cpu)",
]

# Mixed compressors: fp16 inside the machine, the job's compressor between machines (the
# runtime's engines carry the fp16 partner).
MIXED = [
    "Comp(gpu,fp16) -> AlltoallC(intra) -> Decomp(gpu,fp16) -> Comp(gpu) -> AllgatherC(inter) "
    "-> Decomp(gpu) -> Comp(gpu,fp16) -> AllgatherC(intra) -> Decomp(gpu,fp16)",
    "Comp(cpu,fp16) -> GatherC(intra) -> Decomp(cpu,fp16) -> Comp(gpu) -> PushPullC(inter) "
    "-> BroadcastC(intra) -> Decomp(gpu)",
    "Comp(gpu,fp16) -> AlltoallC(intra) -> Decomp(cpu,fp16) -> Comp(cpu) -> PushPullC(inter) "
    "-> Decomp(cpu) -> Allgather(intra)",
    "Comp(gpu,fp16) -> GatherC(intra) -> Decomp(gpu,fp16) -> Comp(gpu) -> GatherC(inter) "
    "-> Decomp(gpu) -> Broadcast(inter) -> Comp(cpu,fp16) -> BroadcastC(intra) "
    "-> Decomp(gpu,fp16)",
    "ReduceScatter(intra) -> Comp(gpu) -> AllgatherC(inter) -> Decomp(gpu) -> Comp(gpu,fp16) "
    "-> AllgatherC(intra) -> Decomp(gpu,fp16)",
]

SIZES = [1, 7, 1000, 4099]
# Above program.REDUCE_SPLIT_BYTES (64 KiB of float32): a flat Reduce over 4 members runs as a
# reduce-scatter then a gather of the summed shards.
LARGE = 20_011
SPLIT_REDUCE = [("Reduce(flat) -> Broadcast(flat)", None),
                ("Reduce(flat) -> Comp(cpu) -> BroadcastC(flat) -> Decomp(gpu)",
                 {"name": "fp16", "params": {}, "ef": False})]
# Small PS partitions (bytes) so that the larger sizes split into several server keys.
PARTITION_BYTES = 4096
CODECS = [{"name": "fp16", "params": {}, "ef": False}]


# Compressors the tree-covering cases rotate through (error feedback where it is the default).
TREE_CODECS = [
    {"name": "randomk", "params": {"ratio": 0.3}, "ef": True},
    {"name": "topk", "params": {"ratio": 0.2}, "ef": True},
    {"name": "dgc", "params": {"ratio": 0.2}, "ef": True},
    {"name": "efsignsgd", "params": {}, "ef": True},
    {"name": "onebit", "params": {}, "ef": True},
    {"name": "fp16", "params": {}, "ef": False},
]


def tree_covering() -> list[Option]:
    """From the 2 x 2 decision tree with one server: one Option per communication signature
    (steps, scopes, the forms they take and the compressor of the payloads they move: a step
    that forwards gathered payloads differs from one that does not, fp16 inside the machine
    from the job's compressor), and one per (signature, devices) among the PS Options."""
    from byteps_espresso.strategy import Cluster, enumerate_options
    from byteps_espresso.strategy.program import compile_option

    seen: dict = {}
    for o in enumerate_options(Cluster.preset(MACHINES, LOCAL, "pcie", 10, servers=1)):
        comm = tuple((op.kind, op.scope, op.takes, op.codec) for op in compile_option(o).ops
                     if not op.kind.is_compute)
        seen.setdefault((comm, o.devices if o.uses_servers else None), o)
    return list(seen.values())


def _cases() -> list[dict]:
    cases = []
    for i, option in enumerate(tree_covering()):
        codec = TREE_CODECS[i % len(TREE_CODECS)] if option.is_compressed else None
        cases.append({"option": str(option), "numel": SIZES[i % len(SIZES)], "codec": codec,
                      "iters": 2})
    for option in UNCOMPRESSED:
        for numel in SIZES:
            cases.append({"option": option, "numel": numel, "codec": None, "iters": 1})
    for option, codec in SPLIT_REDUCE:
        cases.append({"option": option, "numel": LARGE, "codec": codec, "iters": 1})
    for codec in CODECS:
        for option in COMPRESSED:
            for numel in SIZES:
                cases.append({"option": option, "numel": numel, "codec": codec, "iters": 2})
    job = [c for c in TREE_CODECS if c["name"] != "fp16"]  # the partner's a different one
    for i, option in enumerate(MIXED):
        for j, numel in enumerate((7, 4099)):
            cases.append({"option": option, "numel": numel, "iters": 2,
                          "codec": job[(2 * i + j) % len(job)]})
    return cases


CASES = _cases()


def case_input(case: int, it: int, rank: int, numel: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(case * 7919 + it * 104729 + rank * 31)
    return torch.randn(numel, generator=g)


@pytest.fixture(scope="module")
def results(tmp_path_factory, cluster):
    """Run every case once on 4 real worker processes; {(case, it): [per-rank arrays]}."""
    tmp = tmp_path_factory.mktemp("executor")
    (tmp / "cases.json").write_text(json.dumps(CASES))
    for idx, case in enumerate(CASES):
        for it in range(case["iters"]):
            for r in range(WORLD):
                np.save(tmp / f"in_{idx}_{it}_{r}.npy",
                        case_input(idx, it, r, case["numel"]).numpy(), allow_pickle=False)
    # Start-up (importing torch in 4 workers at once) can take over a minute on a loaded
    # 2-core host: give the scheduler's rendezvous more than its 60 s default.
    env = {"BYTEPS_PARTITION_BYTES": str(PARTITION_BYTES), "ESPRESSO_START_TIMEOUT": "200"}
    with cluster.ps_job(MACHINES, LOCAL, servers=1, extra_env=env) as root:
        cluster.run_workers("options_worker.py", [str(tmp / "cases.json"), str(tmp)],
                            machines=MACHINES, local_size=LOCAL, root_port=root, servers=1,
                            timeout=240, extra_env=env)
    out = {}
    for idx, case in enumerate(CASES):
        for it in range(case["iters"]):
            out[idx, it] = [np.load(tmp / f"{idx}_{it}_{r}.npy") for r in range(WORLD)]
    return out


def _reference(idx: int, case: dict) -> list[list[np.ndarray]]:
    spec = case["codec"]
    codecs, server = None, None
    if spec is not None:
        codecs = [CodecPair(spec["name"], spec["params"], error_feedback=spec["ef"])
                  for _ in range(WORLD)]
        server = ServerModel(CodecPair(spec["name"], spec["params"], error_feedback=spec["ef"]))
    ref = Reference(MACHINES, LOCAL, codecs, server, partition_bytes=PARTITION_BYTES,
                    partners={"fp16": [CodecPair("fp16") for _ in range(WORLD)]})
    option = Option.parse(case["option"])
    return [[t.numpy() for t in ref.run(option, [case_input(idx, it, r, case["numel"])
                                                 for r in range(WORLD)], name=f"t{idx}", step=it)]
            for it in range(case["iters"])]


def _native_flat_allreduce(option: Option) -> bool:
    """The only sums whose order the backend chooses: all-reduces over > 2 members."""
    return any(s.kind in (Kind.ALLREDUCE, Kind.ALLREDUCE_C) and s.scope is Scope.FLAT
               for s in option.steps)


def _tolerance(option: Option) -> float:
    """Of a sum in the backend's order: float32's, or half precision's where the payloads are
    summed in it (each addition rounded to 11 significant bits, 2^-9 at the inputs' sums of
    up to about 4)."""
    return 1e-2 if any(s.kind is Kind.ALLREDUCE_C for s in option.steps) else 1e-5


@pytest.mark.timeout(300)
@pytest.mark.parametrize("idx", range(len(CASES)),
                         ids=[f"{c['numel']}-{c['codec'] and c['codec']['name']}-{c['option']}"
                              for c in CASES])
def test_option_matches_reference(results, idx):
    case = CASES[idx]
    option = Option.parse(case["option"])
    expected = _reference(idx, case)
    for it in range(case["iters"]):
        got = results[idx, it]
        for r in range(1, WORLD):
            assert np.array_equal(got[r], got[0]), f"rank {r} differs from rank 0 (iter {it})"
        if _native_flat_allreduce(option):
            tol = _tolerance(option)
            np.testing.assert_allclose(got[0], expected[it][0], rtol=tol, atol=tol)
        else:
            assert np.array_equal(got[0], expected[it][0]), \
                f"iter {it}: max diff {np.abs(got[0] - expected[it][0]).max()}"
        if case["codec"] is None:
            true = sum(case_input(idx, it, r, case["numel"]).double() for r in range(WORLD))
            np.testing.assert_allclose(got[0], true.numpy(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("option", MIXED)
def test_mixed_cases_are_in_the_tree(option):
    from byteps_espresso.strategy import Cluster
    from byteps_espresso.strategy.tree import option_set

    assert Option.parse(option) in option_set(Cluster.preset(MACHINES, LOCAL, "pcie", 10,
                                                             servers=1))
