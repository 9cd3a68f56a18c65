"""The shipped model profiles: every built-in loads, keeps its source note, and plans."""

import json
from importlib import resources

import pytest

from byteps_espresso.strategy import Cluster, Workload, baselines
from byteps_espresso.strategy.context import PlanContext
from byteps_espresso.strategy.workload import BUILTIN_WORKLOADS, WorkloadError

# The paper's six evaluation models (Espresso, EuroSys '23, sec. 7) and ResNet50.
PAPER_MODELS = {"vgg16", "resnet101", "ugatit", "bert", "gpt2", "lstm"}


def test_every_paper_model_ships():
    assert PAPER_MODELS <= set(BUILTIN_WORKLOADS)
    folder = resources.files("byteps_espresso") / "data" / "workloads"
    note = (folder / "README.md").read_text()
    for model in BUILTIN_WORKLOADS:
        raw = json.loads((folder / f"{model}.json").read_text())
        assert raw["model"] == model and "artifact" in raw["source"]
        wl = Workload.builtin(model)
        assert wl.model == model and len(wl.tensors) == len(raw["tensors"])
        assert wl.backward_us > 0 and all(t.numel > 0 for t in wl.tensors)
    for model in ("resnet101", "gpt2", "ugatit"):
        assert model in note  # the source note names where each profile comes from


@pytest.mark.parametrize("model", ["resnet101", "gpt2", "ugatit"])
def test_new_profiles_plan_and_beat_fp32(model):
    wl = Workload.builtin(model)
    ctx = PlanContext(wl, Cluster.preset(8, 8, "pcie", 25), "randomk", {"ratio": 0.01})
    found = baselines.get("espresso").run(ctx)
    fp32 = baselines.get("fp32").run(ctx)
    assert len(found.options) == len(wl.tensors)
    assert found.iteration_us <= fp32.iteration_us + 1e-6
    assert found.iteration_us >= wl.forward_time_us + wl.backward_us - 1e-6


def test_unknown_builtin_names_the_choices():
    with pytest.raises(WorkloadError, match="gpt2"):
        Workload.builtin("gpt3")
