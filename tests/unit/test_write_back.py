"""The average written into ``.grad`` (``_Sync._write_back``): divided on its way there, into
a ``.grad`` that autograd made (in its own dtype) or into a new one, and never a view of the
sum, which may be the bucket's buffer that the next iteration writes again."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from byteps_espresso.worker.optimizer import _Bucket, _Sync

from byteps_espresso.strategy.buckets import Bucket

WORLD = 4.0


def _params() -> dict[str, torch.Tensor]:
    return {"w": torch.nn.Parameter(torch.zeros(3, 2)),
            "h": torch.nn.Parameter(torch.zeros(5, dtype=torch.float16)),
            "b": torch.nn.Parameter(torch.zeros(1))}


def test_the_average_reaches_every_grad_and_none_is_a_view_of_the_buffer():
    params = _params()
    params["w"].grad = torch.full((3, 2), 7.0)  # autograd's, float32: written in place
    params["h"].grad = torch.full((5,), 7.0, dtype=torch.float16)  # in its own dtype
    # "b" has no .grad (unused in this iteration): a new one
    kept_w = params["w"].grad
    bucket = _Bucket(Bucket.of(["w", "h", "b"]), params, torch.device("cpu"), flagged=True)
    assert bucket.buffer is not None and bucket.buffer.numel() == 6 + 5 + 1 + 1
    total = bucket.buffer  # an in-place sum: the result is the buffer itself
    total.copy_(torch.arange(13, dtype=torch.float32) * 4)
    _Sync._write_back(SimpleNamespace(params=params, divisor=WORLD), bucket, total)

    want = torch.arange(13, dtype=torch.float32)
    assert params["w"].grad is kept_w
    assert torch.equal(params["w"].grad, want[:6].view(3, 2))
    assert params["h"].grad.dtype is torch.float16
    assert torch.equal(params["h"].grad, want[6:11].half())
    assert torch.equal(params["b"].grad, want[11:12])
    total.fill_(-1.0)  # the next iteration's gradients
    assert torch.equal(params["w"].grad, want[:6].view(3, 2))
    assert torch.equal(params["h"].grad, want[6:11].half())
    assert torch.equal(params["b"].grad, want[11:12])


def test_a_bucket_of_one_summed_in_place_in_its_own_grad():
    params = {"v": torch.nn.Parameter(torch.zeros(4))}
    grad = params["v"].grad = torch.tensor([4.0, 8.0, -12.0, 2.0])
    bucket = _Bucket(Bucket.of(["v"]), params, torch.device("cpu"))
    assert bucket.buffer is None  # the user's .grad is the flat tensor
    _Sync._write_back(SimpleNamespace(params=params, divisor=WORLD), bucket, grad)
    assert params["v"].grad is grad
    assert torch.equal(grad, torch.tensor([1.0, 2.0, -3.0, 0.5]))
