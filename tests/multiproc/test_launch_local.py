"""espresso-launch --local / --emulate with the real scheduler and servers.

The user command is a small PS job (every rank pushes rank+1 into one key and checks the
sum), so these tests exercise the whole environment contract. Orphans are searched for by
a tag variable every process of the job inherits: after the launcher returns, no process on
the host may still carry it.
"""

import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from byteps_espresso.deploy.emulate import list_namespaces

pytestmark = pytest.mark.timeout(120)

JOB = r'''
import sys, time
import numpy as np
from byteps_espresso.config import Config
from byteps_espresso.server.client import PSClient

cfg = Config.from_env()
fail_rank = int(sys.argv[1]) if len(sys.argv) > 1 else -1
if "gloo" in sys.argv:  # torch.distributed through the scheduler's store, across machines
    import datetime, torch, torch.distributed as dist
    timeout = datetime.timedelta(seconds=60)
    store = dist.TCPStore(cfg.root_uri, cfg.store_port, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=cfg.rank, world_size=cfg.world_size,
                            timeout=timeout)
    t = torch.full((8,), float(cfg.rank + 1))
    dist.all_reduce(t)
    assert t[0].item() == cfg.world_size * (cfg.world_size + 1) / 2, t
    print(f"gloo ok rank={cfg.rank}", flush=True)
client = PSClient(cfg, rank=cfg.rank)
client.declare("grad", 4096, pushers=list(range(cfg.world_size)))
total = client.push_pull("grad", np.full(4096, cfg.rank + 1, np.float32), 0)
expected = cfg.world_size * (cfg.world_size + 1) / 2
assert np.allclose(total, expected), (total[:4], expected)
print(f"sum ok rank={cfg.rank} host={cfg.node_host} root={cfg.root_uri}", flush=True)
if "stats" in sys.argv and cfg.rank == 0:  # the round is complete: every waiter answered
    replies = sum(s["shm_replies"] for s in client.server_stats())
    print(f"shm replies={replies}", flush=True)
if cfg.rank == fail_rank:
    sys.exit(5)
if fail_rank >= 0:
    time.sleep(600)  # survivors wait to be stopped by the launcher
client.close()
'''

needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("tc"),
    reason="--emulate needs root and iproute2 (CI runs as root)")


def _tagged_pids(tag: str) -> list[int]:
    """Live processes whose environment carries ``DEPLOY_TEST_TAG=tag``."""
    needle = f"DEPLOY_TEST_TAG={tag}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                state = (entry / "stat").read_text().rsplit(") ", 1)[-1][0]
                if state != "Z":
                    found.append(int(entry.name))
        except OSError:
            continue
    return found


def _launch(tmp_path, args, job_args=(), **popen):
    script = tmp_path / "job.py"
    script.write_text(JOB)
    tag = uuid.uuid4().hex
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("DMLC_", "BYTEPS_", "CUDA_VISIBLE"))}
    env.update(DEPLOY_TEST_TAG=tag, ESPRESSO_START_TIMEOUT="60", ESPRESSO_TIMEOUT="60")
    launcher = str(Path(sys.executable).with_name("espresso-launch"))
    cmd = [launcher, *args, "--", sys.executable, str(script), *map(str, job_args)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True, **popen)
    return proc, tag


def _communicate(proc, timeout=90):
    try:
        return proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _survivors(tag):
    """Processes of the job still alive (given a moment to be reaped), then killed."""
    deadline = time.monotonic() + 10  # the kernel may take a moment to reap
    while _tagged_pids(tag) and time.monotonic() < deadline:
        time.sleep(0.1)
    survivors = _tagged_pids(tag)
    for pid in survivors:
        os.kill(pid, signal.SIGKILL)
    return survivors


def _finish(proc, tag, timeout=90):
    out, err = _communicate(proc, timeout)
    return out, err, _survivors(tag)


LOCAL = ["--local", "--machines", "2", "--workers-per-machine", "2", "--servers", "1"]


def test_local_job_runs_every_role_with_prefixed_output(tmp_path):
    proc, tag = _launch(tmp_path, LOCAL)
    out, err, survivors = _finish(proc, tag)
    assert proc.returncode == 0, out[-3000:] + err[-3000:]
    for rank in range(4):
        assert f"[worker {rank}] sum ok rank={rank} host=127.0.0.1" in out
    assert "every worker finished" in out
    assert not survivors


def test_local_failure_stops_scheduler_servers_and_workers(tmp_path):
    proc, tag = _launch(tmp_path, LOCAL, job_args=[2])
    out, err, survivors = _finish(proc, tag)
    assert proc.returncode == 5, out[-3000:] + err[-3000:]
    assert "worker 2 exited with code 5" in err
    assert not survivors, "processes of the job outlived the launcher"


def test_local_ctrl_c_stops_everything(tmp_path):
    proc, tag = _launch(tmp_path, LOCAL, job_args=[99])  # nobody fails: all wait
    deadline = time.monotonic() + 60
    # launcher, its watchdog, scheduler, server and four workers
    while len(_tagged_pids(tag)) < 8 and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(1)
    proc.send_signal(signal.SIGINT)
    _, err, survivors = _finish(proc, tag)
    assert proc.returncode == 128 + signal.SIGINT, err[-3000:]
    assert not survivors


@needs_root
def test_emulated_job_uses_namespace_addresses_for_ps_and_gloo(tmp_path):
    proc, tag = _launch(tmp_path, ["--emulate", *LOCAL[1:], "--inter-gbps", "1"],
                        job_args=[-1, "gloo", "stats"])
    out, err, survivors = _finish(proc, tag)
    assert proc.returncode == 0, out[-3000:] + err[-3000:]
    hosts = {line.split("host=")[1].split()[0] for line in out.splitlines() if "sum ok" in line}
    assert len(hosts) == 2 and all(h.startswith("10.213.0.") for h in hosts), hosts
    assert "root=10.213.0.1" in out
    assert out.count("gloo ok") == 4
    assert "shm replies=0" in out  # the server is another host to every machine
    assert not [n for n in list_namespaces() if n.startswith(f"esp{proc.pid}x")]
    assert not survivors


@needs_root
def test_colocated_servers_answer_their_machines_workers_through_shared_memory(tmp_path):
    # Two servers, one per machine; the job's one key lives on one of them, so that
    # machine's two workers reach it through shared memory and the other two over the link.
    args = ["--emulate", "--colocate", *LOCAL[1:-1], "2", "--inter-gbps", "1"]
    proc, tag = _launch(tmp_path, args, job_args=[-1, "gloo", "stats"])
    out, err, survivors = _finish(proc, tag)
    assert proc.returncode == 0, out[-3000:] + err[-3000:]
    assert out.count("sum ok") == 4 and out.count("gloo ok") == 4
    assert "shm replies=2" in out
    assert not [n for n in list_namespaces() if n.startswith(f"esp{proc.pid}x")]
    assert not survivors


@needs_root
def test_emulated_failure_tears_down_every_namespace(tmp_path):
    proc, tag = _launch(tmp_path, ["--emulate", *LOCAL[1:]], job_args=[3])
    out, err, survivors = _finish(proc, tag)
    assert proc.returncode == 5, out[-3000:] + err[-3000:]
    assert "worker 3 exited with code 5" in err
    assert not [n for n in list_namespaces() if n.startswith(f"esp{proc.pid}x")]
    assert not survivors


def test_one_bpslaunch_per_machine_and_role_like_byteps(tmp_path):
    """The BytePS contract: scheduler, server and two worker machines, each its own launcher."""
    from byteps_espresso.deploy.launch import free_port_pair

    script = tmp_path / "job.py"
    script.write_text(JOB)
    tag = uuid.uuid4().hex
    base = {k: v for k, v in os.environ.items()
            if not k.startswith(("DMLC_", "BYTEPS_", "CUDA_VISIBLE"))}
    base.update(DEPLOY_TEST_TAG=tag, DMLC_NUM_WORKER="2", DMLC_NUM_SERVER="1",
                DMLC_PS_ROOT_URI="127.0.0.1", DMLC_PS_ROOT_PORT=str(free_port_pair()),
                BYTEPS_LOCAL_SIZE="2", ESPRESSO_START_TIMEOUT="60")
    bpslaunch = str(Path(sys.executable).with_name("bpslaunch"))
    roles = [{"DMLC_ROLE": "scheduler"}, {"DMLC_ROLE": "server"},
             {"DMLC_ROLE": "worker", "DMLC_WORKER_ID": "0"},
             {"DMLC_ROLE": "worker", "DMLC_WORKER_ID": "1"}]
    procs = [subprocess.Popen([bpslaunch, sys.executable, str(script)], env={**base, **extra},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              start_new_session=True) for extra in roles]
    outputs = [_communicate(proc) for proc in procs]
    assert not _survivors(tag)
    for proc, (out, err) in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, out[-2000:] + err[-2000:]
    worker_out = outputs[2][0] + outputs[3][0]
    assert sorted(line.split("]")[0] for line in worker_out.splitlines() if "sum ok" in line) \
        == ["[worker 0", "[worker 1", "[worker 2", "[worker 3"]
    assert "every process finished" in outputs[0][0]
