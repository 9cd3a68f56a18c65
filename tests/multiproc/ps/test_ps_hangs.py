"""Stopped (SIGSTOP) processes are found by heartbeats, in time, and named; busy ones are not.

Real scheduler, server and worker processes on loopback at the default
ESPRESSO_HEARTBEAT_TIMEOUT (5 s); workers push and pull one key in a loop (ps_worker.py
``loop``). Detection is measured from the SIGSTOP to the first report in the job's
ESPRESSO_FAULT_FILE, which the finder writes before it tells anyone else.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from byteps_espresso.server import faults

# What issue 16 asks for: a stopped process found within 10 s at default settings.
DETECT_S = 10.0
# Seconds the workers may take to start (torch import on a loaded machine) and run round 0.
READY_S = 60.0


def _start(ps_tools, job, tmp_path: Path, workers: int = 2) -> dict[str, subprocess.Popen]:
    procs = {f"worker{r}": ps_tools.start_worker(job.env, r, tmp_path, "loop", str(tmp_path))
             for r in range(workers)}
    deadline = time.monotonic() + READY_S
    while not all((tmp_path / f"ready{r}").exists() for r in range(workers)):
        assert time.monotonic() < deadline, job.logs()
        assert all(p.poll() is None for p in [*procs.values(), *job.procs.values()]), job.logs()
        time.sleep(0.05)
    return procs


def _stop(proc: subprocess.Popen, fault_file: Path) -> faults.Fault | None:
    """SIGSTOP ``proc``; the first fault report, its time made relative to the SIGSTOP (None
    when there is none within twice the bound)."""
    stopped_at = time.time()
    os.kill(proc.pid, signal.SIGSTOP)
    deadline = time.monotonic() + 2 * DETECT_S
    while (first := faults.first(str(fault_file))) is None and time.monotonic() < deadline:
        time.sleep(0.05)
    if first is None:
        return None
    return faults.Fault(first.culprit, first.reason, first.reporter, first.time - stopped_at)


def _resume_and_kill(*procs: subprocess.Popen) -> None:
    for proc in procs:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
            proc.wait()


@pytest.mark.timeout(150)
@pytest.mark.parametrize("target", ["worker1", "server0"])
def test_stopped_worker_or_server_is_found_by_heartbeats_and_named(tmp_path, ps_tools, target):
    fault_file = tmp_path / "faults.jsonl"
    with ps_tools.ps_job(tmp_path, 2, 1, ESPRESSO_FAULT_FILE=str(fault_file)) as job:
        procs = {}
        try:
            procs = _start(ps_tools, job, tmp_path)
            first = _stop({**procs, **job.procs}[target], fault_file)
            # The scheduler exits after answering late comers for a few seconds.
            codes = {n: p.wait(timeout=30) for n, p in [*procs.items(), *job.procs.items()]
                     if n != target}
        finally:
            (tmp_path / "stop").touch()
            _resume_and_kill(*procs.values(), *job.procs.values())
    logs = job.logs()
    name = target[:-1] + " " + target[-1]  # "worker 1", as the launcher names processes
    assert first is not None and first.culprit == name, (faults.read(str(fault_file)), logs)
    assert first.time < DETECT_S, (first, logs)
    # A stopped server is found by the scheduler and by each worker's own connection to it.
    assert first.reporter == "scheduler" or target == "server0", first
    assert 0 not in codes.values(), (codes, logs)
    assert f"aborting the job: {name}" in ps_tools.read_log(tmp_path, "scheduler"), logs
    # The surviving worker fails with the scheduler's reason, which names the culprit; a
    # stopped server's own connection can time out at the worker first, which names it too.
    worker_log = ps_tools.read_log(tmp_path, "worker0")
    assert (f"the scheduler aborted the job: {name}" in worker_log
            or (target == "server0" and f"lost the connection to {name} at" in worker_log)), \
        worker_log
    if target == "worker1":  # the nodes relay it (for launchers on other machines)
        relays = {r.reporter for r in faults.read(str(fault_file))
                  if r.culprit == name and "relaying" in r.reporter}
        assert relays == {"worker 0 (relaying the scheduler's ABORT)",
                          "server 0 (relaying the scheduler's ABORT)"}, relays


@pytest.mark.timeout(150)
def test_stopped_scheduler_is_found_by_every_node(tmp_path, ps_tools):
    fault_file = tmp_path / "faults.jsonl"
    with ps_tools.ps_job(tmp_path, 2, 1, ESPRESSO_FAULT_FILE=str(fault_file)) as job:
        procs = {}
        try:
            procs = _start(ps_tools, job, tmp_path)
            first = _stop(job.procs["scheduler"], fault_file)
            codes = {n: p.wait(timeout=30) for n, p in [*procs.items(),
                                                          ("server0", job.procs["server0"])]}
        finally:
            (tmp_path / "stop").touch()
            _resume_and_kill(*procs.values(), *job.procs.values())
    logs = job.logs()
    assert first is not None and first.time < DETECT_S, (first, logs)
    assert first.culprit == "scheduler", (first, logs)  # the earliest report is the cause
    assert 0 not in codes.values(), (codes, logs)
    reports = faults.read(str(fault_file))
    # The server finds the scheduler on its own and exits; a worker can see that server go
    # before its own scheduler connection drops, and then names the server. Nobody else is
    # blamed.
    assert "server 0" in {r.reporter for r in reports if r.culprit == "scheduler"}, reports
    assert {r.culprit for r in reports} <= {"scheduler", "server 0"}, (reports, logs)
    assert "lost the connection to the scheduler" in ps_tools.read_log(tmp_path, "server0")


def _hold_and_finish(ps_tools, job, tmp_path: Path, seconds: int,
                     during: Callable[[], None] = lambda: None) -> dict[str, int]:
    """Worker 1 holds the GIL for ``seconds`` once (``during`` runs while it does); then a
    few more rounds and a clean stop. Every process's exit code."""
    procs = {}
    try:
        procs = _start(ps_tools, job, tmp_path)
        (tmp_path / "hold1").write_text(str(seconds))
        deadline = time.monotonic() + 30
        while (tmp_path / "hold1").exists():  # the worker takes the file as it starts
            assert time.monotonic() < deadline, job.logs()
            time.sleep(0.02)
        during()
        while not (tmp_path / "held1").exists():
            assert time.monotonic() < deadline, job.logs()
            assert all(p.poll() is None for p in [*procs.values(), *job.procs.values()]), \
                job.logs()
            time.sleep(0.1)
        time.sleep(1.0)  # a few more rounds after the busy one
        (tmp_path / "stop").touch()
        codes = {name: proc.wait(timeout=30) for name, proc in procs.items()}
        codes["scheduler"] = job.procs["scheduler"].wait(timeout=30)
    finally:
        (tmp_path / "stop").touch()
        _resume_and_kill(*procs.values(), *job.procs.values())
    return codes


@pytest.mark.timeout(150)
def test_worker_holding_the_gil_longer_than_the_heartbeat_timeout_is_not_lost(tmp_path, ps_tools):
    # 2 s time-out and a 6 s native call that keeps the GIL: Python-level heartbeats stop,
    # ZeroMQ's must keep the connection (and the job) alive.
    with ps_tools.ps_job(tmp_path, 2, 1, ESPRESSO_HEARTBEAT_TIMEOUT="2") as job:
        codes = _hold_and_finish(ps_tools, job, tmp_path, 6)
    assert set(codes.values()) == {0}, (codes, job.logs())


@pytest.mark.timeout(150)
def test_busy_worker_is_not_blamed_for_a_connection_that_is_not_its(tmp_path, ps_tools):
    # A TCP health check (or a port scan) connects to the scheduler and closes: ZeroMQ
    # reports a dropped connection without naming whose. Worker 1 meanwhile holds the GIL
    # for 4 s at the default 5 s time-out, so its heartbeats have stopped for seconds; it
    # is busy, not lost, and the job must go on.
    def probe() -> None:
        time.sleep(2.5)
        port = int(job.env["DMLC_PS_ROOT_PORT"])
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            time.sleep(0.1)

    with ps_tools.ps_job(tmp_path, 2, 1) as job:
        codes = _hold_and_finish(ps_tools, job, tmp_path, 4, probe)
    assert set(codes.values()) == {0}, (codes, job.logs())
    assert "is lost" not in ps_tools.read_log(tmp_path, "scheduler"), job.logs()
