"""Compressor contract for every algorithm x backend: round trip, sizes, interop, bad input."""

import byteps_espresso.kernels as K
import numpy as np
import pytest
import torch
from byteps_espresso.kernels import NonFiniteError, PayloadError, create, to_numpy, to_torch

SPARSE = {"topk", "randomk", "dgc"}
PASS_THROUGH = {"fp16", "bf16"}  # carry NaN/Inf instead of refusing them
ALL = K.names()
EXPECTED = ["bf16", "dgc", "efsignsgd", "fp16", "int8", "natural", "onebit", "qsgd", "randomk",
            "signsgd", "signum", "terngrad", "topk"]


def params(name):
    return {"ratio": 0.1} if name in SPARSE else {}


def make(name, backend, **extra):
    return create(name, backend=backend, **{**params(name), **extra})


def as_backend(x, backend):
    return torch.from_numpy(x.copy()) if backend == "torch" else x.copy()


def host(a):
    return a.numpy() if isinstance(a, torch.Tensor) else np.asarray(a)


def data(n, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(n).astype(np.float32)
    x[::13] = 0.0
    return x


def test_every_algorithm_is_registered_with_its_own_wire_id():
    assert ALL == EXPECTED
    ids = [K.wire_id(n) for n in ALL]
    assert len(set(ids)) == len(ids)
    assert K.wire_id("fp16") == 1
    for n in ALL:
        assert K.by_wire_id(K.wire_id(n)) == n
    with pytest.raises(ValueError, match="known ids"):
        K.by_wire_id(999)


@pytest.mark.parametrize("backend", K.BACKENDS)
@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("shape", [(1,), (7, 3), (2, 5, 9), (1000,)])
def test_round_trip_shape_dtype_and_sizes(name, backend, shape):
    c = make(name, backend)
    x = data(int(np.prod(shape))).reshape(shape)
    payload, ctx = c.compress(as_backend(x, backend), name="layer", step=2)
    assert isinstance(payload, tuple)
    assert c.payload_nbytes(payload) == c.compressed_nbytes(x.size)
    lengths = c.payload_lengths(x.size)
    assert [host(a).size for a in payload] == list(lengths)
    assert [host(a).dtype for a in payload] == [np.dtype(d) for d in c.payload_dtypes]
    assert all(host(a).ndim == 1 and host(a).flags.c_contiguous for a in payload)
    y = c.decompress(payload, ctx)
    assert tuple(y.shape) == shape
    assert host(y).dtype == np.float32
    assert np.isfinite(host(y)).all()
    # The receiver rebuilds the ctx from shape alone.
    again = c.decompress(payload, c.context(shape, name="layer", step=2))
    np.testing.assert_array_equal(host(again), host(y))
    total = c.aggregate([payload, payload], ctx)
    np.testing.assert_allclose(host(total), 2 * host(y), rtol=1e-6, atol=1e-30)


@pytest.mark.parametrize("name", ALL)
def test_payloads_interoperate_across_backends(name):
    x = data(4099, seed=3)
    t, n = make(name, "torch"), make(name, "numba")
    pt, ctx_t = t.compress(torch.from_numpy(x.copy()), name="w", step=5)
    pn, ctx_n = n.compress(x.copy(), name="w", step=5)
    # Every algorithm here is reproducible: deterministic ones by construction, stochastic ones
    # because both backends draw from the same counter hash; so payloads are bit-identical.
    for a, b in zip(pt, pn, strict=True):
        np.testing.assert_array_equal(host(a).view(np.uint8), b.view(np.uint8))
    from_torch = n.decompress(to_numpy(pt), ctx_n)
    from_numba = t.decompress(to_torch(pn), ctx_t)
    np.testing.assert_array_equal(from_torch, from_numba.numpy())
    np.testing.assert_array_equal(n.decompress(pn, ctx_n), t.decompress(pt, ctx_t).numpy())


@pytest.mark.parametrize("name", ["randomk", "qsgd", "terngrad", "natural"])
def test_stochastic_draws_depend_on_seed_name_and_step(name):
    c = make(name, "numba")
    x = data(5000)
    base = c.compress(x, name="a", step=1)[0]

    def differs(p):
        return any(not np.array_equal(u, v) for u, v in zip(base, p, strict=True))

    assert not differs(c.compress(x, name="a", step=1)[0])
    assert differs(c.compress(x, name="a", step=2)[0])
    assert differs(c.compress(x, name="b", step=1)[0])
    assert differs(make(name, "numba", seed=1).compress(x, name="a", step=1)[0])


def test_randomk_workers_agree_on_indices_whatever_the_values():
    a, b = make("randomk", "numba"), make("randomk", "torch")
    pa, _ = a.compress(data(1000, seed=1), name="k", step=9)
    pb, _ = b.compress(torch.from_numpy(data(1000, seed=2)), name="k", step=9)
    np.testing.assert_array_equal(pa[1], pb[1].numpy())


# ---- bad input ----------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", K.BACKENDS)
@pytest.mark.parametrize("name", ALL)
def test_bad_inputs_raise_clear_errors(name, backend):
    c = make(name, backend)
    x = data(64).reshape(8, 8)
    with pytest.raises(ValueError, match="contiguous"):
        c.compress(as_backend(x, backend).T)
    with pytest.raises(TypeError, match="float32"):
        c.compress(as_backend(x.astype(np.float64), backend))
    with pytest.raises(ValueError, match="empty"):
        c.compress(as_backend(np.zeros(0, np.float32), backend))
    other = torch.from_numpy(x) if backend == "numba" else x
    with pytest.raises(TypeError, match="to_numpy" if backend == "numba" else "to_torch"):
        c.compress(other)
    with pytest.raises(TypeError, match=r"must be a .*got list"):
        c.compress(x.tolist())


@pytest.mark.parametrize("backend", K.BACKENDS)
@pytest.mark.parametrize("name", ALL)
def test_malformed_payloads_raise_payload_error(name, backend):
    c = make(name, backend)
    payload, ctx = c.compress(as_backend(data(100), backend), name="w")
    with pytest.raises(PayloadError, match="arrays"):
        c.decompress(payload + payload[:1], ctx)
    with pytest.raises(PayloadError, match="elements"):
        c.decompress(payload, c.context((1000,)))
    with pytest.raises(PayloadError, match="tuple"):
        c.decompress(payload[0], ctx)
    wrong = payload[0].to(torch.float64) if backend == "torch" else payload[0].astype(np.float64)
    with pytest.raises(PayloadError, match="dtype"):
        c.decompress((wrong, *payload[1:]), ctx)
    short = payload[0][:-1] if host(payload[0]).size > 1 else payload[0][:0]
    with pytest.raises(PayloadError, match="shape"):
        c.decompress((short, *payload[1:]), ctx)
    foreign = to_numpy(payload) if backend == "torch" else to_torch(payload)
    with pytest.raises(PayloadError, match="must be a"):
        c.decompress(foreign, ctx)


@pytest.mark.parametrize("backend", K.BACKENDS)
@pytest.mark.parametrize("name", sorted(SPARSE))
def test_sparse_payload_indices_are_checked(name, backend):
    c = make(name, backend)
    payload, ctx = c.compress(as_backend(data(100), backend))
    values, idx = payload
    for bad in (idx.flip(0) if backend == "torch" else idx[::-1].copy(), idx * 0, idx + 100):
        with pytest.raises(PayloadError, match="ascending"):
            c.decompress((values, bad), ctx)
        with pytest.raises(PayloadError, match="ascending"):
            c.aggregate([payload, (values, bad)], ctx)


@pytest.mark.parametrize("name", sorted(SPARSE))
@pytest.mark.parametrize("ratio", [0, -0.5, 1.5, "0.1", True, float("nan")])
def test_ratio_outside_unit_interval_is_refused(name, ratio):
    with pytest.raises(ValueError, match=r"ratio must be a number in \(0, 1\]"):
        create(name, backend="numba", ratio=ratio)


def test_unknown_names_parameters_and_bad_values_are_refused():
    with pytest.raises(ValueError, match="choose one of bf16, dgc"):
        create("nope")
    with pytest.raises(ValueError, match="choose one of torch, numba"):
        create("fp16", backend="cuda")
    with pytest.raises(ValueError, match="valid parameters: ratio"):
        create("topk", ratio=0.1, k=3)
    with pytest.raises(ValueError, match="valid parameters: none"):
        create("fp16", ratio=0.1)
    with pytest.raises(ValueError, match="levels"):
        create("qsgd", levels=128)
    with pytest.raises(ValueError, match="levels"):
        create("qsgd", levels=0)
    with pytest.raises(ValueError, match="seed"):
        create("randomk", seed=-1)
    with pytest.raises(ValueError, match="momentum"):
        create("signum", momentum=1.0)
    with pytest.raises(ValueError, match="scale"):
        create("randomk", scale="yes")
    with pytest.raises(ValueError, match="sample_ratio"):
        create("dgc", sample_ratio=0)
    with pytest.raises(ValueError, match="unknown compressor"):
        K.wire_id("nope")


def _with_nan_and_inf(n=200):
    x = data(n)
    x[3] = np.nan
    y = data(n)
    y[150] = -np.inf
    return x, y


@pytest.mark.parametrize("backend", K.BACKENDS)
@pytest.mark.parametrize("name", sorted(set(ALL) - PASS_THROUGH - {"randomk"}))
def test_non_finite_input_raises_naming_the_tensor(name, backend):
    c = make(name, backend)
    for bad in _with_nan_and_inf():
        with pytest.raises(NonFiniteError, match=r"'layer3\.bias'"):
            c.compress(as_backend(bad, backend), name="layer3.bias", step=4)


@pytest.mark.parametrize("backend", K.BACKENDS)
def test_randomk_refuses_a_selected_non_finite_value_only(backend):
    x = data(200)
    c = make("randomk", backend)
    _, ctx = c.compress(as_backend(x, backend), name="w")
    chosen = c.indices(200, ctx)
    unchosen = np.setdiff1d(np.arange(200), chosen)
    x[chosen[0]] = np.nan
    with pytest.raises(NonFiniteError, match="'w'"):
        c.compress(as_backend(x, backend), name="w")
    x[chosen[0]] = 1.0
    x[unchosen[0]] = np.inf
    payload, _ = c.compress(as_backend(x, backend), name="w")
    assert np.isfinite(host(payload[0])).all()


@pytest.mark.parametrize("backend", K.BACKENDS)
@pytest.mark.parametrize("name", sorted(PASS_THROUGH))
def test_fp16_and_bf16_carry_nan_and_inf(name, backend):
    x = np.array([1.0, np.nan, np.inf, -np.inf, -2.0, 1e30], np.float32)
    c = make(name, backend)
    y = host(c.decompress(*c.compress(as_backend(x, backend))))
    assert np.isnan(y[1]) and y[2] == np.inf and y[3] == -np.inf and y[4] == -2.0
    if name == "fp16":
        assert y[5] == np.inf  # beyond the float16 range
    else:
        assert abs(y[5] / 1e30 - 1) < 2**-8  # bfloat16 keeps float32's range


def test_signum_keeps_momentum_per_name_and_survives_a_refused_input():
    c = make("signum", "numba", momentum=0.5)
    c.compress(np.ones(4, np.float32), name="a")
    c.compress(-np.ones(4, np.float32), name="b")
    np.testing.assert_array_equal(c.momenta["a"], np.full(4, 0.5, np.float32))
    np.testing.assert_array_equal(c.momenta["b"], np.full(4, -0.5, np.float32))
    with pytest.raises(NonFiniteError):
        c.compress(np.array([np.nan, 0, 0, 0], np.float32), name="a")
    np.testing.assert_array_equal(c.momenta["a"], np.full(4, 0.5, np.float32))
    # -1.0 after +1.0 with momentum 0.5: m = 0.25 - 0.5 = -0.25, so all signs flip.
    payload, ctx = c.compress(-np.ones(4, np.float32), name="a")
    np.testing.assert_array_equal(c.decompress(payload, ctx), -np.ones(4, np.float32))


def test_signum_momenta_are_identical_on_both_backends():
    t, n = make("signum", "torch"), make("signum", "numba")
    for step in range(5):
        x = data(1001, seed=step)
        pt, _ = t.compress(torch.from_numpy(x.copy()), name="w", step=step)
        pn, _ = n.compress(x, name="w", step=step)
        np.testing.assert_array_equal(pt[0].numpy(), pn[0])
    np.testing.assert_array_equal(t.momenta["w"].numpy(), n.momenta["w"])


def test_dgc_takes_the_sampled_path_and_matches_topk():
    x = data(1 << 17, seed=11)
    c, ref = make("dgc", "numba", ratio=0.01), make("topk", "numba", ratio=0.01)
    from byteps_espresso.kernels.dgc import sample_plan
    assert sample_plan(x.size, c.keep(x.size), c.sample_ratio)[0] > 0
    for step in range(3):
        got = c.compress(x, name="w", step=step)[0]
        want = ref.compress(x, name="w", step=step)[0]
        for a, b in zip(got, want, strict=True):
            np.testing.assert_array_equal(a, b)


def test_espresso_compressors_lists_every_algorithm(capsys):
    from byteps_espresso.cli import main

    assert main(["compressors"]) == 0
    out = capsys.readouterr().out
    for name in ALL:
        assert f"\n{name} " in out
    assert main(["compressors", "--json"]) == 0
    import json

    rows = json.loads(capsys.readouterr().out)
    assert {r["name"]: r["wire_id"] for r in rows} == {n: K.wire_id(n) for n in ALL}
    assert {r["name"] for r in rows if r["unbiased"]} == {"natural", "qsgd", "terngrad"}


@pytest.mark.parametrize("backend", K.BACKENDS)
@pytest.mark.parametrize("name", ["int8", "efsignsgd", "onebit", "qsgd", "terngrad"])
def test_payload_scales_must_be_finite_with_the_right_sign(name, backend):
    c = make(name, backend)
    payload, ctx = c.compress(as_backend(data(100), backend))
    for bad in (np.nan, np.inf, -1.0):
        scales = host(payload[-1]).copy()
        scales[0] = bad
        arr = torch.from_numpy(scales) if backend == "torch" else scales
        with pytest.raises(PayloadError, match="scales"):
            c.decompress((*payload[:-1], arr), ctx)


@pytest.mark.parametrize("backend", K.BACKENDS)
def test_natural_exponent_out_of_range_is_refused(backend):
    c = make("natural", backend)
    codes, low = c.compress(as_backend(data(100), backend))[0]
    bad = host(low).copy()
    bad[0] = 500
    with pytest.raises(PayloadError, match="exponent"):
        c.decompress((codes, torch.from_numpy(bad) if backend == "torch" else bad),
                     c.context((100,)))


def test_defaults_tell_callers_which_parameters_an_algorithm_takes():
    assert K.defaults("topk") == {"ratio": 0.01}
    assert K.defaults("fp16") == {}
    seeded = {n for n in ALL if "seed" in K.defaults(n)}
    assert seeded == {"randomk", "dgc", "qsgd", "terngrad", "natural"}
    for n in ALL:
        create(n, **K.defaults(n))
    with pytest.raises(ValueError, match="unknown compressor"):
        K.defaults("nope")
