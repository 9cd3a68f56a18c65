"""Emulated cluster: real namespaces, real shaped links, always torn down (needs root)."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
from byteps_espresso.deploy.emulate import (
    EmulatedCluster,
    EmulationError,
    list_namespaces,
    shape_args,
)

pytestmark = [pytest.mark.root, pytest.mark.timeout(120)]

needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("tc"),
    reason="network namespaces need root and iproute2 (CI runs as root)")

# One-shot TCP sink/source: the sink prints the received rate in bit/s.
TRANSFER = r'''
import socket, sys, time
role, host, seconds = sys.argv[1], sys.argv[2], float(sys.argv[3])
if role == "sink":
    srv = socket.socket(); srv.bind((host, 5201)); srv.listen(1)
    print("ready", flush=True)
    conn, _ = srv.accept(); total = 0; start = None
    while data := conn.recv(1 << 20):
        start = start or time.perf_counter(); total += len(data)
    print(total * 8 / (time.perf_counter() - start), flush=True)
else:
    conn = socket.create_connection((host, 5201)); buf = b"x" * (1 << 20)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        conn.sendall(buf)
    conn.close()
'''


def _ours(cluster):
    return [n for n in list_namespaces() if n.startswith(cluster.prefix)]


def _measure_bits_per_s(cluster, seconds=1.5):
    sink_at, source_at = cluster.placement("worker", 1), cluster.placement("worker", 0)
    sink = subprocess.Popen([*sink_at.prefix, sys.executable, "-c", TRANSFER, "sink",
                             sink_at.host, "0"], stdout=subprocess.PIPE, text=True)
    try:
        assert sink.stdout.readline().strip() == "ready"
        subprocess.run([*source_at.prefix, sys.executable, "-c", TRANSFER, "source",
                        sink_at.host, str(seconds)], check=True, timeout=30)
        out, _ = sink.communicate(timeout=30)
        return float(out)
    finally:
        sink.kill()
        sink.wait()


@needs_root
def test_shaped_link_limits_tcp_throughput_to_the_set_rate():
    rate_gbps = 0.2  # low enough that two busy shared cores are never the bottleneck
    with EmulatedCluster(machines=2, servers=1, inter_gbps=rate_gbps) as cluster:
        assert len(_ours(cluster)) == 5  # bridge, scheduler, server, two machines
        measured = _measure_bits_per_s(cluster)
    assert 0.8 * rate_gbps * 1e9 < measured < 1.05 * rate_gbps * 1e9, measured
    assert not _ours(cluster)


@needs_root
def test_subnet_exists_only_inside_the_namespaces():
    with EmulatedCluster(machines=1, servers=0, inter_gbps=1) as cluster:
        host_addrs = subprocess.run(["ip", "-4", "addr"], capture_output=True, text=True).stdout
        assert cluster.addresses["m0"] not in host_addrs
        inside = subprocess.run([*cluster.placement("worker", 0).prefix, "ip", "-4", "addr"],
                                capture_output=True, text=True, check=True).stdout
        assert cluster.addresses["m0"] in inside


@needs_root
def test_namespaces_are_deleted_when_the_body_fails():
    cluster = EmulatedCluster(machines=2, servers=1, inter_gbps=1)
    with pytest.raises(RuntimeError, match="boom"), cluster:
        assert _ours(cluster)
        raise RuntimeError("boom")
    assert not _ours(cluster)


@needs_root
def test_namespaces_are_deleted_on_ctrl_c(tmp_path):
    # The child restores Ctrl-C's default: a test run started in the background by a
    # non-interactive shell inherits SIGINT ignored, and Python keeps an ignored SIGINT so.
    code = ("import signal, sys, time\n"
            "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
            "from byteps_espresso.deploy.emulate import EmulatedCluster\n"
            "with EmulatedCluster(machines=2, servers=1, inter_gbps=1) as c:\n"
            "    print(c.prefix, flush=True)\n"
            "    time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        prefix = proc.stdout.readline().strip()
        assert prefix.startswith("esp"), proc.stderr.read()
        assert [n for n in list_namespaces() if n.startswith(prefix)]
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=30)
        assert not [n for n in list_namespaces() if n.startswith(prefix)]
    finally:
        proc.kill()
        proc.wait()


@needs_root
def test_latency_needs_netem_or_is_added():
    try:
        cluster = EmulatedCluster(machines=2, servers=0, inter_gbps=1, inter_latency_ms=20)
        with cluster:
            a, b = cluster.placement("worker", 0), cluster.placement("worker", 1)
            ping = [*a.prefix, sys.executable, "-c",
                    "import socket,sys,time\n"
                    "s=socket.socket(socket.AF_INET,socket.SOCK_DGRAM)\n"
                    "s.connect((sys.argv[1],9)); t=time.perf_counter()\n"
                    "r=socket.socket(); r.settimeout(5)\n"
                    "try: r.connect((sys.argv[1],9))\n"
                    "except OSError: pass\n"
                    "print(time.perf_counter()-t)", b.host]
            rtt = float(subprocess.run(ping, capture_output=True, text=True, check=True,
                                       timeout=30).stdout)
        assert rtt >= 0.038  # a refused TCP connect is one round trip: 2 x 20 ms
    except EmulationError as exc:
        assert "netem" in str(exc) and "--inter-latency-ms 0" in str(exc)
        assert not [n for n in list_namespaces() if n.startswith(cluster.prefix)]


def test_refuses_without_root_with_a_clear_message():
    # Import first: the interpreter's own files may be unreadable for the unprivileged user.
    code = ("import os, sys\n"
            "from byteps_espresso.deploy.launch import main\n"
            "os.setgid(65534); os.setuid(65534)\n"
            "sys.exit(main(['--emulate', '--', 'true'], environ={}))\n")
    if os.geteuid() == 0:
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                timeout=60)
    else:
        result = subprocess.run([sys.executable, "-m", "byteps_espresso.deploy.launch",
                                 "--emulate", "--", "true"], capture_output=True, text=True,
                                timeout=60)
    assert result.returncode == 2, result.stderr
    assert "--emulate needs root" in result.stderr


def test_shape_arguments_rate_and_delay():
    (only,) = shape_args(1.0, 0)
    assert only[:3] == ["root", "handle", "1:"] and "tbf" in only
    assert only[only.index("rate") + 1] == "1000.000mbit"
    netem, tbf = shape_args(10.0, 2.5)
    assert netem[-3:] == ["netem", "delay", "2.500ms"][-3:]
    assert tbf[:2] == ["parent", "1:1"]
    assert int(tbf[tbf.index("burst") + 1]) == int(10e9 / 8 * 1e-3)


def test_bad_parameters_are_refused():
    with pytest.raises(EmulationError, match="inter-gbps"):
        EmulatedCluster(machines=1, servers=1, inter_gbps=0)
    with pytest.raises(EmulationError, match="subnet"):
        EmulatedCluster(machines=10, servers=1, inter_gbps=1, subnet="10.213.0.0/29")


@needs_root
def test_namespaces_are_deleted_when_the_owner_is_killed_outright():
    code = ("import time\n"
            "from byteps_espresso.deploy.emulate import EmulatedCluster\n"
            "from byteps_espresso.deploy.reaper import Reaper\n"
            "with Reaper() as r, EmulatedCluster(machines=2, servers=1, inter_gbps=1, "
            "reaper=r) as c:\n"
            "    print(c.prefix, flush=True)\n"
            "    time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        prefix = proc.stdout.readline().strip()
        assert len([n for n in list_namespaces() if n.startswith(prefix)]) == 5
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 20
        while [n for n in list_namespaces() if n.startswith(prefix)]:
            assert time.monotonic() < deadline, "namespaces survived their owner"
            time.sleep(0.1)
    finally:
        proc.kill()
        proc.wait()


@needs_root
@pytest.mark.timeout(240)
@pytest.mark.parametrize("colocate,share", [(True, 0.5), (False, 0.0)])
def test_the_profile_says_which_push_pull_bytes_stay_on_the_machine(tmp_path, colocate, share):
    """2 emulated machines x 2 workers and 2 servers: beside the machines (``--colocate``,
    server j in machine j's namespace) half of each machine's push/pull bytes go to its own
    server and stay off its link; on nodes of their own every byte crosses it. The
    profiled cluster the planner prices says so (``local_server_share``)."""
    out = tmp_path / "profile"
    env = {**os.environ, "ESPRESSO_PROFILE_STEPS": "2", "ESPRESSO_TRIAL_STEPS": "0",
           "ESPRESSO_CHECK_STEPS": "0", "ESPRESSO_PROFILE_OUT": str(out)}
    worker = os.path.join(os.path.dirname(__file__), "workers", "optimizer_worker.py")
    result = subprocess.run(
        [sys.executable, "-m", "byteps_espresso.deploy.launch", "--emulate", "--inter-gbps",
         "10", *(["--colocate"] if colocate else []), "--machines", "2",
         "--workers-per-machine", "2", "--servers", "2", "--",
         sys.executable, worker, str(tmp_path), "espresso", "1", "3"],
        env=env, capture_output=True, text=True, timeout=200)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    cluster = json.loads((out / "cluster.json").read_text())
    assert (cluster["servers"], cluster["shared_host"]) == (2, False)
    assert cluster["local_server_share"] == share
