"""`espresso plan` and `espresso show`: outputs, --json fields, errors that name the file
and field, and the README's picture."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from byteps_espresso.cli import main
from byteps_espresso.strategy import Cluster, Constraints, Strategy, Workload, enumerate_options
from byteps_espresso.strategy.cli import strategy_timelines
from byteps_espresso.strategy.workload import BUILTIN_WORKLOADS

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"

BASE = ["plan", "--machines", "4", "--gpus-per-machine", "2", "--intra", "pcie",
        "--inter-gbps", "25", "--compressor", "randomk", "--ratio", "0.01"]


def test_plan_writes_strategy_and_timeline(tmp_path, capsys):
    out, png = tmp_path / "s.json", tmp_path / "t.png"
    code = main([*BASE, "--workload", "lstm", "--out", str(out), "--timeline", str(png),
                 "--json"])
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report) == {"algorithm", "iteration_time_ms", "baselines", "lower_bound_ms",
                           "search_time_ms", "plan_time_ms", "options_per_tensor",
                           "compressed_tensors", "cpu_offloaded_tensors"}
    assert "bruteforce" not in report["baselines"] and "fp32" in report["baselines"]
    assert report["iteration_time_ms"] <= min(report["baselines"].values()) + 1e-6 or \
        report["iteration_time_ms"] >= report["baselines"]["upper-bound"]
    # no strategy is predicted below the bound (upper-bound's model compresses for free)
    runnable = [ms for name, ms in report["baselines"].items() if name != "upper-bound"]
    assert 0 < report["lower_bound_ms"] <= min(report["iteration_time_ms"], *runnable) + 1e-3
    assert report["plan_time_ms"] >= report["search_time_ms"] > 0
    strategy = Strategy.load(out)
    assert strategy.predicted_ms == pytest.approx(report["iteration_time_ms"], rel=1e-4)
    assert strategy.lower_bound_ms == pytest.approx(report["lower_bound_ms"], rel=1e-4)
    assert "lower bound of every strategy" in strategy.summary()
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_reported_tree_is_the_compressors(capsys):
    """fp16's payloads sum: its tree holds the AllreduceC Options too (tree.sums_payloads)."""
    counts = {}
    for compressor in ("randomk", "fp16"):
        argv = [*BASE[:-4], "--compressor", compressor, "--workload", "lstm", "--json"]
        assert main(argv) == 0
        counts[compressor] = json.loads(capsys.readouterr().out)["options_per_tensor"]
    cluster = Cluster.preset(4, 2, "pcie", 25)
    assert counts == {c: len(enumerate_options(cluster, Constraints(), c))
                      for c in counts}
    assert counts["fp16"] > counts["randomk"]


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


# ---- defects of the command line, one test each ------------------------------------------------
@pytest.mark.parametrize(("flag", "value"), [("--inter-gbps", "inf"), ("--inter-gbps", "nan"),
                                             ("--intra", "inf"), ("--ratio", "nan")])
def test_non_finite_numbers_are_refused_naming_the_flag(tmp_path, capsys, flag, value):
    args = [*BASE, "--workload", "lstm", "--out", str(tmp_path / "s.json")]
    args[args.index(flag) + 1] = value
    with pytest.raises(SystemExit) as stop:
        main(args)
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}: must be a finite number, got '{value}'" in err
    assert list(tmp_path.iterdir()) == []


def test_a_cluster_file_with_infinity_is_refused(tmp_path, capsys):
    cluster = tmp_path / "c.json"
    cluster.write_text('{"machines": 2, "gpus_per_machine": 2, "intra_gbps": 96, '
                       '"intra_latency_us": 10, "inter_gbps": Infinity}')
    out = tmp_path / "s.json"
    assert main(["plan", "--workload", "lstm", "--compressor", "fp16", "--cluster",
                 str(cluster), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert str(cluster) in err and "'inter_gbps' must be a finite number > 0" in err
    assert not out.exists()


def test_a_closed_pipe_ends_the_listing_without_a_traceback():
    """`espresso compressors --json | head`: the reader is gone before anything is written."""
    espresso = Path(sys.executable).with_name("espresso")
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        result = subprocess.run([str(espresso), "compressors", "--json"], stdout=write_end,
                                stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(write_end)
    assert result.returncode == 141, result.stderr  # 128 + SIGPIPE, as the shell reports it
    assert result.stderr == ""
    through_head = subprocess.run(f"'{espresso}' compressors --json | head -n 2", shell=True,
                                  capture_output=True, text=True, timeout=120)
    assert through_head.stdout.splitlines() == ["[", " {"]
    assert through_head.stderr == ""


@pytest.mark.parametrize(("workload", "needle"), [
    ("vgg19", "--workload vgg19: unknown built-in workload; the built-ins are "),
    ("profiles/vgg19.json", "--workload profiles/vgg19.json: no such file (or name a "
                            "built-in workload: "),
])
def test_an_unknown_workload_lists_the_built_ins(capsys, workload, needle):
    assert main([*BASE, "--workload", workload]) == 2
    err = capsys.readouterr().err
    assert needle in err and ", ".join(BUILTIN_WORKLOADS) in err


def test_a_plan_is_printed_without_out(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main([*BASE, "--workload", "lstm"]) == 0
    text = capsys.readouterr().out
    assert "predicted iteration" in text and "speedup over fp32" in text
    assert "wrote" not in text
    assert list(tmp_path.iterdir()) == []


def test_plan_help_shows_the_defaults(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["plan", "--help"])
    assert stop.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for default in ("(default: nvlink)", "(default: espresso)", "(default: 16)"):
        assert default in text
    assert "(default: None)" not in text and "(default: False)" not in text


def test_show_prints_every_tensor_and_draws_the_saved_strategy(tmp_path, capsys):
    saved, png = tmp_path / "s.json", tmp_path / "t.png"
    assert main([*BASE, "--workload", "lstm", "--out", str(saved), "--json"]) == 0
    capsys.readouterr()
    assert main(["show", str(saved), "--timeline", str(png)]) == 0
    text = capsys.readouterr().out
    strategy = Strategy.load(saved)
    assert f"predicted iteration {strategy.predicted_ms:.2f} ms" in text
    for name, option in strategy.options.items():  # one line per tensor, with its Option
        assert re.search(rf"^{re.escape(name)} +[\d,]+ +[\d.]+  {re.escape(str(option))}$",
                         text, re.M), name
    assert "simulated again" not in text  # same costs: the same iteration time
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert strategy_timelines(strategy)["chosen"].iteration_us / 1e3 == \
        pytest.approx(strategy.predicted_ms, rel=1e-9)


def test_show_refuses_a_broken_file_naming_it(tmp_path, capsys):
    broken = tmp_path / "s.json"
    broken.write_text('{"format": "nope"}')
    assert main(["show", str(broken)]) == 2
    assert str(broken) in capsys.readouterr().err


@pytest.mark.timeout(400)
def test_readme_picture_and_sentence_come_from_the_current_planner():
    """The README quotes the plan behind its picture; the picture records the same sentence
    (PNG text chunk), so both are redrawn by readme_figure whenever the planner changes."""
    from PIL import Image

    from byteps_espresso.strategy import readme_figure

    readme = " ".join(README.read_text().replace("\\\n", " ").split())
    expected = readme_figure.sentence(readme_figure.plan())
    assert expected in readme, f"README is out of date; run `python -m " \
        f"byteps_espresso.strategy.readme_figure` and quote: {expected}"
    command = "espresso plan " + " ".join(readme_figure.COMMAND)
    assert command in readme
    assert f"]({readme_figure.FIGURE.as_posix()})" in readme
    with Image.open(ROOT / readme_figure.FIGURE) as picture:
        assert picture.text["Description"] == expected, "picture drawn from an older plan"
        assert picture.text["Command"] == command


def test_plan_models_the_runtimes_lanes(tmp_path):
    from byteps_espresso.worker.runtime import DEFAULT_LANES

    from byteps_espresso.strategy.cli import RUNTIME_LANES

    assert RUNTIME_LANES == DEFAULT_LANES
    for lanes, expected in (([], DEFAULT_LANES), (["--lanes", "3"], 3), (["--lanes", "0"], None)):
        out = tmp_path / f"s{expected}.json"
        assert main([*BASE, "--workload", "lstm", "--out", str(out), *lanes]) == 0
        assert Strategy.load(out).cluster.lanes == expected


def test_plan_takes_compressor_parameters(tmp_path):
    from byteps_espresso.cli import main

    out = tmp_path / "s.json"
    assert main(["plan", "--workload", "vgg16", "--machines", "2", "--gpus-per-machine", "2",
                 "--inter-gbps", "10", "--compressor", "randomk", "--param", "ratio=0.05",
                 "--out", str(out)]) == 0
    assert json.loads(out.read_text())["compressor"]["params"] == {"ratio": 0.05}
    assert main(["plan", "--workload", "vgg16", "--machines", "2", "--gpus-per-machine", "2",
                 "--inter-gbps", "10", "--compressor", "randomk", "--param", "ratio"]) == 2
