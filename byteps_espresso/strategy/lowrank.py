"""Low-rank compressors (PowerSGD) in the planner: their Options, sizes and costs.

A low-rank compressor (``kernels.capabilities(name)``: linear, not elementwise, two collective
rounds) has no payload to gather, forward or decode on its own: its compression is two dense
sums over every worker, of ``P`` and then of ``Q`` (kernels/CONTRACT.md, "PowerSGD"). Its
Options are therefore every uncompressed Option ``S`` of the tree, and each ``S`` wrapped as

    Comp(gpu) -> S -> Decomp(gpu)

where ``Comp`` computes every compressed member's ``P_w = M_w Q`` (and, between the two
rounds, ``Q_w = M_w^T P^`` after the orthogonalization), ``S`` runs twice, once on
``[uncompressed members | P of each]`` and once on ``[Q of each]``, and ``Decomp``
reconstructs ``P^ Q^T``. The rules the tree prunes by (``tree.enumerate_options``):

- *the whole tensor, each worker's own*: a shard after a divisible step or a PS partition is
  not the matrix (``elementwise=False``), and compressing a machine's sum after a ``Reduce``
  would keep the error feedback per machine root instead of per worker, which is not
  PowerSGD's algorithm; ``Comp`` comes before the first step, ``Decomp`` after the last;
- *dense steps only*: the servers and the compressed collectives take payloads they decode
  alone, and ``P``/``Q`` are summed instead (``linear``; the servers then aggregate dense
  keys, ``PushPull``);
- *on the training device*: no numba backend (``backends=("torch",)``), no ``Comp(cpu)``;
- *one compression*: the sums are already over every worker.

The steady state is priced (every matrix PowerSGD compresses after ``start_iter``), as the
planner prices DGC's payloads after its warm-up. Sizes come from the members' shapes
(:class:`Factors`, from ``TensorProfile.shapes``); compute is priced from the multiply-adds
of the matrix products with the cost profile's ``compress``/``decompress`` lines in
multiply-adds instead of elements (``CompressorCosts``, measured by
``worker.profiler.lowrank_costs``).

Example:
    >>> is_lowrank("powersgd"), is_lowrank("topk")
    (True, False)
    >>> str(wrap(Option.parse("Allreduce(flat)")))
    'Comp(gpu) -> Allreduce(flat) -> Decomp(gpu)'
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from byteps_espresso.strategy.options import Device, Kind, Option, OptionError, Step

__all__ = ["COMP", "DECOMP", "Factors", "capabilities_of", "factors", "inner", "is_lowrank",
           "wrap"]

COMP = Step(Kind.COMP, device=Device.GPU)
DECOMP = Step(Kind.DECOMP, device=Device.GPU)


@functools.cache
def is_lowrank(compressor: str) -> bool:
    """Whether ``compressor`` compresses by sums of low-rank factors (PowerSGD): linear,
    not elementwise. Unknown names are not (the kernels registry names them elsewhere)."""
    caps = capabilities_of(compressor)
    return caps is not None and caps.linear and not caps.elementwise


def capabilities_of(compressor: str) -> Any | None:
    """The kernels registry's ``Capabilities`` of ``compressor``, None for an unknown name
    (the registry names it where the compressor is built)."""
    from byteps_espresso.kernels import capabilities

    try:
        return capabilities(compressor)
    except ValueError:
        return None


def wrap(option: Option) -> Option:
    """``Comp(gpu) -> option -> Decomp(gpu)`` for an uncompressed ``option``.

    Raises:
        OptionError: ``option`` already compresses.
    """
    if option.is_compressed:
        raise OptionError(f"{option}: a low-rank compressor wraps an uncompressed Option")
    return Option((COMP, *option.steps, DECOMP))


def inner(option: Option) -> Option | None:
    """The dense Option a low-rank Option runs twice (``S`` of ``Comp -> S -> Decomp``, on any
    device), or None when ``option`` is not of that form."""
    steps = option.steps
    if (len(steps) < 3 or steps[0].kind is not Kind.COMP or steps[-1].kind is not Kind.DECOMP
            or any(s.kind.is_compute or s.kind.is_compressed for s in steps[1:-1])):
        return None
    return Option(steps[1:-1])


@dataclass(frozen=True, order=True)
class Factors:
    """What one tensor (or bucket) moves and computes per iteration under PowerSGD.

    Attributes:
        p: elements of the first sum: the uncompressed members and every ``P`` (n x r).
        q: elements of the second sum: every ``Q`` (m x r); 0 when nothing is compressed.
        mac_p: multiply-adds of ``P_w = M_w Q`` over the compressed members.
        mac_q: of ``Q_w = M_w^T P^`` and the orthogonalization (n r^2).
        mac_r: of the reconstruction ``P^ Q^T``.
    """

    p: int
    q: int
    mac_p: int
    mac_q: int
    mac_r: int


def factors(shapes: Sequence[Sequence[int]], params: Mapping[str, Any]) -> Factors:
    """The :class:`Factors` of a bucket whose members have ``shapes`` (in buffer order), with
    PowerSGD's parameters (``rank``, ``min_compression_rate``), after ``start_iter``."""
    from byteps_espresso.kernels.powersgd import PowerSGD, matrix_shape, worth_compressing

    rank = int(params.get("rank", PowerSGD.defaults["rank"]))
    rate = float(params.get("min_compression_rate", PowerSGD.defaults["min_compression_rate"]))
    p = q = mac_p = mac_q = mac_r = 0
    for shape in shapes:
        nm = matrix_shape(shape)
        if nm is None or not worth_compressing(*nm, rank, rate):
            p += math.prod(int(d) for d in shape)
            continue
        n, m = nm
        r = min(n, m, rank)
        p, q = p + n * r, q + m * r
        mac_p += n * m * r
        mac_q += n * m * r + n * r * r
        mac_r += n * m * r
    return Factors(p, q, mac_p, mac_q, mac_r)
