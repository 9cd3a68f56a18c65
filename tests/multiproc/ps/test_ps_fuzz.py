"""A short run of benchmarks/fuzz.py: a few thousand hostile and malformed messages against
a live, authenticated job's scheduler and server while its workers run checked rounds."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location(
    "fuzz_benchmark", Path(__file__).resolve().parents[3] / "benchmarks" / "fuzz.py")
fuzz = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fuzz)

MESSAGES = 4000


@pytest.mark.timeout(240)
def test_hostile_messages_neither_crash_hang_nor_corrupt_the_job(tmp_path):
    res = fuzz.run(MESSAGES, 1, tmp_path)
    assert res["messages"] >= MESSAGES
    assert all(res["alive_after_fuzz"].values()), res["alive_after_fuzz"]
    assert res["exit_codes"] == {"scheduler": 0, "server": 0, "worker0": 0, "worker1": 0}, (
        res["exit_codes"], [w for r in res["legit"] for w in r["wrong"]])
    for r in res["legit"]:
        assert not r["wrong"], r["wrong"]
        assert r["rounds"] > 0 and r["poisoned"] > 0
    assert res["legit"][0]["refused_place"] > 0
    # Outsiders were dropped without a reply, members' bad messages refused and counted.
    rejected = res["server_rejected_during_fuzz"]
    assert rejected.get("unauthenticated", 0) > MESSAGES // 10, rejected
    assert rejected.get("bad_field", 0) > 0, rejected
    for name, before in res["rss_before_mib"].items():
        assert res["rss_after_mib"][name] - before <= fuzz.TARGET_GROWTH_MIB, (name, res)
