"""Which kernels run the training device's Comp/Decomp (ESPRESSO_DEVICE_KERNELS)."""

import pytest
import torch
from byteps_espresso.worker.codecs import CodecPair, device_backend

from byteps_espresso.strategy.options import Device

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def _same(a, b):
    """Whether two payloads (numpy or torch arrays) hold the same arrays, bit for bit."""
    return len(a) == len(b) and all(torch.equal(torch.as_tensor(u), torch.as_tensor(v))
                                    for u, v in zip(a, b, strict=True))


def test_auto_picks_numba_on_the_cpu_and_torch_on_accelerators():
    assert device_backend(CPU, "auto", "efsignsgd") == "numba"
    assert device_backend(CUDA, "auto", "efsignsgd") == "torch"
    # the casts are as fast or faster with torch on host memory
    assert device_backend(CPU, "auto", "fp16") == "torch"
    assert device_backend(CPU, "torch") == "torch"
    assert device_backend(CPU, "numba") == "numba"


def test_numba_on_accelerator_memory_and_unknown_choices_are_refused():
    with pytest.raises(ValueError, match="ESPRESSO_DEVICE_KERNELS=numba needs host memory"):
        device_backend(CUDA, "numba")
    with pytest.raises(ValueError, match="unknown device kernels 'tpu'"):
        device_backend(CPU, "tpu")


def test_codec_pair_runs_the_chosen_backend_on_the_gpu_steps():
    assert CodecPair("efsignsgd").compressor(Device.GPU).backend == "numba"
    assert CodecPair("efsignsgd", device_kernels="torch").compressor(Device.GPU).backend \
        == "torch"
    # the host pool's steps are numba whatever the device kernels
    assert CodecPair("efsignsgd", device_kernels="torch").compressor(Device.CPU).backend \
        == "numba"


@pytest.mark.parametrize(("name", "params"), [
    ("efsignsgd", {}), ("dgc", {"ratio": 0.01}), ("topk", {"ratio": 0.05}),
    ("randomk", {"ratio": 0.05, "seed": 3}), ("onebit", {}), ("fp16", {})])
def test_both_kernels_give_the_same_bits_with_error_feedback_and_a_restored_state(name, params):
    g = torch.Generator().manual_seed(7)
    grads = [torch.randn(1001, generator=g) for _ in range(4)]
    numba = CodecPair(name, params, error_feedback=name != "fp16", device_kernels="numba")
    torch_ = CodecPair(name, params, error_feedback=name != "fp16", device_kernels="torch")
    for step, x in enumerate(grads[:2]):
        a = numba.compress(Device.GPU, x, "w", step)
        b = torch_.compress(Device.GPU, x, "w", step)
        assert _same(a, b)
        assert torch.equal(numba.decompress(Device.GPU, a, x.numel(), "w", step),
                           torch_.decompress(Device.GPU, b, x.numel(), "w", step))
    # a checkpoint of one backend's state resumes on the other
    restored = CodecPair(name, params, error_feedback=name != "fp16", device_kernels="torch")
    restored.load_state_dict(numba.state_dict())
    for step, x in enumerate(grads[2:], start=2):
        a = numba.compress(Device.GPU, x, "w", step)
        b = restored.compress(Device.GPU, x, "w", step)
        assert _same(a, b)


_LOADS_NOTHING_LATER = """
import torch
from byteps_espresso.kernels.cli import _dispatchers
from byteps_espresso.worker.codecs import CodecPair
from byteps_espresso.strategy.options import Device

def loaded():
    return sum(len(d.signatures) for d in {id(d): d for d in _dispatchers()}.values())

codec = CodecPair("efsignsgd", error_feedback=True)
before = loaded()
codec.load_kernels()
after = loaded()
assert codec.state_dict() == {"gpu": {}, "cpu": {}}, codec.state_dict()
x = torch.randn(100_003, generator=torch.Generator().manual_seed(0))
for dev in (Device.GPU, Device.CPU):
    payload = codec.compress(dev, x, "w", 5)
    codec.decompress(dev, payload, x.numel(), "w", 5)
    codec.aggregate(dev, [payload, payload], x.numel(), "w", 5)
print(before, after, loaded())
"""


def test_load_kernels_leaves_nothing_to_load_for_the_first_step_and_no_state():
    # A fresh process: the tests before this one may have loaded the kernels already.
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _LOADS_NOTHING_LATER], capture_output=True,
                         text=True, timeout=120, check=True).stdout.split()
    before, after, later = map(int, out)
    assert after > before  # the kernels loaded in load_kernels ...
    assert later == after  # ... and the job's first compression on each device loaded none
