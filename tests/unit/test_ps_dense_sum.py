"""The server's dense sum: its kernel against NumPy (the same float32 bits, and its
finiteness answer against np.isfinite), and the choice of the received frame it sums into."""

from __future__ import annotations

import numpy as np
import pytest
import zmq
from byteps_espresso.server import protocol as P
from byteps_espresso.server.server import _backing_frame, add_finite, warm_kernels


@pytest.mark.parametrize("n", [1, 7, 64, 4099, 1 << 16])
def test_add_finite_sums_like_numpy_bit_for_bit(n):
    rng = np.random.default_rng(n)
    acc = (rng.standard_normal(n) * 10.0 ** rng.integers(-30, 30, n)).astype(np.float32)
    x = (rng.standard_normal(n) * 10.0 ** rng.integers(-30, 30, n)).astype(np.float32)
    expected = np.add(acc, x)
    assert add_finite(acc, x)
    assert acc.tobytes() == expected.tobytes()


@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
@pytest.mark.parametrize("where", ["acc", "x"])
def test_add_finite_reports_a_non_finite_sum(bad, where):
    acc, x = np.ones(1000, np.float32), np.ones(1000, np.float32)
    (acc if where == "acc" else x)[517] = bad
    with np.errstate(invalid="ignore"):
        expected = np.add(acc, x)
    assert not add_finite(acc, x)
    np.testing.assert_array_equal(acc, expected)


def test_add_finite_reports_an_overflowing_sum_of_finite_values():
    big = np.finfo(np.float32).max
    acc, x = np.full(9, big, np.float32), np.full(9, big, np.float32)
    assert not add_finite(acc, x)
    assert np.isposinf(acc).all()


def test_a_read_only_push_is_summed_too():
    warm_kernels()  # compiles the writable and the read-only specialization
    x = np.arange(10, dtype=np.float32)
    x.flags.writeable = False
    acc = np.ones(10, np.float32)
    assert add_finite(acc, x)
    np.testing.assert_array_equal(acc, np.arange(10, dtype=np.float32) + 1)


def _received(x: np.ndarray) -> zmq.Frame:
    """``x`` as a frame received from a socket (libzmq owns its buffer)."""
    ctx = zmq.Context.instance()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    a.bind("inproc://dense-sum-frame")
    b.connect("inproc://dense-sum-frame")
    try:
        a.send(x.tobytes())
        return b.recv(copy=False)
    finally:
        a.close(linger=0)
        b.close(linger=0)


def test_the_sum_goes_into_the_received_frame_its_push_views():
    frame = _received(np.arange(8, dtype=np.float32))
    layout = P.Layout.dense(8, P.DType.FLOAT32)
    msg = P.decode([*P.encode(P.MsgType.PUSH, dtype=P.DType.FLOAT32, numel=8,
                              frames=[frame])[:1], frame], 1 << 20)
    (x,) = P.decode_payload(msg, layout)
    assert _backing_frame(x, frame) is frame
    assert _backing_frame(x.copy(), frame) is None  # a misaligned buffer was copied
    assert _backing_frame(x, memoryview(frame)) is None  # not a zmq.Frame
    view = x.view()
    view.flags.writeable = False
    assert _backing_frame(view, frame) is None  # read-only: not summed in place
