"""Shared-memory segments between a worker and a server on the same host (``BYTEPS_ENABLE_IPC``).

A dense key's push and its sum can skip the network stack when the worker and the server
share a host, as BytePS's IPC mode does for colocated servers: the worker writes its push
into a segment it created for the key, sends a header-only PUSH, and the server sums straight
from the segment and writes the round's sum back into it before a header-only PULL_REPLY.
Over loopback TCP every byte is copied four times per round (into the kernel and out, both
ways); through the segment, twice.

The segment is a file in ``/dev/shm`` created by the worker (``O_EXCL``, mode 0600, its
space reserved with ``posix_fallocate`` so a full tmpfs fails here, not later with SIGBUS)
and opened by the server on ATTACH, which checks that the file is a regular one in
``/dev/shm``, owned by the server's user, readable by nobody else and large enough. Once the
server answered, the worker unlinks the name: both keep their mappings, and nothing is left
behind when either process dies.

"The same host" is :func:`host_identity`: the boot, the network namespace and the
``/dev/shm`` mount. Machines emulated as network namespaces on one kernel (deploy/emulate.py)
therefore keep their shaped links; processes on one machine share the segment.
"""

from __future__ import annotations

import functools
import mmap
import os
import secrets
import stat

import numpy as np

__all__ = ["SHM_DIR", "Segment", "boot_id", "host_identity"]

SHM_DIR = "/dev/shm"


@functools.cache
def boot_id() -> str:
    """The running kernel's boot: processes with the same one share a machine's cores
    (emulated machines and containers are namespaces of one kernel). Empty where unknown."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            return f.read().strip()
    except OSError:
        return ""


@functools.cache
def host_identity() -> str:
    """What two processes must share to exchange pushes through a segment: the kernel boot,
    the network namespace (emulated machines are namespaces of one kernel) and the
    ``/dev/shm`` file system (containers may each have their own). Empty when any part is
    unknown, which matches nothing."""
    boot = boot_id()
    if not boot:
        return ""
    try:
        net = os.stat("/proc/self/ns/net").st_ino
        shm = os.stat(SHM_DIR)
    except OSError:
        return ""
    return f"{boot}:{net}:{shm.st_dev}:{shm.st_ino}"


class Segment:
    """One mapped shared-memory file holding a key's float32 elements."""

    def __init__(self, path: str, fd: int, nbytes: int, owner: bool) -> None:
        self.path = path
        self.nbytes = nbytes
        self.owner = owner  # the worker that created it unlinks its name
        try:
            self._map = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self.array = np.frombuffer(self._map, dtype=np.float32)

    @classmethod
    def create(cls, nbytes: int, tag: str) -> Segment:
        """A new segment of ``nbytes`` (a multiple of 4) named after ``tag``.

        Raises:
            OSError: /dev/shm is missing, full (ENOSPC) or not writable.
        """
        path = os.path.join(SHM_DIR, f"espresso-{os.getpid()}-{tag}-{secrets.token_hex(6)}")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            os.posix_fallocate(fd, 0, nbytes)
        except OSError:
            os.close(fd)
            os.unlink(path)
            raise
        return cls(path, fd, nbytes, owner=True)

    @classmethod
    def attach(cls, path: str, nbytes: int) -> Segment:
        """Map a worker's segment of at least ``nbytes``.

        Raises:
            ValueError: the path is not a private regular file of this user in /dev/shm, or
                is too small (the message says which).
            OSError: it cannot be opened.
        """
        if os.path.dirname(path) != SHM_DIR or os.path.basename(path) in ("", ".", ".."):
            raise ValueError(f"segment {path!r} is not a file directly in {SHM_DIR}")
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise ValueError(f"segment {path!r} is not a regular file")
            if st.st_uid != os.getuid() or st.st_mode & 0o077:
                raise ValueError(f"segment {path!r} must belong to this server's user "
                                 f"(uid {os.getuid()}) with mode 0600")
            if st.st_size < nbytes:
                raise ValueError(f"segment {path!r} has {st.st_size} bytes, the key needs "
                                 f"{nbytes}")
        except BaseException:
            os.close(fd)
            raise
        return cls(path, fd, nbytes, owner=False)

    def unlink(self) -> None:
        """Remove the name (the mappings stay); once is enough, later calls do nothing."""
        if self.owner:
            self.owner = False
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass

    def close(self) -> None:
        """Unmap. Arrays still viewing the segment keep it mapped until they are freed."""
        self.unlink()
        self.array = np.zeros(0, np.float32)
        try:
            self._map.close()
        except BufferError:  # an exported view (a result array) is alive; freed with it
            pass
