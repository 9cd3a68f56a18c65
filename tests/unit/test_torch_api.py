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


def test_strategy_file_for_another_world_size_says_how_to_replan(tmp_path):
    import types

    from byteps_espresso.worker.profiler import StrategyFileSpec
    from byteps_espresso.worker.topology import Topology

    from byteps_espresso.strategy import Cluster, Workload, plan

    path = tmp_path / "s.json"
    plan(Workload.builtin("lstm"), Cluster.preset(2, 4, "pcie", 10), "randomk",
         {"ratio": 0.01}).save(path)
    session = types.SimpleNamespace(runtime=types.SimpleNamespace(topology=Topology(2, 2)))
    expected = r"2 machines x 4 workers = 8.*2 x 2 = 4.*--gpus-per-machine 2"
    with pytest.raises(ValueError, match=expected):
        StrategyFileSpec(str(path))._load(session)
    strategy = StrategyFileSpec(str(path))._load(
        types.SimpleNamespace(runtime=types.SimpleNamespace(topology=Topology(4, 2))))
    assert strategy.options
