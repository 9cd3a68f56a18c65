"""The raw baselines of benchmarks/ps.py answer with what their figures assume: the echo with
the bytes sent, the raw sum-server with the sum of every worker's copy, after the last one."""

import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import zmq

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "ps.py"


def _start(tmp_path: Path, *args: str) -> tuple[subprocess.Popen, str]:
    port_file = tmp_path / "port"
    proc = subprocess.Popen([sys.executable, str(SCRIPT), args[0], str(port_file), *args[1:]])
    deadline = time.monotonic() + 60
    while not port_file.exists():
        assert proc.poll() is None and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.05)
    return proc, f"tcp://127.0.0.1:{port_file.read_text()}"


@pytest.mark.timeout(120)
def test_raw_sum_answers_every_worker_after_the_last_copy(tmp_path):
    proc, address = _start(tmp_path, "_sum_server", "2")
    ctx = zmq.Context()
    try:
        socks = [ctx.socket(zmq.DEALER) for _ in range(2)]
        for s in socks:
            s.setsockopt(zmq.RCVTIMEO, 30_000)
            s.connect(address)
        rng = np.random.default_rng(0)
        for _ in range(2):  # the second round reuses the partitions' sum buffers
            parts = [[rng.standard_normal(n, dtype=np.float32) for n in (5, 1000)]
                     for _ in socks]
            for i in range(2):
                socks[0].send_multipart([i.to_bytes(4, "little"), parts[0][i]])
            # One copy of each partition is in: nobody is answered yet.
            assert not socks[0].poll(200)
            for i in range(2):
                socks[1].send_multipart([i.to_bytes(4, "little"), parts[1][i]])
            for s in socks:
                got = [np.frombuffer(s.recv(), np.float32) for _ in range(2)]
                got.sort(key=len)
                for i in range(2):
                    np.testing.assert_array_equal(got[i], parts[0][i] + parts[1][i])
        for s in socks:
            s.close(linger=0)
    finally:
        ctx.term()
        proc.kill()
        proc.wait(30)


@pytest.mark.timeout(120)
def test_echo_returns_the_bytes(tmp_path):
    proc, address = _start(tmp_path, "_echo_server")
    ctx = zmq.Context()
    try:
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.RCVTIMEO, 30_000)
        s.connect(address)
        s.send(b"partition")
        assert s.recv() == b"partition"
        s.close(linger=0)
    finally:
        ctx.term()
        proc.kill()
        proc.wait(30)
