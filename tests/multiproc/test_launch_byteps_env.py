"""A BytePS user's two-machine job: only BytePS's variables, one ``bpslaunch`` per role.

Two network namespaces stand for two machines (the emulated cluster's, joined by a shaped
link). Machine A runs the scheduler, a server and worker machine 0; machine B runs worker
machine 1. Nobody sets ``DMLC_NODE_HOST``, ``DMLC_INTERFACE`` or ``GLOO_SOCKET_IFNAME``: each
process finds the address that routes to ``DMLC_PS_ROOT_URI`` (ps-lite's rule) and gloo
follows it. The job must finish with bit-identical parameters on every worker.

Also: a rendezvous that cannot complete fails naming the store and every rank's address.
"""

import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from byteps_espresso.deploy.emulate import EmulatedCluster, list_namespaces

WORKER = Path(__file__).parent / "workers" / "optimizer_worker.py"
STEPS = 3

needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("tc"),
    reason="network namespaces need root and iproute2 (CI runs as root)")


def _clean_env() -> dict[str, str]:
    """This process's environment without any job, address or interface setting."""
    return {k: v for k, v in os.environ.items()
            if not k.startswith(("DMLC_", "BYTEPS_", "ESPRESSO_", "GLOO_", "NCCL_",
                                 "CUDA_VISIBLE", "NVIDIA_"))}


def _finish(procs, timeout):
    outputs = []
    try:
        for proc in procs:
            out, _ = proc.communicate(timeout=timeout)
            outputs.append(out)
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    return outputs


@needs_root
@pytest.mark.root
@pytest.mark.timeout(300)
def test_two_machines_with_byteps_variables_only(tmp_path):
    bpslaunch = str(Path(sys.executable).with_name("bpslaunch"))
    with EmulatedCluster(machines=2, servers=0, inter_gbps=1.0) as cluster:
        a, b = cluster.placement("worker", 0), cluster.placement("worker", 1)
        job = {**_clean_env(), "DMLC_NUM_WORKER": "2", "DMLC_NUM_SERVER": "1",
               "DMLC_PS_ROOT_URI": a.host, "DMLC_PS_ROOT_PORT": "9000",
               "BYTEPS_LOCAL_SIZE": "2"}
        command = [sys.executable, str(WORKER), str(tmp_path), "none", "1", str(STEPS)]
        roles = [(a, {"DMLC_ROLE": "scheduler"}, []), (a, {"DMLC_ROLE": "server"}, []),
                 (a, {"DMLC_ROLE": "worker", "DMLC_WORKER_ID": "0"}, command),
                 (b, {"DMLC_ROLE": "worker", "DMLC_WORKER_ID": "1"}, command)]
        procs = [subprocess.Popen([*where.prefix, bpslaunch, *argv], env={**job, **role},
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                  start_new_session=True)
                 for where, role, argv in roles]
        outputs = _finish(procs, timeout=240)
    assert not [n for n in list_namespaces() if n.startswith(cluster.prefix)]
    for proc, out in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, out[-4000:]
    assert f"advertising {a.host} (interface eth0; the route to DMLC_PS_ROOT_URI" in outputs[0]
    assert f"listening on {a.host}:9000" in outputs[0]
    for step in range(STEPS):
        params = [np.load(tmp_path / f"params_{step}_{rank}.npy") for rank in range(4)]
        for rank, p in enumerate(params[1:], 1):
            assert p.tobytes() == params[0].tobytes(), f"step {step}: rank {rank} differs"


# A rank whose peers never come: DMLC_NUM_SERVER=0, so rank 0 hosts the store itself.
_LONELY = textwrap.dedent("""
    import sys
    from byteps_espresso.config import Config
    from byteps_espresso.worker.runtime import Runtime
    from byteps_espresso.worker.transport import RendezvousError
    try:
        Runtime(Config.from_env())
    except RendezvousError as exc:
        print("REFUSED", exc, flush=True)
        sys.exit(3)
""")


def _lonely(port: int, rank: int, root: str = "127.0.0.1") -> subprocess.CompletedProcess:
    env = {**_clean_env(), "DMLC_NUM_WORKER": "2", "DMLC_NUM_SERVER": "0",
           "DMLC_PS_ROOT_URI": root, "DMLC_PS_ROOT_PORT": str(port),
           "DMLC_WORKER_ID": str(rank), "ESPRESSO_START_TIMEOUT": "3", "ESPRESSO_TIMEOUT": "3"}
    return subprocess.run([sys.executable, "-c", _LONELY], env=env, capture_output=True,
                          text=True, timeout=90)


@pytest.mark.timeout(120)
def test_rendezvous_timeout_names_the_store_and_the_addresses(cluster):
    port = cluster.free_port_pair()
    alone = _lonely(port, rank=0)
    assert alone.returncode == 3, alone.stdout + alone.stderr
    message = alone.stdout
    assert f"store at 127.0.0.1:{port + 1}" in message
    assert ("rank 0: 127.0.0.1 (interface lo; the route to DMLC_PS_ROOT_URI=127.0.0.1), gloo "
            "over lo; rank 1: never reached the store") in message
    nobody = _lonely(cluster.free_port_pair(), rank=1)
    assert nobody.returncode == 3, nobody.stdout + nobody.stderr
    assert "cannot reach the torch.distributed store at 127.0.0.1:" in nobody.stdout
    assert "advertising 127.0.0.1" in nobody.stdout
