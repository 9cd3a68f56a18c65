"""The torch.distributed store of an authenticated job, over real processes: workers holding
the secret form a gloo world through the scheduler's store gate, while a process without the
secret (or with another one) can neither read nor overwrite the job's rendezvous keys."""

from __future__ import annotations

import queue
import subprocess
import sys
import threading
import time

import pytest

SECRET = "store-gate-secret-0123456789abcdef"

WORKER = r'''
import torch, torch.distributed as dist
from byteps_espresso.config import Config
from byteps_espresso.worker.topology import Topology
from byteps_espresso.worker.transport import init_distributed
cfg = Config.from_env()
tunnel = init_distributed(Topology.from_config(cfg), cfg.root_uri, cfg.store_port,
                          timeout_s=60, secret=cfg.secret(), address=f"worker {cfg.rank}")
t = torch.full((4,), float(cfg.rank + 1))
dist.all_reduce(t)
assert t[0].item() == 3.0, t
dist.destroy_process_group()
tunnel.close()
print("world ok", flush=True)
'''

# argv: port, secret ("" for none). Prints what it could do with the job's keys.
PROBE = r'''
import datetime, sys
import torch.distributed as dist
from byteps_espresso.server.auth import store_key
from byteps_espresso.server.store_gate import StoreTunnel
port, secret = int(sys.argv[1]), sys.argv[2]
host = ("127.0.0.1", port)
if secret:
    tunnel = StoreTunnel("127.0.0.1", port, store_key(secret.encode()))
    host = ("127.0.0.1", tunnel.port)
try:
    store = dist.TCPStore(*host, is_master=False, timeout=datetime.timedelta(seconds=8))
    keys = store.list_keys()
    print("address0", store.get("espresso/address/0").decode(), flush=True)
    store.set("espresso/address/0", "overwritten")
    print("listed", len(keys), flush=True)
except Exception as exc:
    print("refused", type(exc).__name__, flush=True)
'''


def _lines_until(proc: subprocess.Popen, marker: str, timeout_s: float) -> str:
    """What ``proc`` printed up to its line containing ``marker`` (or everything it printed
    by ``timeout_s`` or its exit). A rank may print other lines first (torch warns while its
    store client retries a store not listening yet), and after the marker it keeps running,
    so neither one ``readline`` nor a ``read`` to the end would do."""
    lines: queue.SimpleQueue[str | None] = queue.SimpleQueue()

    def pump() -> None:
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    said, deadline = [], time.monotonic() + timeout_s
    while (left := deadline - time.monotonic()) > 0:
        try:
            line = lines.get(timeout=left)
        except queue.Empty:
            break
        if line is None:
            break
        said.append(line)
        if marker in line:
            break
    return "".join(said)


def _probe(port: int, secret: str, env: dict[str, str]) -> str:
    out = subprocess.run([sys.executable, "-c", PROBE, str(port), secret], env=env,
                         capture_output=True, text=True, timeout=90)
    return out.stdout + out.stderr


@pytest.mark.timeout(240)
def test_only_processes_with_the_secret_reach_the_store(tmp_path, ps_tools):
    with ps_tools.ps_job(tmp_path, 2, 1, ESPRESSO_JOB_SECRET=SECRET,
                         ESPRESSO_START_TIMEOUT="200") as job:
        env = job.env
        port = int(env["DMLC_PS_ROOT_PORT"]) + 1
        workers = [subprocess.Popen([sys.executable, "-c", WORKER],
                                    env=ps_tools.worker_env(env, r), stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True) for r in range(2)]
        try:
            outs = [w.communicate(timeout=150)[0] for w in workers]
        finally:
            ps_tools.kill_all(workers)
        assert all("world ok" in o for o in outs), outs
        plain = {k: v for k, v in env.items() if k != "ESPRESSO_JOB_SECRET"}
        # No secret: torch's own client is refused at the gate, before any store byte.
        assert "refused" in _probe(port, "", plain)
        # Another secret: its proof does not admit it either.
        assert "refused" in _probe(port, "another secret, also 32 characters", plain)
        # The job's keys are there, untouched: a process with the secret reads rank 0's.
        seen = _probe(port, SECRET, plain)
        assert "address0 worker 0" in seen and "listed" in seen, seen
        assert "store gate: refused a connection" in ps_tools.read_log(tmp_path, "scheduler")


RANK = r'''
import sys, torch, torch.distributed as dist
from byteps_espresso.worker.topology import Topology
from byteps_espresso.worker.transport import host_store, init_distributed
rank, port, secret = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3].encode()
store = keep = tunnel = None
if rank == 0:  # DMLC_NUM_SERVER=0: rank 0 hosts the store, behind the gate
    store, keep = host_store("127.0.0.1", "127.0.0.1", port, 60, secret)
tunnel = init_distributed(Topology(1, 2, 0, rank), "127.0.0.1", port, timeout_s=60,
                          store=store, secret=secret, address=f"worker {rank}")
t = torch.full((4,), float(rank + 1))
dist.all_reduce(t)
assert t[0].item() == 3.0, t
print("world ok", flush=True)
sys.stdin.read()  # rank 0 keeps hosting the store until the test is done probing
'''


@pytest.mark.timeout(240)
def test_rank_zero_hosts_a_gated_store_without_servers(tmp_path, ps_tools):
    from byteps_espresso.deploy.launch import free_port_pair

    port = free_port_pair() + 1
    env = ps_tools.base_env(2, 0)
    ranks = [subprocess.Popen([sys.executable, "-c", RANK, str(r), str(port), SECRET],
                              env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(2)]
    try:
        for proc in ranks:
            said = _lines_until(proc, "world ok", timeout_s=150)
            assert "world ok" in said, said
        assert "refused" in _probe(port, "", env)
        seen = _probe(port, SECRET, env)
        assert "address0 worker 0" in seen, seen
    finally:
        for proc in ranks:
            proc.stdin.close()
        ps_tools.kill_all(ranks)
