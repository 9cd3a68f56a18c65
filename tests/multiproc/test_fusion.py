"""Tensor fusion over real processes: 2 machines x 2 workers and a server (gloo, loopback).

Gradients of mixed dtypes and odd sizes are fused into buckets (a small
``ESPRESSO_BUCKET_CAP_MB`` makes several, one of them a gradient above the cap alone). Every
rank uses the same layout, and every gradient equals what the reference interpreter gives for
its bucket (the members' float32 values concatenated, the fp32 Option, divided by the world
size, cast back to the parameter's dtype), bit for bit. A parameter that gets no gradient on
one rank in one iteration counts as zeros there, as with DDP's find_unused_parameters.
``synchronize()`` before ``step()`` (or ``step()`` inside ``skip_synchronize()``) sends each
bucket once per iteration.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from byteps_espresso.worker.reference import Reference, ServerModel
from byteps_espresso.worker.session import fp32_option
from byteps_espresso.worker.topology import Topology

from byteps_espresso.strategy.buckets import MiB, layout

MACHINES, LOCAL = 2, 2
WORLD = MACHINES * LOCAL
CAP_MB = 0.002  # 2,097 bytes: 524 float32 elements per bucket
_spec = importlib.util.spec_from_file_location(
    "fusion_worker", Path(__file__).parent / "workers" / "fusion_worker.py")
worker = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(worker)


@pytest.mark.timeout(200)
def test_fused_buckets_match_the_reference_bit_for_bit(tmp_path, cluster):
    steps = 3
    env = {"ESPRESSO_BUCKET_CAP_MB": str(CAP_MB)}
    with cluster.ps_job(servers=1) as root:
        outputs = cluster.run_workers("fusion_worker.py", [str(tmp_path), str(steps)],
                                      root_port=root, servers=1, timeout=150, extra_env=env)
    # Only the rank that lost a gradient says so, naming the parameter.
    assert [f"got no gradient in iteration 1 (e.g. ['{worker.UNUSED}'])" in out
            for out in outputs] == [False, True, False, False]
    # Backward order: reverse registration, every rank the same.
    order = [name for name, _, _ in reversed(worker.PARAMS)]
    sizes = {name: int(np.prod(shape)) for name, shape, _ in worker.PARAMS}
    cap = int(CAP_MB * MiB)
    expected_layout = layout([(n, sizes[n]) for n in order], cap, cap)
    layouts = [json.loads((tmp_path / f"buckets_{r}.json").read_text()) for r in range(WORLD)]
    assert all(got == [list(b.tensors) for b in expected_layout] for got in layouts)
    assert any(b.fused for b in expected_layout) and ["big"] in layouts[0]
    for r in range(WORLD):  # synchronize() then step(): each bucket sent once an iteration
        sent = json.loads((tmp_path / f"sent_{r}.json").read_text())
        assert sent == {b.name: steps for b in expected_layout}
        assert "after optimizer.step()" in (tmp_path / f"refused_{r}.txt").read_text()
    unused = next(b for b in expected_layout if worker.UNUSED in b.tensors)
    assert unused.fused and unused.tensors[-1] != worker.UNUSED

    # the test's two machines run on this host: the flat path (baselines.fp32_option)
    option = fp32_option(Topology(MACHINES, LOCAL), servers=1, shared_host=True)
    assert {(tmp_path / f"fp32_{r}.txt").read_text() for r in range(WORLD)} == {str(option)}
    dtypes = {name: dtype for name, _, dtype in worker.PARAMS}
    ref = Reference(MACHINES, LOCAL, server=ServerModel())
    for step in range(steps):
        per_rank = [worker.grads(r, step) for r in range(WORLD)]
        for bucket in expected_layout:
            inputs = [torch.cat([g[n].float().reshape(-1) if n in g else torch.zeros(sizes[n])
                                 for n in bucket.tensors]) for g in per_rank]
            total = ref.run(option, inputs, name=bucket.name, step=step)[0] / WORLD
            offset = 0
            for name in bucket.tensors:
                want = total[offset:offset + sizes[name]].to(dtypes[name]).double().numpy()
                offset += sizes[name]
                for r in range(WORLD):
                    got = np.load(tmp_path / f"grad_{step}_{r}_{name}.npy").reshape(-1)
                    assert np.array_equal(got, want), f"step {step} rank {r} {name}"
