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

The first sum runs under the bucket's own name while nothing is compressed (the same
program, keys and counters as ``Compression.none``) and under ``<bucket>#powersgd.p`` from
``start_iter`` on, the second under ``<bucket>#powersgd.q``: each name keeps one size, so a
PS key never changes its length. Both count rounds with the bucket's iteration.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from byteps_espresso.kernels.powersgd import PowerSGD
from byteps_espresso.worker.executor import Executor

from byteps_espresso.strategy.options import Option

__all__ = ["P_SUFFIX", "Q_SUFFIX", "LowRank"]

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

    def __init__(self, params: Mapping[str, Any], shapes: Mapping[str, torch.Size],
                 workers: int) -> None:
        self.state = PowerSGD(**params)
        self.shapes = dict(shapes)
        self.workers = workers
        # Set for one iteration in ESPRESSO_COMPRESSION_ERROR_EVERY (worker/optimizer.py).
        self.measuring = False
        self._errors: dict[str, tuple[float, float]] = {}

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
               members: Sequence[str], offsets: Sequence[int], step: int) -> torch.Tensor:
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
        """
        flat = flat.reshape(-1)
        chosen = self.compressed(members, step)
        if not chosen:
            return ex.run(option, flat, name=name, step=step)
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
