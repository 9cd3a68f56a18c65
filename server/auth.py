"""Message authentication on the PS wire: a MAC over header and frames, keyed by the job secret.

With a job secret (``ESPRESSO_JOB_SECRET`` / ``ESPRESSO_JOB_SECRET_FILE``) every message
carries ``FLAG_MAC`` in its header and one extra last frame: a 16-byte tag over the header
(type, key, round, sender, lengths, flags) and every payload frame. Two keys are derived from
the secret:

    boot key  BLAKE2b(secret, person="espresso-boot"): REGISTER, and the scheduler's ACCEPT
              or ABORT to a node that has not been accepted yet
    job key   BLAKE2b(job id, key=secret digest, person="espresso-job"): everything after
              ACCEPT, which hands every node the job id the scheduler drew at random

A message of another job (another secret, or the same secret with another job id) fails
verification; within a job the tag binds the round and sender, so a replayed push can only
repeat (sender, key, round), which the server's round rules reject. A message that fails
verification is dropped without a reply and counted.

Example:
    >>> auth = Authenticator.boot(b"0123456789abcdef")
    >>> frames = auth.sign([b"header" + bytes(34), b"payload"])
    >>> auth.verify(frames)[1]
    b'payload'
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable, Sequence
from typing import Any

from byteps_espresso.server import protocol as P

__all__ = ["ALGORITHM", "MACS", "TAG_BYTES", "AuthError", "Authenticator",
           "warn_if_unauthenticated"]

TAG_BYTES = 16
_FLAGS = slice(6, 8)  # the header's flags field (protocol.HEADER: offset 6, uint16)


def _blake2b(key: bytes) -> Callable[[], Any]:
    return lambda: hashlib.blake2b(key=key, digest_size=TAG_BYTES)


def _hmac_sha256(key: bytes) -> Callable[[], Any]:
    return lambda: hmac.new(key, digestmod=hashlib.sha256)


# Keyed MACs by name: name -> (key -> new hash object). Both hash at the speed of the host's
# hashing code; ALGORITHM is the faster on the development machine (`python
# benchmarks/ps.py --mac`, BENCHMARKS.md).
MACS: dict[str, Callable[[bytes], Callable[[], Any]]] = {
    "blake2b": _blake2b,
    "hmac-sha256": _hmac_sha256,
}
ALGORITHM = "hmac-sha256"


_WARNED: set[str] = set()  # roles of this process already warned


def warn_if_unauthenticated(secret: bytes | None, role: str, log: Any) -> None:
    """Say once per process that the job runs without authentication."""
    if secret is None and not _WARNED:
        _WARNED.add(role)
        log.warning("%s: no ESPRESSO_JOB_SECRET: parameter-server messages are not "
                    "authenticated, so any process that reaches this job's ports can join "
                    "it or alter its gradients; set a per-job secret (espresso-launch "
                    "--local/--emulate generate one)", role)


class AuthError(ValueError):
    """A message is not authenticated by this job's key; it is dropped without a reply."""


def _view(frame: Any) -> memoryview:
    buf = getattr(frame, "buffer", None)  # zmq.Frame
    return memoryview(buf if buf is not None else frame)


class Authenticator:
    """Signs and verifies messages with one key; without a key it only refuses MACs.

    Args:
        key: the MAC key, or None for an unauthenticated job.
        algorithm: a name in :data:`MACS`.
    """

    def __init__(self, key: bytes | None, algorithm: str = ALGORITHM) -> None:
        if algorithm not in MACS:
            raise ValueError(f"unknown MAC {algorithm!r}; choose one of {sorted(MACS)}")
        self.key = key
        self.algorithm = algorithm
        self._new = MACS[algorithm](key) if key is not None else None

    @property
    def enabled(self) -> bool:
        return self._new is not None

    @classmethod
    def boot(cls, secret: bytes | None) -> Authenticator:
        """The key of registration messages (None secret: unauthenticated)."""
        if secret is None:
            return cls(None)
        return cls(hashlib.blake2b(secret, digest_size=32, person=b"espresso-boot").digest())

    def for_job(self, secret: bytes | None, job: str) -> Authenticator:
        """The key of everything after ACCEPT, bound to the job id ``job``."""
        if secret is None:
            return Authenticator(None)
        digest = hashlib.blake2b(secret, digest_size=32, person=b"espresso-secret").digest()
        return Authenticator(hashlib.blake2b(job.encode(), key=digest, digest_size=32,
                                             person=b"espresso-job").digest(), self.algorithm)

    def tag(self, frames: Sequence[Any]) -> bytes:
        assert self._new is not None
        mac = self._new()
        for frame in frames:
            mac.update(_view(frame))
        return mac.digest()[:TAG_BYTES]

    def sign(self, frames: list[Any]) -> list[Any]:
        """``frames`` (header first) with FLAG_MAC set and the tag appended; unchanged when
        the job is unauthenticated."""
        if self._new is None:
            return frames
        head = bytes(frames[0])
        flags = int.from_bytes(head[_FLAGS], "little") | P.FLAG_MAC
        head = head[:_FLAGS.start] + flags.to_bytes(2, "little") + head[_FLAGS.stop:]
        signed = [head, *frames[1:]]
        signed.append(self.tag(signed))
        return signed

    def verify(self, frames: Sequence[Any]) -> Sequence[Any]:
        """The message without its tag, once the tag is checked.

        Raises:
            AuthError: (authenticated job) no FLAG_MAC, no tag, or a wrong tag.
            ProtocolError: (unauthenticated job) the message carries a MAC: the peers
                disagree on the secret.
        """
        head = _view(frames[0]) if frames else memoryview(b"")
        flagged = (head.nbytes >= _FLAGS.stop
                   and int.from_bytes(head[_FLAGS], "little") & P.FLAG_MAC)
        if self._new is None:
            if flagged:
                raise P.ProtocolError(P.ErrorCode.BAD_FIELD,
                                      "the message carries a MAC but this process has no job "
                                      "secret; give every process of the job the same "
                                      "ESPRESSO_JOB_SECRET")
            return frames
        if not flagged or len(frames) < 2:
            raise AuthError("not signed (no FLAG_MAC or no tag frame)")
        tag = _view(frames[-1])
        if tag.nbytes != TAG_BYTES or not hmac.compare_digest(self.tag(frames[:-1]), tag):
            raise AuthError("wrong MAC: another job's secret, or the message was altered")
        return frames[:-1]
