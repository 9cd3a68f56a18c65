"""Misuse of the drop-in API fails with messages that say what to change."""

import pytest
import torch
from byteps_espresso.worker.optimizer import _named

import byteps_espresso.torch as bps


def test_calls_before_init_say_call_init():
    for call in (bps.rank, bps.size, lambda: bps.push_pull(torch.ones(2)),
                 lambda: bps.DistributedOptimizer(torch.optim.SGD([torch.nn.Parameter(
                     torch.ones(1))], lr=0.1))):
        with pytest.raises(bps.NotInitializedError, match=r"bps\.init\(\)"):
            call()


def test_duplicate_and_missing_names_are_refused():
    a, b = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([a, b], lr=0.1)
    with pytest.raises(ValueError, match="duplicated: \\['w'\\]"):
        _named(opt, [("w", a), ("w", b)])
    with pytest.raises(ValueError, match="no name"):
        _named(opt, [("a", a)])
    assert [n for n, _ in _named(opt, [("a", a), ("b", b)])] == ["a", "b"]
    assert [n for n, _ in _named(opt, None)] == ["push_pull.noname.0", "push_pull.noname.1"]
