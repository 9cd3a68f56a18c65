"""powersgd: rank-r PowerSGD (Vogels et al., "PowerSGD: Practical Low-Rank Gradient
Compression for Distributed Optimization", NeurIPS 2019), as PyTorch ships it
(``torch/distributed/algorithms/ddp_comm_hooks/powerSGD_hook.py``).

PowerSGD is not an elementwise codec: it views a tensor as a matrix ``M`` (``n`` rows: the
first dimension; ``m`` columns: the rest) and its compression is itself two all-reduces.
One iteration of one tensor on worker ``w`` (``Q`` is identical on every worker)::

    M_w = grad_w + e_w                  # error feedback (e_w: this worker's error)
    P_w = M_w Q                         # 1. compute_p           (n x r)
    P   = allreduce(P_w)                # 2. first collective sum
    P^  = orthogonalize(P)              # 3. Gram-Schmidt on the columns
    Q_w = M_w^T P^                      # 4. compute_q           (m x r)
    Q   = allreduce(Q_w)                # 5. second collective sum
    sum = P^ Q^T                        # 6. reconstruct: the estimate of sum_w M_w
    e_w = M_w - sum / W                 # the local error, as the reference hook keeps it
    Q kept for the next iteration       # warm start (orthogonalized again before reuse)

The math is in pure functions (:func:`compute_p`, :func:`orthogonalize`, :func:`compute_q`,
:func:`reconstruct`); :class:`PowerSGD` holds the per-tensor state (error, Q) and the
parameters. The first ``start_iter`` iterations, vectors and matrices too small to gain
``min_compression_rate`` are all-reduced uncompressed (:meth:`PowerSGD.compresses`), as in
the reference hook. The initial Q comes from the counter-based hash of ``_random`` keyed by
``key_seed(seed, name, step)`` (uniform in [-1, 1), not the hook's normal draws): the same
bits on every worker and device. Every step is deterministic, so given the same inputs and
the same (deterministic) sums every worker holds a bit-identical result.

Capabilities (see CONTRACT.md): not elementwise, needs the matrix shape, linear (payloads
sum), two collective rounds, torch backend only, never re-compressed.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import torch
from byteps_espresso.kernels._random import uniform_torch
from byteps_espresso.kernels.base import Capabilities, check_int, key_seed
from byteps_espresso.kernels.registry import register_collective

__all__ = ["POWERSGD", "PowerSGD", "compute_p", "compute_q", "initial_q", "matrix_shape",
           "orthogonalize", "reconstruct", "worth_compressing"]

#: What PowerSGD needs from an Option (CONTRACT.md, "Capabilities").
POWERSGD = Capabilities(elementwise=False, needs_shape=True, linear=True, collective_rounds=2,
                        backends=("torch",), recompressible=False)

AllReduce = Callable[[torch.Tensor], torch.Tensor]


# ---- pure functions ----------------------------------------------------------------------------
def matrix_shape(shape: Sequence[int]) -> tuple[int, int] | None:
    """The matrix PowerSGD sees: (first dimension, product of the rest); None for a vector."""
    if len(shape) < 2:
        return None
    return int(shape[0]), math.prod(int(d) for d in shape[1:])


def worth_compressing(n: int, m: int, rank: int, min_rate: float) -> bool:
    """The reference hook's test: ``(n + m) * r * min_rate < n * m``, ``r = min(n, m, rank)``."""
    r = min(n, m, rank)
    return (n + m) * r * min_rate < n * m


def initial_q(m: int, rank: int, seed: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """An ``m x rank`` float32 matrix uniform in [-1, 1), identical for a seed on every device."""
    u = uniform_torch(m * rank, seed, torch.device(device))
    return u.mul_(2.0).sub_(1.0).reshape(m, rank)  # exact: 24-bit uniforms times 2, minus 1


def compute_p(matrix: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Step 1: ``P = M Q`` (n x r)."""
    return matrix @ q


def orthogonalize(p: torch.Tensor, epsilon: float = 1e-8) -> torch.Tensor:
    """Step 3: Gram-Schmidt on the columns of ``p`` (a new tensor; ``p`` is left alone).

    Column ``i`` is divided by its norm (plus ``epsilon``, so a vanishing column stays finite),
    then projected out of the later columns, as the reference hook's ``_orthogonalize``.
    """
    out = p.clone()
    cols = out.shape[1]
    for i in range(cols):
        col = out[:, i:i + 1]
        col /= torch.linalg.vector_norm(col) + epsilon
        if i + 1 < cols:
            rest = out[:, i + 1:]
            rest -= (col * rest).sum(dim=0) * col
    return out


def compute_q(matrix: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Step 4: ``Q = M^T P`` (m x r)."""
    return matrix.t() @ p


def reconstruct(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Step 6: ``P Q^T`` (n x m)."""
    return p @ q.t()


# ---- state -------------------------------------------------------------------------------------
@register_collective
class PowerSGD:
    """Per-tensor PowerSGD state: the error and the warm-start Q of every tensor name.

    Args:
        rank: the approximation rank ``r`` (the reference's ``matrix_approximation_rank``).
        start_iter: iterations all-reduced uncompressed first (10, as the reference hook's
            documented example sets ``start_powerSGD_iter``; the hook's own default is 1,000).
        min_compression_rate: compress a matrix only if it shrinks by more than this.
        error_feedback: keep and add each worker's error (on by default, as the reference).
        warm_start: reuse the last Q (else a fresh random Q every iteration).
        seed: seeds the random Q (the job passes ``ESPRESSO_SEED``).
        epsilon: added to column norms in :func:`orthogonalize`.

    Use :meth:`reduce` with an injected all-reduce, or the three steps :meth:`start`,
    :meth:`middle`, :meth:`finish` around two collective sums of your own.

    Example:
        >>> import torch
        >>> ps = PowerSGD(rank=2, start_iter=0)
        >>> total = ps.reduce("w", torch.ones(8, 8), step=0, allreduce=lambda t: t, workers=1)
    """

    name: ClassVar[str] = "powersgd"
    capabilities: ClassVar[Capabilities] = POWERSGD
    defaults: ClassVar[dict[str, Any]] = {"rank": 1, "start_iter": 10, "min_compression_rate": 2.0,
                                          "error_feedback": True, "warm_start": True, "seed": 0,
                                          "epsilon": 1e-8}

    def __init__(self, **params: Any) -> None:
        unknown = sorted(set(params) - set(self.defaults))
        if unknown:
            raise ValueError(f"powersgd: unknown parameter(s) {', '.join(unknown)}; valid "
                             f"parameters: {', '.join(sorted(self.defaults))}")
        self.params = {**self.defaults, **params}
        p = self.params
        self.rank = check_int(self.name, "rank", p["rank"], 1, 2**16)
        self.start_iter = check_int(self.name, "start_iter", p["start_iter"], 0, 2**31 - 1)
        self.seed = check_int(self.name, "seed", p["seed"], 0, 2**63 - 1)
        for flag in ("error_feedback", "warm_start"):
            if not isinstance(p[flag], bool):
                raise ValueError(f"powersgd: {flag} must be true or false, got {p[flag]!r}")
        for positive in ("min_compression_rate", "epsilon"):
            v = p[positive]
            if isinstance(v, bool) or not isinstance(v, int | float) or v < 0:
                raise ValueError(f"powersgd: {positive} must be a number >= 0, got {v!r}")
        self.error: dict[str, torch.Tensor] = {}
        self.q: dict[str, torch.Tensor] = {}
        self._pending: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    # ---- what is compressed ----------------------------------------------------------------
    def compresses(self, shape: Sequence[int], step: int) -> bool:
        """Whether a tensor of ``shape`` is compressed at iteration ``step``.

        False for the first ``start_iter`` iterations, for vectors and for matrices that do
        not shrink by ``min_compression_rate``: those are all-reduced uncompressed.
        """
        nm = matrix_shape(shape)
        return step >= self.start_iter and nm is not None and worth_compressing(
            *nm, self.rank, float(self.params["min_compression_rate"]))

    def wire_numel(self, shape: Sequence[int]) -> tuple[int, int]:
        """Elements of P and Q one worker sends per iteration (after ``start_iter``).

        Returns:
            ``(n * r, m * r)``, or ``(numel, 0)`` for a tensor sent uncompressed.
        """
        if not self.compresses(shape, self.start_iter):
            return math.prod(int(d) for d in shape), 0
        n, m = matrix_shape(shape)  # type: ignore[misc]
        r = min(n, m, self.rank)
        return n * r, m * r

    # ---- one iteration in three steps ------------------------------------------------------
    def start(self, name: str, grad: torch.Tensor, step: int) -> torch.Tensor:
        """Add the error, take the matrix view, return this worker's ``P_w = M_w Q``.

        Raises:
            ValueError: the tensor is not compressed at ``step`` (see :meth:`compresses`),
                or a name's saved state has another shape.
        """
        if not self.compresses(grad.shape, step):
            raise ValueError(f"powersgd: tensor {name!r} {tuple(grad.shape)} is not compressed "
                             f"at step {step}; all-reduce it uncompressed (see compresses())")
        n, m = matrix_shape(grad.shape)  # type: ignore[misc]
        matrix = grad.detach().reshape(n, m).to(torch.float32)
        err = self.error.get(name)
        if self.params["error_feedback"] and err is not None:
            if err.shape != matrix.shape:
                raise ValueError(f"powersgd: tensor {name!r} has shape {tuple(grad.shape)} but "
                                 f"its saved error has {tuple(err.shape)}; call reset({name!r})")
            matrix = matrix + err
        q = self.q.get(name) if self.params["warm_start"] else None
        if q is None:
            r = min(n, m, self.rank)
            q = initial_q(m, r, key_seed(self.seed, name, step), matrix.device)
        q = orthogonalize(q, float(self.params["epsilon"]))
        self._pending[name] = (matrix, q)
        return compute_p(matrix, q)

    def middle(self, name: str, p_sum: torch.Tensor) -> torch.Tensor:
        """From the all-reduced P: orthogonalize it, return this worker's ``Q_w = M_w^T P^``."""
        matrix, _ = self._step_state(name, "middle")
        p_hat = orthogonalize(p_sum, float(self.params["epsilon"]))
        self._pending[name] = (matrix, p_hat)
        return compute_q(matrix, p_hat)

    def finish(self, name: str, q_sum: torch.Tensor, workers: int) -> torch.Tensor:
        """From the all-reduced Q: the estimate of the sum over workers, as a flat tensor.

        Keeps ``e_w = M_w - sum / workers`` (with error feedback) and Q (with warm start).
        """
        matrix, p_hat = self._step_state(name, "finish")
        del self._pending[name]
        total = reconstruct(p_hat, q_sum)
        if self.params["error_feedback"]:
            self.error[name] = matrix - total / workers
        if self.params["warm_start"]:
            self.q[name] = q_sum.clone()
        return total.reshape(-1)

    def reduce(self, name: str, grad: torch.Tensor, step: int, allreduce: AllReduce,
               workers: int) -> torch.Tensor:
        """One iteration of one tensor: the sum over workers (flat), compressed or not.

        Args:
            name: the tensor's name (keys the state; seeds the initial Q).
            grad: this worker's gradient (any shape; float32).
            step: the iteration.
            allreduce: sums a tensor over the workers (the injected transport; every worker
                must get the same bits, e.g. a sum in rank order).
            workers: the number of workers the all-reduce sums over.
        """
        if not self.compresses(grad.shape, step):
            return allreduce(grad.detach().reshape(-1).to(torch.float32))
        p = allreduce(self.start(name, grad, step))
        q = allreduce(self.middle(name, p))
        return self.finish(name, q, workers)

    def reset(self, name: str | None = None) -> None:
        """Forget the error and Q of tensor ``name`` (of every tensor when None)."""
        for slots in (self.error, self.q, self._pending):
            if name is None:
                slots.clear()
            else:
                slots.pop(name, None)

    def _step_state(self, name: str, step: str) -> tuple[torch.Tensor, torch.Tensor]:
        try:
            return self._pending[name]
        except KeyError:
            raise RuntimeError(f"powersgd: {step}() of tensor {name!r} before start(); call "
                               "start, middle and finish in order") from None

    def __repr__(self) -> str:
        params = ", ".join(f"{k}={v!r}" for k, v in sorted(self.params.items()))
        return f"PowerSGD({params})"
