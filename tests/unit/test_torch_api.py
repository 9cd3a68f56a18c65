"""Misuse of the drop-in API fails with messages that say what to change."""

import json

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


def test_is_initialized_and_declare_before_init():
    assert bps.is_initialized() is False
    with pytest.raises(bps.NotInitializedError):
        bps.declare("w")


# ---- objects on the wire (no pickle) --------------------------------------------------------
def test_objects_round_trip_with_their_types():
    import numpy as np
    from byteps_espresso.worker.objects import decode_object, encode_object

    obj = {"epoch": 3, "lr": 0.1, "betas": (0.9, (0.99,)), 4: [None, True, "x"],
           "bytes": b"\x00\xff", "t": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3),
           "scalar": torch.tensor(2.5), "a": np.arange(4, dtype=np.int16),
           "__espresso__": "a user key that looks like a tag", "inf": float("-inf")}
    data = encode_object(obj)
    assert json.loads(data)  # plain JSON
    back = decode_object(data)
    assert back.keys() == obj.keys() and back["betas"] == (0.9, (0.99,)) and back[4] == [
        None, True, "x"]
    assert back["t"].dtype == torch.bfloat16 and torch.equal(back["t"], obj["t"])
    assert back["scalar"].shape == () and back["a"].dtype == np.int16
    assert back["__espresso__"] == obj["__espresso__"] and back["inf"] == float("-inf")


@pytest.mark.parametrize("bad", [object(), {(1, 2): 3}, {"f": print},
                                 torch.zeros(2).to_sparse()])
def test_unsupported_objects_are_refused_by_name(bad):
    from byteps_espresso.worker.objects import encode_object

    with pytest.raises(TypeError, match="cannot encode"):
        encode_object(bad)


def test_received_object_arrays_are_refused():
    import numpy as np
    from byteps_espresso.worker.objects import decode_object, encode_object

    forged = encode_object(np.arange(2)).replace(b"<i8", b"|O")
    with pytest.raises(ValueError, match="not an encoded object"):
        decode_object(forged)


# ---- reduction operators --------------------------------------------------------------------
def test_op_supersedes_average_as_in_horovod():
    from byteps_espresso.worker.reduction import ReduceOp, resolve_op

    assert resolve_op(None, None) is ReduceOp.AVERAGE
    assert resolve_op(False, None) is ReduceOp.SUM
    assert resolve_op(None, bps.Sum) is ReduceOp.SUM
    with pytest.raises(ValueError, match="supersedes"):
        resolve_op(True, bps.Average)
    with pytest.raises(ValueError, match="Adasum"):
        resolve_op(None, bps.Adasum)


# ---- job-wide compression variables ---------------------------------------------------------
def _cfg(**env):
    from byteps_espresso.config import Config

    return Config.from_env({"DMLC_NUM_WORKER": "1", "DMLC_NUM_SERVER": "0",
                            "DMLC_PS_ROOT_URI": "127.0.0.1", "DMLC_PS_ROOT_PORT": "9000", **env})


def test_espresso_strategy_replaces_any_compression():
    from byteps_espresso.worker.profiler import StrategyFileSpec

    cfg = _cfg(ESPRESSO_STRATEGY="/plans/s.json")
    for spec in (bps.Compression.none, bps.Compression.fp16,
                 bps.Compression.espresso("dgc", ratio=0.01, error_feedback=True)):
        chosen = bps.job_compression(cfg, spec)
        assert isinstance(chosen, StrategyFileSpec) and chosen.path == "/plans/s.json"
        assert chosen.profile_steps(None) == 0  # nothing is profiled or planned
    assert bps.job_compression(cfg, bps.Compression.espresso("dgc", error_feedback=True)
                               ).error_feedback is True


def test_espresso_compressor_and_seed_apply_to_unchosen_compression():
    from byteps_espresso.worker.profiler import EspressoSpec

    cfg = _cfg(ESPRESSO_COMPRESSOR="randomk", ESPRESSO_SEED="7")
    chosen = bps.job_compression(cfg, bps.Compression.none)
    assert isinstance(chosen, EspressoSpec) and chosen.compressor == "randomk"
    assert chosen.params == {"seed": 7}
    assert bps.job_compression(cfg, bps.Compression.fp16) is bps.Compression.fp16
    own = bps.job_compression(cfg, bps.Compression.espresso("qsgd", seed=3))
    assert own.compressor == "qsgd" and own.params == {"seed": 3}
    assert bps.job_compression(_cfg(ESPRESSO_SEED="7"),
                               bps.Compression.espresso("fp16")).params == {}  # no seed taken
    assert bps.job_compression(_cfg(), bps.Compression.none) is bps.Compression.none


def test_a_sparsity_warm_up_is_planned_without_the_servers_compression():
    from byteps_espresso.strategy import Kind

    # a PS key keeps one payload layout; dgc's warm-up changes it from stage to stage
    assert Kind.PUSH_PULL_C in bps.Compression.espresso("dgc", warmup_steps=10).constraints.forbid
    assert Kind.PUSH_PULL_C not in bps.Compression.espresso("dgc").constraints.forbid


def test_powersgd_runs_on_every_bucket_or_is_planned_per_bucket():
    chosen = bps.job_compression(_cfg(ESPRESSO_COMPRESSOR="powersgd", ESPRESSO_SEED="7"),
                                 bps.Compression.none)
    assert chosen == bps.Compression.powersgd()
    planned = bps.Compression.espresso("powersgd", rank=8, error_feedback=False)
    assert planned.low_rank and planned.params == {"rank": 8, "error_feedback": False}
    with pytest.raises(ValueError, match="rank"):
        bps.Compression.espresso("powersgd", rank=0)
    with pytest.raises(ValueError, match="DGC's"):
        bps.Compression.espresso("powersgd", momentum_correction=True)


# ---- optimizer state description ------------------------------------------------------------
def _adam(lr=0.1):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1))
    return model, torch.optim.Adam(model.parameters(), lr=lr, betas=(0.5, 0.6))


def test_a_fresh_optimizer_takes_a_trained_ones_state():
    from byteps_espresso.worker.objects import decode_object, encode_object
    from byteps_espresso.worker.optimizer_state import apply_description, describe, state_tensors

    model, trained = _adam()
    for _ in range(2):
        trained.zero_grad()
        model(torch.ones(4, 3)).sum().backward()
        trained.step()
    _, fresh = _adam(lr=0.7)
    fresh.param_groups[0]["betas"] = (0.9, 0.9)
    description = decode_object(encode_object(describe(trained)))  # as the wire carries it
    assert apply_description(fresh, description) is None
    for mine, theirs in zip(state_tensors(fresh, description),
                            state_tensors(trained, description), strict=True):
        mine.copy_(theirs)  # what the broadcast does
    assert encode_object(fresh.state_dict()) == encode_object(trained.state_dict())


def test_a_different_optimizer_is_named_not_hung():
    from byteps_espresso.worker.optimizer_state import apply_description, describe

    _, opt = _adam()
    other = torch.optim.SGD([torch.nn.Parameter(torch.ones(5))], lr=0.1)
    assert "same optimizer over the same model" in apply_description(other, describe(opt))


def test_espresso_plans_one_lossy_compression_unless_recompression_is_allowed():
    from byteps_espresso.strategy import Constraints

    assert bps.Compression.espresso("dgc", ratio=0.01).constraints == Constraints(max_lossy=1)
    mine = Constraints(allow_cpu=False)
    assert (bps.Compression.espresso("dgc", constraints=mine).constraints
            == Constraints(allow_cpu=False, max_lossy=1))
    assert bps.Compression.espresso("dgc", recompress=True).constraints is None
    assert (bps.Compression.espresso("dgc", constraints=Constraints(max_lossy=3)).constraints
            == Constraints(max_lossy=3))
    # a baseline asked for by name runs as its authors defined it
    assert bps.Compression.espresso("dgc", algorithm="cpu-only").constraints is None


def test_exclusion_by_pattern_or_by_default_every_parameter_of_one_dimension():
    from byteps_espresso.worker.profiler import excluded_names

    from byteps_espresso.config import Config

    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 2))
    params = dict(net.named_parameters())
    assert excluded_names(params, None) == {"0.bias", "1.weight", "1.bias", "2.bias"}
    assert excluded_names(params, ("2.*",)) == {"2.weight", "2.bias"}
    assert excluded_names(params, ()) == frozenset()
    # fp16 only rounds: nothing by default, as DDP's fp16 hook; patterns still apply
    assert excluded_names(params, None, "fp16") == frozenset()
    assert excluded_names(params, ("2.*",), "fp16") == {"2.weight", "2.bias"}
    assert excluded_names(params, None, "dgc") == {"0.bias", "1.weight", "1.bias", "2.bias"}
    base = {"DMLC_ROLE": "worker", "DMLC_NUM_WORKER": "1", "DMLC_NUM_SERVER": "0",
            "DMLC_PS_ROOT_URI": "127.0.0.1", "DMLC_PS_ROOT_PORT": "9100"}
    assert (Config.from_env({**base, "ESPRESSO_EXCLUDE": "*.bias, 1.*"}).exclude
            == ("*.bias", "1.*"))
    assert Config.from_env({**base, "ESPRESSO_EXCLUDE": "none"}).exclude == ()
    assert Config.from_env(base).exclude is None
    with pytest.raises(ValueError, match="ESPRESSO_EXCLUDE"):
        Config.from_env({**base, "ESPRESSO_EXCLUDE": "*.bias,,x"})
    assert bps.Compression.espresso("topk", exclude=["*.bias"]).exclude == ("*.bias",)
    with pytest.raises(TypeError, match=r"\['\*\.bias'\]"):
        bps.Compression.espresso("topk", exclude="*.bias")


def test_dgc_recipe_takes_the_optimizers_momentum_or_says_why_it_cannot():
    from byteps_espresso.worker.optimizer import _take_momentum

    assert bps.Compression.espresso("dgc", momentum_correction=True, clip_norm=5.0
                                    ).recipe == {"clip_norm": 5.0}
    assert bps.Compression.espresso("dgc").recipe is None  # off by default (measured)
    assert bps.Compression.espresso("dgc", momentum_correction=False).recipe is None
    assert bps.Compression.espresso("topk").recipe is None
    with pytest.raises(ValueError, match="clip_norm is part of DGC's recipe"):
        bps.Compression.espresso("topk", clip_norm=1.0)
    w = torch.nn.Parameter(torch.ones(2))
    sgd = torch.optim.SGD([w], lr=0.1, momentum=0.9, weight_decay=1e-4)
    assert _take_momentum(sgd) == (0.9, 1e-4)
    assert sgd.param_groups[0]["momentum"] == 0 and sgd.param_groups[0]["weight_decay"] == 0
    with pytest.raises(ValueError, match="needs SGD with momentum, not Adam"):
        _take_momentum(torch.optim.Adam([w]))
    with pytest.raises(ValueError, match="nesterov"):
        _take_momentum(torch.optim.SGD([w], lr=0.1, momentum=0.9, nesterov=True))
