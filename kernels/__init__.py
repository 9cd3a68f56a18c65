"""Gradient compressors with a torch backend (training device) and a numba backend (host CPUs).

Every algorithm lives in its own module and registers itself; see CONTRACT.md for the
invariants, wire ids and payload layouts.

Example:
    >>> import numpy as np
    >>> from byteps_espresso.kernels import create, names
    >>> c = create("topk", backend="numba", ratio=0.1)
    >>> payload, ctx = c.compress(np.arange(20, dtype=np.float32), name="w", step=0)
    >>> c.decompress(payload, ctx).shape
    (20,)
"""

# Importing the algorithm modules registers them.
from byteps_espresso.kernels import (  # noqa: F401
    bf16,
    dgc,
    efsignsgd,
    fp16,
    int8,
    natural,
    onebit,
    powersgd,
    qsgd,
    randomk,
    signsgd,
    signum,
    terngrad,
    topk,
)
from byteps_espresso.kernels.base import (
    BACKENDS,
    Capabilities,
    Compressor,
    Ctx,
    NonFiniteError,
    Payload,
    PayloadError,
    key_seed,
    to_numpy,
    to_torch,
)
from byteps_espresso.kernels.error_feedback import ErrorFeedback
from byteps_espresso.kernels.momentum import MomentumCorrection
from byteps_espresso.kernels.powersgd import PowerSGD
from byteps_espresso.kernels.registry import (
    by_wire_id,
    capabilities,
    collective_names,
    create,
    create_collective,
    defaults,
    names,
    wire_id,
)

__all__ = [
    "BACKENDS",
    "Capabilities",
    "Compressor",
    "Ctx",
    "ErrorFeedback",
    "MomentumCorrection",
    "NonFiniteError",
    "Payload",
    "PayloadError",
    "PowerSGD",
    "by_wire_id",
    "capabilities",
    "collective_names",
    "create",
    "create_collective",
    "defaults",
    "key_seed",
    "names",
    "to_numpy",
    "to_torch",
    "wire_id",
]
