"""Shared-memory segments (server/shm.py): what a server accepts to map, and that both sides
see one memory."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
from byteps_espresso.server.shm import SHM_DIR, Segment, host_identity

pytestmark = pytest.mark.skipif(not os.path.isdir(SHM_DIR), reason="no /dev/shm")


def test_worker_and_server_mappings_share_the_elements_and_leave_no_name():
    mine = Segment.create(4 * 1000, "test")
    try:
        assert os.stat(mine.path).st_mode & 0o777 == 0o600
        theirs = Segment.attach(mine.path, 4 * 1000)
        mine.unlink()
        assert not os.path.exists(mine.path)  # both mappings outlive the name
        mine.array[:] = np.arange(1000, dtype=np.float32)
        assert np.array_equal(theirs.array, np.arange(1000, dtype=np.float32))
        theirs.array[::2] = -1.0
        assert mine.array[0] == -1.0 and mine.array[1] == 1.0
        theirs.close()
    finally:
        mine.close()


def test_attach_refuses_what_is_not_a_private_segment_of_this_user(tmp_path):
    seg = Segment.create(4096, "test")
    try:
        with pytest.raises(ValueError, match="needs 8192"):
            Segment.attach(seg.path, 8192)
        os.chmod(seg.path, 0o644)
        with pytest.raises(ValueError, match="mode 0600"):
            Segment.attach(seg.path, 4096)
        os.chmod(seg.path, 0o600)
        outside = tmp_path / "segment"
        outside.write_bytes(bytes(4096))
        with pytest.raises(ValueError, match="not a file directly in /dev/shm"):
            Segment.attach(str(outside), 4096)
        with pytest.raises(ValueError, match="not a file directly in /dev/shm"):
            Segment.attach(os.path.join(SHM_DIR, "..", "etc", "passwd"), 4096)
        link = os.path.join(SHM_DIR, f"espresso-test-link-{os.getpid()}")
        os.symlink(seg.path, link)
        try:
            with pytest.raises(OSError):  # O_NOFOLLOW: a link is never followed
                Segment.attach(link, 4096)
        finally:
            os.unlink(link)
        sub = os.path.join(SHM_DIR, f"espresso-test-dir-{os.getpid()}")
        os.mkdir(sub)
        try:
            with pytest.raises((ValueError, OSError)):
                Segment.attach(sub, 4096)
        finally:
            os.rmdir(sub)
        with pytest.raises(FileNotFoundError):
            Segment.attach(os.path.join(SHM_DIR, "espresso-no-such-segment"), 4096)
    finally:
        seg.close()
    assert not os.path.exists(seg.path)


def test_host_identity_names_boot_network_namespace_and_shm_mount():
    ident = host_identity()
    boot, net, dev, ino = ident.split(":")
    with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
        assert boot == f.read().strip()
    assert int(net) == os.stat("/proc/self/ns/net").st_ino
    assert (int(dev), int(ino)) == (os.stat(SHM_DIR).st_dev, os.stat(SHM_DIR).st_ino)


@pytest.mark.timeout(60)
@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                    reason="a network namespace needs root and unshare")
def test_another_network_namespace_is_another_host():
    """Emulated machines are network namespaces of one kernel (deploy/emulate.py): their
    workers and servers must not share segments, or the shaped links would be bypassed."""
    code = "from byteps_espresso.server.shm import host_identity; print(host_identity())"
    there = subprocess.run(["unshare", "--net", sys.executable, "-c", code],
                           capture_output=True, text=True, timeout=50, check=True).stdout.strip()
    here = host_identity().split(":")
    assert there.split(":")[1] != here[1]  # the namespace differs,
    assert [there.split(":")[i] for i in (0, 2, 3)] == [here[i] for i in (0, 2, 3)]  # no more
