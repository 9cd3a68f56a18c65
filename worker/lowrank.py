"""PowerSGD over the runtime's buckets: two dense sums per bucket, on a dense Option.

PowerSGD (``kernels/powersgd.py``) is not a codec with a payload to decode: its compression
is itself two all-reduces, of ``P`` and then of ``Q``, with an orthogonalization between
them. Every worker holds the same sums, so the sums can run on any dense Option that sums
over every worker (CONTRACT.md, "Options PowerSGD can follow"): by default the job's
collectives (``Compression.powersgd(sums="allreduce")``: the uncompressed path without
servers, as PyTorch's hook all-reduces), or its fp32 Option through the parameter servers
(``sums="ps"``: BytePS's ``ReduceScatter(intra) -> PushPull(inter) -> Allgather(intra)``),
whose servers then aggregate what PowerSGD sends: dense ``P`` and ``Q`` keys of ``n * r``
and ``m * r`` floats.

One bucket and iteration, on the bucket's lane (so the matrix products overlap the rest of
the backward pass, as a ``Comp`` does), batched like PyTorch's ``powerSGD_hook``:

1. every member PowerSGD compresses at this iteration adds its error and computes
   ``P_w = M_w Q``; the members it leaves alone (vectors, matrices too small to shrink,
   every member during the first ``start_iter`` iterations) are copied beside them;
2. one dense sum of ``[uncompressed members | P of each compressed member]``;
3. each compressed member orthogonalizes its ``P`` and computes ``Q_w = M_w^T P^``;
4. one dense sum of ``[Q of each compressed member]``;
5. each compressed member's estimate ``P^ Q^T`` of the sum (and its new error).

The first sum runs under the bucket's own name while nothing is compressed (in a plan on
``S`` or the job's fp32 Option, whichever the model prices faster for the whole bucket:
``S`` is chosen for P and Q, which are small) and under ``<bucket>#powersgd.p`` from
``start_iter`` on, the second under ``<bucket>#powersgd.q``: each name keeps one size, so a
PS key never changes its length. Both count rounds with the bucket's iteration.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from byteps_espresso.kernels.powersgd import PowerSGD
from byteps_espresso.worker.executor import Executor

from byteps_espresso.strategy.options import Option

__all__ = ["P_SUFFIX", "Q_SUFFIX", "LowRank", "cost_samples", "measure_costs"]

#: Names of a bucket's two PowerSGD sums (``<bucket><suffix>``).
P_SUFFIX, Q_SUFFIX = "#powersgd.p", "#powersgd.q"


class LowRank:
    """PowerSGD state of one optimizer, and one bucket's iteration over an executor.

    Args:
        params: PowerSGD's parameters (``kernels.powersgd.PowerSGD.defaults``).
        shapes: each parameter's shape (PowerSGD views it as a matrix).
        workers: the number of workers the sums run over.

    Example:
        >>> import torch
        >>> lr = LowRank({"rank": 1, "start_iter": 0}, {"w": torch.Size([4, 4])}, workers=1)
        >>> lr.compressed(["w"], step=0)
        [0]
    """

    def __init__(self, params: Mapping[str, Any], shapes: Mapping[str, Sequence[int]],
                 workers: int) -> None:
        self.state = PowerSGD(**params)
        self.shapes = dict(shapes)
        self.workers = workers
        # Set for one iteration in ESPRESSO_COMPRESSION_ERROR_EVERY (worker/optimizer.py).
        self.measuring = False
        # The Option of a bucket's iterations that compress nothing, per (bucket, sums'
        # Option): what CompressionSpec.uncompressed_sums chose (worker/optimizer.py).
        self.uncompressed: dict[tuple[str, Option], Option] = {}
        self._errors: dict[str, tuple[float, float]] = {}

    @classmethod
    def of_job(cls, session: Any, params: Mapping[str, Any],
               shapes: Mapping[str, Sequence[int]]) -> LowRank:
        """A job's PowerSGD state: its parameters over every worker, seeded by
        ``ESPRESSO_SEED`` unless ``params`` names a seed."""
        return cls({"seed": session.runtime.cfg.seed, **params}, shapes,
                   session.runtime.topology.world_size)

    def take_errors(self) -> dict[str, tuple[float, float]]:
        """{``<bucket>#powersgd``: (squared norm of each worker's error, squared norm of its
        input)} over the compressed members, for every bucket since the last call. The input
        is the gradient plus the error carried in, the error ``M_w - estimate / workers``
        (what error feedback carries out), as PowerSGD's reference hook defines it."""
        errors, self._errors = self._errors, {}
        return errors

    @property
    def params(self) -> dict[str, Any]:
        return dict(self.state.params)

    def compressed(self, members: Sequence[str], step: int) -> list[int]:
        """Indices of the members PowerSGD compresses at iteration ``step``."""
        return [i for i, name in enumerate(members)
                if self.state.compresses(self.shapes[name], step)]

    def reduce(self, ex: Executor, option: Option, flat: torch.Tensor, *, name: str,
               members: Sequence[str], offsets: Sequence[int], step: int,
               uncompressed: Option | None = None) -> torch.Tensor:
        """The sum over workers of one bucket (flat, PowerSGD's estimate where it compressed).

        Args:
            ex: the lane's executor.
            option: the dense Option both sums run (it must sum over every worker).
            flat: this worker's bucket (members in order; anything after the last member,
                e.g. the non-finite flag, travels uncompressed).
            name: the bucket's name.
            members: its parameters, in buffer order.
            offsets: where each member starts in ``flat``.
            step: the bucket's iteration (the same on every rank).
            uncompressed: the Option of an iteration that compresses no member (the
                bucket's one sum, under its own name); None: ``option``.
        """
        flat = flat.reshape(-1)
        chosen = self.compressed(members, step)
        if not chosen:
            return ex.run(option if uncompressed is None else uncompressed, flat, name=name,
                          step=step)
        ends = [*offsets[1:], offsets[-1] + math.prod(self.shapes[members[-1]])]
        spans = [(offsets[i], ends[i]) for i in chosen]
        dense = _complement(spans, flat.numel())
        inputs = [self._input(members[i], flat[a:b]) for i, (a, b) in zip(chosen, spans,
                                                                             strict=True)
                  ] if self.measuring else None
        # 1-2: P of every compressed member beside the uncompressed values, one sum
        ps = [self.state.start(members[i], flat[a:b].view(self.shapes[members[i]]), step)
              for i, (a, b) in zip(chosen, spans, strict=True)]
        first = torch.cat([flat[a:b] for a, b in dense] + [p.reshape(-1) for p in ps])
        first = ex.run(option, first, name=name + P_SUFFIX, step=step)
        out = torch.empty_like(flat)
        at = 0
        for a, b in dense:
            out[a:b] = first[at:at + b - a]
            at += b - a
        # 3-4: Q of every compressed member from the orthogonalized sum of its P, one sum
        qs = []
        for i, p in zip(chosen, ps, strict=True):
            p_sum = first[at:at + p.numel()].view(p.shape)
            at += p.numel()
            qs.append(self.state.middle(members[i], p_sum))
        second = ex.run(option, torch.cat([q.reshape(-1) for q in qs]),
                        name=name + Q_SUFFIX, step=step)
        # 5: the estimate of each compressed member's sum
        at = 0
        for i, (a, b), q in zip(chosen, spans, qs, strict=True):
            q_sum = second[at:at + q.numel()].view(q.shape)
            at += q.numel()
            out[a:b] = self.state.finish(members[i], q_sum, self.workers)
        if inputs is not None:
            err2 = sum(float(torch.sum((m - out[a:b] / self.workers) ** 2))
                       for m, (a, b) in zip(inputs, spans, strict=True))
            self._errors[name + "#powersgd"] = (err2, sum(float(torch.sum(m * m))
                                                          for m in inputs))
        return out

    def _input(self, name: str, grad: torch.Tensor) -> torch.Tensor:
        """What PowerSGD compresses for ``name``: the gradient plus the error carried in."""
        err = self.state.error.get(name) if self.state.params["error_feedback"] else None
        return grad.to(torch.float32) + err.reshape(-1) if err is not None \
            else grad.to(torch.float32).clone()

    # ---- checkpoints ------------------------------------------------------------------------
    def state_dict(self) -> dict[str, dict[str, dict[str, torch.Tensor]]]:
        """Each compressed parameter's error and warm-start Q (CPU copies)."""
        slots = {"error": self.state.error, "q": self.state.q}
        names = sorted(set(self.state.error) | set(self.state.q))
        return {"powersgd": {n: {s: v[n].detach().to("cpu", copy=True)
                                 for s, v in slots.items() if n in v} for n in names}}

    def load_state_dict(self, state: Mapping[str, Mapping[str, Mapping[str, torch.Tensor]]],
                        device: torch.device) -> None:
        """Restore :meth:`state_dict`'s output (errors and Qs onto ``device``)."""
        self.state.reset()
        for n, slots in state.get("powersgd", {}).items():
            if n not in self.shapes:
                raise ValueError(f"the checkpoint's PowerSGD state names parameter {n!r}, which "
                                 "this model does not have; load a checkpoint of this model")
            for slot, t in slots.items():
                getattr(self.state, slot)[n] = t.detach().to(device, copy=True)


# ---- costs for the planner -------------------------------------------------------------------
# Timed calls per product and shape (the median is kept), after one untimed call.
_COST_REPS = 3
# Matrices timed at most (the largest and smallest first, then by size): a model's layers
# repeat a few shapes, and the fit is a line in multiply-adds.
_COST_SHAPES = 6
# Shapes timed where the model has fewer than two distinct matrices PowerSGD compresses
# (rows x columns; a line needs two sizes): a small and a mid-size layer.
_FALLBACK_SHAPES = ((64, 64), (512, 512))


def cost_samples(params: Mapping[str, Any], shapes: Sequence[Sequence[int]],
                 device: torch.device, budget_s: float | None = None) -> list[dict[str, Any]]:
    """PowerSGD's products timed on ``device`` on the model's own matrix shapes, as
    ``CompressorCosts.fit`` samples in multiply-adds.

    ``compress`` covers ``P_w = M_w Q`` and, between the sums, the orthogonalization and
    ``Q_w = M_w^T P^`` (each sample with its multiply-add count); ``decompress`` the
    reconstruction ``P^ Q^T``. Only ``gpu`` (the training device) is profiled: PowerSGD has no
    numba backend. With ``budget_s`` the shapes after the second stop once that many seconds
    have passed (the smallest and the largest come first: the widest span for the fit).
    """
    from byteps_espresso.kernels.powersgd import (
        compute_p,
        matrix_shape,
        reconstruct,
        worth_compressing,
    )

    state = PowerSGD(**{k: v for k, v in params.items() if k in PowerSGD.defaults})
    rate = float(state.params["min_compression_rate"])
    mats = sorted({nm for nm in map(matrix_shape, shapes)
                   if nm is not None and worth_compressing(*nm, state.rank, rate)},
                  key=lambda nm: nm[0] * nm[1])
    if len({n * m for n, m in mats}) < 2:
        mats = sorted({*mats, *_FALLBACK_SHAPES}, key=lambda nm: nm[0] * nm[1])
    mats = [mats[0], mats[-1], *mats[1:-1]][:_COST_SHAPES]
    gen = torch.Generator().manual_seed(0)
    samples: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    for i, (n, m) in enumerate(mats):
        if i >= 2 and budget_s is not None and time.perf_counter() - t0 > budget_s:
            break
        r = min(n, m, state.rank)
        matrix = torch.randn(n, m, generator=gen).to(device)
        q = torch.randn(m, r, generator=gen).to(device)
        p = compute_p(matrix, q)
        steps = (("compress", n * m * r, compute_p, (matrix, q)),
                 ("compress", n * m * r + n * r * r, _q_of, (matrix, p)),
                 ("decompress", n * m * r, reconstruct, (p, q)))
        for op, macs, fn, args in steps:
            samples.append({"compressor": "powersgd", "device": "gpu", "op": op,
                            "numel": macs, "us": _time(fn, args, device)})
    return samples


def measure_costs(params: Mapping[str, Any], shapes: Sequence[Sequence[int]],
                  device: torch.device) -> Any:
    """PowerSGD's compute costs on ``device`` for the planner (``strategy.lowrank``): its
    products timed alone on the model's own matrix shapes (:func:`cost_samples`), fitted as
    lines in multiply-adds. The runtime times them in its lanes during the profiled
    iterations instead, beside the training (``worker.profiler.LaneProbes``); this is its
    fallback.

    Returns:
        ``strategy.CompressorCosts`` with a ``powersgd`` entry.
    """
    from byteps_espresso.strategy import CompressorCosts

    return CompressorCosts.fit(cost_samples(params, shapes, device),
                               note=f"PowerSGD's products timed on {device} at start-up, in "
                               "multiply-adds; by byteps_espresso.worker.lowrank",
                               params={"powersgd": dict(params)})


def _q_of(matrix: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """The work between PowerSGD's two sums: orthogonalize the summed P, then ``M^T P^``."""
    from byteps_espresso.kernels.powersgd import compute_q, orthogonalize

    return compute_q(matrix, orthogonalize(p))


def _time(fn: Any, args: tuple, device: torch.device) -> float:
    """Median microseconds of ``_COST_REPS`` calls of ``fn(*args)`` after an untimed one."""
    def synced() -> None:
        fn(*args)
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    synced()
    times = []
    for _ in range(_COST_REPS):
        t0 = time.perf_counter()
        synced()
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def _complement(spans: Sequence[tuple[int, int]], numel: int) -> list[tuple[int, int]]:
    """The ranges of ``[0, numel)`` outside the sorted, disjoint ``spans``."""
    out, at = [], 0
    for a, b in spans:
        if a > at:
            out.append((at, a))
        at = b
    if at < numel:
        out.append((at, numel))
    return out
