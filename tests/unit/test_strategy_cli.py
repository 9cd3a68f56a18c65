"""`espresso plan`: outputs, --json fields, and errors that name the file and field."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from byteps_espresso.cli import main
from byteps_espresso.strategy import Strategy, Workload

BASE = ["plan", "--machines", "4", "--gpus-per-machine", "2", "--intra", "pcie",
        "--inter-gbps", "25", "--compressor", "randomk", "--ratio", "0.01"]


def test_plan_writes_strategy_and_timeline(tmp_path, capsys):
    out, png = tmp_path / "s.json", tmp_path / "t.png"
    code = main([*BASE, "--workload", "lstm", "--out", str(out), "--timeline", str(png),
                 "--json"])
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report) == {"algorithm", "iteration_time_ms", "baselines", "search_time_ms",
                           "options_per_tensor", "compressed_tensors",
                           "cpu_offloaded_tensors"}
    assert "bruteforce" not in report["baselines"] and "fp32" in report["baselines"]
    assert report["iteration_time_ms"] <= min(report["baselines"].values()) + 1e-6 or \
        report["iteration_time_ms"] >= report["baselines"]["upper-bound"]
    strategy = Strategy.load(out)
    assert strategy.predicted_ms == pytest.approx(report["iteration_time_ms"], rel=1e-4)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_table_output_and_baseline_algorithm(tmp_path, capsys):
    code = main([*BASE, "--workload", "lstm", "--out", str(tmp_path / "s.json"),
                 "--algorithm", "hipress", "--constraint", "no-cpu"])
    assert code == 0
    text = capsys.readouterr().out
    assert "hipress" in text and "speedup over fp32" in text


@pytest.mark.parametrize(("edit", "needle"), [
    (lambda d: d["tensors"][1].pop("numel"), "tensors[1].numel"),
    (lambda d: d.__setitem__("tensors", []), "'tensors'"),
    (lambda d: d.__setitem__("time_unit", "ms"), "time_unit"),
])
def test_malformed_workload_names_file_and_field(tmp_path, capsys, edit, needle):
    data = Workload.builtin("lstm").to_dict()
    edit(data)
    wl = tmp_path / "wl.json"
    wl.write_text(json.dumps(data))
    out = tmp_path / "s.json"
    assert main([*BASE, "--workload", str(wl), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert str(wl) in err and needle in err
    assert not out.exists() and list(tmp_path.iterdir()) == [wl]


def test_malformed_cluster_constraint_and_outputs(tmp_path, capsys):
    cluster = tmp_path / "c.json"
    cluster.write_text(json.dumps({"machines": 2, "gpus_per_machine": 2, "intra_gbps": -1,
                                   "intra_latency_us": 1, "inter_gbps": 10}))
    out = tmp_path / "s.json"
    args = ["plan", "--workload", "lstm", "--compressor", "fp16", "--out", str(out)]
    assert main([*args, "--cluster", str(cluster)]) == 2
    err = capsys.readouterr().err
    assert str(cluster) in err and "intra_gbps" in err
    assert main([*BASE, "--workload", "lstm", "--out", str(out),
                 "--constraint", "max-compressions=many"]) == 2
    assert "max-compressions" in capsys.readouterr().err
    assert main([*BASE, "--workload", "lstm", "--out", str(out),
                 "--timeline", str(tmp_path / "t.bogus")]) == 2
    assert "unsupported image type" in capsys.readouterr().err
    assert main([*BASE, "--workload", "lstm", "--out", str(tmp_path / "no" / "s.json")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main([*BASE[:-3], "nope", "--workload", "lstm", "--out", str(out)]) == 2
    assert "unknown compressor" in capsys.readouterr().err
    assert main([*BASE, "--workload", "lstm", "--out", str(out), "--algorithm",
                 "bruteforce"]) == 2
    assert "bruteforce would simulate" in capsys.readouterr().err
    assert not out.exists()


def test_installed_command_runs(tmp_path):
    # the console script (``python -m byteps_espresso.cli`` runs cli.py as __main__, whose
    # registry the plugins do not see)
    espresso = Path(sys.executable).with_name("espresso")
    result = subprocess.run([str(espresso), *BASE, "--workload",
                             "lstm", "--out", str(tmp_path / "s.json"), "--json"],
                            cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["algorithm"] == "espresso"


def test_plan_models_the_runtimes_lanes(tmp_path):
    from byteps_espresso.worker.runtime import DEFAULT_LANES

    from byteps_espresso.strategy.cli import RUNTIME_LANES

    assert RUNTIME_LANES == DEFAULT_LANES
    for lanes, expected in (([], DEFAULT_LANES), (["--lanes", "3"], 3), (["--lanes", "0"], None)):
        out = tmp_path / f"s{expected}.json"
        assert main([*BASE, "--workload", "lstm", "--out", str(out), *lanes]) == 0
        assert Strategy.load(out).cluster.lanes == expected
