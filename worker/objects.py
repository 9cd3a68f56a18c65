"""Python objects as JSON bytes, for ``broadcast_object`` and optimizer state (no pickle).

Supported values, nested freely:

- ``None``, ``bool``, ``int``, ``float`` (also NaN and infinities), ``str``;
- ``list`` and ``tuple`` (a tuple comes back a tuple);
- ``dict`` with keys of the scalar types above (``str`` keys stay a JSON object; a dict with
  other keys comes back with the same keys and order);
- ``bytes``;
- ``torch.Tensor`` (dense, any non-quantized dtype; it comes back on the CPU) and
  ``numpy.ndarray`` of numeric or bool dtype.

Anything else raises :class:`TypeError` naming the type: no arbitrary object is ever
reconstructed from received bytes, which is why pickle is not used.

Example:
    >>> decode_object(encode_object({"epoch": 3, "betas": (0.9, 0.999)}))
    {'epoch': 3, 'betas': (0.9, 0.999)}
"""

from __future__ import annotations

import base64
import json
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

__all__ = ["SUPPORTED", "decode_object", "encode_object"]

SUPPORTED = ("None, bool, int, float, str, bytes, list, tuple, dict (scalar keys), "
             "torch.Tensor, numpy.ndarray")
# A JSON object with this key is one of the tagged values below; a user dict that has the key
# is itself sent tagged, so nothing is ambiguous.
_TAG = "__espresso__"


def encode_object(obj: Any) -> bytes:
    """``obj`` as UTF-8 JSON.

    Raises:
        TypeError: ``obj`` holds a value of an unsupported type (named in the message).
    """
    return json.dumps(_encode(obj), separators=(",", ":")).encode()


def decode_object(data: bytes) -> Any:
    """The object :func:`encode_object` encoded.

    Raises:
        ValueError: ``data`` is not such an encoding.
    """
    try:
        return _decode(json.loads(data.decode()))
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as exc:
        raise ValueError(f"not an encoded object: {exc}") from None


def _array(kind: str, dtype: str, shape: list[int], raw: bytes) -> dict[str, Any]:
    return {_TAG: kind, "dtype": dtype, "shape": shape,
            "data": base64.b64encode(raw).decode("ascii")}


def _encode_dict(obj: dict) -> Any:
    if all(isinstance(k, str) for k in obj) and _TAG not in obj:
        return {k: _encode(v) for k, v in obj.items()}
    for k in obj:
        if not (k is None or isinstance(k, (bool, int, float, str))):
            raise TypeError(f"cannot encode a dict key of type {type(k).__name__}; "
                            f"supported: {SUPPORTED}")
    return {_TAG: "dict", "items": [[k, _encode(v)] for k, v in obj.items()]}


def _encode_tensor(obj: torch.Tensor) -> Any:
    if obj.is_sparse or obj.is_quantized:
        raise TypeError("cannot encode a sparse or quantized tensor; send it dense")
    flat = obj.detach().cpu().contiguous().reshape(-1)
    raw = flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
    return _array("tensor", str(obj.dtype).removeprefix("torch."), list(obj.shape), raw)


def _encode_ndarray(obj: np.ndarray) -> Any:
    if obj.dtype.kind not in "biufc":
        raise TypeError(f"cannot encode a numpy array of dtype {obj.dtype}; supported: "
                        "numeric and bool")
    return _array("ndarray", obj.dtype.str, list(obj.shape), np.ascontiguousarray(obj).tobytes())


# Encoders of the non-JSON types, by type (checked in this order: bool before int is moot,
# both are JSON scalars and handled first).
_ENCODERS: tuple[tuple[type | tuple[type, ...], Callable[[Any], Any]], ...] = (
    (list, lambda obj: [_encode(v) for v in obj]),
    (tuple, lambda obj: {_TAG: "tuple", "items": [_encode(v) for v in obj]}),
    (dict, _encode_dict),
    ((bytes, bytearray), lambda obj: {_TAG: "bytes",
                                      "data": base64.b64encode(bytes(obj)).decode("ascii")}),
    (torch.Tensor, _encode_tensor),
    (np.ndarray, _encode_ndarray),
)


def _encode(obj: Any) -> Any:
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    for kind, encoder in _ENCODERS:
        if isinstance(obj, kind):
            return encoder(obj)
    raise TypeError(f"cannot encode a value of type {type(obj).__name__}; supported: "
                    f"{SUPPORTED}")


def _decode_tensor(obj: dict) -> torch.Tensor:
    dtype = getattr(torch, obj["dtype"], None)
    if not isinstance(dtype, torch.dtype):
        raise KeyError(f"unknown tensor dtype {obj['dtype']!r}")
    raw = base64.b64decode(obj["data"])
    buf = (torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw
           else torch.empty(0, dtype=torch.uint8))
    return buf.view(dtype).reshape(tuple(int(d) for d in obj["shape"])).clone()


def _decode_ndarray(obj: dict) -> np.ndarray:
    dtype = np.dtype(obj["dtype"])
    if dtype.kind not in "biufc":  # never object arrays from received bytes
        raise KeyError(f"refused numpy dtype {dtype}")
    raw = base64.b64decode(obj["data"])
    return np.frombuffer(raw, dtype=dtype).reshape(tuple(int(d) for d in obj["shape"])).copy()


_DECODERS: dict[str, Callable[[dict], Any]] = {
    "tuple": lambda obj: tuple(_decode(v) for v in obj["items"]),
    "dict": lambda obj: {k: _decode(v) for k, v in obj["items"]},
    "bytes": lambda obj: base64.b64decode(obj["data"]),
    "tensor": _decode_tensor,
    "ndarray": _decode_ndarray,
}


def _decode(obj: Any) -> Any:
    if isinstance(obj, list):
        return [_decode(v) for v in obj]
    if not isinstance(obj, dict):
        return obj
    kind = obj.get(_TAG)
    if kind is None:
        return {k: _decode(v) for k, v in obj.items()}
    return _DECODERS[kind](obj)
