"""Reduction operators of the Horovod-style API (``op=bps.Average`` / ``bps.Sum``).

Horovod's rules, in one place for ``allreduce`` and ``DistributedOptimizer``: ``op``
supersedes the deprecated ``average`` flag (passing both is an error), the default is
``Average``, and ``gradient_predivide_factor`` (divide before the sum, multiply back after)
is only meaningful with ``Average``.
"""

from __future__ import annotations

import enum

__all__ = ["ReduceOp", "resolve_op"]


class ReduceOp(str, enum.Enum):
    """How contributions are combined: ``AVERAGE`` (sum / size) or ``SUM``.

    ``ADASUM`` exists so that scripts naming ``hvd.Adasum`` import; using it is refused.
    """

    AVERAGE = "average"
    SUM = "sum"
    ADASUM = "adasum"


def resolve_op(average: bool | None, op: ReduceOp | None) -> ReduceOp:
    """The operator Horovod would apply for ``average`` / ``op``.

    Raises:
        ValueError: both are given, or ``op`` is ``ADASUM`` (not implemented here).
    """
    if op is not None and average is not None:
        raise ValueError("the op parameter supersedes average; pass only one of them "
                         "(op=bps.Average or op=bps.Sum)")
    if op is None:
        op = ReduceOp.AVERAGE if average is None or average else ReduceOp.SUM
    op = ReduceOp(op)
    if op is ReduceOp.ADASUM:
        raise ValueError("op=Adasum is not implemented by byteps-espresso; use bps.Average "
                         "or bps.Sum")
    return op
