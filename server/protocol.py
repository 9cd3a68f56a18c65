"""The PS wire protocol: a fixed binary header followed by raw payload frames.

Every message is one ZeroMQ multipart message: frame 0 is the header, frames 1..n are the
raw payload buffers (or one JSON frame for small control data). Nothing is ever unpickled:
the header is parsed with :mod:`struct`, payloads become numpy views of the received bytes,
control bodies are JSON objects. See ``docs/protocol.md`` for the table.

Header (little endian, 40 bytes, then ``nframes`` x uint64 frame lengths):

    magic 4s | version u8 | type u8 | flags u16 | key u64 | round i64 | sender i32 |
    codec u16 | dtype u8 | nframes u8 | numel u64 | length[nframes] u64

Every count and length is checked against the header, the key's payload layout and the
message-size limit before a single array is created.

Example:
    >>> frames = encode(MsgType.PULL, key=3, round=7, sender=0)
    >>> decode(frames, max_message_bytes=1 << 20).header.round
    7
"""

from __future__ import annotations

import enum
import functools
import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

__all__ = [
    "FLAG_MAC",
    "FLAG_PULL",
    "FLAG_SHM",
    "HEADER",
    "MAGIC",
    "MAX_CONTROL_BYTES",
    "MAX_FRAMES",
    "VERSION",
    "DType",
    "ErrorCode",
    "Header",
    "Layout",
    "Message",
    "MsgType",
    "ProtocolError",
    "check_shared",
    "decode",
    "decode_control",
    "decode_json",
    "decode_payload",
    "encode",
    "encode_control",
    "encode_error",
    "encode_json",
    "nbytes",
    "pack_state",
    "unpack_state",
]

MAGIC = b"BPSE"
VERSION = 1
# magic, version, type, flags, key, round, sender, codec, dtype, nframes, numel
HEADER = struct.Struct("<4sBBHQqiHBBQ")
_LENGTH = struct.Struct("<Q")
# No codec payload has more than a handful of arrays; 16 bounds the header size.
MAX_FRAMES = 16
# The frame-length tail of a header with n frames, packed and parsed in one call.
_LENGTHS = tuple(struct.Struct(f"<{n}Q") for n in range(MAX_FRAMES + 1))
# JSON control bodies (registration, declare, errors, stats) are small; 1 MiB bounds them.
MAX_CONTROL_BYTES = 1 << 20
# Codec id 0 means "dense": one frame holding the tensor in the header's dtype.
DENSE_CODEC = 0
# Header flag bits. FLAG_PULL on a PUSH: "and pull": the server answers with the round's
# PULL_REPLY (or ERROR) instead of PUSH_OK, saving a message pair per key and round.
FLAG_PULL = 0x1
# FLAG_MAC: the last frame is a MAC over the rest (server/auth.py); stripped before decode.
FLAG_MAC = 0x2
# FLAG_SHM: a dense PUSH (with FLAG_PULL) or PULL_REPLY without payload frames: the push is
# in the sender's shared-memory segment of the key, the sum was written into the receiver's
# (ATTACH; server/shm.py).
FLAG_SHM = 0x4
KNOWN_FLAGS = FLAG_PULL | FLAG_MAC | FLAG_SHM


class MsgType(enum.IntEnum):
    """Message types; requests and their replies."""

    REGISTER = 1      # node -> scheduler, JSON {role, rank, world_size, address}
    ACCEPT = 2        # scheduler -> node, JSON {rank, servers, num_workers}
    ABORT = 3         # scheduler -> node, JSON {reason}: the job failed, exit
    HEARTBEAT = 4     # node -> scheduler, no frames
    BARRIER = 5       # worker -> scheduler
    BARRIER_OK = 6    # scheduler -> every worker once all arrived
    PLACE = 7         # worker -> scheduler, JSON key description: where do its parts live
    PLACE_OK = 8      # scheduler -> worker, JSON {keys: [{key, server, name}]}
    DONE = 9          # worker -> scheduler: finished; DONE_OK acknowledges
    DONE_OK = 10
    SHUTDOWN = 11     # scheduler -> server: exit normally, answer BYE
    BYE = 12
    DECLARE = 13      # worker -> server, JSON key spec
    DECLARE_OK = 14
    PUSH = 15         # worker -> server, payload frames
    PUSH_OK = 16
    PULL = 17         # worker -> server, no frames
    PULL_REPLY = 18   # server -> worker, aggregated payload frames
    ERROR = 19        # any -> requester, JSON {code, message, request}
    STATS = 20        # anyone -> server, no frames
    STATS_REPLY = 21  # JSON counters
    STATE = 22        # rank 0 -> server: JSON {op: list|get|put, ...} [+ raw state arrays]
    STATE_REPLY = 23  # JSON answer [+ raw state arrays]
    ATTACH = 24       # worker -> server, JSON {path, host}: exchange this key in shared memory
    ATTACH_OK = 25


class DType(enum.IntEnum):
    """Element type of the tensor a message is about (not of a codec's payload arrays)."""

    NONE = 0
    FLOAT32 = 1
    FLOAT16 = 2

    @property
    def numpy(self) -> np.dtype:
        if self is DType.NONE:
            raise ProtocolError(ErrorCode.UNKNOWN_DTYPE, "dtype NONE has no element type")
        return np.dtype(_NUMPY[self])

    @classmethod
    def from_name(cls, name: str) -> DType:
        for member, np_name in _NUMPY.items():
            if np_name == name:
                return member
        raise ProtocolError(ErrorCode.UNKNOWN_DTYPE, f"dtype {name!r} is not supported; use "
                            f"one of {sorted(_NUMPY.values())}")


_NUMPY = {DType.FLOAT32: "float32", DType.FLOAT16: "float16"}


class ErrorCode(str, enum.Enum):
    """Why a message was rejected; servers count rejections per code."""

    BAD_MAGIC = "bad_magic"
    BAD_VERSION = "bad_version"
    BAD_TYPE = "bad_type"
    TRUNCATED = "truncated"
    BAD_LENGTH = "bad_length"
    TOO_LARGE = "too_large"
    UNKNOWN_CODEC = "unknown_codec"
    UNKNOWN_DTYPE = "unknown_dtype"
    UNKNOWN_KEY = "unknown_key"
    BAD_JSON = "bad_json"
    BAD_FIELD = "bad_field"
    BAD_DECLARE = "bad_declare"
    NOT_A_PUSHER = "not_a_pusher"
    DUPLICATE_PUSH = "duplicate_push"
    STALE_ROUND = "stale_round"
    FUTURE_ROUND = "future_round"
    UNEXPECTED = "unexpected"
    NON_FINITE = "non_finite"
    ROUND_TIMEOUT = "round_timeout"
    INTERNAL = "internal"


class ProtocolError(ValueError):
    """A message is malformed or not acceptable; ``code`` says which rule it broke."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(f"{code.value}: {message}")
        self.code = code
        self.detail = message


class Header(NamedTuple):
    """The parsed fixed header of one message (immutable; a tuple, built once per message
    received, which a frozen dataclass makes several times slower)."""

    type: MsgType
    key: int = 0
    round: int = 0
    sender: int = -1
    codec: int = DENSE_CODEC
    dtype: DType = DType.NONE
    numel: int = 0
    lengths: tuple[int, ...] = ()
    flags: int = 0

    def describe(self) -> str:
        return f"{self.type.name} key={self.key} round={self.round} sender={self.sender}"


class Message(NamedTuple):
    """A decoded message: its header and one buffer per payload frame (not copied).

    ``raw`` holds the received payload frame objects themselves (``zmq.Frame`` when received
    with ``copy=False``): a server can sum into such a frame and send it on by reference,
    which costs neither a copy nor pyzmq's release of a zero-copy buffer."""

    header: Header
    frames: tuple[memoryview, ...]
    raw: tuple[Any, ...] = ()


@dataclass(frozen=True)
class Layout:
    """What a key's payload must look like: codec id, tensor dtype, numel, frame dtypes and
    element counts. Built once per key; :func:`decode_payload` checks messages against it."""

    codec: int
    dtype: DType
    numel: int
    frame_dtypes: tuple[np.dtype, ...]
    frame_lengths: tuple[int, ...]

    @functools.cached_property
    def frame_nbytes(self) -> tuple[int, ...]:
        """Bytes of each payload frame (computed once: every message is checked against it)."""
        return tuple(n * d.itemsize for n, d in zip(self.frame_lengths, self.frame_dtypes,
                                                    strict=True))

    @classmethod
    def dense(cls, numel: int, dtype: DType) -> Layout:
        return cls(DENSE_CODEC, dtype, numel, (dtype.numpy,), (numel,))


# ---- encoding ---------------------------------------------------------------------------------
def nbytes(frame: Any) -> int:
    """Byte length of a payload frame (numpy array, bytes, memoryview or ``zmq.Frame``)."""
    if isinstance(frame, np.ndarray):
        return int(frame.nbytes)
    return memoryview(frame).nbytes


def encode(type: MsgType, *, key: int = 0, round: int = 0, sender: int = -1,
           codec: int = DENSE_CODEC, dtype: DType = DType.NONE, numel: int = 0,
           frames: Sequence[Any] = (), flags: int = 0) -> list[Any]:
    """Build the frames of one message: the packed header, then ``frames`` unchanged.

    Args:
        type: the message type.
        key, round, sender, codec, dtype, numel, flags: header fields.
        frames: payload buffers (numpy arrays, bytes); they are sent without copying.

    Returns:
        The list to pass to ``socket.send_multipart``.

    Raises:
        ProtocolError: too many frames, or a field out of its header range.
    """
    if len(frames) > MAX_FRAMES:
        raise ProtocolError(ErrorCode.BAD_LENGTH,
                            f"{len(frames)} frames exceed the limit of {MAX_FRAMES}")
    lengths = [nbytes(f) for f in frames]
    try:
        head = HEADER.pack(MAGIC, VERSION, int(type), flags, key, round, sender, codec,
                           int(dtype), len(frames), numel)
    except struct.error as exc:
        raise ProtocolError(ErrorCode.BAD_FIELD, f"header field out of range: {exc}") from None
    return [head + _LENGTHS[len(lengths)].pack(*lengths), *frames]


def encode_json(type: MsgType, body: dict[str, Any], **fields: Any) -> list[Any]:
    """A control message whose single frame is the JSON object ``body``."""
    return encode_control(type, body, (), **fields)


def encode_control(type: MsgType, body: dict[str, Any], frames: Sequence[Any] = (),
                   **fields: Any) -> list[Any]:
    """A control message: frame 0 the JSON object ``body``, then raw ``frames`` (arrays)."""
    data = json.dumps(body, separators=(",", ":"), allow_nan=False).encode()
    if len(data) > MAX_CONTROL_BYTES:
        raise ProtocolError(ErrorCode.TOO_LARGE,
                            f"control body of {len(data)} bytes exceeds {MAX_CONTROL_BYTES}")
    return encode(type, frames=[data, *frames], **fields)


def encode_error(code: ErrorCode, message: str, *, request: Header | None = None,
                 sender: int = -1) -> list[Any]:
    """An ERROR reply echoing the key and round of ``request`` (when it could be parsed)."""
    body = {"code": code.value, "message": message,
            "request": request.type.name if request is not None else None}
    if request is None:
        return encode_json(MsgType.ERROR, body, sender=sender)
    return encode_json(MsgType.ERROR, body, key=request.key, round=request.round, sender=sender)


# ---- decoding ---------------------------------------------------------------------------------
def _buffer(frame: Any) -> memoryview:
    view = memoryview(frame)  # zmq.Frame, bytes, arrays: all export their buffer
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


# Known ids of the header's enum fields, looked up without an Enum call per message.
_MSG_TYPES = {int(t): t for t in MsgType}
_DTYPES = {int(d): d for d in DType}


def decode(frames: Sequence[Any], max_message_bytes: int) -> Message:
    """Parse and check one received multipart message (without the ROUTER identity).

    Checks, in order and before anything is allocated: a header frame is present and long
    enough, magic, version, known type, frame count within limits, header length matches the
    frame count, the received frames match the announced lengths one by one, the total
    stays under ``max_message_bytes``, known dtype and codec, non-negative round.

    Args:
        frames: the received frames (``zmq.Frame``, bytes or memoryviews).
        max_message_bytes: ``cfg.max_message_bytes``.

    Returns:
        The :class:`Message`, its payload frames as zero-copy memoryviews.

    Raises:
        ProtocolError: the first rule the message breaks, with what was expected.
    """
    if not frames:
        raise ProtocolError(ErrorCode.TRUNCATED, "empty message")
    head = _buffer(frames[0])
    mtype, flags, key, round_, sender, codec, dtype_id, numel, lengths = _parse_header(head)
    total = sum(lengths) + head.nbytes
    if total > max_message_bytes:
        raise ProtocolError(ErrorCode.TOO_LARGE,
                            f"message of {total} bytes exceeds ESPRESSO_MAX_MESSAGE_BYTES="
                            f"{max_message_bytes}")
    payload = frames[1:]
    views = _check_frames(payload, lengths)
    dtype = _DTYPES.get(dtype_id)
    if dtype is None:
        raise ProtocolError(ErrorCode.UNKNOWN_DTYPE, f"unknown dtype id {dtype_id}")
    if codec != DENSE_CODEC:
        _check_codec(codec)
    if round_ < 0:
        raise ProtocolError(ErrorCode.BAD_FIELD, f"round {round_} is negative")
    if sender < -1:
        raise ProtocolError(ErrorCode.BAD_FIELD, f"sender {sender} is not a rank")
    if flags & ~KNOWN_FLAGS:
        raise ProtocolError(ErrorCode.BAD_FIELD, f"unknown flag bits {flags & ~KNOWN_FLAGS:#x}")
    return Message(Header(mtype, key, round_, sender, codec, dtype, numel, lengths, flags),
                   views, tuple(payload))


def _parse_header(head: memoryview) -> tuple[Any, ...]:
    """Fixed fields (type, flags, key, round, sender, codec, dtype id, numel), then the
    tuple of frame lengths."""
    if head.nbytes < HEADER.size:
        raise ProtocolError(ErrorCode.TRUNCATED,
                            f"header has {head.nbytes} bytes, needs at least {HEADER.size}")
    (magic, version, type_id, flags, key, round_, sender, codec, dtype_id, nframes,
     numel) = HEADER.unpack_from(head)
    if magic != MAGIC:
        raise ProtocolError(ErrorCode.BAD_MAGIC, f"magic {bytes(magic)!r} is not {MAGIC!r}")
    if version != VERSION:
        raise ProtocolError(ErrorCode.BAD_VERSION,
                            f"protocol version {version}, this build speaks {VERSION}")
    mtype = _MSG_TYPES.get(type_id)
    if mtype is None:
        raise ProtocolError(ErrorCode.BAD_TYPE, f"unknown message type {type_id}")
    if nframes > MAX_FRAMES:
        raise ProtocolError(ErrorCode.BAD_LENGTH,
                            f"header announces {nframes} frames, the limit is {MAX_FRAMES}")
    expected = HEADER.size + nframes * _LENGTH.size
    if head.nbytes != expected:
        raise ProtocolError(ErrorCode.TRUNCATED if head.nbytes < expected
                            else ErrorCode.BAD_LENGTH,
                            f"header of {head.nbytes} bytes, expected {expected} for "
                            f"{nframes} frames")
    lengths = _LENGTHS[nframes].unpack_from(head, HEADER.size)
    return mtype, flags, key, round_, sender, codec, dtype_id, numel, lengths


def _check_frames(frames: Sequence[Any], lengths: tuple[int, ...]) -> tuple[memoryview, ...]:
    """The payload frames as memoryviews, after checking their count and sizes."""
    if len(frames) != len(lengths):
        raise ProtocolError(ErrorCode.TRUNCATED if len(frames) < len(lengths)
                            else ErrorCode.BAD_LENGTH,
                            f"header announces {len(lengths)} payload frames, received "
                            f"{len(frames)}")
    views = tuple(map(_buffer, frames))
    if tuple(v.nbytes for v in views) != lengths:
        for i, (view, length) in enumerate(zip(views, lengths, strict=True)):
            if view.nbytes != length:
                raise ProtocolError(ErrorCode.TRUNCATED if view.nbytes < length
                                    else ErrorCode.BAD_LENGTH,
                                    f"frame {i} has {view.nbytes} bytes, header says {length}")
    return views


def _check_codec(codec: int) -> None:
    from byteps_espresso.kernels import by_wire_id

    try:
        by_wire_id(codec)
    except ValueError as exc:
        raise ProtocolError(ErrorCode.UNKNOWN_CODEC, str(exc)) from None


def decode_json(msg: Message) -> dict[str, Any]:
    """The JSON object carried by a control message.

    Raises:
        ProtocolError: not exactly one frame, too large, not UTF-8 JSON, or not an object.
    """
    if len(msg.frames) != 1:
        raise ProtocolError(ErrorCode.BAD_JSON,
                            f"{msg.header.type.name} carries one JSON frame, got "
                            f"{len(msg.frames)}")
    return _json_object(msg.frames[0])


def decode_control(msg: Message) -> tuple[dict[str, Any], tuple[memoryview, ...]]:
    """The JSON object of frame 0 and the raw frames after it (:func:`encode_control`).

    Raises:
        ProtocolError: no frame, or frame 0 too large, not UTF-8 JSON, or not an object.
    """
    if not msg.frames:
        raise ProtocolError(ErrorCode.BAD_JSON,
                            f"{msg.header.type.name} carries a JSON frame first, got none")
    return _json_object(msg.frames[0]), msg.frames[1:]


def _json_object(raw: memoryview) -> dict[str, Any]:
    if raw.nbytes > MAX_CONTROL_BYTES:
        raise ProtocolError(ErrorCode.TOO_LARGE,
                            f"control body of {raw.nbytes} bytes exceeds {MAX_CONTROL_BYTES}")
    try:
        body = json.loads(bytes(raw).decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ProtocolError(ErrorCode.BAD_JSON, f"control body is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise ProtocolError(ErrorCode.BAD_JSON,
                            f"control body must be a JSON object, got {type(body).__name__}")
    return body


# ---- compressor state (STATE / STATE_REPLY) ----------------------------------------------------
# Element types a state array may have on the wire (residuals and momenta are float32).
STATE_DTYPES = ("float32",)


def pack_state(state: dict[str, dict[str, np.ndarray]]) -> tuple[list[list[Any]], list[Any]]:
    """A compressor's state (``{tensor name: {slot: array}}``) as JSON entries
    ``[tensor, slot, dtype, numel]`` and one raw frame per array, in the same order.

    Raises:
        ProtocolError: more arrays than a message carries, or an unsupported dtype.
    """
    entries, frames = [], []
    for name, slots in state.items():
        for slot, array in slots.items():
            arr = np.ascontiguousarray(array).reshape(-1)
            if arr.dtype.name not in STATE_DTYPES:
                raise ProtocolError(ErrorCode.UNKNOWN_DTYPE, f"state {name!r}/{slot!r} is "
                                    f"{arr.dtype}; state arrays are {list(STATE_DTYPES)}")
            entries.append([name, slot, arr.dtype.name, int(arr.size)])
            frames.append(arr)
    if len(frames) > MAX_FRAMES - 1:  # frame 0 is the JSON body
        raise ProtocolError(ErrorCode.BAD_LENGTH, f"{len(frames)} state arrays exceed the "
                            f"{MAX_FRAMES - 1} one message carries")
    return entries, frames


def unpack_state(entries: Any, frames: Sequence[memoryview]
                 ) -> dict[str, dict[str, np.ndarray]]:
    """The state :func:`pack_state` sent, each array a copy of its received frame.

    Raises:
        ProtocolError: entries that are not ``[str, str, dtype, int]`` lists, an unknown
            dtype, or frames whose count or sizes differ from the entries.
    """
    if not isinstance(entries, list) or len(entries) != len(frames):
        raise ProtocolError(ErrorCode.BAD_FIELD, f"state entries must be a list of one "
                            f"[tensor, slot, dtype, numel] per frame ({len(frames)} frames)")
    out: dict[str, dict[str, np.ndarray]] = {}
    for entry, frame in zip(entries, frames, strict=True):
        if not (isinstance(entry, list) and len(entry) == 4 and isinstance(entry[0], str)
                and isinstance(entry[1], str) and entry[2] in STATE_DTYPES
                and type(entry[3]) is int and entry[3] >= 0):
            raise ProtocolError(ErrorCode.BAD_FIELD, f"state entry {str(entry)[:200]} is not "
                                f"[tensor, slot, one of {list(STATE_DTYPES)}, numel]")
        name, slot, dtype, numel = entry
        if frame.nbytes != numel * np.dtype(dtype).itemsize:
            raise ProtocolError(ErrorCode.BAD_LENGTH, f"state {name!r}/{slot!r}: frame of "
                                f"{frame.nbytes} bytes for {numel} {dtype}")
        out.setdefault(name, {})[slot] = np.frombuffer(frame, dtype=dtype).copy()
    return out


def decode_payload(msg: Message, layout: Layout) -> tuple[np.ndarray, ...]:
    """Check a PUSH or PULL_REPLY against its key's layout and view its frames as arrays.

    Args:
        msg: a decoded message.
        layout: the key's expected codec, dtype, numel and frame dtypes/lengths.

    Returns:
        One 1-D numpy array per frame, viewing the received bytes (copied only when the
        buffer is misaligned for the element type).

    Raises:
        ProtocolError: codec, dtype, numel, frame count or a frame length differs.
    """
    _check_layout(msg.header, layout)
    expected = layout.frame_nbytes
    if msg.header.lengths != expected:
        raise ProtocolError(ErrorCode.BAD_LENGTH,
                            f"key {msg.header.key} payload frames must be {list(expected)} "
                            f"bytes, got {list(msg.header.lengths)}")
    arrays = []
    for view, dtype in zip(msg.frames, layout.frame_dtypes, strict=True):
        arr = np.frombuffer(view, dtype=dtype)
        if not arr.flags.aligned:
            arr = arr.copy()
        arrays.append(arr)
    return tuple(arrays)


def check_shared(msg: Message, layout: Layout) -> None:
    """Check a ``FLAG_SHM`` PUSH or PULL_REPLY against its key's layout: a dense float32
    key, the layout's numel, no payload frames (the payload is in the shared segment).

    Raises:
        ProtocolError: the key is not dense float32, or the header's codec, dtype, numel or
            frames differ.
    """
    h = msg.header
    if layout.codec != DENSE_CODEC or layout.dtype is not DType.FLOAT32:
        raise ProtocolError(ErrorCode.BAD_FIELD,
                            f"key {h.key} is not dense float32: it cannot be exchanged in "
                            "shared memory")
    _check_layout(h, layout)
    if h.lengths:
        raise ProtocolError(ErrorCode.BAD_LENGTH,
                            f"key {h.key}: a shared-memory message has no payload frames, got "
                            f"{len(h.lengths)}")


def _check_layout(h: Header, layout: Layout) -> None:
    if h.codec != layout.codec:
        raise ProtocolError(ErrorCode.UNKNOWN_CODEC,
                            f"key {h.key} is declared with codec {layout.codec}, message has "
                            f"codec {h.codec}")
    if h.dtype != layout.dtype:
        raise ProtocolError(ErrorCode.UNKNOWN_DTYPE,
                            f"key {h.key} is declared {layout.dtype.name}, message has "
                            f"{h.dtype.name}")
    if h.numel != layout.numel:
        raise ProtocolError(ErrorCode.BAD_LENGTH,
                            f"key {h.key} has {layout.numel} elements, message says {h.numel}")
