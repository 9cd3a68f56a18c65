"""bpslaunch as a worker machine: ranks, GPUs, prefixed output, fail-fast, Ctrl-C, no orphans.

These run the real console script on real processes; the user command is a small script
that forks a grandchild (so whole process groups must be stopped) and then behaves as told.
"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(60)

SCRIPT = r'''
import os, signal, subprocess, sys, time
rank = int(os.environ["DMLC_WORKER_ID"]) * int(os.environ["BYTEPS_LOCAL_SIZE"]) \
    + int(os.environ["BYTEPS_LOCAL_RANK"])
out = sys.argv[1]
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
with open(os.path.join(out, f"pids.{rank}"), "w") as f:
    f.write(f"{os.getpid()} {child.pid}")
print(f"rank={rank} gpu={os.environ.get('CUDA_VISIBLE_DEVICES', 'none')}", flush=True)
action = dict(a.split("=") for a in sys.argv[2:]).get(str(rank), "exit0")
if action == "ignore-term":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
if action.startswith("fail"):
    time.sleep(0.5)
    sys.exit(int(action[4:]))
if action == "exit0":
    child.kill()
    sys.exit(0)
time.sleep(600)
'''


def _env(**extra):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("DMLC_", "BYTEPS_", "ESPRESSO_", "CUDA_VISIBLE"))}
    env.update(DMLC_ROLE="worker", DMLC_NUM_WORKER="2", DMLC_NUM_SERVER="1",
               DMLC_PS_ROOT_URI="127.0.0.1", DMLC_PS_ROOT_PORT="9000", DMLC_WORKER_ID="1",
               BYTEPS_LOCAL_SIZE="3")
    env.update(extra)
    return env


def _bpslaunch():
    return str(Path(sys.executable).with_name("bpslaunch"))


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[-1][0] != "Z"
    except FileNotFoundError:
        return False


def _pids(out: Path) -> list[int]:
    return [int(p) for f in sorted(out.glob("pids.*")) for p in f.read_text().split()]


def _launch(tmp_path, actions, *, env=None, extra_args=()):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    cmd = [_bpslaunch(), *extra_args, sys.executable, str(script), str(tmp_path), *actions]
    return subprocess.Popen(cmd, env=env or _env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def _finish(proc, timeout=30):
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return out, err


def _wait_started(out: Path, count: int):
    deadline = time.monotonic() + 20
    while len(_pids(out)) < count and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(_pids(out)) == count, "workers did not start"


def _survivors(out: Path, limit_s: float) -> list[int]:
    """Processes of the job still alive after up to ``limit_s`` (the kernel reaps them)."""
    deadline = time.monotonic() + limit_s
    while [p for p in _pids(out) if _alive(p)] and time.monotonic() < deadline:
        time.sleep(0.1)
    return [p for p in _pids(out) if _alive(p)]


def _kill_leftovers(out: Path):
    for pid in _pids(out):
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)


def test_worker_role_starts_local_size_ranks_that_see_every_gpu(tmp_path):
    proc = _launch(tmp_path, [], env=_env(CUDA_VISIBLE_DEVICES="5,6,7"))
    try:
        out, err = _finish(proc)
        assert proc.returncode == 0, err
        lines = sorted(line for line in out.splitlines() if "rank=" in line)
        # As with BytePS: each selects cuda:<local rank> among the machine's GPUs.
        assert lines == ["[worker 3] rank=3 gpu=5,6,7", "[worker 4] rank=4 gpu=5,6,7",
                         "[worker 5] rank=5 gpu=5,6,7"]
    finally:
        _kill_leftovers(tmp_path)


def test_first_failure_stops_every_process_group_and_is_named(tmp_path):
    proc = _launch(tmp_path, ["4=fail7", "3=sleep", "5=sleep"])
    try:
        _, err = _finish(proc)
        assert proc.returncode == 7
        assert "worker 4 exited with code 7" in err
        pids = _pids(tmp_path)
        assert len(pids) == 6  # three workers and their three grandchildren
        assert not [p for p in pids if _alive(p)], "processes survived the launcher"
    finally:
        _kill_leftovers(tmp_path)


def test_sigterm_ignoring_process_is_killed_after_the_grace_period(tmp_path):
    proc = _launch(tmp_path, ["3=fail2", "4=ignore-term", "5=sleep"],
                   extra_args=["--grace-s", "1"])
    try:
        start = time.monotonic()
        _, err = _finish(proc)
        assert proc.returncode == 2, err
        assert time.monotonic() - start < 10
        assert not [p for p in _pids(tmp_path) if _alive(p)]
    finally:
        _kill_leftovers(tmp_path)


def test_ctrl_c_stops_everything(tmp_path):
    proc = _launch(tmp_path, ["3=sleep", "4=sleep", "5=sleep"])
    try:
        _wait_started(tmp_path, 6)
        proc.send_signal(signal.SIGINT)
        _, err = _finish(proc)
        assert proc.returncode == 128 + signal.SIGINT
        assert "interrupted by SIGINT" in err
        assert not [p for p in _pids(tmp_path) if _alive(p)]
    finally:
        _kill_leftovers(tmp_path)


def test_missing_contract_variable_is_named(tmp_path):
    env = _env()
    del env["DMLC_PS_ROOT_URI"]
    proc = _launch(tmp_path, [], env=env)
    _, err = _finish(proc)
    assert proc.returncode == 2
    assert "DMLC_PS_ROOT_URI is not set" in err
    assert not _pids(tmp_path)


def test_killing_the_launcher_outright_leaves_no_process_behind(tmp_path):
    proc = _launch(tmp_path, ["3=sleep", "4=sleep", "5=sleep"])
    try:
        _wait_started(tmp_path, 6)
        proc.kill()  # no cleanup code runs in the launcher
        proc.wait()
        assert not _survivors(tmp_path, 20), "orphans survived"
    finally:
        _finish(proc)
        _kill_leftovers(tmp_path)


def test_stopped_launcher_is_killed_by_its_reaper_with_its_job(tmp_path):
    proc = _launch(tmp_path, ["3=sleep", "4=sleep", "5=sleep"],
                   env=_env(ESPRESSO_HEARTBEAT_TIMEOUT="2"))
    try:
        _wait_started(tmp_path, 6)
        os.kill(proc.pid, signal.SIGSTOP)
        stopped_at = time.monotonic()
        _, err = _finish(proc)
        took = time.monotonic() - stopped_at
        assert proc.returncode == -signal.SIGKILL, err
        last = err.strip().splitlines()[-1]
        assert f"the launcher (pid {proc.pid}) has not responded for" in last, err
        assert "it is stopped: SIGSTOP" in last, err
        # 2 s without a beat; the workers then exit at once on the reaper's SIGTERM.
        assert took < 10, took
        assert not _survivors(tmp_path, 10), "processes survived the launcher"
    finally:
        _kill_leftovers(tmp_path)
