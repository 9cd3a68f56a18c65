"""The PS wire protocol: round trips, one test per validation rule, and a structure-aware
fuzz of the decoder (malformed messages may only ever raise ProtocolError)."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
from byteps_espresso.server import protocol as P
from byteps_espresso.server.keys import KeySpec, part_names, split
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

LIMIT = 1 << 16


def _push(x: np.ndarray, **fields) -> list:
    args = {"key": 3, "round": 5, "sender": 1, "dtype": P.DType.FLOAT32, "numel": x.size,
            "frames": [x], **fields}
    return P.encode(P.MsgType.PUSH, **args)


def _code(frames: list, limit: int = LIMIT) -> P.ErrorCode:
    with pytest.raises(P.ProtocolError) as info:
        P.decode(frames, limit)
    return info.value.code


def test_push_round_trips_without_copying():
    x = np.arange(10, dtype=np.float32)
    msg = P.decode(_push(x), LIMIT)
    assert msg.header == P.Header(P.MsgType.PUSH, 3, 5, 1, 0, P.DType.FLOAT32, 10, (40,))
    (arr,) = P.decode_payload(msg, P.Layout.dense(10, P.DType.FLOAT32))
    assert np.array_equal(arr, x)


@pytest.mark.parametrize("mtype", list(P.MsgType))
def test_every_message_type_round_trips_with_json(mtype):
    frames = P.encode_json(mtype, {"a": [1, 2], "b": "c"}, key=2**64 - 1, round=2**63 - 1,
                           sender=2**31 - 1)
    msg = P.decode(frames, LIMIT)
    assert msg.header.type is mtype and msg.header.key == 2**64 - 1
    assert P.decode_json(msg) == {"a": [1, 2], "b": "c"}


def test_header_layout_is_the_documented_one():
    assert P.HEADER.size == 40
    head = _push(np.zeros(2, np.float32))[0]
    assert head[:4] == b"BPSE" and head[4] == P.VERSION and head[5] == P.MsgType.PUSH
    assert struct.unpack_from("<Q", head, 8)[0] == 3      # key
    assert struct.unpack_from("<q", head, 16)[0] == 5     # round
    assert struct.unpack_from("<i", head, 24)[0] == 1     # sender
    assert head[30] == P.DType.FLOAT32 and head[31] == 1  # dtype, nframes
    assert struct.unpack_from("<Q", head, 40)[0] == 8     # frame 0 length


def _patch(head: bytes, offset: int, fmt: str, value: int) -> bytes:
    buf = bytearray(head)
    struct.pack_into(fmt, buf, offset, value)
    return bytes(buf)


@pytest.mark.parametrize(("mutate", "code"), [
    (lambda f: [], P.ErrorCode.TRUNCATED),
    (lambda f: [f[0][:39], f[1]], P.ErrorCode.TRUNCATED),
    (lambda f: [b"XXXX" + f[0][4:], f[1]], P.ErrorCode.BAD_MAGIC),
    (lambda f: [_patch(f[0], 4, "<B", 9), f[1]], P.ErrorCode.BAD_VERSION),
    (lambda f: [_patch(f[0], 5, "<B", 200), f[1]], P.ErrorCode.BAD_TYPE),
    (lambda f: [_patch(f[0], 31, "<B", 17), f[1]], P.ErrorCode.BAD_LENGTH),
    (lambda f: [_patch(f[0], 31, "<B", 2), f[1]], P.ErrorCode.TRUNCATED),
    (lambda f: [f[0] + b"\0" * 8, f[1]], P.ErrorCode.BAD_LENGTH),
    (lambda f: [f[0]], P.ErrorCode.TRUNCATED),
    (lambda f: [*f, b"extra"], P.ErrorCode.BAD_LENGTH),
    (lambda f: [f[0], bytes(f[1])[:-1]], P.ErrorCode.TRUNCATED),
    (lambda f: [f[0], bytes(f[1]) + b"!"], P.ErrorCode.BAD_LENGTH),
    (lambda f: [_patch(f[0], 40, "<Q", LIMIT), f[1]], P.ErrorCode.TOO_LARGE),
    (lambda f: [_patch(f[0], 40, "<Q", 2**64 - 1), f[1]], P.ErrorCode.TOO_LARGE),
    (lambda f: [_patch(f[0], 30, "<B", 77), f[1]], P.ErrorCode.UNKNOWN_DTYPE),
    (lambda f: [_patch(f[0], 28, "<H", 999), f[1]], P.ErrorCode.UNKNOWN_CODEC),
    (lambda f: [_patch(f[0], 16, "<q", -1), f[1]], P.ErrorCode.BAD_FIELD),
    (lambda f: [_patch(f[0], 24, "<i", -2), f[1]], P.ErrorCode.BAD_FIELD),
    (lambda f: [_patch(f[0], 6, "<H", 0x8000), f[1]], P.ErrorCode.BAD_FIELD),
])
def test_each_rule_rejects_with_its_code(mutate, code):
    frames = _push(np.ones(4, np.float32))
    assert _code(mutate(frames)) is code


@pytest.mark.parametrize(("layout", "code"), [
    (P.Layout.dense(5, P.DType.FLOAT32), P.ErrorCode.BAD_LENGTH),        # numel differs
    (P.Layout.dense(4, P.DType.FLOAT16), P.ErrorCode.UNKNOWN_DTYPE),
    (P.Layout(1, P.DType.FLOAT32, 4, (np.dtype(np.float16),), (4,)), P.ErrorCode.UNKNOWN_CODEC),
    (P.Layout(0, P.DType.FLOAT32, 4, (np.dtype(np.float32),) * 2, (2, 2)),
     P.ErrorCode.BAD_LENGTH),
])
def test_payload_must_match_the_key_layout(layout, code):
    msg = P.decode(_push(np.ones(4, np.float32)), LIMIT)
    with pytest.raises(P.ProtocolError) as info:
        P.decode_payload(msg, layout)
    assert info.value.code is code


def test_misaligned_frames_are_copied_to_aligned_arrays():
    raw = bytearray(33)
    view = memoryview(raw)[1:]
    frames = [P.encode(P.MsgType.PUSH, dtype=P.DType.FLOAT32, numel=8, frames=[view])[0], view]
    (arr,) = P.decode_payload(P.decode(frames, LIMIT), P.Layout.dense(8, P.DType.FLOAT32))
    assert arr.flags.aligned and arr.size == 8


@pytest.mark.parametrize("body", [b"{", b"[1, 2]", b"\xff\xfe", b'"x"', b"NaN"])
def test_control_bodies_must_be_json_objects(body):
    msg = P.decode(P.encode(P.MsgType.DECLARE, frames=[body]), LIMIT)
    with pytest.raises(P.ProtocolError) as info:
        P.decode_json(msg)
    assert info.value.code is P.ErrorCode.BAD_JSON


@pytest.mark.parametrize("change", [
    {"name": ""}, {"name": 5}, {"numel": 0}, {"numel": 1.5}, {"numel": True},
    {"dtype": "int8"}, {"compressor": "nope"}, {"compressor": "fp16", "dtype": "float16"},
    {"params": {"a": [1]}}, {"params": []}, {"pushers": []}, {"pushers": [0, 0]},
    {"pushers": [-1]}, {"pushers": [9]}, {"pushers": "0"},
])
def test_key_spec_rejects_each_bad_field(change):
    body = {"name": "w", "numel": 10, "dtype": "float32", "compressor": None, "params": {},
            "pushers": [0, 1], **change}
    with pytest.raises(P.ProtocolError) as info:
        KeySpec.from_json(body, world_size=4)
    assert info.value.code is P.ErrorCode.BAD_DECLARE


def test_key_spec_round_trips_and_derives_layouts():
    spec = KeySpec.from_json({"name": "w", "numel": 10, "compressor": "fp16",
                              "params": {"server_recompress": False}, "pushers": [1, 0]}, 2)
    assert spec.pushers == (0, 1) and KeySpec.from_json(spec.to_json(), 2) == spec
    assert spec.push_layout().frame_nbytes == (20,)
    assert spec.reply_layout() == P.Layout.dense(10, P.DType.FLOAT32)
    assert spec.codec_params == {}


@pytest.mark.parametrize(("numel", "part_bytes"), [(1, 4096), (1000, 4096), (1025, 4096),
                                                   (10**6 + 7, 4_096_000), (10**6, 1024)])
def test_split_covers_the_tensor_in_balanced_chunks(numel, part_bytes):
    parts = split(numel, 4, part_bytes)
    assert [o for o, _ in parts] == list(np.cumsum([0] + [n for _, n in parts])[:-1])
    assert sum(n for _, n in parts) == numel
    assert max(n for _, n in parts) * 4 <= part_bytes
    assert max(n for _, n in parts) - min(n for _, n in parts) <= 1
    assert len(part_names("t", len(parts))) == len(parts)


# ---- fuzz -----------------------------------------------------------------------------------
_LAYOUTS = [P.Layout.dense(4, P.DType.FLOAT32), P.Layout.dense(4, P.DType.FLOAT16),
            KeySpec("f", 4, compressor="fp16", pushers=(0,)).push_layout()]


@st.composite
def _messages(draw) -> list:
    """Messages built field by field, each field valid or not, then mutated at byte level."""
    nframes = draw(st.integers(0, 20))
    frames = [draw(st.binary(max_size=64)) for _ in range(min(nframes, 4))]
    lengths = [len(f) if draw(st.booleans()) else draw(st.integers(0, 2**64 - 1))
               for f in frames]
    lengths += [draw(st.integers(0, 2**64 - 1)) for _ in range(nframes - len(frames))]
    head = P.HEADER.pack(
        draw(st.sampled_from([P.MAGIC, b"BPSF", b"\0\0\0\0"])),
        draw(st.sampled_from([P.VERSION, 0, 255])),
        draw(st.one_of(st.sampled_from(list(P.MsgType)), st.integers(0, 255))),
        draw(st.integers(0, 2**16 - 1)),
        draw(st.integers(0, 2**64 - 1)),
        draw(st.integers(-(2**63), 2**63 - 1)),
        draw(st.integers(-(2**31), 2**31 - 1)),
        draw(st.sampled_from([0, 1, 2, 65535])),
        draw(st.integers(0, 255)),
        draw(st.sampled_from([nframes, len(frames), 0, 255])),
        draw(st.sampled_from([4, 0, 2**64 - 1])),
    ) + b"".join(struct.pack("<Q", n) for n in lengths)
    mutation = draw(st.sampled_from(["none", "cut", "flip", "append", "drop", "dup"]))
    if mutation == "cut":
        head = head[:draw(st.integers(0, len(head)))]
    elif mutation == "flip" and head:
        i = draw(st.integers(0, len(head) - 1))
        head = head[:i] + bytes([head[i] ^ draw(st.integers(1, 255))]) + head[i + 1:]
    elif mutation == "append":
        head += draw(st.binary(min_size=1, max_size=16))
    elif mutation == "drop" and frames:
        frames = frames[:-1]
    elif mutation == "dup" and frames:
        frames = [*frames, frames[0]]
    return [head, *frames]


def _decode_everything(frames: list) -> None:
    try:
        msg = P.decode(frames, 4096)
    except P.ProtocolError:
        return
    for layout in _LAYOUTS:
        try:
            P.decode_payload(msg, layout)
        except P.ProtocolError:
            pass
    try:
        KeySpec.from_json(P.decode_json(msg), world_size=4)
    except P.ProtocolError:
        pass


@settings(max_examples=3000, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(_messages())
def test_fuzz_structured_messages_only_raise_protocol_error(frames):
    _decode_everything(frames)


@settings(max_examples=1000, deadline=None, derandomize=True)
@given(st.lists(st.binary(max_size=128), max_size=5))
def test_fuzz_random_frames_only_raise_protocol_error(frames):
    _decode_everything(frames)


@settings(max_examples=500, deadline=None, derandomize=True)
@given(st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False)
                    | st.text(max_size=8),
                    lambda children: st.lists(children, max_size=3)
                    | st.dictionaries(st.text(max_size=8), children, max_size=4),
                    max_leaves=12))
def test_fuzz_declare_bodies_only_raise_protocol_error(body):
    if isinstance(body, dict):
        body = {"name": "k", "numel": 4, "pushers": [0], **body}
    frames = P.encode(P.MsgType.DECLARE, frames=[json.dumps(body).encode()])
    _decode_everything(frames)


# ---- authentication (server/auth.py) ---------------------------------------------------------
@settings(max_examples=300, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(_messages(), st.lists(st.binary(max_size=128), max_size=5)))
def test_fuzz_verify_only_raises_auth_or_protocol_error(frames):
    from byteps_espresso.server.auth import Authenticator, AuthError

    for auth in (Authenticator(None), Authenticator(bytes(range(32)))):
        try:
            _decode_everything(list(auth.verify(frames)))
        except (AuthError, P.ProtocolError):
            pass


def _signed_push(auth):
    x = np.arange(64, dtype=np.float32)
    return auth.sign(P.encode(P.MsgType.PUSH, key=3, round=7, sender=1, dtype=P.DType.FLOAT32,
                              numel=64, frames=[x]))


@pytest.mark.parametrize("algorithm", ["chacha20-poly1305", "poly1305", "blake2b", "hmac-sha256"])
def test_mac_round_trips_and_any_altered_byte_fails(algorithm):
    from byteps_espresso.server.auth import Authenticator, AuthError

    auth = Authenticator.boot(b"0123456789abcdef").for_job(b"0123456789abcdef", "job-1")
    auth = Authenticator(auth.key, algorithm)
    frames = _signed_push(auth)
    msg = P.decode(auth.verify(frames), 1 << 20)
    assert msg.header.flags & P.FLAG_MAC and msg.header.round == 7
    for index in range(3):  # header, payload, tag
        for offset in (0, 9, -1):
            bad = [bytearray(bytes(f)) if isinstance(f, bytes) else bytearray(f.tobytes())
                   for f in frames]
            bad[index][offset] ^= 0x01
            with pytest.raises(AuthError):
                auth.verify([bytes(b) for b in bad])


@pytest.mark.parametrize("piece", [None, 2])
def test_mac_binds_frame_order_and_boundaries(monkeypatch, piece):
    """Moving bytes between frames, swapping or dropping frames fails, also when frames are
    hashed in pieces (the AEAD's length limit; ``piece`` shrinks it to reach that path)."""
    from byteps_espresso.server import auth as A

    if piece is not None:
        monkeypatch.setattr(A, "_PIECE", piece)
    auth = A.Authenticator(bytes(range(32)))
    assert auth.algorithm == "chacha20-poly1305"
    head = P.encode(P.MsgType.PULL, key=3, round=7, sender=1)[0]
    signed = auth.sign([head, b"abcd", b"e", b""])
    assert auth.verify(signed)[1:] == [b"abcd", b"e", b""]
    head, tag = signed[0], signed[-1]
    for frames in ([b"abc", b"de", b""], [b"e", b"abcd", b""], [b"abcd", b"e"],
                   [b"abcd", b"", b"e"], [b"abcde", b""], [b"abcd", b"e", b"", b""]):
        with pytest.raises(A.AuthError):
            auth.verify([head, *frames, tag])


def test_mac_binds_the_job_and_refuses_unsigned_messages():
    from byteps_espresso.server.auth import Authenticator, AuthError

    secret = b"0123456789abcdef"
    boot = Authenticator.boot(secret)
    job1, job2 = boot.for_job(secret, "job-1"), boot.for_job(secret, "job-2")
    frames = _signed_push(job1)
    for other in (job2, boot, Authenticator.boot(b"another secret!!!").for_job(
            b"another secret!!!", "job-1")):
        with pytest.raises(AuthError):
            other.verify(frames)
    with pytest.raises(AuthError, match="not signed"):
        job1.verify(P.encode(P.MsgType.PULL, key=3, round=7, sender=1))
    # A process without the secret says clearly that the peers disagree.
    with pytest.raises(P.ProtocolError, match="ESPRESSO_JOB_SECRET"):
        Authenticator(None).verify(frames)
    plain = P.encode(P.MsgType.PULL, key=3, round=7, sender=1)
    assert Authenticator(None).verify(plain) == plain


def test_job_secret_from_env_or_file_never_shows_itself(tmp_path):
    from byteps_espresso.config import Config, ConfigError

    base = {"DMLC_NUM_WORKER": "1", "DMLC_NUM_SERVER": "1", "DMLC_PS_ROOT_URI": "127.0.0.1",
            "DMLC_PS_ROOT_PORT": "9000"}
    secret = "s3cret-value-0123456789"
    cfg = Config.from_env({**base, "ESPRESSO_JOB_SECRET": secret})
    assert cfg.secret() == secret.encode()
    assert secret not in repr(cfg) and secret not in str(cfg.job_secret)
    assert Config.from_env(cfg.as_env()).secret() == secret.encode()
    path = tmp_path / "secret"
    path.write_text(secret + "\n")
    assert Config.from_env({**base, "ESPRESSO_JOB_SECRET_FILE": str(path)}).secret() == \
        secret.encode()
    assert Config.from_env(base).secret() is None
    with pytest.raises(ConfigError, match="set only one"):
        Config.from_env({**base, "ESPRESSO_JOB_SECRET": secret,
                         "ESPRESSO_JOB_SECRET_FILE": str(path)})
    with pytest.raises(ConfigError, match="at least 16") as info:
        Config.from_env({**base, "ESPRESSO_JOB_SECRET": "tooshort"})
    assert "tooshort" not in str(info.value)
    path.write_text("short")
    with pytest.raises(ConfigError, match=r"ESPRESSO_JOB_SECRET_FILE=.* holds 5 characters"):
        Config.from_env({**base, "ESPRESSO_JOB_SECRET_FILE": str(path)})
    with pytest.raises(ConfigError, match="cannot be read"):
        Config.from_env({**base, "ESPRESSO_JOB_SECRET_FILE": str(tmp_path / "missing")})


def test_compressor_state_round_trips_as_json_entries_and_raw_frames():
    state = {"w#0c[0:5]": {"residual": np.arange(5, dtype=np.float32),
                           "momentum": np.ones(5, np.float32)}}
    entries, arrays = P.pack_state(state)
    msg = P.decode(P.encode_control(P.MsgType.STATE, {"op": "put", "state": entries}, arrays,
                                    sender=0), 1 << 20)
    body, frames = P.decode_control(msg)
    back = P.unpack_state(body["state"], frames)
    assert {n: {s: a.tobytes() for s, a in sl.items()} for n, sl in back.items()} == {
        n: {s: a.tobytes() for s, a in sl.items()} for n, sl in state.items()}


@pytest.mark.parametrize(("entries", "frames", "code"), [
    ([["w", "residual", "float32", 2]], [b"\0" * 4], P.ErrorCode.BAD_LENGTH),
    ([["w", "residual", "float64", 1]], [b"\0" * 8], P.ErrorCode.BAD_FIELD),
    ([["w", "residual", "float32", -1]], [b""], P.ErrorCode.BAD_FIELD),
    ([["w", "residual", "float32"]], [b"\0" * 4], P.ErrorCode.BAD_FIELD),
    ({"w": 1}, [b"\0" * 4], P.ErrorCode.BAD_FIELD),
    ([], [b"\0" * 4], P.ErrorCode.BAD_FIELD),
])
def test_malformed_state_is_refused_with_its_code(entries, frames, code):
    with pytest.raises(P.ProtocolError) as exc:
        P.unpack_state(entries, [memoryview(f) for f in frames])
    assert exc.value.code is code


def test_state_of_more_arrays_than_a_message_carries_is_refused():
    state = {f"t{i}": {"residual": np.zeros(1, np.float32)} for i in range(P.MAX_FRAMES)}
    with pytest.raises(P.ProtocolError, match="exceed"):
        P.pack_state(state)
