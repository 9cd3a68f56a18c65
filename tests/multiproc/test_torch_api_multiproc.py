"""The drop-in API with real processes: every call's semantics, the resume pattern, how a
script that never calls ``shutdown`` ends, and ``ESPRESSO_STRATEGY`` in a real job.

Hard time-outs everywhere: the launcher runs under ``communicate(timeout=...)`` and every
test has a pytest time-out.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

WORKERS = Path(__file__).parent / "workers"
LAUNCHER = str(Path(sys.executable).with_name("espresso-launch"))


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("DMLC_", "BYTEPS_", "ESPRESSO_", "CUDA_VISIBLE"))}
    env.update({"ESPRESSO_START_TIMEOUT": "60", "ESPRESSO_TIMEOUT": "60", "OMP_NUM_THREADS": "1",
                **extra})
    return env


def _launch_local(args: list[str], timeout: float, **extra: str) -> tuple[int, str]:
    proc = subprocess.Popen([LAUNCHER, "--local", *args], env=_env(**extra),
                            stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode, out


@pytest.mark.timeout(240)
def test_every_call_and_the_resume_pattern_in_a_job_that_never_calls_shutdown(tmp_path):
    code, out = _launch_local(["--machines", "2", "--workers-per-machine", "2", "--servers",
                               "1", "--", sys.executable, str(WORKERS / "api_worker.py"),
                               str(tmp_path)], timeout=200)
    assert code == 0, out[-5000:]
    assert "every worker finished" in out and "lost" not in out
    for rank in range(4):
        assert f"[worker {rank}] api ok rank={rank}" in out
    results = [json.loads((tmp_path / f"api_{rank}.json").read_text()) for rank in range(4)]
    # The resume pattern: every rank holds rank 0's optimizer state, and stays identical.
    assert all(r == results[0] for r in results[1:]), results


@pytest.mark.timeout(180)
def test_a_script_without_shutdown_leaves_the_job_cleanly(tmp_path):
    """The shape of BytePS's benchmark_byteps.py: no shutdown() anywhere. Also: a BytePS
    variable that is not implemented is reported once for the whole job."""
    code, out = _launch_local(["--machines", "2", "--workers-per-machine", "1", "--servers",
                               "1", "--", sys.executable, str(WORKERS / "exit_worker.py"),
                               "finish"], timeout=150, DMLC_ENABLE_RDMA="1")
    assert code == 0, out[-5000:]
    assert out.count("trained rank=") == 2 and "every worker is done; job finished" in out
    assert "lost" not in out
    assert out.count("DMLC_ENABLE_RDMA='1' is ignored: it asks for RDMA") == 1, out[-5000:]


@pytest.mark.timeout(240)
def test_an_uncaught_exception_still_stops_the_job_at_once(cluster, tmp_path):
    """Shutdown at exit must not make a failed worker look finished: the others are told it
    was lost at once instead of waiting for ESPRESSO_TIMEOUT."""
    timeout_s = 120
    with cluster.ps_job(machines=2, local_size=1, servers=1) as root:
        procs, logs, ended = [], [], {}
        try:
            for rank in range(2):
                env = _env(DMLC_ROLE="worker", DMLC_NUM_WORKER="2", DMLC_NUM_SERVER="1",
                           DMLC_PS_ROOT_URI="127.0.0.1", DMLC_PS_ROOT_PORT=str(root),
                           DMLC_WORKER_ID=str(rank), ESPRESSO_TIMEOUT=str(timeout_s))
                logs.append(open(tmp_path / f"worker{rank}.log", "w+"))
                procs.append(subprocess.Popen([sys.executable, str(WORKERS / "exit_worker.py"),
                                               "raise"], env=env, stdout=logs[-1],
                                              stderr=subprocess.STDOUT))
            deadline = time.monotonic() + timeout_s + 60
            while len(ended) < 2 and time.monotonic() < deadline:
                for rank, p in enumerate(procs):
                    if rank not in ended and p.poll() is not None:
                        ended[rank] = time.monotonic()
                time.sleep(0.1)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
            outputs = []
            for log in logs:
                log.seek(0)
                outputs.append(log.read())
                log.close()
    assert len(ended) == 2, f"still running: {[r for r in range(2) if r not in ended]}"
    assert procs[1].returncode != 0 and "rank 1 fails on purpose" in outputs[1]
    assert procs[0].returncode != 0, outputs[0][-3000:]
    assert "worker 1 is lost" in outputs[0], outputs[0][-3000:]
    waited = ended[0] - ended[1]
    assert waited < timeout_s / 2, f"rank 0 waited {waited:.0f} s for a lost peer"


@pytest.mark.timeout(180)
def test_espresso_strategy_is_loaded_and_nothing_is_profiled(tmp_path, cluster):
    from byteps_espresso.strategy import Cluster, plan

    workload = cluster.model_workload("strategy_env_worker")
    strategy = plan(workload, Cluster.preset(2, 1, "pcie", 10), "randomk", {"ratio": 0.5},
                    algorithm="all-gpu")
    path = tmp_path / "strategy.json"
    strategy.save(path)
    cluster.run_workers("strategy_env_worker.py", [str(tmp_path)], machines=2, local_size=1,
                        root_port=cluster.free_port_pair(), timeout=150,
                        extra_env={"ESPRESSO_STRATEGY": str(path),
                                   "ESPRESSO_PROFILE_STEPS": "50"})
    for rank in range(2):
        assert (tmp_path / f"strategy_{rank}.txt").read_text() == "all-gpu randomk"
        # the codec's kernels loaded while the optimizer was built: the steps loaded none
        built, after = map(int, (tmp_path / f"kernels_{rank}.txt").read_text().split())
        assert built > 0 and after == built, (built, after)
