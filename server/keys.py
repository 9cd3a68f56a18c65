"""Key specifications: what a PS key holds, shared by the client, scheduler and servers.

A *key* is a tensor or one partition of a large tensor. Its spec travels as JSON (DECLARE,
PLACE) and is validated here field by field, so a server never builds a compressor or a
buffer from unchecked input.

Reserved parameters (taken out before the compressor is built):
    ``server_error_feedback`` (bool, default false): the server keeps an error-feedback
        residual per key when it re-compresses the aggregate.
    ``server_recompress`` (bool, default true): the server answers pulls with the
        re-compressed aggregate; false answers with the dense float32 aggregate.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from byteps_espresso.server.protocol import DType, ErrorCode, Layout, ProtocolError

__all__ = ["RESERVED_PARAMS", "KeySpec", "part_names", "split"]

RESERVED_PARAMS = ("server_error_feedback", "server_recompress")
# Longest key name accepted on the wire (characters); tensor names are far shorter.
MAX_NAME_CHARS = 1024
# Largest tensor a key may describe (elements): 2**40 float32 is 4 TiB, beyond any gradient.
MAX_NUMEL = 1 << 40
# Most pushers per key; beyond any cluster this project targets.
MAX_PUSHERS = 1 << 16


def _fail(message: str) -> ProtocolError:
    return ProtocolError(ErrorCode.BAD_DECLARE, message)


@dataclass(frozen=True)
class KeySpec:
    """One key: its name, element count, dtype, codec and who pushes it.

    Attributes:
        name: the key name; the ctx name used to compress and decompress this key's payloads.
        numel: elements of the (partition of the) tensor.
        dtype: ``"float32"`` or ``"float16"`` (dense keys only).
        compressor: registry name, or None for dense keys.
        params: compressor parameters plus the reserved server parameters.
        pushers: sorted global ranks that push every round.
    """

    name: str
    numel: int
    dtype: str = "float32"
    compressor: str | None = None
    params: dict[str, Any] = field(default_factory=dict)
    pushers: tuple[int, ...] = ()

    @property
    def codec_params(self) -> dict[str, Any]:
        return {k: v for k, v in self.params.items() if k not in RESERVED_PARAMS}

    @property
    def error_feedback(self) -> bool:
        return bool(self.params.get("server_error_feedback", False))

    @property
    def recompress(self) -> bool:
        return bool(self.params.get("server_recompress", True))

    def create_compressor(self) -> Any:
        """The numba-backend compressor of this key (None for dense keys)."""
        if self.compressor is None:
            return None
        from byteps_espresso.kernels import create

        return create(self.compressor, backend="numba", **self.codec_params)

    def push_layout(self, compressor: Any = None) -> Layout:
        """Frames a PUSH of this key carries (the codec's payload arrays, or the dense tensor)."""
        if self.compressor is None:
            return Layout.dense(self.numel, DType.from_name(self.dtype))
        from byteps_espresso.kernels import wire_id

        c = compressor if compressor is not None else self.create_compressor()
        return Layout(wire_id(self.compressor), DType.FLOAT32, self.numel,
                      tuple(np.dtype(d) for d in c.payload_dtypes),
                      tuple(int(n) for n in c.payload_lengths(self.numel)))

    def reply_layout(self, compressor: Any = None) -> Layout:
        """Frames a PULL_REPLY of this key carries."""
        if self.compressor is not None and not self.recompress:
            return Layout.dense(self.numel, DType.FLOAT32)
        return self.push_layout(compressor)

    def wire_bytes(self, compressor: Any = None) -> int:
        return sum(self.push_layout(compressor).frame_nbytes)

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "numel": self.numel, "dtype": self.dtype,
                "compressor": self.compressor, "params": dict(self.params),
                "pushers": list(self.pushers)}

    @classmethod
    def from_json(cls, body: dict[str, Any], world_size: int | None = None) -> KeySpec:
        """Validate a JSON key spec field by field.

        Raises:
            ProtocolError: (code ``bad_declare``) a missing, mistyped or out-of-range field.
        """
        if not isinstance(body, dict):
            raise _fail(f"a key spec must be a JSON object, got {type(body).__name__}")
        name = body.get("name")
        if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME_CHARS:
            raise _fail(f"name must be a string of 1..{MAX_NAME_CHARS} characters, got "
                        f"{str(name)[:80]!r}")
        numel = body.get("numel")
        if type(numel) is not int or not 0 < numel <= MAX_NUMEL:
            raise _fail(f"{name}: numel must be an integer in [1, {MAX_NUMEL}], got {numel!r}")
        dtype = body.get("dtype", "float32")
        if dtype not in ("float32", "float16"):
            raise _fail(f"{name}: dtype must be float32 or float16, got {dtype!r}")
        compressor = body.get("compressor")
        params = body.get("params", {})
        if not isinstance(params, dict) or not all(
                isinstance(k, str) and (v is None or isinstance(v, (bool, int, float, str)))
                for k, v in params.items()):
            raise _fail(f"{name}: params must be an object of JSON scalars, got {params!r}")
        if compressor is not None:
            _check_compressor(name, compressor, dtype)
        pushers = body.get("pushers")
        if (not isinstance(pushers, list) or not 0 < len(pushers) <= MAX_PUSHERS
                or not all(type(r) is int and r >= 0 for r in pushers)
                or len(set(pushers)) != len(pushers)):
            raise _fail(f"{name}: pushers must be a non-empty list of distinct ranks, got "
                        f"{str(pushers)[:80]}")
        if world_size is not None and max(pushers) >= world_size:
            raise _fail(f"{name}: pusher rank {max(pushers)} is not a worker; ranks are "
                        f"0..{world_size - 1}")
        return cls(name, numel, dtype, compressor, dict(params), tuple(sorted(pushers)))


def _check_compressor(name: str, compressor: Any, dtype: str) -> None:
    from byteps_espresso.kernels import names

    if not isinstance(compressor, str) or compressor not in names():
        raise _fail(f"{name}: unknown compressor {compressor!r}; choose one of "
                    f"{', '.join(names())} or null for dense")
    if dtype != "float32":
        raise _fail(f"{name}: compressed keys hold float32 tensors, got {dtype}")


def split(numel: int, itemsize: int, partition_bytes: int) -> list[tuple[int, int]]:
    """Partitions of a tensor as (offset, numel): as few equal chunks as keep every chunk
    within ``partition_bytes`` (the first ``numel % n`` chunks one element longer, as
    ``torch.tensor_split`` does).

    Raises:
        ValueError: ``numel`` < 1 or ``partition_bytes`` smaller than one element.
    """
    if numel < 1:
        raise ValueError(f"a key needs at least one element, got numel={numel}")
    per_part = partition_bytes // itemsize
    if per_part < 1:
        raise ValueError(f"BYTEPS_PARTITION_BYTES={partition_bytes} is smaller than one element")
    n = math.ceil(numel / per_part)
    base, extra = divmod(numel, n)
    out, offset = [], 0
    for i in range(n):
        size = base + (1 if i < extra else 0)
        out.append((offset, size))
        offset += size
    return out


def part_names(name: str, count: int) -> list[str]:
    """Key names of a tensor's partitions: the tensor name itself when it is not split,
    else ``name#i``. Compress partition ``i`` with ``name=part_names(...)[i]``."""
    if count == 1:
        return [name]
    return [f"{name}#{i}" for i in range(count)]

