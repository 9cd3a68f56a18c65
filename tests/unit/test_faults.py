"""Fault reports: appended by several processes, read back oldest first, never fatal."""

import json
import subprocess
import sys

import pytest
from byteps_espresso.server import faults

REPORTER = """
import sys
from byteps_espresso.server import faults
path, rank = sys.argv[1], int(sys.argv[2])
for i in range(50):
    faults.report(path, f"worker {rank}", f"report {i} of worker {rank} " + "x" * 500,
                  f"worker {1 - rank}")
"""


@pytest.mark.timeout(120)
def test_reports_of_concurrent_processes_stay_whole_lines(tmp_path):
    path = str(tmp_path / "faults.jsonl")
    procs = [subprocess.Popen([sys.executable, "-c", REPORTER, path, str(r)]) for r in range(2)]
    assert [p.wait(timeout=100) for p in procs] == [0, 0]
    lines = (tmp_path / "faults.jsonl").read_text().splitlines()
    assert len(lines) == 100
    assert all(json.loads(line)["culprit"] in ("worker 0", "worker 1") for line in lines)
    read = faults.read(path)
    assert len(read) == 100
    assert [f.time for f in read] == sorted(f.time for f in read)


def test_earliest_report_wins_and_malformed_lines_are_skipped(tmp_path):
    path = tmp_path / "faults.jsonl"
    path.write_text('not json\n{"culprit": "server 0"}\n'
                    '{"culprit": "scheduler", "reason": "late", "reporter": "worker 0", '
                    '"time": 20.0}\n'
                    '{"culprit": "worker 1", "reason": "early", "reporter": "scheduler", '
                    '"time": 10.0}\n')
    first = faults.first(str(path))
    assert first == faults.Fault("worker 1", "early", "scheduler", 10.0)
    assert [f.culprit for f in faults.read(str(path))] == ["worker 1", "scheduler"]


def test_missing_or_unwritable_file_is_no_error(tmp_path):
    assert faults.read(str(tmp_path / "absent")) == []
    assert faults.first(None) is None
    faults.report(None, "worker 0", "nothing to write to", "scheduler")
    faults.report(str(tmp_path / "no" / "such" / "dir"), "worker 0", "logged", "scheduler")
