"""Statistical unbiasedness of the stochastic codecs, and the wrappers' invariants."""

import byteps_espresso.kernels as K
import numpy as np
import pytest
import torch
from byteps_espresso.kernels import ErrorFeedback, MomentumCorrection, NonFiniteError, create

# Unbiasedness: every decoded entry is a two-point draw around x with a known gap g (the
# distance between the two values it can round to), so by Hoeffding's inequality the mean of
# T independent draws lies within g * sqrt(ln(2 / delta) / (2 T)) of x with probability
# 1 - delta. delta = 1e-6 per entry. The draws are keyed by step with fixed seeds, so the test
# is deterministic. A second check averages the gap-normalized errors over all entries:
# each has sd <= 0.5 / sqrt(T), so their mean must lie within 5 * 0.5 / sqrt(T * n).
T = 1000
DELTA = 1e-6


def _gap(c, x, payload):
    name = c.name
    if name == "qsgd":
        return np.full_like(x, payload[1][0]) / c.levels
    if name == "terngrad":
        return np.full_like(x, payload[1][0])
    if name == "natural":
        return 2.0 ** np.floor(np.log2(np.abs(x)))
    return np.abs(x) * (x.size / payload[0].size)  # randomk: x * n / k or 0


@pytest.mark.parametrize(("name", "params"), [
    ("qsgd", {"levels": 3}),
    ("qsgd", {"levels": 127}),
    ("terngrad", {}),
    ("natural", {}),
    ("randomk", {"ratio": 0.25, "scale": True}),
])
def test_unbiased_codecs_are_unbiased(name, params):
    c = create(name, backend="numba", **params)
    assert c.unbiased
    rng = np.random.default_rng(42)
    x = (rng.choice([-1, 1], 512) * rng.uniform(0.01, 2.0, 512)).astype(np.float32)
    total = np.zeros(x.size, np.float64)
    for step in range(T):
        payload, ctx = c.compress(x, name="w", step=step)
        total += c.decompress(payload, ctx)
    gap = _gap(c, x, payload).astype(np.float64)
    error = total / T - x
    assert np.all(np.abs(error) <= gap * np.sqrt(np.log(2 / DELTA) / (2 * T)) + 1e-7)
    assert abs(np.mean(error / gap)) < 5 * 0.5 / np.sqrt(T * x.size)


def test_randomk_without_scaling_is_biased_and_says_so():
    assert not create("randomk", backend="numba").unbiased
    assert create("randomk", backend="numba", scale=True).unbiased


def test_randomk_selects_uniformly():
    c = create("randomk", backend="numba", ratio=0.1)
    counts = np.zeros(200)
    for step in range(2000):
        counts[c.indices(200, c.context((200,), name="w", step=step))] += 1
    # Each index is kept with probability 0.1: expected 200, binomial sd ~13.4.
    assert np.all(np.abs(counts - 200) < 5 * 13.4), (counts.min(), counts.max())


# ---- error feedback -----------------------------------------------------------------------------

SPARSE = {"topk", "randomk", "dgc"}


@pytest.mark.parametrize("backend", K.BACKENDS)
@pytest.mark.parametrize("name", K.names())
def test_error_feedback_conserves_the_sum(name, backend):
    params = {"ratio": 0.05} if name in SPARSE else {}
    ef = ErrorFeedback(create(name, backend=backend, **params))
    assert (ef.name, ef.wire_id, ef.backend) == (name, K.wire_id(name), backend)
    rng = np.random.default_rng(1)
    inputs_sum = np.zeros((10, 31), np.float64)
    sent_sum = np.zeros((10, 31), np.float64)
    for step in range(6):
        x = rng.standard_normal((10, 31)).astype(np.float32)
        arg = torch.from_numpy(x) if backend == "torch" else x
        payload, ctx = ef.compress(arg, name="layer", step=step)
        y = ef.decompress(payload, ctx)
        sent_sum += y.numpy() if backend == "torch" else y
        inputs_sum += x
    residual = ef.residual("layer")
    residual = residual.numpy() if backend == "torch" else residual
    np.testing.assert_allclose(sent_sum + residual, inputs_sum, rtol=0, atol=1e-4)


def test_error_feedback_keeps_one_residual_per_name_and_checks_shapes():
    ef = ErrorFeedback(create("topk", backend="numba", ratio=0.5))
    ef.compress(np.array([4.0, 1.0], np.float32), name="a")
    ef.compress(np.array([1.0, 4.0], np.float32), name="b")
    np.testing.assert_array_equal(ef.residual("a"), [0.0, 1.0])
    np.testing.assert_array_equal(ef.residual("b"), [1.0, 0.0])
    with pytest.raises(ValueError, match=r"reset\('a'\)"):
        ef.compress(np.ones(3, np.float32), name="a")
    ef.reset("a")
    ef.compress(np.ones(3, np.float32), name="a")
    with pytest.raises(NonFiniteError):
        ef.compress(np.array([np.nan, 1.0], np.float32), name="b")
    np.testing.assert_array_equal(ef.residual("b"), [1.0, 0.0])  # untouched
    with pytest.raises(TypeError, match="wraps a Compressor"):
        ErrorFeedback("topk")


def test_error_feedback_serves_server_side_recompression():
    # A server aggregates two workers' payloads and re-compresses the sum with its own EF.
    workers = [ErrorFeedback(create("onebit", backend="torch")) for _ in range(2)]
    server = ErrorFeedback(create("onebit", backend="numba"))
    rng = np.random.default_rng(3)
    pushed, pulled = np.zeros(64), np.zeros(64)
    for step in range(4):
        payloads = []
        for rank, w in enumerate(workers):
            x = rng.standard_normal(64).astype(np.float32)
            pushed += x
            p, ctx = w.compress(torch.from_numpy(x), name="g", step=step)
            payloads.append(K.to_numpy(p))
            del rank
        total = server.aggregate(payloads, server.context((64,), name="g", step=step))
        p, ctx = server.compress(total.astype(np.float32), name="g", step=step)
        pulled += server.decompress(p, ctx)
    residuals = sum(w.residual("g").numpy() for w in workers) + server.residual("g")
    np.testing.assert_allclose(pulled + residuals, pushed, atol=1e-4)


# ---- momentum correction ------------------------------------------------------------------------

def _dgc_reference(xs, momentum, ratio):
    u = np.zeros_like(xs[0])
    v = np.zeros_like(xs[0])
    sent = []
    for x in xs:
        u = momentum * u + x
        v = v + u
        k = max(1, int(x.size * ratio))
        idx = np.sort(np.lexsort((np.arange(x.size), -np.abs(v)))[:k])
        d = np.zeros_like(v)
        d[idx] = v[idx]
        sent.append(d)
        v = v - d
        u[idx] = 0
    return sent, u, v


@pytest.mark.parametrize("backend", K.BACKENDS)
def test_momentum_correction_matches_the_dgc_reference(backend):
    rng = np.random.default_rng(5)
    xs = [rng.standard_normal(300).astype(np.float32) for _ in range(5)]
    mc = MomentumCorrection(create("dgc", backend=backend, ratio=0.05), momentum=0.9)
    want, u, v = _dgc_reference(xs, np.float32(0.9), 0.05)
    for step, x in enumerate(xs):
        arg = torch.from_numpy(x) if backend == "torch" else x
        y = mc.decompress(*mc.compress(arg, name="w", step=step))
        np.testing.assert_allclose(y.numpy() if backend == "torch" else y, want[step],
                                   rtol=1e-5, atol=1e-6)
    state = {k: (a.numpy() if backend == "torch" else a) for k, a in mc.state["w"].items()}
    np.testing.assert_allclose(state["velocity"], u, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(state["accumulated"], v, rtol=1e-5, atol=1e-6)


def test_momentum_correction_without_masking_conserves_the_velocity_sum():
    rng = np.random.default_rng(6)
    mc = MomentumCorrection(create("topk", backend="numba", ratio=0.1), momentum=0.5,
                            masking=False)
    u = np.zeros(100, np.float64)
    velocity_sum = np.zeros(100)
    sent = np.zeros(100)
    for step in range(5):
        x = rng.standard_normal(100).astype(np.float32)
        u = 0.5 * u + x
        velocity_sum += u
        sent += mc.decompress(*mc.compress(x, name="w", step=step))
    np.testing.assert_allclose(sent + mc.state["w"]["accumulated"], velocity_sum, atol=1e-4)
    with pytest.raises(ValueError, match="momentum"):
        MomentumCorrection(create("topk"), momentum=1.5)
