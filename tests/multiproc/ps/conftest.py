"""Real PS jobs on loopback: a scheduler and servers as processes, free ports, hard timeouts.

``ps_job`` starts ``python -m byteps_espresso.server`` processes; ``PSJob.clients`` builds
real :class:`PSClient` objects (in threads of the test process, or the test starts worker
processes with :func:`worker_env`). Everything is killed in ``finally``.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import time
import types
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import zmq
from byteps_espresso.deploy.launch import free_port_pair
from byteps_espresso.server import protocol as P
from byteps_espresso.server.client import PSClient

from byteps_espresso.config import Config

HERE = Path(__file__).parent
WORKER_SCRIPT = HERE / "ps_worker.py"
# Small keys keep the tests fast while every tensor still spans several partitions.
PARTITION_BYTES = 64 * 1024
# Hard limit for any PS process started by a test, in seconds.
PROC_TIMEOUT_S = 90
# The test jobs' ESPRESSO_MAX_MESSAGE_BYTES.
MAX_MESSAGE_BYTES = 8 << 20


def base_env(num_workers: int, num_servers: int, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("DMLC_", "BYTEPS_", "ESPRESSO_"))}
    env.update({
        "DMLC_NUM_WORKER": str(num_workers),
        "DMLC_NUM_SERVER": str(num_servers),
        "DMLC_PS_ROOT_URI": "127.0.0.1",
        "DMLC_PS_ROOT_PORT": str(free_port_pair()),
        "ESPRESSO_START_TIMEOUT": "30",
        "ESPRESSO_TIMEOUT": "20",
        "ESPRESSO_MAX_MESSAGE_BYTES": str(MAX_MESSAGE_BYTES),
        "BYTEPS_PARTITION_BYTES": str(PARTITION_BYTES),
        "BYTEPS_SERVER_ENGINE_THREAD": "2",
        "ESPRESSO_LOG_LEVEL": "WARNING",
    })
    env.update(extra)
    return env


def worker_env(env: dict[str, str], rank: int) -> dict[str, str]:
    return {**env, "DMLC_ROLE": "worker", "DMLC_WORKER_ID": str(rank)}


def start_role(env: dict[str, str], role: str, log_dir: Path, name: str) -> subprocess.Popen:
    out = open(log_dir / f"{name}.log", "w")
    return subprocess.Popen([sys.executable, "-m", "byteps_espresso.server"],
                            env={**env, "DMLC_ROLE": role}, stdout=out,
                            stderr=subprocess.STDOUT)


def start_worker(env: dict[str, str], rank: int, log_dir: Path, *args: str
                 ) -> subprocess.Popen:
    out = open(log_dir / f"worker{rank}.log", "w")
    return subprocess.Popen([sys.executable, str(WORKER_SCRIPT), *args],
                            env=worker_env(env, rank), stdout=out, stderr=subprocess.STDOUT)


def kill_all(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
    for proc in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)


def read_log(log_dir: Path, name: str) -> str:
    return (log_dir / f"{name}.log").read_text()


class RawPeer:
    """A bare DEALER speaking the wire protocol by hand."""

    def __init__(self, address: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)

    def request(self, frames: list) -> P.Message:
        self.sock.send_multipart(frames)
        assert self.sock.poll(20_000), "no reply from the server"
        return P.decode(self.sock.recv_multipart(), MAX_MESSAGE_BYTES)

    def rejected(self, frames: list, code: P.ErrorCode) -> dict:
        reply = self.request(frames)
        assert reply.header.type is P.MsgType.ERROR, reply.header
        body = P.decode_json(reply)
        assert body["code"] == code.value, body
        assert body["message"]
        return body

    def push(self, key: int, round_: int, sender: int, x: np.ndarray, **fields) -> list:
        args = {"key": key, "round": round_, "sender": sender, "dtype": P.DType.FLOAT32,
                "numel": x.size, "frames": [x], **fields}
        return P.encode(P.MsgType.PUSH, **args)

    def close(self) -> None:
        self.sock.close()
        self.ctx.term()


@dataclass
class PSJob:
    env: dict[str, str]
    log_dir: Path
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    clients: list[PSClient] = field(default_factory=list)

    def config(self, rank: int) -> Config:
        return Config.from_env(worker_env(self.env, rank))

    def connect(self, num_workers: int) -> list[PSClient]:
        """Register ``num_workers`` PSClients concurrently (registration blocks until all)."""
        out: list[PSClient | BaseException | None] = [None] * num_workers

        def make(rank: int) -> None:
            try:
                out[rank] = PSClient(self.config(rank))
            except BaseException as exc:
                out[rank] = exc

        threads = [threading.Thread(target=make, args=(r,)) for r in range(num_workers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=PROC_TIMEOUT_S)
        for item in out:
            if not isinstance(item, PSClient):
                raise RuntimeError(f"client start failed: {item!r}\n{self.logs()}")
        self.clients = out  # type: ignore[assignment]
        return self.clients

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}"
                         for p in sorted(self.log_dir.glob("*.log")))

    def close(self) -> None:
        for client in self.clients:
            with contextlib.suppress(Exception):
                client.close()
        deadline = time.monotonic() + 10
        for proc in self.procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        kill_all(list(self.procs.values()))


@contextlib.contextmanager
def ps_job(tmp_path: Path, num_workers: int, num_servers: int, *, start_servers: int | None = None,
           **extra: str) -> Iterator[PSJob]:
    """A scheduler and ``start_servers`` (default all) servers as processes."""
    env = base_env(num_workers, num_servers, **extra)
    job = PSJob(env, tmp_path)
    try:
        job.procs["scheduler"] = start_role(env, "scheduler", tmp_path, "scheduler")
        for i in range(num_servers if start_servers is None else start_servers):
            job.procs[f"server{i}"] = start_role(env, "server", tmp_path, f"server{i}")
        yield job
    finally:
        job.close()


@pytest.fixture(scope="module")
def ps_job_factory(tmp_path_factory: pytest.TempPathFactory):
    """Module-wide PS jobs with 4 in-process clients, by number of servers."""
    jobs: dict[int, PSJob] = {}
    stack = contextlib.ExitStack()

    def get(num_servers: int) -> PSJob:
        if num_servers not in jobs:
            tmp = tmp_path_factory.mktemp(f"ps{num_servers}")
            job = stack.enter_context(ps_job(tmp, 4, num_servers))
            job.connect(4)
            jobs[num_servers] = job
        return jobs[num_servers]

    with stack:
        yield get


@pytest.fixture
def ps_tools() -> types.SimpleNamespace:
    """The helpers above, for test modules (conftest is not importable by name)."""
    return types.SimpleNamespace(ps_job=ps_job, start_worker=start_worker, start_role=start_role,
                                 kill_all=kill_all, read_log=read_log, base_env=base_env,
                                 worker_env=worker_env, RawPeer=RawPeer,
                                 max_message_bytes=MAX_MESSAGE_BYTES)
