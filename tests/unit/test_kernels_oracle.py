"""Each algorithm against a small, independent NumPy reference (both backends)."""

import math

import numpy as np
import pytest
import torch
from byteps_espresso.kernels import create, key_seed
from byteps_espresso.kernels._random import uniform_torch

BACKENDS = ("numba", "torch")


def run(name, backend, x, **params):
    c = create(name, backend=backend, **params)
    arg = torch.from_numpy(x.copy()) if backend == "torch" else x.copy()
    payload, ctx = c.compress(arg, name="t", step=7)
    host = tuple(a.numpy() if isinstance(a, torch.Tensor) else a for a in payload)
    y = c.decompress(payload, ctx)
    return c, host, (y.numpy() if isinstance(y, torch.Tensor) else y)


def sample(n=2003, seed=0):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(n) * np.exp(rng.uniform(-8, 8, n))).astype(np.float32)
    x[::17] = 0.0
    x[5::31] = -0.0
    x[7::29] = x[8]  # ties
    return x


def draws(n):
    """The uniforms the stochastic codecs draw for tensor "t", step 7, seed 0."""
    return uniform_torch(n, key_seed(0, "t", 7), torch.device("cpu")).numpy()


def signbits(x):
    return (x.view(np.uint32) >> 31).astype(np.uint8)


@pytest.mark.parametrize("backend", BACKENDS)
def test_fp16(backend):
    x = sample()
    _, (p,), y = run("fp16", backend, x)
    np.testing.assert_array_equal(p, x.astype(np.float16))
    np.testing.assert_array_equal(y, x.astype(np.float16).astype(np.float32))


def _bf16_reference(v):
    # Candidates: truncation and the next bfloat16 away from zero; nearest wins, ties to even.
    bits = int(np.float32(v).view(np.uint32))
    lo = bits & 0xFFFF0000
    hi = lo + 0x10000
    flo = float(np.uint32(lo).view(np.float32))
    fhi = float(np.uint32(hi).view(np.float32)) if (hi >> 23) & 0xFF != 0xFF or lo >> 16 == 0x7F7F \
        else math.copysign(math.inf, v)
    dlo, dhi = abs(float(v) - flo), abs(fhi - float(v))
    if dlo < dhi or (dlo == dhi and not (lo >> 16) & 1):
        return lo >> 16
    return (hi >> 16) & 0xFFFF


@pytest.mark.parametrize("backend", BACKENDS)
def test_bf16(backend):
    x = sample(501)
    x[:4] = [1.0 + 2**-8, 1.0 + 3 * 2**-8, -(1.0 + 2**-8), 3.3895314e38]  # exact ties, near max
    _, (p,), y = run("bf16", backend, x)
    want = np.array([_bf16_reference(v) for v in x], np.uint16)
    np.testing.assert_array_equal(p, want)
    np.testing.assert_array_equal(y, (want.astype(np.uint32) << 16).view(np.float32))


@pytest.mark.parametrize("backend", BACKENDS)
def test_int8(backend):
    x = sample()
    _, (q, scale), y = run("int8", backend, x)
    want_scale = np.float32(np.abs(x).max()) / np.float32(127)
    assert scale[0] == want_scale
    want = np.clip(np.rint(x / want_scale), -127, 127).astype(np.int8)
    np.testing.assert_array_equal(q, want)
    np.testing.assert_array_equal(y, want.astype(np.float32) * want_scale)
    assert np.abs(y - x).max() <= want_scale / 2 * (1 + 1e-6)


def _topk_reference(x, k):
    order = np.lexsort((np.arange(x.size), -np.abs(x)))  # larger |x| first, then lower index
    return np.sort(order[:k])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["topk", "dgc"])
@pytest.mark.parametrize("ratio", [0.001, 0.05, 0.5, 1.0])
def test_topk_and_dgc(name, backend, ratio):
    x = sample(40000)
    x[100:300] = 7.0  # a large block of ties straddling the cut
    _c, (values, idx), y = run(name, backend, x, ratio=ratio)
    k = max(1, int(x.size * ratio))
    want = _topk_reference(x, k)
    np.testing.assert_array_equal(idx, want.astype(np.int32))
    np.testing.assert_array_equal(values, x[want])
    dense = np.zeros_like(x)
    dense[want] = x[want]
    np.testing.assert_array_equal(y, dense)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("scale", [False, True])
def test_randomk(backend, scale):
    x = sample()
    _c, (values, idx), y = run("randomk", backend, x, ratio=0.1, scale=scale)
    k = int(x.size * 0.1)
    assert idx.size == k and np.unique(idx).size == k and (np.diff(idx) > 0).all()
    factor = np.float32(x.size / k) if scale else np.float32(1)
    np.testing.assert_array_equal(values, x[idx] * factor)
    dense = np.zeros_like(x)
    dense[idx] = x[idx] * factor
    np.testing.assert_array_equal(y, dense)


@pytest.mark.parametrize("backend", BACKENDS)
def test_signsgd(backend):
    x = sample(1001)
    _, (p,), y = run("signsgd", backend, x)
    np.testing.assert_array_equal(p, np.packbits(signbits(x), bitorder="little"))
    np.testing.assert_array_equal(y, np.where(signbits(x), -1.0, 1.0).astype(np.float32))


def wide(n=5000, seed=4):
    """Magnitudes over 60 decades, with subnormals and exact zeros, across several blocks."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(n) * 10.0 ** rng.uniform(-30, 30, n)).astype(np.float32)
    x[::97] = np.float32(3e-42) * rng.choice([-1, 1])
    x[::101] = 0.0
    return x


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("make_x", [lambda: sample(1001), wide])
def test_efsignsgd(backend, make_x):
    x = make_x()
    _, (p, scale), y = run("efsignsgd", backend, x)
    want = np.float32(math.fsum(abs(float(v)) for v in x) / x.size)
    np.testing.assert_allclose(scale[0], want, rtol=2**-23)
    np.testing.assert_array_equal(p, np.packbits(signbits(x), bitorder="little"))
    np.testing.assert_array_equal(y, np.where(signbits(x), -scale[0], scale[0]))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("make_x", [lambda: sample(1001), wide])
def test_onebit(backend, make_x):
    x = make_x()
    neg = signbits(x).astype(bool)
    _, (_p, means), y = run("onebit", backend, x)
    want = [math.fsum(map(float, x[~neg])) / (~neg).sum(),
            math.fsum(map(float, x[neg])) / neg.sum()]
    np.testing.assert_allclose(means, np.array(want, np.float32), rtol=2**-23)
    np.testing.assert_array_equal(y, np.where(neg, means[1], means[0]))
    # Each group's sum is preserved.
    np.testing.assert_allclose(y[neg].sum(dtype=np.float64), x[neg].sum(dtype=np.float64),
                               rtol=1e-5)
    # Both backends agree bit for bit, also on wide-range input.
    _, (_, other), _ = run("onebit", "torch" if backend == "numba" else "numba", x)
    np.testing.assert_array_equal(means, other)
    # Without negatives the second mean is 0.
    _, (_, only_pos), _ = run("onebit", backend, np.abs(x) + 1)
    assert only_pos[1] == 0


def _unpack(packed, n, bits):
    per = 8 // bits
    codes = (packed[:, None] >> (np.arange(per) * bits)) & ((1 << bits) - 1)
    return codes.reshape(-1)[:n].astype(np.int64)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("levels", "bits"), [(1, 2), (3, 4), (7, 4), (8, 8), (127, 8)])
def test_qsgd(backend, levels, bits):
    x = sample(777)
    _, (packed, norm), y = run("qsgd", backend, x, levels=levels)
    want_norm = np.float32(math.sqrt(math.fsum(float(v) ** 2 for v in x)))
    np.testing.assert_allclose(norm[0], want_norm, rtol=2**-23)
    r = (np.abs(x) / norm[0]) * np.float32(levels)
    level = np.minimum(np.floor(r) + (draws(x.size) < r - np.floor(r)), levels).astype(np.int64)
    code = np.where(signbits(x), levels - level, levels + level)
    np.testing.assert_array_equal(_unpack(packed, x.size, bits), code)
    unit = norm[0] / np.float32(levels)
    np.testing.assert_array_equal(y, (code - levels).astype(np.float32) * unit)


@pytest.mark.parametrize("backend", BACKENDS)
def test_terngrad(backend):
    x = sample(777)
    _, (packed, s), y = run("terngrad", backend, x)
    assert s[0] == np.abs(x).max()
    keep = draws(x.size) < np.abs(x) / s[0]
    want = np.where(keep, np.where(signbits(x), -s[0], s[0]), 0).astype(np.float32)
    np.testing.assert_array_equal(y, want)
    assert packed.size == (x.size + 3) // 4


@pytest.mark.parametrize("backend", BACKENDS)
def test_natural(backend):
    x = sample(3001)
    x[:3] = [1.5, -0.75, 2.0**-140]  # halfway cases and one far below the lowest power
    _, (codes, low), y = run("natural", backend, x)
    amax_exp = math.frexp(float(np.abs(x).max()))[1] - 1
    assert low[0] == amax_exp + 127 + 1 - 126
    u = draws(x.size)
    h = (uniform_torch(x.size, key_seed(0, "t", 7), torch.device("cpu")).numpy() * 2**24)
    lowest = 2.0 ** (int(low[0]) - 127)
    for i, v in enumerate(x.astype(np.float64)):
        a = abs(v)
        if a >= max(lowest, 2.0**-126):
            _m, e = math.frexp(a)  # a = m * 2**e, m in [0.5, 1)
            down = 2.0 ** (e - 1)
            frac = (a - down) / down  # exact: the 23-bit significand / 2**23
            up = (int(h[i]) >> 1) < round(frac * 2**23)
            want = down * 2 if up else down
        else:
            want = lowest if u[i] < a / lowest else 0.0
        assert y[i] == np.float32(math.copysign(want, v) if want else 0.0), (i, v, y[i])
    assert codes.dtype == np.uint8
