"""The measured compression error against a hand computation, with and without error feedback."""

import numpy as np
import pytest
import torch
from byteps_espresso.worker.codecs import CodecPair

from byteps_espresso.strategy.options import Device


def _topk(x: np.ndarray, k: int) -> np.ndarray:
    """What top-k sends, decoded: the k entries of largest magnitude, zeros elsewhere."""
    out = np.zeros_like(x)
    keep = np.argsort(-np.abs(x), kind="stable")[:k]
    out[keep] = x[keep]
    return out


@pytest.mark.parametrize("device", [Device.GPU, Device.CPU])
@pytest.mark.parametrize("error_feedback", [False, True])
def test_relative_error_is_what_was_sent_minus_the_input(device, error_feedback):
    rng = np.random.default_rng(3)
    x1, x2 = (rng.standard_normal(40).astype(np.float32) for _ in range(2))
    codec = CodecPair("topk", {"ratio": 0.25}, error_feedback=error_feedback)
    codec.compress(device, torch.from_numpy(x1), "w#0[0:40]", 0)
    assert codec.take_errors() == {}  # not measuring: nothing decoded, nothing recorded
    codec.measuring = True
    codec.compress(device, torch.from_numpy(x2), "w#0[0:40]", 1)
    (name, (err2, norm2)), = codec.take_errors().items()
    # error feedback: the second compression sends top-k of x2 plus what the first dropped
    carried = x1 - _topk(x1, 10) if error_feedback else 0.0
    sent = _topk(x2 + carried, 10)
    assert name == "w#0[0:40]"
    assert err2 == pytest.approx(float(np.sum((sent - x2) ** 2)), rel=1e-5)
    assert norm2 == pytest.approx(float(np.sum(x2 ** 2)), rel=1e-5)
    assert codec.take_errors() == {}  # taken once
