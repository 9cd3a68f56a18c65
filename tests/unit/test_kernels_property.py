"""Property-based tests (hypothesis) over tensor sizes, including 1, odd sizes,
non-multiples of 8 and a 16M-element case for the bit-packed codecs."""

import byteps_espresso.kernels as K
import numpy as np
import pytest
import torch
from byteps_espresso.kernels import create, to_numpy, to_torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

PACKED = ["signsgd", "efsignsgd", "onebit", "terngrad", "qsgd"]
SPARSE = {"topk", "randomk", "dgc"}
SMALL_SIZES = st.one_of(st.sampled_from([1, 2, 3, 7, 8, 9, 15, 17, 63, 65, 1023]),
                        st.integers(min_value=1, max_value=5000))


def _signbits(x):
    return (x.view(np.uint32) >> 31).astype(bool)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=st.sampled_from(K.names()), n=SMALL_SIZES, seed=st.integers(0, 2**32 - 1),
       ratio=st.floats(min_value=1e-4, max_value=1.0))
def test_any_size_round_trips_identically_on_both_backends(name, n, seed, ratio):
    params = {"ratio": ratio} if name in SPARSE else {}
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(n) * 10.0 ** rng.integers(-20, 20)).astype(np.float32)
    cn, ct = create(name, "numba", **params), create(name, "torch", **params)
    pn, ctx = cn.compress(x, name="p", step=seed % 97)
    pt, _ = ct.compress(torch.from_numpy(x), name="p", step=seed % 97)
    assert cn.payload_nbytes(pn) == cn.compressed_nbytes(n) == ct.payload_nbytes(pt)
    for a, b in zip(pn, to_numpy(pt), strict=True):
        np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))
    y = cn.decompress(pn, ctx)
    assert y.shape == (n,) and y.dtype == np.float32
    np.testing.assert_array_equal(y, ct.decompress(to_torch(pn), ctx).numpy())
    if name in {"signsgd", "signum", "efsignsgd", "onebit"}:
        # Sign codecs: the decoded sign follows the input's sign bit.
        np.testing.assert_array_equal(_signbits(y) | (y == 0), _signbits(x) | (y == 0))


# 16M elements plus a few, so the last byte is partial; one example per codec keeps it fast.
LARGE = 1 << 24


@pytest.mark.parametrize("name", PACKED)
@settings(max_examples=1, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.data_too_large])
@given(extra=st.integers(1, 7))
def test_packed_codecs_at_16m_elements(name, extra):
    n = LARGE + extra
    x = np.random.default_rng(extra).standard_normal(n).astype(np.float32)
    c = create(name, "numba", **({"levels": 7} if name == "qsgd" else {}))
    payload, ctx = c.compress(x, name="big")
    assert c.payload_nbytes(payload) == c.compressed_nbytes(n)
    bits = {"terngrad": 2, "qsgd": 4}.get(name, 1)
    assert payload[0].size == -(-n * bits // 8)
    y = c.decompress(payload, ctx)
    assert y.shape == (n,)
    if bits == 1:
        np.testing.assert_array_equal(payload[0], np.packbits(_signbits(x), bitorder="little"))
    else:
        # Quantized codecs never flip a sign.
        assert not np.any((y != 0) & (_signbits(y) != _signbits(x)))
    # The torch backend agrees on the packed signs at this size too.
    if name == "signsgd":
        (pt,), _ = create(name, "torch").compress(torch.from_numpy(x))
        np.testing.assert_array_equal(pt.numpy(), payload[0])
