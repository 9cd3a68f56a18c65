"""Compressor state exported and imported (checkpoints): a compressor restored from another's
state goes on with bit-identical payloads, on both backends, through every stateful layer
(error feedback, DGC momentum correction, signum's momentum) and through ``torch.save``."""

import io

import numpy as np
import pytest
import torch
from byteps_espresso.kernels import ErrorFeedback, MomentumCorrection, create, to_numpy
from byteps_espresso.worker.codecs import CodecPair

from byteps_espresso.strategy.options import Device

NUMEL = 1000
NAMES = ("w#0[0:1000]", "b#2[0:1000]")


def _input(step: int, i: int, backend: str):
    x = np.random.default_rng([step, i, 5]).standard_normal(NUMEL, np.float32)
    return torch.from_numpy(x) if backend == "torch" else x


def _stateful(kind: str, backend: str):
    if kind == "ef-randomk":
        return ErrorFeedback(create("randomk", backend=backend, ratio=0.1, seed=3))
    if kind == "dgc-momentum":
        return MomentumCorrection(create("dgc", backend=backend, ratio=0.05), momentum=0.9,
                                  clip_norm=10.0, workers=4)
    if kind == "ef-signum":
        return ErrorFeedback(create("signum", backend=backend, momentum=0.8))
    raise AssertionError(kind)


def _steps(comp, steps, backend):
    return [[to_numpy(comp.compress(_input(s, i, backend), name=n, step=s)[0])
             for i, n in enumerate(NAMES)] for s in steps]


@pytest.mark.parametrize("backend", ["torch", "numba"])
@pytest.mark.parametrize("kind", ["ef-randomk", "dgc-momentum", "ef-signum"])
def test_a_restored_compressor_goes_on_bit_identical(kind, backend):
    uninterrupted = _stateful(kind, backend)
    _steps(uninterrupted, range(3), backend)
    state = uninterrupted.export_state()
    assert sorted(state) == sorted(NAMES) and all(state[n] for n in NAMES)
    restored = _stateful(kind, backend)
    restored.import_state({n: {s: a.clone() if isinstance(a, torch.Tensor) else a.copy()
                               for s, a in slots.items()} for n, slots in state.items()})
    fresh = _stateful(kind, backend)
    want, got = _steps(uninterrupted, range(3, 6), backend), _steps(restored, range(3, 6),
                                                                   backend)
    for a, b in zip(want, got, strict=True):
        for pa, pb in zip(a, b, strict=True):
            assert all(x.tobytes() == y.tobytes() for x, y in zip(pa, pb, strict=True))
    # Without the state the same steps differ: the test would notice a lost slot.
    lost = _steps(fresh, range(3, 6), backend)
    assert any(x.tobytes() != y.tobytes() for a, b in zip(want, lost, strict=True)
               for pa, pb in zip(a, b, strict=True) for x, y in zip(pa, pb, strict=True))


def test_a_slot_no_layer_keeps_is_refused_by_name():
    ef = ErrorFeedback(create("topk", backend="numba", ratio=0.1))
    with pytest.raises(ValueError, match=r"\['velocity'\] are not kept"):
        ef.import_state({"w": {"residual": np.zeros(3, np.float32),
                               "velocity": np.zeros(3, np.float32)}})
    assert create("topk", backend="numba").export_state() == {}


def test_codec_pair_state_survives_torch_save_on_both_devices():
    def run(pair, steps):
        out = []
        for s in steps:
            for dev in (Device.GPU, Device.CPU):
                x = torch.from_numpy(np.asarray(_input(s, 0, "numba")))
                out.append(to_numpy(pair.compress(dev, x, f"t#{dev.value}", s)))
        return out

    a = CodecPair("randomk", {"ratio": 0.1, "seed": 1}, error_feedback=True)
    run(a, range(2))
    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)
    buf.seek(0)
    b = CodecPair("randomk", {"ratio": 0.1, "seed": 1}, error_feedback=True)
    b.load_state_dict(torch.load(buf, weights_only=True))
    assert sorted(b.state_dict()["cpu"]) == ["t#cpu"] and sorted(b.state_dict()["gpu"]) == [
        "t#gpu"]
    for pa, pb in zip(run(a, range(2, 4)), run(b, range(2, 4)), strict=True):
        assert all(x.tobytes() == y.tobytes() for x, y in zip(pa, pb, strict=True))
