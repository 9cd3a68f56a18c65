"""DGC as its paper runs it: warm-up schedule, local clipping, momentum correction, on both
backends with identical payloads (Lin et al., ICLR 2018, sections 3.2-3.3)."""

import itertools
import math

import byteps_espresso.kernels as K
import numpy as np
import pytest
import torch
from byteps_espresso.kernels import MomentumCorrection, PayloadError, create, to_numpy, to_torch
from byteps_espresso.kernels._sparse import warmup_ratio, warmup_stage, warmup_stages
from byteps_espresso.kernels.dgc import DGC_WARMUP_RATIO, recipe
from byteps_espresso.kernels.momentum import clip_factor


def test_warmup_falls_exponentially_stage_by_stage():
    # 0.25 -> 0.001 takes 4 stages of at most a factor 4 (DGC's per-epoch values); over
    # 4 x 100 iterations each stage keeps one fraction for 100 iterations.
    final, steps = 0.001, 400
    assert warmup_stages(final, DGC_WARMUP_RATIO) == 4
    for t in range(0, steps, 7):
        stage = t * 4 // steps
        assert warmup_stage(t, final, DGC_WARMUP_RATIO, steps) == stage
        want = DGC_WARMUP_RATIO * (final / DGC_WARMUP_RATIO) ** (stage / 4)
        assert warmup_ratio(t, final, DGC_WARMUP_RATIO, steps) == pytest.approx(want, rel=1e-12)
    assert warmup_ratio(0, final, 0.25, steps) == 0.25
    assert warmup_ratio(99, final, 0.25, steps) == 0.25  # still the first stage
    assert warmup_ratio(steps, final, 0.25, steps) == final
    assert warmup_ratio(10**6, final, 0.25, steps) == final
    assert warmup_ratio(None, final, 0.25, steps) == final  # steady state
    assert warmup_ratio(5, final, 0.25, 0) == final  # no warm-up
    assert warmup_stage(steps, final, 0.25, steps) is None
    # DGC's epoch boundaries with a factor-4 schedule from 0.25 to 0.25 / 4**4
    assert warmup_stages(0.25 / 4**4, 0.25) == 4
    quarter = [warmup_ratio(e * 100, 0.25 / 4**4, 0.25, 400) for e in range(5)]
    np.testing.assert_allclose(quarter, [0.25, 0.0625, 0.015625, 0.00390625, 0.0009765625])
    # 0.25 -> 0.01: 3 stages, each a factor 0.04 ** (1 / 3) = 0.342 sparser
    assert warmup_stages(0.01, 0.25) == 3
    # monotone falling
    ratios = [warmup_ratio(t, final, 0.25, steps) for t in range(steps + 1)]
    assert all(a >= b for a, b in itertools.pairwise(ratios))


@pytest.mark.parametrize("backend", K.BACKENDS)
def test_warmup_sets_k_and_the_payload_lengths_per_step(backend):
    n = 10_000
    c = create("dgc", backend=backend, ratio=0.001, warmup_steps=100)
    x = np.random.default_rng(0).standard_normal(n).astype(np.float32)
    arg = torch.from_numpy(x) if backend == "torch" else x
    for step in (0, 1, 50, 99, 100, 1000):
        k = max(1, int(n * warmup_ratio(step, 0.001, 0.25, 100)))
        payload, ctx = c.compress(arg, name="w", step=step)
        assert payload[0].shape[0] == k == c.payload_lengths(n, step)[0]
        assert c.payload_nbytes(payload) == c.compressed_nbytes(n, step) == 8 * k
        # the kept entries are the k largest magnitudes
        idx = np.sort(np.lexsort((np.arange(n), -np.abs(x)))[:k])
        np.testing.assert_array_equal(np.asarray(to_numpy(payload)[1]), idx)
        c.decompress(payload, ctx)
    assert c.payload_lengths(n) == (10, 10)  # None: the steady state the cost model prices
    assert [c.stage(t) for t in (0, 24, 25, 99, 100)] == [0, 0, 1, 3, None]
    assert c.steady_step == 100 and create("topk").stage(0) is None
    # a payload of another step's length is refused
    payload, _ = c.compress(arg, name="w", step=0)
    with pytest.raises(PayloadError, match="expected"):
        c.decompress(payload, c.context((n,), name="w", step=100))


def test_warmup_parameters_are_checked():
    with pytest.raises(ValueError, match="warmup_steps"):
        create("dgc", warmup_steps=-1)
    with pytest.raises(ValueError, match="warmup_ratio"):
        create("dgc", warmup_ratio=1.5)
    with pytest.raises(ValueError, match="unknown parameter"):
        create("topk", warmup_steps=10)  # only dgc declares a warm-up


def test_clip_factor_is_the_local_threshold_formula():
    # local threshold = clip_norm / sqrt(workers)
    assert clip_factor(10.0, 8.0, 4) == np.float32(4.0 / 10.0)
    assert clip_factor(3.0, 8.0, 4) == np.float32(1.0)  # under the threshold: unchanged
    assert clip_factor(1e6, None, 4) == np.float32(1.0)
    with pytest.raises(ValueError, match="clip_norm"):
        MomentumCorrection(create("topk"), clip_norm=0.0)
    with pytest.raises(ValueError, match="workers"):
        MomentumCorrection(create("topk"), clip_norm=1.0, workers=0)


def _reference(xs, *, ratio, warmup, momentum, clip, workers):
    """DGC in float64 numpy from the paper's equations (top-k of the accumulation)."""
    u = np.zeros(xs[0].size)
    v = np.zeros(xs[0].size)
    sent = []
    local = clip / math.sqrt(workers)
    for t, x in enumerate(xs):
        g = x.astype(np.float64)
        norm = np.linalg.norm(g)
        if norm > local:
            g = g * (local / norm)
        u = momentum * u + g
        v = v + u
        k = max(1, int(x.size * warmup_ratio(t, ratio, 0.25, warmup)))
        idx = np.sort(np.lexsort((np.arange(x.size), -np.abs(v)))[:k])
        d = np.zeros_like(v)
        d[idx] = v[idx]
        sent.append(d)
        v = v - d
        u[idx] = 0.0  # momentum factor masking
    return sent


@pytest.mark.parametrize("backend", K.BACKENDS)
def test_recipe_matches_the_paper_equations(backend):
    rng = np.random.default_rng(3)
    xs = [(rng.standard_normal(2000) * (1 + 3 * (t % 2))).astype(np.float32) for t in range(8)]
    dgc = recipe(backend, ratio=0.01, warmup_steps=5, momentum=0.9, clip_norm=40.0, workers=4)
    want = _reference(xs, ratio=0.01, warmup=5, momentum=0.9, clip=40.0, workers=4)
    for t, x in enumerate(xs):
        arg = torch.from_numpy(x) if backend == "torch" else x
        y = dgc.decompress(*dgc.compress(arg, name="w", step=t))
        y = y.numpy() if backend == "torch" else y
        np.testing.assert_allclose(y, want[t], rtol=1e-4, atol=1e-5)
        assert np.count_nonzero(y) == max(1, int(2000 * warmup_ratio(t, 0.01, 0.25, 5)))


def test_recipe_payloads_are_identical_on_both_backends():
    rng = np.random.default_rng(4)
    comps = {b: recipe(b, ratio=0.01, warmup_steps=6, clip_norm=30.0, workers=4)
             for b in K.BACKENDS}
    for t in range(9):
        x = (rng.standard_normal(5000) * (1 + t)).astype(np.float32)
        pt, _ = comps["torch"].compress(torch.from_numpy(x.copy()), name="layer", step=t)
        pn, _ = comps["numba"].compress(x.copy(), name="layer", step=t)
        for a, b in zip(to_numpy(pt), pn, strict=True):
            assert a.dtype == b.dtype
            assert a.tobytes() == b.tobytes()
        # and the payloads decode on the other backend
        cn = create("dgc", backend="numba", ratio=0.01, warmup_steps=6)
        ctx = cn.context((5000,), name="layer", step=t)
        cn.decompress(to_numpy(pt), ctx)
        create("dgc", backend="torch", ratio=0.01, warmup_steps=6).decompress(to_torch(pn), ctx)
    for slot in ("velocity", "accumulated"):
        assert comps["torch"].state["layer"][slot].numpy().tobytes() == \
            comps["numba"].state["layer"][slot].tobytes()


def test_clipping_leaves_state_untouched_on_non_finite_input():
    dgc = recipe("numba", ratio=0.1, clip_norm=1.0)
    dgc.compress(np.ones(100, np.float32), name="w", step=0)
    before = {k: v.copy() for k, v in dgc.state["w"].items()}
    bad = np.ones(100, np.float32)
    bad[3] = np.nan
    with pytest.raises(K.NonFiniteError):
        dgc.compress(bad, name="w", step=1)
    for k, v in before.items():
        np.testing.assert_array_equal(dgc.state["w"][k], v)
