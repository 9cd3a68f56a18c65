"""Message authentication on the PS wire: a MAC over header and frames, keyed by the job secret.

With a job secret (``ESPRESSO_JOB_SECRET`` / ``ESPRESSO_JOB_SECRET_FILE``) every message
carries ``FLAG_MAC`` in its header and one extra last frame, the tag over the header (type,
key, round, sender, lengths, flags) and every payload frame. The MAC is Poly1305 under a fresh
key per message, computed by OpenSSL's ChaCha20-Poly1305 AEAD with an empty plaintext (RFC
8439: the AEAD then only authenticates its associated data). The sender draws a 16-byte
nonce; the message key is BLAKE2b(nonce, key=the long-term key); frame ``i`` is the
associated data of the AEAD under that key and the 12-byte nonce ``i``, and the tag is the
AEAD's tag over the frames' 16-byte tags under the nonce ``2^95``, so frames can be neither
altered, dropped, added nor reordered. The tag frame is nonce + that tag (32 bytes). The
AEAD hashes without holding the interpreter lock, which the bare Poly1305 of the same
library holds: a lane thread verifying a 64 MB reply no longer stalls the training thread,
and two threads hash in parallel. Both hash about 4x faster than HMAC-SHA256 and 10x faster
than keyed BLAKE2b here (``python benchmarks/ps.py --mac``, BENCHMARKS.md), which is what
keeps the cost of authenticating 64 MB gradients small. Two long-term keys are derived from
the secret:

    boot key  BLAKE2b(secret, person="espresso-boot"): REGISTER, and the scheduler's ACCEPT
              or ABORT to a node that has not been accepted yet
    job key   BLAKE2b(job id, key=secret digest, person="espresso-job"): everything after
              ACCEPT, which hands every node the job id the scheduler drew at random

A message of another job (another secret, or the same secret with another job id) fails
verification; within a job the tag binds the round and sender, so a replayed push can only
repeat (sender, key, round), which the server's round rules reject. A message that fails
verification is dropped without a reply and counted. Random 128-bit nonces make a repeated
message key (which would let an observer of both messages forge) negligible: 2^-64 after
2^32 messages of one job.

Example:
    >>> auth = Authenticator.boot(b"0123456789abcdef")
    >>> frames = auth.sign([b"header" + bytes(34), b"payload"])
    >>> auth.verify(frames)[1]
    b'payload'
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Callable, Sequence
from typing import Any

from byteps_espresso.server import protocol as P
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.poly1305 import Poly1305

__all__ = ["ALGORITHM", "MACS", "AuthError", "Authenticator", "store_key",
           "warn_if_unauthenticated"]

_FLAGS = slice(6, 8)  # the header's flags field (protocol.HEADER: offset 6, uint16)
_DIGEST = 16  # bytes of every tag (Poly1305's size; the keyed hashes are truncated to it)


def _message_key(key: bytes, nonce: bytes, person: bytes) -> bytes:
    """The 32-byte key of one message: BLAKE2b(nonce) under the long-term key."""
    return hashlib.blake2b(nonce, key=key, digest_size=32, person=person).digest()


class _Poly1305:
    """Poly1305 under a one-time key drawn per message from a random nonce (holds the
    interpreter lock while it hashes)."""

    nonce_bytes = 16

    def __init__(self, key: bytes) -> None:
        self.key = key

    def tag(self, nonce: bytes, frames: Sequence[Any]) -> bytes:
        mac = Poly1305(_message_key(self.key, nonce, b"espresso-poly"))
        for frame in frames:
            mac.update(_view(frame))
        return mac.finalize()


# The AEAD nonce of the tag over the frames' tags: above every frame index (a valid message
# has at most protocol.MAX_FRAMES = 16 frames; a longer one fails decoding after its MAC).
_LAST_NONCE = (1 << 95).to_bytes(12, "little")
_PIECE = 1 << 30  # bytes of a frame per AEAD call (its limit is 2^31 - 1)


class _ChaChaPoly:
    """Poly1305 through the ChaCha20-Poly1305 AEAD with an empty plaintext, one tag per frame
    under a per-message key, then a tag over those tags (the interpreter lock is released
    while a frame is hashed)."""

    nonce_bytes = 16

    def __init__(self, key: bytes) -> None:
        self.key = key

    def tag(self, nonce: bytes, frames: Sequence[Any]) -> bytes:
        aead = ChaCha20Poly1305(_message_key(self.key, nonce, b"espresso-aead"))
        tags = []
        for i, frame in enumerate(frames):
            view = _view(frame)
            # The AEAD takes at most 2^31 - 1 bytes; a larger frame (ESPRESSO_MAX_MESSAGE_BYTES
            # above 1 GiB) is hashed in pieces, each under the nonce (frame, piece).
            for piece, start in enumerate(range(0, max(view.nbytes, 1), _PIECE)):
                nonce_i = (i | piece << 32).to_bytes(12, "little")
                tags.append(aead.encrypt(nonce_i, b"", view[start:start + _PIECE]))
        return aead.encrypt(_LAST_NONCE, b"", b"".join(tags))


class _KeyedHash:
    """A keyed hash from hashlib (deterministic: no nonce)."""

    nonce_bytes = 0

    def __init__(self, new: Callable[[], Any]) -> None:
        self._new = new

    def tag(self, nonce: bytes, frames: Sequence[Any]) -> bytes:
        mac = self._new()
        for frame in frames:
            mac.update(_view(frame))
        return mac.digest()[:_DIGEST]


# MACs by name: name -> (long-term key -> MAC). ALGORITHM is the one every process uses; the
# others stay for `python benchmarks/ps.py --mac`, which measured it within 4% of the fastest
# (the bare Poly1305) on the development machine and the only fast one that two threads run
# in parallel (BENCHMARKS.md, "Parameter server").
MACS: dict[str, Callable[[bytes], Any]] = {
    "chacha20-poly1305": _ChaChaPoly,
    "poly1305": _Poly1305,
    "blake2b": lambda key: _KeyedHash(
        lambda: hashlib.blake2b(key=key, digest_size=_DIGEST)),
    "hmac-sha256": lambda key: _KeyedHash(lambda: hmac.new(key, digestmod=hashlib.sha256)),
}
ALGORITHM = "chacha20-poly1305"


def store_key(secret: bytes) -> bytes:
    """The key that admits a connection to the job's torch.distributed store."""
    return hashlib.blake2b(secret, digest_size=32, person=b"espresso-store").digest()


_WARNED: set[str] = set()  # roles of this process already warned


def warn_if_unauthenticated(secret: bytes | None, role: str, log: Any) -> None:
    """Say once per process that the job runs without authentication."""
    if secret is None and not _WARNED:
        _WARNED.add(role)
        log.warning("%s: no ESPRESSO_JOB_SECRET: parameter-server messages are not "
                    "authenticated, so any process that reaches this job's ports can join "
                    "it or alter its gradients; set a per-job secret (espresso-launch "
                    "--local/--emulate --auth generates one)", role)


class AuthError(ValueError):
    """A message is not authenticated by this job's key; it is dropped without a reply."""


def _view(frame: Any) -> memoryview:
    """The bytes of a frame, array or buffer, without copying."""
    buf = getattr(frame, "buffer", None)  # zmq.Frame
    view = memoryview(buf if buf is not None else frame)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


class Authenticator:
    """Signs and verifies messages with one key; without a key it only refuses MACs.

    Args:
        key: the long-term MAC key, or None for an unauthenticated job.
        algorithm: a name in :data:`MACS`.
    """

    def __init__(self, key: bytes | None, algorithm: str = ALGORITHM) -> None:
        if algorithm not in MACS:
            raise ValueError(f"unknown MAC {algorithm!r}; choose one of {sorted(MACS)}")
        self.key = key
        self.algorithm = algorithm
        self._mac = MACS[algorithm](key) if key is not None else None
        self.tag_bytes = (self._mac.nonce_bytes + _DIGEST) if self._mac is not None else 0

    @property
    def enabled(self) -> bool:
        return self._mac is not None

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
        """The tag frame of ``frames``: a fresh nonce (if the MAC takes one), then the MAC."""
        assert self._mac is not None
        nonce = os.urandom(self._mac.nonce_bytes) if self._mac.nonce_bytes else b""
        return nonce + self._mac.tag(nonce, frames)

    def sign(self, frames: list[Any]) -> list[Any]:
        """``frames`` (header first) with FLAG_MAC set and the tag appended; unchanged when
        the job is unauthenticated."""
        if self._mac is None:
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
        if self._mac is None:
            if flagged:
                raise P.ProtocolError(P.ErrorCode.BAD_FIELD,
                                      "the message carries a MAC but this process has no job "
                                      "secret; give every process of the job the same "
                                      "ESPRESSO_JOB_SECRET")
            return frames
        if not flagged or len(frames) < 2:
            raise AuthError("not signed (no FLAG_MAC or no tag frame)")
        tag = _view(frames[-1])
        if tag.nbytes != self.tag_bytes:
            raise AuthError(f"a tag frame of {tag.nbytes} bytes, not {self.tag_bytes}")
        nonce = bytes(tag[:self._mac.nonce_bytes])
        if not hmac.compare_digest(self._mac.tag(nonce, frames[:-1]), tag[len(nonce):]):
            raise AuthError("wrong MAC: another job's secret, or the message was altered")
        return frames[:-1]
