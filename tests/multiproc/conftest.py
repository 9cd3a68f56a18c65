"""Launch emulated machines x workers as real processes on loopback, with hard timeouts.

Workers get the BytePS environment (DMLC_NUM_WORKER machines, BYTEPS_LOCAL_SIZE workers
each, DMLC_WORKER_ID, BYTEPS_LOCAL_RANK); the torch.distributed store is either hosted by the
test (``store_master``) or by a real scheduler.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path

import pytest

WORKERS = Path(__file__).parent / "workers"
REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    """A port that was free a moment ago on 127.0.0.1 (bind port 0, read it back)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_port_pair() -> int:
    """A port p with p and p + 1 free (scheduler port and its store port)."""
    for _ in range(50):
        p = free_port()
        with socket.socket() as a, socket.socket() as b:
            try:
                a.bind(("127.0.0.1", p))
                b.bind(("127.0.0.1", p + 1))
            except OSError:
                continue
        return p
    raise RuntimeError("no two adjacent free ports on 127.0.0.1")


def worker_env(machines: int, local_size: int, rank: int, root_port: int, *,
               servers: int = 0, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DMLC_", "BYTEPS_",
                                                                      "ESPRESSO_"))}
    env.update({
        "DMLC_ROLE": "worker", "DMLC_NUM_WORKER": str(machines), "DMLC_NUM_SERVER": str(servers),
        "DMLC_PS_ROOT_URI": "127.0.0.1", "DMLC_PS_ROOT_PORT": str(root_port),
        "DMLC_WORKER_ID": str(rank // local_size), "BYTEPS_LOCAL_SIZE": str(local_size),
        "BYTEPS_LOCAL_RANK": str(rank % local_size), "ESPRESSO_TIMEOUT": "60",
        "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO),
    })
    env.update(extra or {})
    return env


def run_workers(script: str, args: list[str], *, machines: int = 2, local_size: int = 2,
                root_port: int, servers: int = 0, timeout: float = 240,
                extra_env: Mapping[str, str] | None = None) -> list[str]:
    """Run ``script`` as every worker; return their outputs; fail on any error or timeout."""
    procs = []
    logs = []
    try:
        for rank in range(machines * local_size):
            log = tempfile.TemporaryFile("w+")
            logs.append(log)
            procs.append(subprocess.Popen(
                [sys.executable, str(WORKERS / script), *args],
                env=worker_env(machines, local_size, rank, root_port, servers=servers,
                               extra=extra_env),
                stdout=log, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + timeout
        for p in procs:
            try:
                p.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                break
        outputs = []
        for log in logs:
            log.seek(0)
            outputs.append(log.read())
        hung = [f"--- worker {r} still running after {timeout} s:\n{out[-2500:]}"
                for r, (p, out) in enumerate(zip(procs, outputs, strict=True))
                if p.poll() is None]
        assert not hung, "\n".join(hung)
        failed = [f"--- worker {r} exited {p.returncode}:\n{out[-2500:]}"
                  for r, (p, out) in enumerate(zip(procs, outputs, strict=True))
                  if p.returncode != 0]
        assert not failed, "\n".join(failed)
        return outputs
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for log in logs:
            log.close()


def model_workload(script: str):
    """A Workload of the ``model()`` of worker script ``script`` (a module in workers/):
    its parameters in backward order, each ready 100 us apart (for planning test strategies)."""
    import importlib

    from byteps_espresso.strategy import Workload
    from byteps_espresso.strategy.workload import TensorProfile

    sys.path.insert(0, str(WORKERS))
    try:
        model = importlib.import_module(script).model
    finally:
        sys.path.remove(str(WORKERS))
    params = list(model().named_parameters())
    return Workload(tuple(TensorProfile(name, p.numel(), 100.0)
                          for name, p in reversed(params)), model="tiny")


@pytest.fixture(scope="session")
def cluster():
    """The launch helpers, as a fixture (test modules cannot import conftest)."""
    import types

    return types.SimpleNamespace(free_port=free_port, free_port_pair=free_port_pair,
                                 run_workers=run_workers, store=_store, ps_job=ps_job,
                                 model_workload=model_workload)


@contextlib.contextmanager
def ps_job(machines: int = 2, local_size: int = 2, servers: int = 1,
           extra_env: Mapping[str, str] | None = None):
    """A real scheduler (which hosts the torch.distributed store) and ``servers`` servers.

    Yields the DMLC_PS_ROOT_PORT to give the workers; kills everything on exit.
    """
    root = free_port_pair()
    env = worker_env(machines, local_size, 0, root, servers=servers, extra=extra_env)
    env.pop("DMLC_WORKER_ID")
    env.pop("BYTEPS_LOCAL_RANK")
    procs = []
    logs = []
    try:
        for role in ["scheduler"] + ["server"] * servers:
            log = tempfile.TemporaryFile("w+")
            logs.append(log)
            procs.append(subprocess.Popen([sys.executable, "-m", "byteps_espresso.server"],
                                          env={**env, "DMLC_ROLE": role}, stdout=log,
                                          stderr=subprocess.STDOUT))
        yield root
    finally:
        deadline = time.monotonic() + 10
        for p in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            if p.poll() is None:
                p.kill()
                p.wait()
        for log in logs:
            log.close()


@contextlib.contextmanager
def _store(root_port: int):
    """Host the torch.distributed TCPStore on ``root_port + 1`` (what the scheduler does)."""
    import datetime

    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", root_port + 1, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=120))
    try:
        yield store
    finally:
        del store
