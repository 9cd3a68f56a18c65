"""The worker runtime's CUDA path: skipped cleanly on machines without CUDA.

- Options on CUDA tensors (torch backend on the GPU, numba on the host, device<->host copies)
  over the in-memory transport equal the reference interpreter on CPU tensors.
- NCCL: one worker per process group (a single GPU), a Runtime on NCCL runs every scope.
- Several workers with CUDA tensors over gloo (what one GPU allows): see
  tests/multiproc/test_executor.py, run with ESPRESSO_TEST_DEVICE=cuda.
"""

import datetime
import socket
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from byteps_espresso.worker.codecs import CodecPair
from byteps_espresso.worker.executor import Executor
from byteps_espresso.worker.local_transport import LocalHub
from byteps_espresso.worker.reference import Reference

from byteps_espresso.config import Config
from byteps_espresso.strategy.options import Option

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

OPTIONS = [
    "Comp(gpu) -> AllgatherC(flat) -> Decomp(gpu)",
    "Comp(cpu) -> AlltoallC(intra) -> Decomp(gpu) -> Comp(gpu) -> AllgatherC(inter) "
    "-> Decomp(cpu) -> Allgather(intra)",
    "Reduce(intra) -> Comp(gpu) -> GatherC(inter) -> Decomp(gpu) -> Comp(cpu) "
    "-> BroadcastC(inter) -> Decomp(cpu) -> Broadcast(intra)",
]


@pytest.mark.parametrize("option", OPTIONS)
def test_cuda_tensors_equal_cpu_reference(option):
    world = 4
    hub = LocalHub(2, 2)
    xs = [torch.randn(1001) for _ in range(world)]
    executors = [Executor(hub.transport(r), CodecPair("fp16", device="cuda"), device="cuda")
                 for r in range(world)]
    with ThreadPoolExecutor(world) as pool:
        futs = [pool.submit(executors[r].run, Option.parse(option), xs[r].cuda(), name="w", step=0)
                for r in range(world)]
        got = [f.result(timeout=60) for f in futs]
    ref = Reference(2, 2, [CodecPair("fp16") for _ in range(world)])
    expected = ref.run(Option.parse(option), xs, name="w", step=0)
    for r in range(world):
        assert got[r].is_cuda
        assert torch.equal(got[r].cpu(), expected[r])


def test_nccl_runtime_single_worker():
    from byteps_espresso.worker.runtime import Runtime

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port + 1, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=30))
    cfg = Config.from_env({"DMLC_NUM_WORKER": "1", "DMLC_NUM_SERVER": "0",
                           "DMLC_PS_ROOT_URI": "127.0.0.1", "DMLC_PS_ROOT_PORT": str(port)})
    rt = Runtime(cfg, device="cuda")
    try:
        assert rt.backend == "nccl"
        engine = rt.engine(CodecPair("fp16", device="cuda"))
        x = torch.randn(777, device="cuda")
        for option in ["Allreduce(flat)", "ReduceScatter(intra) -> Allreduce(inter) -> "
                       "Allgather(intra)", *OPTIONS]:
            out = engine.run("w", x, Option.parse(option))
            assert out.is_cuda
            torch.testing.assert_close(out, x, rtol=1e-3, atol=1e-3)
    finally:
        rt.close()
        del store
