"""Sums of decoded payloads and error feedback's residual, for every algorithm x backend: what
decoding each payload and adding the dense arrays in list order gives (bit for bit where the
packed bits are read straight into the sum, the sign codecs on numba; the sparse codecs add
into zeros, so a lone -0.0 sums to 0.0), a residual is a new array each step, and a payload
decoded into a slice of a larger buffer is its decoded values."""

import byteps_espresso.kernels as K
import numpy as np
import pytest
import torch
from byteps_espresso.kernels import ErrorFeedback, create
from byteps_espresso.kernels._signs import SignCodecNumba

SPARSE = {"topk", "randomk", "dgc"}
SIZES = [1, 7, 8, 9, 64, 1001, 290_305]  # under a byte, whole bytes, a ragged last byte


def make(name, backend):
    return create(name, backend=backend, **({"ratio": 0.1} if name in SPARSE else {}))


def inputs(n, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(n).astype(np.float32) * np.float32(10.0 ** rng.integers(-3, 3))
    x[::13] = 0.0
    x[5::17] = -0.0
    return x


def as_backend(x, backend):
    return torch.from_numpy(x.copy()) if backend == "torch" else x.copy()


def host(a):
    return a.numpy() if isinstance(a, torch.Tensor) else np.asarray(a)


def dense_sum(codec, payloads, ctx):
    total = host(codec.decompress(payloads[0], ctx)).copy()
    for p in payloads[1:]:
        total += host(codec.decompress(p, ctx))
    return total


@pytest.mark.parametrize("backend", ["numba", "torch"])
@pytest.mark.parametrize("name", K.names())
@pytest.mark.parametrize("n", SIZES)
def test_aggregate_equals_the_sum_of_dense_decodes(name, backend, n):
    codec = make(name, backend)
    payloads, ctx = [], None
    for r in range(5):
        payload, ctx = codec.compress(as_backend(inputs(n, r), backend), name="t", step=3)
        payloads.append(payload)
    for k in (1, 2, 5):
        got = host(codec.aggregate(payloads[:k], ctx))
        want = dense_sum(codec, payloads[:k], ctx)
        assert got.dtype == np.float32 and got.shape == want.shape
        assert np.array_equal(got, want), (name, k)
        if isinstance(codec, SignCodecNumba):
            assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), (name, k)


@pytest.mark.parametrize("backend", ["numba", "torch"])
@pytest.mark.parametrize("name", K.names())
@pytest.mark.parametrize("n", SIZES)
def test_error_feedback_keeps_the_input_minus_what_was_sent(name, backend, n):
    ef, bare = ErrorFeedback(make(name, backend)), make(name, backend)
    residual = np.zeros(n, np.float32)
    kept = []
    for step in range(3):
        x = inputs(n, 10 + step)
        payload, ctx = ef.compress(as_backend(x, backend), name="w", step=step)
        corrected = x + residual
        want_payload, _ = bare.compress(as_backend(corrected, backend), name="w", step=step)
        assert all(np.array_equal(host(a), host(b)) for a, b in zip(payload, want_payload,
                                                                     strict=True))
        residual = corrected - host(bare.decompress(want_payload, ctx))
        got = ef.residual("w")
        assert np.array_equal(host(got).view(np.uint32), residual.view(np.uint32))
        kept.append((got, host(got).copy()))
    # every step's residual is its own array: one exported earlier is not written again
    assert all(np.array_equal(host(a), b) for a, b in kept)


@pytest.mark.parametrize("backend", ["numba", "torch"])
@pytest.mark.parametrize("name", K.names())
def test_decompress_into_writes_the_decoded_values_into_its_slice_only(name, backend):
    codec = make(name, backend)
    n = 1001
    payload, ctx = codec.compress(as_backend(inputs(n, 3), backend), name="t", step=3)
    want = host(codec.decompress(payload, ctx)).reshape(-1)
    buf = torch.full((n + 20,), 7.0)
    codec.decompress_into(payload, ctx, buf[10:10 + n])
    assert np.array_equal(buf[10:10 + n].numpy().view(np.uint32), want.view(np.uint32))
    assert (buf[:10] == 7.0).all() and (buf[10 + n:] == 7.0).all()
