"""An authenticated gate in front of the job's torch.distributed TCPStore.

torch's TCPStore has no authentication, and any client can list, read, overwrite and delete
every key (``list_keys``), so hiding keys under a prefix would not keep an outsider out. In an
authenticated job (``ESPRESSO_JOB_SECRET``) the store therefore listens only on the host's
loopback, and the public store port (``DMLC_PS_ROOT_PORT + 1``) is a :class:`StoreGate`:
each connection must first prove it holds the secret, and only then is it joined to the
store. Clients reach the gate through a :class:`StoreTunnel`, a loopback port in their own
process that torch's TCPStore client connects to.

Handshake (fixed sizes, before any store byte flows):

    gate   -> client  b"ESPS" + challenge (16 random bytes)
    client -> gate    nonce (16 random bytes) + BLAKE2b(b"ESPS" + challenge + nonce,
                      key=auth.store_key(secret), 32 bytes)
    gate   -> client  b"OK", then both directions are relayed until either side closes

A connection that does not answer correctly within :data:`ADMIT_TIMEOUT_S` is closed without
having exchanged a byte with the store; refusals are counted and logged (rate-limited). The
proof is bound to a fresh challenge, so a recorded handshake does not admit a replay. After
the handshake the relayed bytes are neither authenticated nor encrypted: an attacker on the
path between a worker and the scheduler is left to the network (docs/ps.md).

Example:
    >>> inner = loopback_listener()     # TCPStore(..., master_listen_fd=inner.fileno())
    >>> gate = StoreGate(public_listener, inner, store_key(secret))        # doctest: +SKIP
    >>> tunnel = StoreTunnel("10.0.0.1", 9001, store_key(secret))          # doctest: +SKIP
    >>> store = dist.TCPStore("127.0.0.1", tunnel.port, is_master=False)   # doctest: +SKIP
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import selectors
import socket
import threading

__all__ = ["ADMIT_TIMEOUT_S", "MAX_PENDING", "StoreGate", "StoreTunnel", "loopback_listener",
           "prove"]

log = logging.getLogger(__name__)

# Seconds a new connection has to complete the handshake before the gate closes it.
ADMIT_TIMEOUT_S = 5.0
# Handshakes in progress at once; further connections are closed at once (a flood of idle
# connections then costs the gate no more than this many threads).
MAX_PENDING = 64
_MAGIC = b"ESPS"
_CHALLENGE = 16
_PROOF = 16 + 32  # nonce + BLAKE2b tag
_CHUNK = 1 << 16  # bytes relayed per read
# Log the first N refusals, then every LOG_EVERY-th.
_LOG_FIRST, _LOG_EVERY = 20, 1000


def _tag(key: bytes, challenge: bytes, nonce: bytes) -> bytes:
    return hashlib.blake2b(_MAGIC + challenge + nonce, key=key, digest_size=32).digest()


def _read_exactly(conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            raise ConnectionError("closed during the handshake")
        data += chunk
    return data


def prove(conn: socket.socket, key: bytes, timeout_s: float = ADMIT_TIMEOUT_S) -> None:
    """The client's half of the handshake on a connected socket.

    Raises:
        ConnectionError: the gate closed the connection or did not admit it (wrong secret).
    """
    conn.settimeout(timeout_s)
    try:
        hello = _read_exactly(conn, len(_MAGIC) + _CHALLENGE)
        if not hello.startswith(_MAGIC):
            raise ConnectionError("the peer is not an espresso store gate")
        nonce = os.urandom(16)
        conn.sendall(nonce + _tag(key, hello[len(_MAGIC):], nonce))
        if _read_exactly(conn, 2) != b"OK":
            raise ConnectionError("the store gate did not admit this connection")
    except (OSError, TimeoutError) as exc:
        raise ConnectionError(f"the store gate refused this connection: {exc}; does every "
                              "process of the job have the same ESPRESSO_JOB_SECRET?") from None
    conn.settimeout(None)


def _relay(a: socket.socket, b: socket.socket) -> None:
    """Copy bytes both ways until either side closes; then close both."""
    with selectors.DefaultSelector() as sel:
        sel.register(a, selectors.EVENT_READ, b)
        sel.register(b, selectors.EVENT_READ, a)
        try:
            while True:
                for sk, _ in sel.select():
                    data = sk.fileobj.recv(_CHUNK)
                    if not data:
                        return
                    sk.data.sendall(data)
        except OSError:
            return
        finally:
            a.close()
            b.close()


class StoreGate:
    """Admits connections on ``listener`` that prove the secret, relaying each to the store,
    which listens on ``inner`` (a loopback port); runs on daemon threads until :meth:`close`,
    which closes both listening sockets.

    Args:
        listener: a bound, listening socket (the public store port).
        inner: the listening loopback socket the TCPStore itself serves
            (``master_listen_fd``); see :func:`loopback_listener`.
        key: :func:`byteps_espresso.server.auth.store_key` of the job secret.
    """

    def __init__(self, listener: socket.socket, inner: socket.socket, key: bytes) -> None:
        self.listener = listener
        self.inner_listener = inner
        self.inner = inner.getsockname()[:2]
        self.key = key
        self.refused = 0
        self.admitted = 0
        self._pending = threading.BoundedSemaphore(MAX_PENDING)
        self._lock = threading.Lock()
        self._closed = False
        threading.Thread(target=self._accept, name="store-gate", daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, peer = self.listener.accept()
            except OSError:
                return  # closed
            if not self._pending.acquire(blocking=False):
                self._refuse(conn, peer, f"{MAX_PENDING} handshakes already in progress")
                continue
            threading.Thread(target=self._admit, args=(conn, peer), name="store-gate-conn",
                             daemon=True).start()

    def _admit(self, conn: socket.socket, peer: tuple) -> None:
        try:
            conn.settimeout(ADMIT_TIMEOUT_S)
            challenge = os.urandom(_CHALLENGE)
            conn.sendall(_MAGIC + challenge)
            proof = _read_exactly(conn, _PROOF)
            if not hmac.compare_digest(proof[16:], _tag(self.key, challenge, proof[:16])):
                self._refuse(conn, peer, "wrong proof of the job secret")
                return
            inner = socket.create_connection(self.inner, timeout=ADMIT_TIMEOUT_S)
            conn.sendall(b"OK")
        except (OSError, ConnectionError) as exc:
            self._refuse(conn, peer, f"no valid handshake within {ADMIT_TIMEOUT_S:g} s ({exc})")
            return
        finally:
            self._pending.release()
        with self._lock:
            self.admitted += 1
        conn.settimeout(None)
        inner.settimeout(None)
        _relay(conn, inner)

    def _refuse(self, conn: socket.socket, peer: tuple, why: str) -> None:
        conn.close()
        with self._lock:
            self.refused += 1
            count = self.refused
        if count <= _LOG_FIRST or count % _LOG_EVERY == 0:
            log.warning("store gate: refused a connection from %s (#%d): %s", peer[0], count,
                        why)

    def close(self) -> None:
        self._closed = True
        self.listener.close()
        self.inner_listener.close()


def loopback_listener() -> socket.socket:
    """A listening socket on a free port of 127.0.0.1, for the store behind a gate."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(1024)
    return sock


class StoreTunnel:
    """A loopback port whose connections reach the job's store through its gate at
    ``host:port``; give :attr:`port` on ``127.0.0.1`` to ``dist.TCPStore``.

    The relay runs in a child process (``python -m byteps_espresso.server.store_gate``):
    torch's TCPStore client holds the GIL while it connects, so a relay on a thread of the
    same process could never answer it. The key reaches the child on its stdin, never on
    its command line; the child exits when this process closes the pipe or dies.

    Raises:
        ConnectionError: the relay process did not start.
    """

    def __init__(self, host: str, port: int, key: bytes) -> None:
        import subprocess
        import sys

        self.proc = subprocess.Popen([sys.executable, "-m", __name__, host, str(port)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(key.hex().encode() + b"\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line.strip().isdigit():
            self.close()
            raise ConnectionError(f"the store tunnel to {host}:{port} did not start")
        self.port = int(line)

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()  # the child exits
        try:
            self.proc.wait(timeout=5)
        except Exception:
            self.proc.kill()


def _tunnel(host: str, port: int, key: bytes, listener: socket.socket) -> None:
    """The relay process's loop: each local connection gets its own admitted connection."""
    def connect(local: socket.socket) -> None:
        try:
            remote = socket.create_connection((host, port), timeout=ADMIT_TIMEOUT_S)
            prove(remote, key)
        except (OSError, ConnectionError) as exc:
            log.error("store tunnel to %s:%d: %s", host, port, exc)
            local.close()
            return
        _relay(local, remote)

    while True:
        local, _ = listener.accept()
        threading.Thread(target=connect, args=(local,), daemon=True).start()


def main() -> None:
    """``python -m byteps_espresso.server.store_gate HOST PORT``: the relay of a
    :class:`StoreTunnel`; reads the key (hex) from stdin, prints its loopback port."""
    import sys

    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    host, port = sys.argv[1], int(sys.argv[2])
    key = bytes.fromhex(sys.stdin.readline().strip())
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    threading.Thread(target=_tunnel, args=(host, port, key, listener), daemon=True).start()
    print(listener.getsockname()[1], flush=True)
    sys.stdin.read()  # until the parent closes the pipe or dies
    os._exit(0)  # relay threads may be blocked in recv


if __name__ == "__main__":
    main()
