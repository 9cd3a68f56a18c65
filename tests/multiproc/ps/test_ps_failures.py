"""A job that cannot start or loses a server ends every process with a clear error, in time."""

from __future__ import annotations

import re
import subprocess
import sys
import time

import pytest

START_TIMEOUT_S = 5.0
OP_TIMEOUT_S = 8.0


def _wait_all(procs: dict[str, subprocess.Popen], limit_s: float) -> dict[str, int]:
    deadline = time.monotonic() + limit_s
    codes = {}
    for name, proc in procs.items():
        try:
            codes[name] = proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            codes[name] = None
    return codes


@pytest.mark.timeout(90)
def test_missing_server_fails_every_process_listing_it(tmp_path, ps_tools):
    procs: dict[str, subprocess.Popen] = {}
    with ps_tools.ps_job(tmp_path, 2, 2, start_servers=1,
                         ESPRESSO_START_TIMEOUT=str(START_TIMEOUT_S),
                         ESPRESSO_TIMEOUT=str(OP_TIMEOUT_S)) as job:
        try:
            started = time.monotonic()
            for r in range(2):
                procs[f"worker{r}"] = ps_tools.start_worker(job.env, r, tmp_path, "connect",
                                                            str(tmp_path))
            procs.update(job.procs)
            # Start-up timeout, plus process start (imports) on a busy machine.
            codes = _wait_all(procs, START_TIMEOUT_S + 30)
            elapsed = time.monotonic() - started
        finally:
            ps_tools.kill_all(list(procs.values()))
    logs = job.logs()
    assert all(code not in (0, None) for code in codes.values()), (codes, logs)
    assert elapsed < START_TIMEOUT_S + 30
    for name in ("worker0", "worker1", "scheduler", "server0"):
        text = ps_tools.read_log(tmp_path, name)
        assert "1 of 2 server(s) never registered (server ranks [1] unassigned)" in text, (
            name, text)


@pytest.mark.timeout(120)
def test_server_killed_mid_round_fails_every_worker(tmp_path, ps_tools):
    procs: dict[str, subprocess.Popen] = {}
    with ps_tools.ps_job(tmp_path, 2, 2, ESPRESSO_TIMEOUT=str(OP_TIMEOUT_S)) as job:
        try:
            for r in range(2):
                procs[f"worker{r}"] = ps_tools.start_worker(job.env, r, tmp_path, "killed",
                                                            str(tmp_path))
            deadline = time.monotonic() + 60
            while not all((tmp_path / f"ready{r}").exists() for r in range(2)):
                assert time.monotonic() < deadline, job.logs()
                assert all(p.poll() is None for p in procs.values()), job.logs()
                time.sleep(0.05)
            time.sleep(0.3)  # worker 0 has pushed round 1 and waits for its pull
            job.procs["server1"].kill()
            killed_at = time.monotonic()
            (tmp_path / "go").touch()  # worker 1 now pushes round 1 into the dead server
            codes = _wait_all(procs, OP_TIMEOUT_S + 10)
            elapsed = time.monotonic() - killed_at
            rest = {n: p for n, p in job.procs.items() if n != "server1"}
            rest_codes = _wait_all(rest, OP_TIMEOUT_S + 10)
        finally:
            ps_tools.kill_all(list(procs.values()))
    logs = job.logs()
    assert all(code not in (0, None) for code in codes.values()), (codes, logs)
    assert elapsed < OP_TIMEOUT_S + 10
    sched = ps_tools.read_log(tmp_path, "scheduler")
    # The scheduler aborts because a worker reported the loss, or missed heartbeats.
    lost = re.search(r"aborting the job: .*server (\d) at (tcp://[0-9.:]+)", sched)
    assert lost, sched
    for r in range(2):
        text = ps_tools.read_log(tmp_path, f"worker{r}")
        assert re.search(r"PSError: push_pull of 'k#\d' \(key \d+\) round 1 on server \d: "
                         rf".*server {lost[1]} at {lost[2]}", text), text
    assert rest_codes["scheduler"] == 1 and rest_codes["server0"] == 1, (rest_codes, logs)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("env", "needle"), [
    ({"DMLC_ROLE": "server", "DMLC_NUM_WORKER": "1", "DMLC_NUM_SERVER": "1",
      "DMLC_PS_ROOT_URI": "127.0.0.1"}, "DMLC_PS_ROOT_PORT is not set"),
    ({"DMLC_ROLE": "scheduler", "DMLC_NUM_WORKER": "1", "DMLC_NUM_SERVER": "0",
      "DMLC_PS_ROOT_URI": "127.0.0.1", "DMLC_PS_ROOT_PORT": "9000"}, "DMLC_NUM_SERVER=0"),
    ({"DMLC_ROLE": "worker", "DMLC_NUM_WORKER": "1", "DMLC_NUM_SERVER": "1",
      "DMLC_PS_ROOT_URI": "127.0.0.1", "DMLC_PS_ROOT_PORT": "9000"}, "DMLC_ROLE=worker"),
    ({"DMLC_ROLE": "server", "DMLC_NUM_WORKER": "1", "DMLC_NUM_SERVER": "1",
      "DMLC_PS_ROOT_URI": "127.0.0.1", "DMLC_PS_ROOT_PORT": "x"}, "DMLC_PS_ROOT_PORT='x'"),
])
def test_configuration_errors_exit_2_naming_the_variable(env, needle):
    result = subprocess.run([sys.executable, "-m", "byteps_espresso.server"], env=env,
                            capture_output=True, text=True, timeout=50)
    assert result.returncode == 2, result.stderr
    assert needle in result.stderr


@pytest.mark.timeout(90)
def test_scheduler_killed_fails_pending_and_later_operations(tmp_path, ps_tools):
    import numpy as np
    from byteps_espresso.server.client import PSError

    with ps_tools.ps_job(tmp_path, 2, 1, ESPRESSO_TIMEOUT=str(OP_TIMEOUT_S)) as job:
        c0, c1 = job.connect(2)
        for c in (c0, c1):
            c.declare("s", 100, pushers=[0, 1])
        x = np.ones(100, np.float32)
        pending = c0.push_pull_async("s", x, 0)  # waits for rank 1, which never pushes
        job.procs["scheduler"].kill()
        killed_at = time.monotonic()
        # The server notices too and exits; whichever loss the client sees first names it.
        with pytest.raises(PSError, match=r"lost the connection to (the scheduler|server 0)"):
            pending.wait()
        with pytest.raises(PSError, match="lost the connection to the scheduler"):
            c1.push_pull("s", x, 0)
        assert time.monotonic() - killed_at < OP_TIMEOUT_S
        assert job.procs["server0"].wait(timeout=OP_TIMEOUT_S + 10) == 1
    assert "lost the connection to the scheduler" in ps_tools.read_log(tmp_path, "server0")
