"""Strategy files: round trip, validation errors that name the file and field."""

import dataclasses
import json

import pytest

from byteps_espresso.strategy import (
    Cluster,
    Constraints,
    Strategy,
    StrategyError,
    Workload,
    WorkloadError,
    plan,
)


@pytest.fixture(scope="module")
def strategy():
    return plan(Workload.builtin("lstm"), Cluster.preset(4, 2, "pcie", 25), "randomk",
                {"ratio": 0.01},
                constraints=Constraints(max_compressions=2))


def test_round_trip_reproduces_options(strategy, tmp_path):
    path = tmp_path / "s.json"
    strategy.save(path)
    loaded = Strategy.load(path)
    assert loaded.options == strategy.options
    assert list(loaded.options) == list(strategy.options)
    assert loaded.workload == strategy.workload and loaded.cluster == strategy.cluster
    assert loaded.constraints == strategy.constraints
    assert loaded.predicted_ms == pytest.approx(strategy.predicted_ms)
    assert loaded.baselines == pytest.approx(strategy.baselines)
    assert "fp32" in loaded.summary()
    assert loaded.lower_bound_ms is None  # plan() does not price it
    bounded = dataclasses.replace(strategy, lower_bound_ms=strategy.predicted_ms * 0.9)
    bounded.save(path)
    again = Strategy.load(path)
    assert again.lower_bound_ms == pytest.approx(strategy.predicted_ms * 0.9)
    assert "lower bound of every strategy" in again.summary()
    assert "11.11% above it" in again.summary()
    at_bound = dataclasses.replace(strategy, lower_bound_ms=strategy.predicted_ms)
    assert "(optimal under the model)" in at_bound.summary()


def _first(data):
    return data["workload"]["tensors"][0]["name"]


def _broken(strategy, tmp_path, mutate):
    data = strategy.to_dict()
    mutate(data)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    return path


@pytest.mark.parametrize(("mutate", "field"), [
    (lambda d: d["options"].__setitem__(_first(d), ["Comp(gpu)"]), "options."),
    (lambda d: d["options"].__setitem__(_first(d), ["Allreduce(world)"]), "options."),
    (lambda d: d["options"].pop(_first(d)), "options"),
    (lambda d: d["cluster"].__setitem__("machines", 0), "machines"),
    (lambda d: d["workload"]["tensors"][0].__setitem__("numel", -3), "tensors[0]"),
    (lambda d: d.__setitem__("constraints", ["bogus"]), "constraints"),
    (lambda d: d.__setitem__("format", "x"), "format"),
    (lambda d: d.__setitem__("lower_bound_ms", "fast"), "lower_bound_ms"),
])
def test_malformed_fields_are_named(strategy, tmp_path, mutate, field):
    path = _broken(strategy, tmp_path, mutate)
    with pytest.raises(StrategyError) as err:
        Strategy.load(path)
    assert str(path) in str(err.value) and field in str(err.value)


def test_bad_json_and_missing_file(tmp_path):
    bad = tmp_path / "x.json"
    bad.write_text("{")
    with pytest.raises(StrategyError, match="not valid JSON"):
        Strategy.load(bad)
    with pytest.raises(StrategyError, match="cannot read"):
        Strategy.load(tmp_path / "missing.json")


def test_workload_round_trip_and_errors(tmp_path):
    wl = Workload.builtin("vgg16")
    path = tmp_path / "w.json"
    wl.save(path)
    assert Workload.load(path) == wl
    data = json.loads(path.read_text())
    data["tensors"][3]["ready_gap_us"] = "soon"
    path.write_text(json.dumps(data))
    with pytest.raises(WorkloadError, match=r"tensors\[3\]"):
        Workload.load(path)


def test_mixed_compressors_round_trip(tmp_path):
    """A strategy whose Options name fp16 on their intra steps (``Comp(gpu,fp16)``) saves
    and loads them by those names; ``no-mixed`` round-trips as a constraint."""
    cluster = Cluster.preset(8, 8, "nvlink", 100)
    mixed = plan(Workload.builtin("ugatit"), cluster, "efsignsgd")
    assert any(o.partners for o in mixed.options.values())
    mixed.save(tmp_path / "m.json")
    assert ",fp16)" in (tmp_path / "m.json").read_text()
    assert Strategy.load(tmp_path / "m.json").options == mixed.options
    alone = plan(Workload.builtin("lstm"), cluster, "efsignsgd",
                 constraints=Constraints.parse(["no-mixed"]))
    alone.save(tmp_path / "a.json")
    assert Strategy.load(tmp_path / "a.json").constraints.partner is None
