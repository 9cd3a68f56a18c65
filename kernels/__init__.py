"""Gradient compressors with a torch backend (training device) and a numba backend (host CPUs).

Example:
    >>> from byteps_espresso.kernels import create, names
    >>> c = create("fp16", backend="torch")
"""

from byteps_espresso.kernels import fp16  # noqa: F401  (registers itself)
from byteps_espresso.kernels.base import BACKENDS, Compressor, Ctx, Payload, PayloadError
from byteps_espresso.kernels.registry import by_wire_id, create, names, wire_id

__all__ = [
    "BACKENDS",
    "Compressor",
    "Ctx",
    "Payload",
    "PayloadError",
    "by_wire_id",
    "create",
    "names",
    "wire_id",
]
