"""PowerSGD (Vogels et al., NeurIPS 2019): the pure steps against a NumPy oracle, several
ranks in lockstep bit-identical, error feedback, warm start, uncompressed first iterations,
and its capabilities in the registry."""

import threading

import byteps_espresso.kernels as K
import numpy as np
import pytest
import torch
from byteps_espresso.kernels import PowerSGD, capabilities, create, create_collective
from byteps_espresso.kernels.base import key_seed
from byteps_espresso.kernels.powersgd import (
    compute_p,
    compute_q,
    initial_q,
    matrix_shape,
    orthogonalize,
    reconstruct,
    worth_compressing,
)


# ---- NumPy oracle (float64) ---------------------------------------------------------------------
def np_orthogonalize(p, eps=1e-8):
    p = p.astype(np.float64).copy()
    for i in range(p.shape[1]):
        p[:, i] /= np.linalg.norm(p[:, i]) + eps
        for j in range(i + 1, p.shape[1]):
            p[:, j] -= np.dot(p[:, i], p[:, j]) * p[:, i]
    return p


def np_powersgd(grads, q0, steps_errors=None):
    """One PowerSGD iteration over all workers' matrices; returns (sum estimate, errors, Q)."""
    errors = steps_errors or [np.zeros_like(g, dtype=np.float64) for g in grads]
    ms = [g.astype(np.float64) + e for g, e in zip(grads, errors, strict=True)]
    q = np_orthogonalize(q0)
    p = sum(m @ q for m in ms)
    p_hat = np_orthogonalize(p)
    q_sum = sum(m.T @ p_hat for m in ms)
    total = p_hat @ q_sum.T
    return total, [m - total / len(ms) for m in ms], q_sum


def lockstep(states, grads, name, step):
    """Every rank's start/middle/finish with the sums taken in rank order (a deterministic
    all-reduce): what a real transport hands every rank."""
    ps = [s.start(name, g, step) for s, g in zip(states, grads, strict=True)]
    p_sum = ps[0].clone()
    for p in ps[1:]:
        p_sum += p
    qs = [s.middle(name, p_sum.clone()) for s in states]
    q_sum = qs[0].clone()
    for q in qs[1:]:
        q_sum += q
    return [s.finish(name, q_sum.clone(), len(states)) for s in states]


def test_pure_steps_against_numpy():
    rng = np.random.default_rng(0)
    m = rng.standard_normal((30, 20)).astype(np.float32)
    q = rng.standard_normal((20, 3)).astype(np.float32)
    mt, qt = torch.from_numpy(m), torch.from_numpy(q)
    np.testing.assert_allclose(compute_p(mt, qt).numpy(), m @ q, rtol=1e-5, atol=1e-5)
    p = m @ q
    got = orthogonalize(torch.from_numpy(p)).numpy()
    np.testing.assert_allclose(got, np_orthogonalize(p), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(got.T @ got, np.eye(3), atol=1e-5)  # orthonormal columns
    np.testing.assert_allclose(compute_q(mt, torch.from_numpy(got)).numpy(), m.T @ got,
                               rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(reconstruct(torch.from_numpy(p), qt).numpy(), p @ q.T,
                               rtol=1e-5, atol=1e-4)
    assert np.array_equal(orthogonalize(torch.from_numpy(p)).numpy(), got)  # deterministic
    # a vanishing column stays finite thanks to epsilon
    assert torch.isfinite(orthogonalize(torch.zeros(5, 2))).all()


def test_shapes_and_the_compression_test():
    assert matrix_shape((8,)) is None
    assert matrix_shape((4, 3, 5)) == (4, 15)
    # the reference hook's rule: (n + m) * r * rate < n * m
    assert worth_compressing(100, 100, 4, 2.0)
    assert not worth_compressing(4, 4, 4, 2.0)
    ps = PowerSGD(rank=2, start_iter=3)
    assert not ps.compresses((64, 64), 2)  # uncompressed first iterations
    assert ps.compresses((64, 64), 3)
    assert not ps.compresses((4096,), 100)  # vectors are never compressed
    assert ps.wire_numel((64, 32)) == (128, 64)
    assert ps.wire_numel((10,)) == (10, 0)


def test_initial_q_is_the_same_bits_for_a_seed_and_in_range():
    a = initial_q(50, 4, key_seed(7, "w", 3))
    b = initial_q(50, 4, key_seed(7, "w", 3))
    assert a.dtype == torch.float32 and a.shape == (50, 4)
    assert torch.equal(a, b)
    assert not torch.equal(a, initial_q(50, 4, key_seed(7, "w", 4)))
    assert float(a.min()) >= -1.0 and float(a.max()) < 1.0


@pytest.mark.parametrize("workers", [1, 2, 4])
def test_ranks_in_lockstep_match_the_oracle_and_each_other(workers):
    rng = np.random.default_rng(workers)
    states = [PowerSGD(rank=3, start_iter=0, seed=11) for _ in range(workers)]
    errors = None
    q_prev = None
    for step in range(4):
        grads = [rng.standard_normal((40, 24)).astype(np.float32) for _ in range(workers)]
        outs = lockstep(states, [torch.from_numpy(g) for g in grads], "w", step)
        for o in outs[1:]:  # bit-identical on every rank
            assert torch.equal(o, outs[0])
        q0 = initial_q(24, 3, key_seed(11, "w", 0)).numpy() if q_prev is None else q_prev
        total, errors, q_prev = np_powersgd(grads, q0, errors)
        np.testing.assert_allclose(outs[0].numpy().reshape(40, 24), total, rtol=2e-3,
                                   atol=2e-4)
        for s, e in zip(states, errors, strict=True):
            np.testing.assert_allclose(s.error["w"].numpy(), e, rtol=2e-3, atol=2e-4)


def test_error_feedback_conserves_the_sum_of_gradients():
    rng = np.random.default_rng(5)
    workers, steps = 3, 6
    states = [PowerSGD(rank=1, start_iter=0) for _ in range(workers)]
    sent = np.zeros((32, 16))
    given = np.zeros((32, 16))
    for step in range(steps):
        grads = [rng.standard_normal((32, 16)).astype(np.float32) for _ in range(workers)]
        given += sum(g.astype(np.float64) for g in grads)
        sent += lockstep(states, [torch.from_numpy(g) for g in grads], "w", step)[0].numpy() \
            .reshape(32, 16)
    residual = sum(s.error["w"].numpy().astype(np.float64) for s in states)
    np.testing.assert_allclose(sent + residual, given, atol=1e-3)


def test_a_low_rank_sum_is_recovered_exactly_enough():
    rng = np.random.default_rng(6)
    u, v = rng.standard_normal((50, 2)), rng.standard_normal((30, 2))
    grads = [(u @ v.T * (w + 1)).astype(np.float32) for w in range(2)]
    states = [PowerSGD(rank=2, start_iter=0, error_feedback=False) for _ in range(2)]
    out = lockstep(states, [torch.from_numpy(g) for g in grads], "w", 0)[0].numpy()
    np.testing.assert_allclose(out.reshape(50, 30), grads[0] + grads[1], rtol=1e-3, atol=1e-3)


def test_reduce_with_an_injected_allreduce_over_threads():
    """Four threads, a real (in-memory) all-reduce summing in rank order."""
    workers = 4
    barrier = threading.Barrier(workers)
    slots: list = [None] * workers
    results: dict = {}

    def allreduce_for(rank):
        def allreduce(t):
            slots[rank] = t.clone()
            barrier.wait()
            total = slots[0].clone()
            for other in slots[1:]:
                total += other
            barrier.wait()
            return total
        return allreduce

    rng = np.random.default_rng(7)
    grads = [[torch.from_numpy(rng.standard_normal((24, 12)).astype(np.float32))
              for _ in range(workers)] for _ in range(3)]

    def run(rank):
        ps = PowerSGD(rank=2, start_iter=1)
        results[rank] = [ps.reduce("w", grads[s][rank], s, allreduce_for(rank), workers)
                         for s in range(3)]

    threads = [threading.Thread(target=run, args=(r,)) for r in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    for step in range(3):
        for r in range(1, workers):
            assert torch.equal(results[r][step], results[0][step])
    # step 0 is uncompressed (start_iter=1): the exact sum
    np.testing.assert_allclose(results[0][0].numpy(), sum(g.numpy() for g in grads[0]).ravel(),
                               rtol=1e-6, atol=1e-6)
    # later steps equal the lockstep path
    ref = [PowerSGD(rank=2, start_iter=1) for _ in range(workers)]
    for s in (1, 2):
        want = lockstep(ref, grads[s], "w", s)[0]
        assert torch.equal(results[0][s], want)


def test_warm_start_reuses_q_and_its_absence_draws_anew():
    rng = np.random.default_rng(8)
    g = torch.from_numpy(rng.standard_normal((20, 20)).astype(np.float32))
    warm = PowerSGD(rank=2, start_iter=0)
    lockstep([warm], [g], "w", 0)
    assert "w" in warm.q
    cold = PowerSGD(rank=2, start_iter=0, warm_start=False)
    lockstep([cold], [g], "w", 0)
    assert cold.q == {}
    # the warm Q of step 0 is what step 1 starts from
    p1 = warm.start("w", g, 1)
    m = g + warm.error["w"]
    assert torch.equal(p1, compute_p(m, orthogonalize(warm.q["w"])))


def test_bad_use_raises_helpful_errors():
    with pytest.raises(ValueError, match="unknown parameter"):
        PowerSGD(rnk=2)
    with pytest.raises(ValueError, match="rank"):
        PowerSGD(rank=0)
    ps = PowerSGD(rank=1, start_iter=5)
    with pytest.raises(ValueError, match="not compressed"):
        ps.start("w", torch.ones(8, 8), 0)
    with pytest.raises(RuntimeError, match="before start"):
        PowerSGD(start_iter=0).middle("w", torch.ones(8, 1))


def test_capabilities_and_registry():
    caps = capabilities("powersgd")
    assert not caps.elementwise and caps.needs_shape and caps.linear
    assert caps.collective_rounds == 2 and caps.backends == ("torch",)
    assert not caps.recompressible
    for name in K.names():  # every codec compresses a flat range alone, on both backends
        c = capabilities(name)
        assert c.elementwise and not c.needs_shape and c.collective_rounds == 0
        assert c.backends == K.BACKENDS
        assert c.linear == (name == "fp16")  # only the half-precision cast sums as a payload
    assert K.collective_names() == ["powersgd"]
    assert "powersgd" not in K.names()
    assert isinstance(create_collective("powersgd", rank=4), PowerSGD)
    assert K.defaults("powersgd")["rank"] == 1
    with pytest.raises(ValueError, match="create_collective"):
        create("powersgd")
    with pytest.raises(ValueError, match="collective: powersgd"):
        capabilities("nope")
    with pytest.raises(ValueError, match="registered twice"):
        K.registry.register_collective(PowerSGD)
    wrapped = K.ErrorFeedback(create("topk"))
    assert wrapped.capabilities == capabilities("topk")
