"""ESPRESSO_SERVER_PORT: a server listens on the declared port (as a NetworkPolicy admits it)."""

from __future__ import annotations

import pytest
from byteps_espresso.deploy.launch import free_port_pair

pytestmark = pytest.mark.timeout(150)


def test_server_listens_on_the_fixed_port_and_a_taken_one_is_named(tmp_path, ps_tools):
    port = free_port_pair()  # p and p + 1 free: use p + 1 as the fixed server port
    with ps_tools.ps_job(tmp_path, 2, 1, ESPRESSO_SERVER_PORT=str(port + 1)) as job:
        clients = job.connect(2)
        assert [c.servers for c in clients] == [[f"tcp://127.0.0.1:{port + 1}"]] * 2
        # A second server on the same host and port cannot listen: it exits 1 naming both.
        taken = ps_tools.start_role(job.env, "server", tmp_path, "taken")
        job.procs["taken"] = taken
        assert taken.wait(timeout=60) == 1
        log = ps_tools.read_log(tmp_path, "taken")
        assert f"cannot listen on 127.0.0.1:{port + 1} (ESPRESSO_SERVER_PORT)" in log, log
        assert "Traceback" not in log
