"""The torch backend on CUDA: payloads identical to the numba backend's (skipped without CUDA)."""

import byteps_espresso.kernels as K
import numpy as np
import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

SPARSE = {"topk", "randomk", "dgc"}


@pytest.mark.parametrize("name", K.names())
@pytest.mark.parametrize("numel", [1, 1001, 1 << 20])
def test_cuda_payloads_match_numba_and_decode_on_the_host(name, numel):
    params = {"ratio": 0.01} if name in SPARSE else {}
    x = np.random.default_rng(numel).standard_normal(numel).astype(np.float32)
    gpu, cpu = K.create(name, "torch", **params), K.create(name, "numba", **params)
    pg, ctx = gpu.compress(torch.from_numpy(x).cuda(), name="w", step=3)
    pc, _ = cpu.compress(x, name="w", step=3)
    assert all(a.is_cuda for a in pg)
    for a, b in zip(K.to_numpy(pg), pc, strict=True):
        np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))
    y = gpu.decompress(pg, ctx)
    assert y.is_cuda and y.shape == (numel,)
    np.testing.assert_array_equal(y.cpu().numpy(), cpu.decompress(K.to_numpy(pg), ctx))
