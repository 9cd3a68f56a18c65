"""DistributedOptimizer and the Compression choices of the drop-in ``byteps.torch`` API.

``DistributedOptimizer(opt, named_parameters=..., compression=...)`` returns an optimizer of
the same class as ``opt`` (like BytePS/Horovod) whose parameters get a post-accumulate-grad
hook. When a gradient has been accumulated ``backward_passes_per_step`` times, the hook hands
it to the executor, which runs the tensor's Option asynchronously so communication overlaps
the rest of the backward pass; ``step()`` waits for every gradient, writes the average over
workers into ``.grad`` and runs the wrapped optimizer's update.

Ordering: collectives must be issued in the same order on every rank. Gradients are handed
over in one fixed order (the parameters in reverse registration order, the usual backward
order, or the profiled backward order once a strategy is planned): a gradient that becomes
ready early waits until the ones before it are handed over. ``step()`` hands over whatever is
left (zeros for parameters that got no gradient), so every rank submits the same tensors.

With ``Compression.espresso`` the planner's finalists may then be measured for a few iterations
each before one is kept (``worker.trials``, ``ESPRESSO_TRIAL_STEPS``).

Compression choices:
    ``Compression.none``     uncompressed, hierarchical like BytePS (``fp32_option``).
    ``Compression.fp16``     every gradient as float16 payloads: all-reduced as casts (DDP's
        fp16 hook, ``AllreduceC``), or pushed and pulled where PS servers run.
    ``Compression.powersgd(rank=1, ...)``  PowerSGD on every bucket (``worker.lowrank``).
    ``Compression.espresso(compressor="randomk", ratio=0.01, ...)``  profile the first
        ``ESPRESSO_PROFILE_STEPS`` iterations uncompressed, then plan per tensor.
    ``Compression.strategy(path)``  a strategy planned offline (``espresso plan``).
"""

from __future__ import annotations

import abc
import cmath
import contextlib
import dataclasses
import logging
import math
import statistics
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from byteps_espresso.kernels.powersgd import PowerSGD
from byteps_espresso.worker import checkpoint
from byteps_espresso.worker.check import (
    REPLAN_GAIN,
    Check,
    check_record,
    check_text,
    write_check,
)
from byteps_espresso.worker.codecs import CodecPair
from byteps_espresso.worker.executor import Engine, Handle
from byteps_espresso.worker.lowrank import LowRank
from byteps_espresso.worker.reduction import ReduceOp, resolve_op
from byteps_espresso.worker.session import Session, current
from byteps_espresso.worker.trials import Trials

from byteps_espresso.strategy.buckets import Bucket, MiB, check_layout, ddp_layout
from byteps_espresso.strategy.costs import dense_us
from byteps_espresso.strategy.lowrank import inner as low_rank_inner
from byteps_espresso.strategy.lowrank import wrap
from byteps_espresso.strategy.options import ROUNDING, Device, Kind, Option, Scope
from byteps_espresso.strategy.tree import sums_payloads

__all__ = ["Compression", "CompressionSpec", "DistributedOptimizer", "NonFiniteGradientError",
           "Plan", "StartupProfile", "first_step_at"]

log = logging.getLogger(__name__)

# The plan DDP's fp16 hook runs, on DDP's buckets (the baseline of that name, for a compressor
# whose payloads sum; worker/profiler.py adds it to the finalists): the check's first
# fall-back.
HOOK_PLAN = "allreduce-c"

# Buckets named per compression-error log line (the largest errors).
_ERRORS_LOGGED = 8


class NonFiniteGradientError(RuntimeError):
    """A rank's gradient held NaN or Inf (``ESPRESSO_NONFINITE=error``); the message, the same
    on every rank, names the tensor, the rank and the iteration."""


# ---- compression choices ---------------------------------------------------------------------
class CompressionSpec(abc.ABC):
    """How a DistributedOptimizer picks each gradient's Option and compressor."""

    #: The strategy is chosen at start-up from measurements: a resumed job takes the one in
    #: its checkpoint instead of profiling again (``worker.checkpoint``).
    takes_checkpoint_strategy = False

    #: iterations to run uncompressed while profiling before :meth:`plan` (0: plan at once)
    def profile_steps(self, session: Session) -> int:
        return 0

    @abc.abstractmethod
    def codec(self, session: Session) -> CodecPair | None:
        """The compressor the Options use (None for uncompressed)."""

    def excluded(self, session: Session, params: Mapping[str, torch.Tensor]) -> frozenset[str]:
        """Parameters the plan must leave uncompressed."""
        return frozenset()

    def lowrank(self, session: Session, shapes: Mapping[str, torch.Size]) -> LowRank | None:
        """PowerSGD around the buckets' Options (None: the Options alone)."""
        return None

    def uncompressed_sums(self, session: Session, sums: Option, numel: int) -> Option:
        """The Option of a PowerSGD bucket's iterations in which it compresses no member
        (its first ``start_iter``; ``numel`` elements), given ``sums``, the Option of its two
        sums: of ``sums`` and the job's fp32 Option, the one the model prices faster for the
        whole bucket, on the cluster of the strategy in use (``sums`` without one). A plan
        picks ``sums`` for P and Q, a few thousand elements each: on the LSTM at 1 Gbit/s
        its ``PushPull(flat)`` (every worker's whole bucket through the one server machine)
        took the uncompressed iterations 130-170 ms each where fp32's path took 90 ms. At
        0.25 Gbit/s it is the other way round: fp32's path through that server took 220-270
        ms, the planned ``ReduceScatter(intra) -> Allreduce(inter) -> Allgather(intra)``
        100-125 ms (BENCHMARKS.md, "End-to-end")."""
        strategy = session.strategy
        if strategy is None or sums == session.fp32:
            return sums
        return min((sums, session.fp32), key=lambda o: dense_us(strategy.cluster, o, numel))

    def checks(self, session: Session) -> bool:
        """Whether the kept strategy's first iterations are checked against the model
        (``worker.check``; the same answer on every rank)."""
        return False

    def replan(self, session: Session, kept: Any,
               runs: Sequence[Any]) -> tuple[Any | None, dict[str, Any]]:
        """The model refitted to the timed ``runs`` (``worker.check.Run``) of the ``kept``
        strategy, and a strategy to run instead, or None to stay; with what the refit found
        (every rank calls it and gets the same)."""
        return None, {}

    def probes(self, session: Session, numels: Sequence[int], traffic: Mapping[str, int],
               shapes: Mapping[str, Sequence[int]] | None = None) -> Any | None:
        """Cost probes to run in the lanes during the profiled iterations (None: none);
        ``traffic``: elements per bucket the profiled iterations synchronize; ``shapes``:
        every parameter's shape."""
        return None

    @abc.abstractmethod
    def plan(self, session: Session, tensors: Sequence[tuple[str, int]],
             profile: Any | None) -> Plan:
        """Options per tensor name, optionally a new submission order and finalists to try."""


@dataclass(frozen=True)
class Plan:
    """What :meth:`CompressionSpec.plan` decided.

    Attributes:
        options: tensor name -> Option.
        order: a new submission order (the backward order), or None to keep the current one.
        finalists: Strategies to measure before keeping one (``worker.trials``), the planned
            one (``options``) first; empty: no trials.
        buckets: the tensor-fusion layout over ``order`` (each Option's key is a bucket's
            name); None: the default layout (``ESPRESSO_BUCKET_CAP_MB``, else DDP's caps).
        fp32_ms: the profiled fp32 iterations' measured time (slowest rank's fastest), the
            trials' yardstick from their first finalist on; None: not measured.
        fp32_fastest_ms: the fastest profiled fp32 iteration over all ranks, the unit of the
            start-up budget; None: ``fp32_ms``.
    """

    options: dict[str, Option]
    order: list[str] | None = None
    finalists: tuple[Any, ...] = ()
    buckets: tuple[Bucket, ...] | None = None
    fp32_ms: float | None = None
    fp32_fastest_ms: float | None = None


@dataclass
class StartupProfile:
    """What the profiled iterations measured, handed to :meth:`CompressionSpec.plan`.

    Attributes:
        ready: per iteration, {tensor name: time its gradient was ready} (perf_counter s).
        starts: per iteration, when it began (the previous step's end).
        probes: the spec's lane probes (see :meth:`CompressionSpec.probes`), or None.
        buckets: {bucket name: elements} of the buckets the profiled iterations
            synchronized, in submission order (the probes timed their steps).
        excluded: parameters to keep uncompressed (:meth:`CompressionSpec.excluded`).
        layout: those buckets' member gradients, in submission order.
        shapes: every parameter's shape (low-rank compressors plan with them).
        cpu_starts: the process's CPU time (every thread) at each of ``starts``, s.
    """

    ready: list[dict[str, float]]
    starts: list[float]
    probes: Any | None = None
    buckets: dict[str, int] = field(default_factory=dict)
    excluded: frozenset[str] = frozenset()
    layout: tuple[Bucket, ...] = ()
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    cpu_starts: list[float] = field(default_factory=list)


@dataclass(frozen=True)
class _Uniform(CompressionSpec):
    """The same Option for every tensor: uncompressed, or one fixed compressed path."""

    compressor: str | None = None
    params: Mapping[str, Any] = field(default_factory=dict)

    def codec(self, session: Session) -> CodecPair | None:
        if self.compressor is None:
            return None
        rt = session.runtime
        return CodecPair(self.compressor, dict(self.params), device=rt.device,
                         device_kernels=rt.cfg.device_kernels)

    def option(self, session: Session) -> Option:
        if self.compressor is None:
            return session.fp32
        topo = session.runtime.topology
        if session.runtime.cfg.num_servers > 0:
            return Option.parse("Comp(gpu) -> PushPullC(flat) -> Decomp(gpu)")
        if sums_payloads(self.compressor):  # cast, all-reduce the casts: DDP's fp16 hook
            return Option.parse("Comp(gpu) -> AllreduceC(flat) -> Decomp(gpu)")
        if topo.local_size > 1 and topo.machines > 1:
            return Option.parse("Comp(gpu) -> AlltoallC(intra) -> Decomp(gpu) -> Comp(gpu) -> "
                                "AllgatherC(inter) -> Decomp(gpu) -> Comp(gpu) -> "
                                "AllgatherC(intra) -> Decomp(gpu)")
        return Option.parse("Comp(gpu) -> AllgatherC(flat) -> Decomp(gpu)")

    def plan(self, session: Session, tensors: Sequence[tuple[str, int]],
             profile: Any | None) -> Plan:
        option = self.option(session)
        buckets = default_layout(session, tensors)
        return Plan({b.name: option for b in buckets}, buckets=buckets)


# Where Compression.powersgd's sums run (see its ``sums``).
POWERSGD_SUMS = ("allreduce", "ps")


@dataclass(frozen=True)
class _PowerSGD(CompressionSpec):
    """PowerSGD on every bucket, its two sums on a dense Option (``worker.lowrank``):
    ``sums="allreduce"`` the job's collectives, ``"ps"`` its fp32 Option (the servers)."""

    params: Mapping[str, Any] = field(default_factory=dict)
    sums: str = "allreduce"

    def codec(self, session: Session) -> CodecPair | None:
        return None

    def lowrank(self, session: Session, shapes: Mapping[str, torch.Size]) -> LowRank:
        return LowRank.of_job(session, self.params, shapes)

    def uncompressed_sums(self, session: Session, sums: Option, numel: int) -> Option:
        # Its sums run the job's dense path already; PyTorch's hook, too, all-reduces the
        # uncompressed iterations as it does P and Q.
        return sums

    def plan(self, session: Session, tensors: Sequence[tuple[str, int]],
             profile: Any | None) -> Plan:
        buckets = default_layout(session, tensors)
        option = wrap(session.fp32 if self.sums == "ps" else session.allreduce)
        return Plan(dict.fromkeys((b.name for b in buckets), option), buckets=buckets)


class Compression:
    """Gradient compression choices, with byteps.torch's names plus Espresso's own.

    Example:
        >>> opt = bps.DistributedOptimizer(opt, model.named_parameters(),   # doctest: +SKIP
        ...                                compression=bps.Compression.espresso("dgc", ratio=0.01))
    """

    none: CompressionSpec = _Uniform()
    fp16: CompressionSpec = _Uniform("fp16")

    @staticmethod
    def espresso(compressor: str = "randomk", *, error_feedback: bool | None = None,
                 algorithm: str = "espresso", constraints: Any | None = None,
                 recompress: bool = False, exclude: Sequence[str] | None = None,
                 momentum_correction: bool = False, clip_norm: float | None = None,
                 **params: Any) -> CompressionSpec:
        """Profile, then plan a per-tensor strategy with the strategy engine.

        Args:
            compressor: a registered compressor (``espresso compressors`` lists them).
            error_feedback: wrap the compressor in error feedback (default: on for the
                biased sparsifiers and sign codecs, off for unbiased and fp16/bf16).
            algorithm: ``espresso`` or a baseline name of the strategy engine.
            constraints: a ``strategy.Constraints`` pruning the decision tree.
            recompress: let the plan compress a gradient more than once per iteration
                (sums re-compressed between hierarchy levels or by the servers). Off by
                default: each compression adds its error to the update, so Espresso's plan
                keeps one (``max-lossy=1``) unless ``constraints`` sets ``max_lossy``.
            momentum_correction: DGC's recipe as its paper runs it (Lin et al., ICLR 2018):
                momentum correction with local accumulation, momentum factor masking and,
                with ``clip_norm=C``, local gradient clipping at ``C / sqrt(workers)``. The
                wrapped SGD's momentum and weight decay are applied before communication
                instead (the optimizer then steps with neither). Off by default: on
                examples/train.py's LSTM (every tensor compressed, 160 steps) it ended at
                4.05 against 1.78 without it at 1%, 5.29 against 1.22 at 5% (fp32 1.22);
                masking drops the momentum of every value it sends, which costs most when
                values are sent often (docs/worker.md, "Convergence"). The sparsity warm-up
                (dgc's ``warmup_steps``) works with or without it.
            exclude: name globs (``fnmatch``) of parameters to keep uncompressed, e.g.
                ``["*.bias", "*norm*"]``; ``[]`` compresses any. Default: ``ESPRESSO_EXCLUDE``,
                else every parameter of at most one dimension (none for fp16, which only
                rounds). Kept out of compressed buckets (they are fused only with each
                other).
            **params: the compressor's parameters (``ratio=0.01``, ``seed=...``).
        """
        from byteps_espresso.kernels import registry
        from byteps_espresso.worker.profiler import EspressoSpec

        from byteps_espresso.strategy.tree import Constraints

        if compressor in registry.collective_names():
            if momentum_correction or params.get("warmup_steps"):
                raise ValueError(f"{compressor}: momentum_correction and warmup_steps are "
                                 "DGC's; PowerSGD keeps its own error and starts after "
                                 "start_iter uncompressed iterations")
            if error_feedback is not None:
                params = {**params, "error_feedback": error_feedback}
            registry.create_collective(compressor, **params)  # validates now
            error_feedback = None
        if not recompress and algorithm == "espresso":
            base = constraints if constraints is not None else Constraints()
            if base.max_lossy is None:
                constraints = dataclasses.replace(base, max_lossy=1)
        if params.get("warmup_steps"):
            # A PS key keeps one payload layout; the warm-up changes it from stage to stage.
            base = constraints if constraints is not None else Constraints()
            constraints = dataclasses.replace(base, forbid=base.forbid | {Kind.PUSH_PULL_C})
        if isinstance(exclude, str):
            raise TypeError(f"exclude must be a list of name patterns, e.g. [{exclude!r}]")
        if clip_norm is not None and not momentum_correction:
            raise ValueError("clip_norm is part of DGC's recipe: use it with compressor='dgc' "
                             "(or momentum_correction=True)")
        if clip_norm is not None and not clip_norm > 0:
            raise ValueError(f"clip_norm must be > 0, got {clip_norm!r}")
        return EspressoSpec(compressor, dict(params), error_feedback, algorithm, constraints,
                            None if exclude is None else tuple(exclude),
                            {"clip_norm": clip_norm} if momentum_correction else None)

    @staticmethod
    def powersgd(rank: int = 1, *, start_iter: int = 10, min_compression_rate: float = 2.0,
                 error_feedback: bool = True, warm_start: bool = True,
                 sums: str = "allreduce", **params: Any) -> CompressionSpec:
        """Rank-``rank`` PowerSGD (Vogels et al., NeurIPS 2019) on every bucket, as PyTorch's
        ``powerSGD_hook`` runs it on DDP's buckets.

        Each bucket's matrices (parameters of two or more dimensions, the trailing ones
        flattened) are compressed to ``P`` and ``Q``; both are summed over every worker.
        The first ``start_iter`` iterations, vectors, and matrices that would not shrink by
        ``min_compression_rate`` are summed uncompressed.

        Args:
            rank: the approximation rank (``matrix_approximation_rank``).
            start_iter: iterations summed uncompressed first.
            min_compression_rate: compress a matrix only if it shrinks by more than this.
            error_feedback: keep each worker's error and add it next iteration.
            warm_start: reuse the last ``Q`` (else a fresh random one every iteration).
            sums: where the sums run: ``allreduce``, the job's collectives (the
                uncompressed path without servers: each machine's reduce-scatter, an
                all-reduce between machines, the all-gather), as PyTorch's hook runs them;
                ``ps``, the job's fp32 path through the parameter servers (BytePS's).
                PowerSGD's sums are small and latency-bound, and through one server machine
                every machine's share crosses the server's link: on the emulated cluster
                ``allreduce`` measured faster (BENCHMARKS.md "End-to-end").
            **params: ``seed`` (default ``ESPRESSO_SEED``) or ``epsilon``.

        Raises:
            ValueError: a parameter is unknown or out of range (the message lists the valid
                ones).
        """
        if sums not in POWERSGD_SUMS:
            raise ValueError(f"Compression.powersgd: sums={sums!r}; use one of "
                             f"{', '.join(POWERSGD_SUMS)}")
        settings = {"rank": rank, "start_iter": start_iter,
                    "min_compression_rate": min_compression_rate,
                    "error_feedback": error_feedback, "warm_start": warm_start, **params}
        PowerSGD(**settings)  # validates now, not at the first step
        return _PowerSGD(settings, sums)

    @staticmethod
    def strategy(path: str) -> CompressionSpec:
        """Use a strategy file planned offline (``espresso plan ... --out PATH``)."""
        from byteps_espresso.worker.profiler import StrategyFileSpec

        return StrategyFileSpec(path)


# ---- the optimizer ---------------------------------------------------------------------------
class _DistributedOptimizer(torch.optim.Optimizer):
    """Methods mixed into the wrapped optimizer's class (see :func:`DistributedOptimizer`)."""

    def __init__(self, params: Any, named_parameters: Sequence[tuple[str, torch.Tensor]],
                 compression: CompressionSpec, backward_passes_per_step: int,
                 scale: tuple[float, float | None] = (1.0, None)) -> None:
        super(self.__class__, self).__init__(params)  # the wrapped optimizer's own __init__
        self._bps = _Sync(self, named_parameters, compression, backward_passes_per_step, scale)

    def synchronize(self) -> None:
        """Wait for every gradient of this iteration and write the averages into ``.grad``.

        Each gradient is communicated once per iteration: ``synchronize()`` (e.g. before
        ``clip_grad_norm_``) followed by ``step()`` does not synchronize again.
        """
        self._bps.synchronize()

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """``step()`` inside this context does not synchronize (Horovod's and BytePS's
        pattern after an explicit :meth:`synchronize`).

        Example:
            >>> opt.synchronize()                                   # doctest: +SKIP
            >>> torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # doctest: +SKIP
            >>> with opt.skip_synchronize():                        # doctest: +SKIP
            ...     opt.step()
        """
        self._bps.skip = True
        try:
            yield
        finally:
            self._bps.skip = False

    def set_backward_passes_per_step(self, passes: int) -> None:
        """Accumulate ``passes`` local backward passes before communicating (between
        iterations only).

        Raises:
            ValueError: ``passes`` < 1.
            RuntimeError: gradients of this iteration are already being synchronized.
        """
        self._bps.set_passes(passes)

    def step(self, closure: Any = None) -> Any:
        if not self._bps.skip:
            self._bps.synchronize()
        if self._bps.skip_step:  # a non-finite gradient somewhere, ESPRESSO_NONFINITE=skip
            return None
        return super(self.__class__, self).step(closure)

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped for a non-finite gradient (``ESPRESSO_NONFINITE=skip``)."""
        return self._bps.skipped

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state plus, under ``"espresso"``, everything the compressed
        run depends on: this rank's compressor state, the iteration counters, the strategy
        in use and, on rank 0, the servers' state (``worker.checkpoint``).

        The section is this rank's: save it on every rank and load each rank's own file.

        Raises:
            RuntimeError: called in the middle of an iteration (call it after ``step()``).
        """
        out = super(self.__class__, self).state_dict()
        out[checkpoint.KEY] = checkpoint.capture(self._bps)
        return out

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore a :meth:`state_dict` (or a plain torch optimizer's state dict, which
        restores only the torch state). A ``Compression.espresso`` job takes the
        checkpoint's strategy and does not profile again.

        Raises:
            CheckpointError: the checkpoint is from another world size, rank, compressor or
                strategy (the message names what differs).
            RuntimeError: called in the middle of an iteration.
        """
        saved = state_dict.get(checkpoint.KEY)
        checked = checkpoint.check(self._bps, saved) if saved is not None else None
        super(self.__class__, self).load_state_dict(
            {k: v for k, v in state_dict.items() if k != checkpoint.KEY})
        if checked is not None:
            checkpoint.apply(self._bps, saved, checked)

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._bps.pending():
            raise RuntimeError("zero_grad() called while gradients are being synchronized; "
                               "call optimizer.step() (or synchronize()) first")
        self._bps.zeroed()
        return super(self.__class__, self).zero_grad(set_to_none)


class _Bucket:
    """One bucket's members and its preallocated flat buffer (None for a bucket of one).

    The last bucket of the submission order always has a buffer, one element longer than its
    members: the non-finite flag (see :meth:`_Sync._check_finite`).
    """

    __slots__ = ("buffer", "flagged", "name", "numels", "offsets", "tensors")

    def __init__(self, bucket: Bucket, params: Mapping[str, torch.Tensor],
                 device: torch.device, flagged: bool = False, owned: bool = False) -> None:
        self.name = bucket.name
        self.tensors = bucket.tensors
        self.numels = [params[n].numel() for n in bucket.tensors]
        self.offsets = [0]
        for n in self.numels[:-1]:
            self.offsets.append(self.offsets[-1] + n)
        self.flagged = flagged
        # The executor sums float32 whatever the parameters' dtype; one buffer per bucket,
        # written in place every iteration (DDP's bucket buffers).
        self.buffer = (torch.empty(sum(self.numels) + flagged, dtype=torch.float32,
                                   device=device)
                       if bucket.fused or flagged or owned else None)


class _Sync:
    """Hook bookkeeping, buckets, submission order, profiling and planning of one optimizer."""

    _zeroed: float | None = None  # the first zero_grad(), before any gradient (zeroed())
    check: Check | None = None  # the kept strategy's check (worker.check)
    # What the check tries after the kept strategy, in order (_next_fallback): the plan's
    # hook finalist (HOOK_PLAN, unmeasured) and its fp32 finalist with the time the profiled
    # iterations measured (Plan.fp32_ms).
    _fallbacks: tuple[tuple[Any, float | None], ...] = ()
    _replanned: Any = None  # the re-planned strategy, once one is checked
    # The ranks' notes on non-finite gradients, when the last bucket's Option may not carry
    # its flag (see _check_finite); issued with that bucket.
    _flags: Handle | None = None

    def __init__(self, opt: torch.optim.Optimizer, named: Sequence[tuple[str, torch.Tensor]],
                 compression: CompressionSpec, passes: int,
                 scale: tuple[float, float | None] = (1.0, None)) -> None:
        self.session = current()
        self.compression = compression
        self.passes = passes
        self.params = {name: p for name, p in named}
        self.numel = {name: p.numel() for name, p in named}
        self.shapes = {name: tuple(p.shape) for name, p in named}
        self.device = self.session.runtime.device
        self.world = self.session.runtime.topology.world_size
        # Reverse registration order: the usual backward order.
        self.order = [name for name, p in reversed(named) if p.requires_grad]
        self.count: dict[str, int] = dict.fromkeys(self.order, 0)
        self.handles: list[tuple[_Bucket, Handle]] = []
        self.next = 0  # tensors of self.order handed over so far, this iteration
        self.submitted = 0  # buckets submitted so far, this iteration
        self.iteration = 0
        self.ready_times: list[dict[str, float]] = []
        self.starts: list[float] = [time.perf_counter()]  # iteration i began at starts[i]
        # The process's CPU time (every thread) at each of ``starts`` and at ``ended``.
        self.cpu_starts: list[float] = [time.process_time()]
        # When the last synchronize() returned, and when the first step began (_first_step_at)
        self.ended = self._first_step = self.starts[0]
        self.ended_cpu = self.cpu_starts[0]
        self.unused_warned = False
        # True from a synchronize() until the next gradient arrives: a second synchronize()
        # (step() after an explicit one) has nothing new to send.
        self.synced = False
        self.skip = False  # inside skip_synchronize()
        self.nonfinite = self.session.runtime.cfg.nonfinite
        self.skip_step = False  # this iteration's update is skipped (a non-finite gradient)
        self.skipped = 0
        # The last measured relative compression error per compressed bucket (largest first).
        self.compression_errors: dict[str, float] = {}
        # Order index of the first non-finite gradient of each bucket of this iteration that
        # had one on this rank (see _check_finite).
        self.bad: list[int] = []
        self.codec = compression.codec(self.session)
        self.lowrank = compression.lowrank(self.session,
                                           self.shapes)
        # What measures the compression error (ESPRESSO_COMPRESSION_ERROR_EVERY), if anything.
        self.measured = self.codec if self.codec is not None else self.lowrank
        # DGC's recipe: (momentum, weight decay) applied before communication, and each
        # parameter's velocity while its bucket goes uncompressed (see _corrected).
        self.momentum: tuple[float, float] | None = None
        self.velocity: dict[str, torch.Tensor] = {}
        recipe = getattr(compression, "recipe", None)
        if recipe is not None and self.codec is not None:
            self.momentum = _take_momentum(opt)
            self.codec.correct_momentum(self.momentum[0], recipe.get("clip_norm"), self.world)
        self.engine: Engine = self.session.plain
        self.options: dict[str, Option] | None = None
        # Each gradient is divided by `predivide` before it is sent and the sum by `divisor`
        # after (the world size: the average; 1: the sum; see DistributedOptimizer's op).
        self.predivide, divisor = scale
        self.divisor = self.world if divisor is None else divisor
        self._profile_steps = compression.profile_steps(self.session)
        self.probes = None
        self._codec_engine: Engine | None = None
        self.trials: Trials | None = None
        self._checks: list[Check] = []  # the kept strategy's check and those after it
        self._trials_from = 0  # the iteration the trials' first one runs (see _apply_plan)
        self.buckets: list[_Bucket] = []
        self._begin(compression)
        for name in self.order:
            self.params[name].register_post_accumulate_grad_hook(self._hook(name))

    def _begin(self, compression: CompressionSpec) -> None:
        """Profile, or train the given strategy from the first step (nothing to profile);
        either way the codec's kernels load now, not in a lane during the first backward pass
        (:meth:`CodecPair.load_kernels`): on the devices the strategy compresses on, or on
        both, which the probes time."""
        if self._profile_steps == 0:
            self._apply_plan(None)
        else:
            self._start_profiling(compression)
        if self.codec is not None:
            devices = (Device.GPU, Device.CPU) if self.options is None else {
                d for o in self.options.values() if o.is_compressed for d in o.devices}
            self.codec.load_kernels(devices)

    def _start_profiling(self, compression: CompressionSpec) -> None:
        # While profiling every bucket runs the fp32 path, fused as Compression.none fuses.
        self._use_buckets(default_layout(self.session,
                                         [(n, self.numel[n]) for n in self.order]))
        # The compressor is timed on gradient and bucket sizes: the plan may fuse or not.
        traffic = {b.name: sum(b.numels) for b in self.buckets}
        self.probes = compression.probes(
            self.session, [*self.numel.values(), *traffic.values()], traffic, self.shapes)
        # The codec's engine (a thread per lane), started now rather than in the last
        # profiled iteration, where it took 10 ms of the plan's switch.
        self._codec_engine = (self.session.runtime.engine(self.codec)
                              if self.codec is not None else None)

    # ---- buckets ---------------------------------------------------------------------------
    def _use_buckets(self, buckets: Sequence[Bucket]) -> None:
        """Synchronize in ``buckets`` from the next iteration on (every rank the same)."""
        check_layout(buckets, self.order, "the strategy's buckets")
        last = len(buckets) - 1
        self.buckets = [_Bucket(b, self.params, self.device, flagged=i == last,
                                owned=self.momentum is not None)
                        for i, b in enumerate(buckets)]
        ends, end = [], 0
        for b in self.buckets:
            end += len(b.tensors)
            ends.append(end)
        self._ends = ends  # bucket i is complete once self.next reaches ends[i]

    @property
    def bucket_names(self) -> list[str]:
        return [b.name for b in self.buckets]

    # ---- hooks and submission ----------------------------------------------------------------
    def _hook(self, name: str):  # type: ignore[no-untyped-def]
        def hook(p: torch.Tensor) -> None:
            self.synced = False
            self.count[name] += 1
            if self.count[name] > self.passes:
                raise RuntimeError(
                    f"gradient of {name!r} was computed {self.count[name]} times before "
                    f"optimizer.step(); increase backward_passes_per_step (now {self.passes}) "
                    "or call step() after every backward pass")
            if self.options is None and self.count[name] == 1:
                while len(self.ready_times) <= self.iteration:
                    self.ready_times.append({})
                self.ready_times[self.iteration][name] = time.perf_counter()
            self._dispatch()

        return hook

    def _dispatch(self) -> None:
        order, count, passes = self.order, self.count, self.passes
        while self.next < len(order) and count[order[self.next]] >= passes:
            self.next += 1
        while self.submitted < len(self.buckets) and self._ends[self.submitted] <= self.next:
            self._submit(self.buckets[self.submitted])
            self.submitted += 1

    def _submit(self, bucket: _Bucket) -> None:
        measured = self.measured
        if self.submitted == 0 and measured is not None:  # the iteration's first bucket
            every = self.session.runtime.cfg.compression_error_every
            measured.measuring = bool(self.options is not None and self.trials is None
                                      and every and self.iteration % every == 0)
        option = self._option(bucket)
        flat = self._corrected(bucket, option) if self.momentum is not None \
            else self._gathered(bucket)
        if self.predivide != 1.0:  # the buffer is ours; a bucket of one is the user's .grad
            flat = flat.div_(self.predivide) if bucket.buffer is not None \
                else flat / self.predivide
        members = flat[:-1] if bucket.flagged else flat
        if not _finite(members):
            self.bad.append(self._first_nonfinite(bucket, members))
            # Compressors may drop non-finite values and servers refuse them; zeros go in
            # their place, since one rank failing alone would leave the others waiting.
            # PowerSGD would spread them through every worker's P and keep them in its
            # error, past a skipped step.
            zeroed = option.is_compressed or option.uses_servers or self.lowrank is not None
            if zeroed and bucket.buffer is not None:
                members.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
            elif zeroed:  # the user's .grad: a copy
                flat = torch.nan_to_num(flat, nan=0.0, posinf=0.0, neginf=0.0)
        if bucket.flagged:
            flat[-1] = 1.0 if self.bad else 0.0
        self.handles.append((bucket, self._start(bucket, flat, option)))
        if bucket.flagged and not self._flag_survives(option):
            # Every bucket of this rank has been checked and a lossy compressor may drop the
            # flag: the ranks compare notes now, on another lane than the bucket's, beside
            # its Option. Issued after it, behind the lanes, this 1-element all-gather took
            # 1-31 ms (median about 4) of each iteration of a compressed LSTM plan at
            # 1 Gbit/s, waiting for the slowest rank after every sum was done (BENCHMARKS.md,
            # "Checking the kept strategy").
            first = float(min(self.bad)) if self.bad else -1.0
            self._flags = self.engine.call(
                self.engine.lane_of(bucket.name) + 1, lambda ex: ex.transport.allgather(
                    Scope.FLAT, torch.tensor([first], dtype=torch.float64), [1] * self.world),
                "espresso.nonfinite")
        # The compressor's timings follow the last bucket of a profiled iteration: the same
        # point of every rank's submission order, beside the synchronization they share the
        # host with (the link probes follow it, in synchronize()).
        if (self.submitted + 1 == len(self.buckets) and self.options is None
                and self.probes is not None):
            self.probes.issue(self.engine, self.iteration)

    def _start(self, bucket: _Bucket, flat: torch.Tensor, option: Option) -> Handle:
        # A bucket's counter is at least the training's iteration, so compressor schedules
        # (dgc's sparsity warm-up, PowerSGD's start_iter) follow the training, not the
        # bucket: a layout that a plan or a trial brings in at iteration 30 does not start
        # its warm-up over, and a bucket back after the trials does not pick up where it
        # stopped.
        step = self.engine.next_step(bucket.name, self.iteration)
        sums = low_rank_inner(option) if self.lowrank is not None else None
        if sums is None:
            return self.engine.submit(bucket.name, flat, option, step=step)
        # PowerSGD (``Comp(gpu) -> S -> Decomp(gpu)``) runs its matrix products and both sums
        # (each on S) on the bucket's lane, counting the bucket's iterations as a submitted
        # Option would (PS rounds, start_iter).
        lowrank, name, members, offsets = self.lowrank, bucket.name, bucket.tensors, \
            bucket.offsets
        dense = lowrank.uncompressed.get((name, sums))
        if dense is None:  # priced once per bucket and sums
            dense = lowrank.uncompressed[name, sums] = self.compression.uncompressed_sums(
                self.session, sums, flat.numel())
        return self.engine.call(
            self.engine.lane_of(name),
            lambda ex: lowrank.reduce(ex, sums, flat, name=name, members=members,
                                      offsets=offsets, step=step,
                                      uncompressed=dense), name)

    def _option(self, bucket: _Bucket) -> Option:
        """The bucket's Option this iteration (the fp32 one while profiling)."""
        return self.options[bucket.name] if self.options is not None else self.session.fp32

    def _gathered(self, bucket: _Bucket) -> torch.Tensor:
        """The bucket's gradients: its buffer filled, or a bucket of one's own ``.grad``."""
        if bucket.buffer is None:
            p = self.params[bucket.tensors[0]]
            return p.grad if p.grad is not None else torch.zeros_like(p)
        flat = bucket.buffer
        for name, offset, numel in zip(bucket.tensors, bucket.offsets, bucket.numels,
                                       strict=True):
            grad = self.params[name].grad
            piece = flat[offset:offset + numel]
            if grad is None:
                piece.zero_()
            else:
                piece.copy_(grad.reshape(-1))
        return flat

    def _corrected(self, bucket: _Bucket, option: Option) -> torch.Tensor:
        """The bucket's input under DGC's recipe, in its buffer.

        Weight decay joins every gradient before communication (the parameters are the same
        on every rank, so the sum carries it once per worker, as the optimizer would add it
        to the average). An uncompressed bucket carries each member's velocity
        ``u = momentum * u + g``: the average of the workers' velocities is the velocity of
        the average, so the optimizer, stepping without momentum, does what it would have.
        A compressed bucket leaves momentum to the codec's correction and masking, and its
        members' velocities here start again from zero if they are ever sent uncompressed.
        """
        momentum, decay = self.momentum  # type: ignore[misc]
        flat = bucket.buffer
        assert flat is not None
        for name, offset, numel in zip(bucket.tensors, bucket.offsets, bucket.numels,
                                       strict=True):
            p = self.params[name]
            piece = flat[offset:offset + numel]
            if p.grad is None:
                piece.zero_()
            else:
                piece.copy_(p.grad.reshape(-1))
            if decay:
                piece.add_(p.detach().reshape(-1), alpha=decay)
            if option.is_compressed:
                self.velocity.pop(name, None)
                continue
            u = self.velocity.get(name)
            if u is None:
                self.velocity[name] = piece.clone()
            else:
                piece.copy_(u.mul_(momentum).add_(piece))
        return flat

    def pending(self) -> bool:
        return bool(self.handles)

    def _warn_unused(self) -> None:
        unused = [n for n in self.order[self.next:] if self.count[n] < self.passes]
        if unused and not self.unused_warned:
            self.unused_warned = True
            log.warning(
                "%d parameter(s) got no gradient in iteration %d (e.g. %s): they are "
                "synchronized as zeros at step(), as DDP's find_unused_parameters does, and "
                "the buckets after them wait until then; leave parameters the model never uses "
                "out of named_parameters and the optimizer", len(unused), self.iteration,
                unused[:3])

    # ---- the iteration's end -----------------------------------------------------------------
    def set_passes(self, passes: int) -> None:
        if passes < 1:
            raise ValueError(f"backward_passes_per_step must be >= 1, got {passes}")
        if self.handles or any(self.count.values()):
            raise RuntimeError("set_backward_passes_per_step() called in the middle of an "
                               "iteration; call it after optimizer.step()")
        self.passes = passes

    def synchronize(self) -> None:
        if self.synced:  # nothing arrived since the last synchronize(): already averaged
            return
        if self.next < len(self.order):  # parameters without (enough) gradients
            self._warn_unused()
            self.next = len(self.order)
            self._dispatch()
        timeout = self.session.runtime.cfg.op_timeout_s
        results = [(bucket, handle.wait(timeout)) for bucket, handle in self.handles]
        self._check_finite(results, timeout)
        for bucket, total in results:
            self._write_back(bucket, total)
        measured = self.measured
        if measured is not None and measured.measuring:
            measured.measuring = False
            self._compression_errors(timeout)
        self.handles.clear()
        self.count = dict.fromkeys(self.order, 0)
        self.next = self.submitted = 0
        self.iteration += 1
        self.synced = True
        if self.options is None:
            if self.probes is not None:  # before the next forward, which runs alone
                self.probes.issue_links(self.engine, self.iteration - 1)
                self.probes.wait(timeout)
            self.starts.append(time.perf_counter())
            self.cpu_starts.append(time.process_time())
            if self.iteration >= self._profile_steps:
                self._first_step = self._first_step_at()
                self._apply_plan(StartupProfile(
                    self.ready_times, self.starts, self.probes,
                    {b.name: sum(b.numels) for b in self.buckets},
                    self.compression.excluded(self.session, self.params),
                    tuple(Bucket.of(b.tensors) for b in self.buckets), self.shapes,
                    self.cpu_starts))
        elif self.trials is not None:
            if self.iteration > self._trials_from:
                self._trial_step()
            elif self.iteration == self._trials_from:
                self._begin_trials()
        elif self.check is not None:
            self._check_step()
        self.ended = time.perf_counter()
        self.ended_cpu = time.process_time()

    # ---- non-finite gradients -----------------------------------------------------------------
    def _first_nonfinite(self, bucket: _Bucket, flat: torch.Tensor) -> int:
        """Index in ``self.order`` of the bucket's first member with a NaN or Inf here."""
        for name, offset, numel in zip(bucket.tensors, bucket.offsets, bucket.numels,
                                       strict=True):
            if not bool(torch.isfinite(flat[offset:offset + numel]).all()):
                return self.order.index(name)
        return self.order.index(bucket.tensors[0])

    def _check_finite(self, results: Sequence[tuple[_Bucket, torch.Tensor]],
                      timeout: float) -> None:
        """Stop or skip the step on every rank alike when any rank had a non-finite gradient.

        Every bucket's input was checked in :meth:`_submit`. The last bucket carries one more
        element, 1 where this rank found a non-finite gradient in any bucket: when its Option
        is uncompressed the sum of these flags reaches every rank with the gradients, and only
        when it is not zero do the ranks all-gather which gradient was bad (so too through
        fp16's casts and PowerSGD, :meth:`_flag_survives`). When a lossy compressor carries
        the last bucket the flag may not survive, so the ranks compare notes every
        iteration: one 1-element all-gather per rank, issued with the last bucket
        (:meth:`_submit`).
        """
        self.skip_step = False
        local, self.bad = self.bad, []
        if not results:  # no parameter to synchronize
            return
        last, total = results[-1]
        flags, self._flags = self._flags, None
        if self._flag_survives(self._option(last)):
            if not float(total[-1]):
                return
            first = float(min(local)) if local else -1.0
            flags = self.engine.call(0, lambda ex: ex.transport.allgather(
                Scope.FLAT, torch.tensor([first], dtype=torch.float64), [1] * self.world),
                "espresso.nonfinite")
        assert flags is not None
        every = flags.wait(timeout)
        bad = [(int(i), r) for r, i in enumerate(every.tolist()) if i >= 0]
        if not bad:
            return
        what = ", ".join(f"rank {r}: {self.order[i]!r}" for i, r in bad)
        message = (f"non-finite gradient (NaN or Inf) in iteration {self.iteration}: {what}")
        if self.nonfinite == "skip":
            self.skip_step = True
            self.skipped += 1
            log.warning("%s; every rank skips this optimizer step (%d skipped so far, "
                        "ESPRESSO_NONFINITE=skip)", message, self.skipped)
            return
        raise NonFiniteGradientError(
            f"{message}; every rank stops. Lower the learning rate, clip gradients, or set "
            "ESPRESSO_NONFINITE=skip to skip such steps as AMP's GradScaler does")

    def _flag_survives(self, option: Option) -> bool:
        """Whether the sum of the non-finite flags reaches every rank with the last bucket:
        an uncompressed Option sums it exactly, PowerSGD sends what follows its members (the
        flag) in the dense part of its first sum, and a cast to half precision keeps it
        exact through every step (0 and 1, and sums of up to 2048 of them, are fp16 values;
        the servers and the decoders sum in float32)."""
        if not option.is_compressed or self.lowrank is not None:
            return True
        job = self.codec.name if self.codec is not None else None
        return all((s.codec or job) in ROUNDING for s in option.steps if s.kind is Kind.COMP)

    # ---- compression error ----------------------------------------------------------------
    def _compression_errors(self, timeout: float) -> None:
        """Log this iteration's relative compression error per compressed bucket and, with
        ``ESPRESSO_COMPRESSION_ERROR_BUDGET``, send the buckets over it uncompressed from now
        on (decided on the largest error over ranks, so every rank switches alike)."""
        assert self.options is not None
        lowrank, source = self.lowrank, self.measured
        assert source is not None
        sums: dict[str, list[float]] = {}
        for cname, (err2, norm2) in source.take_errors().items():
            acc = sums.setdefault(cname.rpartition("#")[0], [0.0, 0.0])
            acc[0] += err2
            acc[1] += norm2
        # The same names on every rank (the budget all-gathers one error per name).
        names = ([b.name for b in self.buckets
                  if lowrank.compressed(b.tensors, lowrank.state.start_iter)]
                 if lowrank is not None else
                 [b.name for b in self.buckets if self.options[b.name].is_compressed])
        errors = [math.sqrt(sums[n][0] / sums[n][1]) if n in sums and sums[n][1] > 0 else 0.0
                  for n in names]
        budget = self.session.runtime.cfg.compression_error_budget
        if budget is not None and names:
            every = self.engine.call(0, lambda ex: ex.transport.allgather(
                Scope.FLAT, torch.tensor(errors, dtype=torch.float64),
                [len(errors)] * self.world), "espresso.compression_error").wait(timeout)
            errors = every.reshape(self.world, len(names)).amax(0).tolist()
        measured = sorted(((e, n) for e, n in zip(errors, names, strict=True) if e > 0),
                          reverse=True)
        self.compression_errors = {n: e for e, n in measured}
        if measured and self.session.runtime.topology.rank == 0:
            log.info("relative compression error at iteration %d (%s), largest first: %s",
                     self.iteration, "largest over ranks" if budget is not None else "rank 0",
                     ", ".join(f"{n} {e:.3f}" for e, n in measured[:_ERRORS_LOGGED]))
        # PowerSGD's buckets already run a dense Option: the budget does not move them.
        over = [n for e, n in measured if budget is not None and e > budget
                and lowrank is None]
        if over:
            self.options = {**self.options, **dict.fromkeys(over, self.session.fp32)}
            log.warning("%d bucket(s) over ESPRESSO_COMPRESSION_ERROR_BUDGET=%g are "
                        "synchronized uncompressed from now on: %s", len(over), budget,
                        ", ".join(over[:_ERRORS_LOGGED]))

    def _write_back(self, bucket: _Bucket, total: torch.Tensor) -> None:
        """The average over workers into each member's ``.grad``, divided on its way there:
        one pass over each member, and no ``.grad`` is a view of ``total``, which may be the
        bucket's buffer (rewritten next iteration)."""
        flat, divisor = total.reshape(-1), self.divisor
        for name, offset, numel in zip(bucket.tensors, bucket.offsets, bucket.numels,
                                       strict=True):
            p = self.params[name]
            value = flat[offset:offset + numel].view(p.shape)
            grad = p.grad
            if grad is None:
                p.grad = torch.div(value, divisor).to(p.dtype)
            elif grad.dtype is torch.float32 and grad.device == value.device:
                torch.div(value, divisor, out=grad)
            else:
                grad.copy_(torch.div(value, divisor))

    # ---- plans and trials --------------------------------------------------------------------
    def zeroed(self) -> None:
        """``zero_grad()`` was called: the first call before any gradient marks when the
        first step began, in scripts that zero the gradients at the top of the loop."""
        if self._zeroed is None and not self.ready_times:
            self._zeroed = time.perf_counter()

    def _first_step_at(self) -> float:
        return first_step_at(self.starts, self.ready_times, self._zeroed)

    def _trial_step(self) -> None:
        """Record the finalist's iteration; move to the next one, or keep the fastest."""
        trials = self.trials
        assert trials is not None
        trials.record(time.perf_counter() - self.ended, self.session)
        if not trials.done:
            self._use_strategy(trials.current)
            return
        self._keep(trials)

    def _keep(self, trials: Trials) -> None:
        kept = trials.choose(self.session)
        # A finalist the trials measured lost to the kept one there: no second look.
        measured = trials.measured_ms()
        tried = {id(s) for i, s in enumerate(trials.finalists)
                 if i not in trials.profiled and not math.isnan(measured[i])}
        self._fallbacks = tuple(f for f in self._fallbacks if id(f[0]) not in tried)
        self.session.strategy = kept
        self._use_strategy(kept)
        self.trials = None
        self._start_check()

    # ---- the check of the kept strategy (worker/check.py) -----------------------------------
    def _steady_step(self) -> int:
        """The first iteration after the compressor's schedule (dgc's sparsity warm-up,
        PowerSGD's uncompressed first iterations): what the planner priced."""
        return (self.codec.steady_step if self.codec is not None
                else self.lowrank.state.start_iter if self.lowrank is not None else 0)

    def _start_check(self) -> None:
        steps = self.session.runtime.cfg.check_steps
        strategy = self.session.strategy
        if steps < 2 or strategy is None or not self.compression.checks(self.session):
            return
        self.check = Check(strategy, steps, max(self.iteration, self._steady_step()),
                           list(self.engine.executors), servers_cpu=self._servers_cpu())
        if self.iteration == self.check.start:
            self.check.begin()

    def _check_step(self) -> None:
        """After each iteration while a strategy is checked (every rank alike)."""
        check = self.check
        assert check is not None
        if self.iteration <= check.start:
            if self.iteration == check.start:
                check.begin()
            return
        if not check.record(time.perf_counter() - self.ended,
                            time.process_time() - self.ended_cpu):
            return
        runs = check.runs(self.session)
        measured = check.measure(self.session)
        best = check.against
        if best is not None:  # a strategy checked after the kept one
            assert best.measured_ms is not None
            if measured < best.measured_ms:
                best = check
            self._checks.append(check)
            new, _ = self._next_fallback(best.measured_ms)
        else:
            self._checks = [check]
            best = check
            new, ms = self._next_fallback(measured)
            if new is not None:  # measured beats predicted: no re-plan of the same model
                check.info = {"fallback": new.algorithm} | ({} if ms is None
                                                           else {"fp32_ms": ms})
            elif runs:
                new, check.info = self.compression.replan(self.session, check.strategy, runs)
                self._replanned = new
        if new is None:
            if best is not check:  # the last one checked lost: back to the fastest
                self._use_strategy(best.strategy)
                self.session.strategy = best.strategy
            self._end_check(best)
            return
        self._use_strategy(new)
        self.session.strategy = new
        self.check = Check(new, check.steps, self.iteration, list(self.engine.executors),
                           against=best, servers_cpu=self._servers_cpu())
        self.check.begin()

    def _servers_cpu(self) -> Callable[[], float] | None:
        """Rank 0's reading of the CPU seconds of the servers on its cores (their STATS), for
        the check's record; None on the other ranks, without servers, or where this
        kernel's boot is unknown."""
        from byteps_espresso.server.client import PSError
        from byteps_espresso.server.shm import boot_id

        client, mine = self.session.runtime.ps_client, boot_id()
        if client is None or self.session.runtime.topology.rank != 0 or not mine:
            return None

        def read() -> float:
            try:
                return sum(s["cpu_s"] for s in client.server_stats()
                           if s.get("boot_id") == mine)
            except PSError as exc:  # a record, not the training: the reading is left out
                log.warning("the servers' CPU time was not read for the check: %s", exc)
                return math.nan

        return read

    def _next_fallback(self, best_ms: float) -> tuple[Any | None, float | None]:
        """The next strategy to check after one that measured ``best_ms`` (the same on every
        rank), taken off :attr:`_fallbacks`, with its profiled time (None: unmeasured), or
        (None, None). Measured beats predicted: when no trial ran (the start-up budget had no
        room for one) the check is the first measurement of the planned strategy, and on a
        host whose cores the workers share a plan of many small steps can run well over its
        prediction (an fp16 transformer on loopback: predicted 97 ms, measured 206, the fp32
        path 131; at 1 Gbit/s the LSTM's fp16 plan predicted 26.9 ms, measured 43.2, where
        DDP's fp16 hook's plan runs in 23.4). So an unmeasured fall-back (the hook's plan,
        HOOK_PLAN) is checked next, and a measured one (the fp32 path) where it measured more
        than ``REPLAN_GAIN`` faster; the model is neither refitted nor planned again: the
        re-plan would rank on the model just measured wrong (and took 2.8 s once, on the same
        transformer)."""
        while self._fallbacks:
            (strategy, ms), *rest = self._fallbacks
            self._fallbacks = tuple(rest)
            if ms is None or ms < best_ms * (1 - REPLAN_GAIN):
                return strategy, ms
        return None, None

    def _end_check(self, best: Check) -> None:
        """Log the check and, with ``ESPRESSO_PROFILE_OUT``, write ``check.json`` (rank 0):
        the kept strategy's check, those after it, and which one ``best`` (training on) is."""
        kept, *later = self._checks
        stayed = ("kept" if best is kept else "replanned" if best.strategy is self._replanned
                  else best.strategy.algorithm)
        rt = self.session.runtime
        if rt.topology.rank == 0:
            record = check_record(kept, later, stayed, rt.host_cores)
            log.info("%s", check_text(record))
            if rt.cfg.profile_out:
                write_check(rt.cfg.profile_out, record)
                if best is not kept:  # what ESPRESSO_STRATEGY would reuse
                    best.strategy.save(Path(rt.cfg.profile_out) / "strategy.json")
        self.check = None
        self._checks = []

    def _begin_trials(self) -> None:
        trials = self.trials
        assert trials is not None
        trials.begin(self.session, time.perf_counter() - self._first_step)
        if trials.done:  # the start-up budget has no room for them: the plan stays
            self._keep(trials)
        elif trials.current is not trials.finalists[0]:  # the first is running
            self._use_strategy(trials.current)

    def _use_strategy(self, strategy: Any) -> None:
        if [b.tensors for b in strategy.layout] != [b.tensors for b in self.buckets]:
            # Finalists may submit in different orders (the fp32 one keeps the profiled
            # iterations' buckets, in their order), so the layout brings its own.
            self.order = [n for b in strategy.layout for n in b.tensors]
            self._use_buckets(strategy.layout)
        self.options = self._checked(strategy.options)

    def adopt(self, strategy: Any) -> None:
        """Run ``strategy`` from the next iteration on, without profiling or trials (a
        resumed job takes its checkpoint's strategy)."""
        order = [n for b in strategy.layout for n in b.tensors]
        if sorted(order) != sorted(self.order):
            raise ValueError("the strategy was planned for other parameters; load a "
                             "checkpoint of this model")
        self.order = order
        self.trials = self.check = None
        self._fallbacks = ()
        if self.probes is not None:
            self.probes.close()
            self.probes = None
        self._use_strategy(strategy)
        self.session.strategy = strategy
        if self.codec is not None and self.engine is self.session.plain:
            self.engine = self._take_codec_engine()

    def _checked(self, options: dict[str, Option]) -> dict[str, Option]:
        missing = [name for name in self.bucket_names if name not in options]
        if missing:
            raise ValueError(f"the strategy has no Option for {len(missing)} parameter(s) or "
                             f"bucket(s), e.g. {missing[:3]}; plan it for this model's "
                             "named_parameters")
        return options

    def _apply_plan(self, profile: Any | None) -> None:
        tensors = [(name, self.numel[name]) for name in self.order]
        plan = self.compression.plan(self.session, tensors, profile)
        if plan.order is not None:
            if sorted(plan.order) != sorted(self.order):
                raise ValueError("a planned tensor order must name every parameter once")
            self.order = list(plan.order)
        if plan.buckets is not None:
            self._use_buckets(plan.buckets)
        elif plan.order is not None or not self.buckets:  # the default caps (new order)
            self._use_buckets(default_layout(self.session, [(n, self.numel[n])
                                                            for n in self.order]))
        self.options = self._checked(plan.options)
        if self.codec is not None:
            self.engine = self._take_codec_engine()
        if plan.finalists:
            # The trials measure the steady state the planner priced: through a compressor's
            # schedule (dgc's sparsity warm-up, whose first stage sends a quarter of each
            # gradient) the planned strategy trains, and the trials follow it.
            self._trials_from = max(self.iteration, self._steady_step())
            cfg = self.session.runtime.cfg
            hooked = next((s for s in plan.finalists if s.algorithm == HOOK_PLAN), None)
            fp32 = next((s for s in plan.finalists if s.algorithm == "fp32"), None)
            self._fallbacks = (*(() if hooked is None else ((hooked, None),)),
                               *(() if fp32 is None or plan.fp32_ms is None
                                 else ((fp32, plan.fp32_ms),)))
            self.trials = Trials(plan.finalists, cfg.trial_steps, fp32_ms=plan.fp32_ms,
                                 start=self._trials_from, budget=cfg.startup_budget,
                                 budget_unit_ms=plan.fp32_fastest_ms)
            if self.iteration == self._trials_from:
                self._begin_trials()
        if self.trials is None and self.check is None and profile is not None:
            self._start_check()  # no trials: the planned strategy is the kept one

    def _take_codec_engine(self) -> Engine:
        """The codec's engine: the one started while profiling, else a new one."""
        engine = self._codec_engine or self.session.runtime.engine(self.codec)
        self._codec_engine = None
        return engine


def first_step_at(starts: Sequence[float], ready: Sequence[Mapping[str, float]],
                  zeroed: float | None) -> float:
    """When the first step began (perf_counter s), from the profiled iterations: the earlier
    of the first ``zero_grad()`` (``zeroed``, before any gradient; None: not called) and the
    first gradient less the median time the later iterations took from their start to their
    first gradient. A first forward pass is slower, so that alone starts the clock late (by up
    to 0.2 s on the LSTM, 2 fp32 iterations at 1 Gbit/s). Never before ``starts[0]``, when
    the optimizer was built (before the script's own set-up).

    Args:
        starts: when each iteration began (``starts[0]``: the optimizer's construction).
        ready: per iteration, {gradient name: when it was ready}.
        zeroed: the first ``zero_grad()``, or None.
    """
    reach = [min(times.values()) - start
             for times, start in zip(ready[1:], starts[1:], strict=False) if times]
    begun = [zeroed] if zeroed is not None else []
    if ready and ready[0] and reach:
        begun.append(min(ready[0].values()) - statistics.median(reach))
    return max(starts[0], min(begun)) if begun else starts[0]


def _finite(t: torch.Tensor) -> bool:
    """No NaN or Inf in ``t``: one reduction without a temporary (a sum is NaN or infinite
    when any element is), and the exact check only when the sum overflowed. The sum is read
    as a Python float: ``torch.isfinite`` of a 0-d tensor is a few kernels (4.9 us against
    0.2 on this host, one thread), once per bucket and iteration."""
    return cmath.isfinite(t.sum().item()) or bool(torch.isfinite(t).all())


def _take_momentum(opt: torch.optim.Optimizer) -> tuple[float, float]:
    """The wrapped SGD's (momentum, weight decay), set to 0 in every parameter group: DGC's
    recipe applies both before communication.

    Raises:
        ValueError: not SGD-like, or settings the recipe cannot move (nesterov, dampening,
            different values per group).
    """
    groups = opt.param_groups
    if any("momentum" not in g for g in groups):
        raise ValueError(f"DGC's momentum correction needs SGD with momentum, not "
                         f"{type(opt).__name__}; pass momentum_correction=False to use dgc as a "
                         "sparsifier with error feedback")
    if any(g.get("nesterov") or g.get("dampening", 0) for g in groups):
        raise ValueError("DGC's momentum correction implements plain momentum: use SGD "
                         "without nesterov and dampening, or momentum_correction=False")
    values = {(float(g["momentum"]), float(g.get("weight_decay", 0.0))) for g in groups}
    if len(values) > 1:
        raise ValueError(f"DGC's momentum correction needs one momentum and weight decay for "
                         f"every parameter group, got {sorted(values)}")
    for g in groups:
        g["momentum"] = 0.0
        g["weight_decay"] = 0.0
    return values.pop()


def default_layout(session: Session, tensors: Sequence[tuple[str, int]]) -> tuple[Bucket, ...]:
    """The buckets of ``Compression.none``/``fp16`` and of the profiled iterations: DDP's
    caps (25 MiB, the first bucket 1 MiB), or ``ESPRESSO_BUCKET_CAP_MB``."""
    cap_mb = session.runtime.cfg.bucket_cap_mb
    return ddp_layout(tensors, None if cap_mb is None else int(cap_mb * MiB))


def _named(optimizer: torch.optim.Optimizer,
           named_parameters: Iterable[tuple[str, torch.Tensor]] | None,
           ) -> list[tuple[str, torch.Tensor]]:
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if named_parameters is None:
        log.warning("DistributedOptimizer without named_parameters: naming parameters by "
                    "position; pass model.named_parameters() for stable names")
        return [(f"push_pull.noname.{i}", p) for i, p in enumerate(params)]
    named = list(named_parameters)
    if any(not isinstance(n, str) or not isinstance(p, torch.Tensor) for n, p in named):
        raise ValueError("named_parameters must be (name, tensor) pairs, e.g. "
                         "model.named_parameters()")
    names = [n for n, _ in named]
    dups = sorted({n for n in names if names.count(n) > 1})
    if dups:
        raise ValueError(f"parameter names must be unique; duplicated: {dups}. Pass "
                         "model.named_parameters() or make the names unique")
    known = {id(p) for _, p in named}
    unnamed = [i for i, p in enumerate(params) if id(p) not in known]
    if unnamed:
        raise ValueError(f"named_parameters was given but {len(unnamed)} optimizer parameter(s) "
                         f"(positions {unnamed[:5]}) have no name; pass the named_parameters of "
                         "every module the optimizer updates")
    in_opt = {id(p) for p in params}
    return [(n, p) for n, p in named if id(p) in in_opt]


def DistributedOptimizer(optimizer: torch.optim.Optimizer,
                         named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None,
                         compression: CompressionSpec = Compression.none,
                         backward_passes_per_step: int = 1, *,
                         op: ReduceOp = ReduceOp.AVERAGE,
                         gradient_predivide_factor: float = 1.0) -> torch.optim.Optimizer:
    """Wrap ``optimizer`` so that ``step()`` applies the gradients averaged over all workers.

    Args:
        optimizer: any ``torch.optim.Optimizer``; its class and hyper-parameters are kept.
        named_parameters: ``model.named_parameters()``; names select per-tensor strategies.
        compression: ``Compression.none``, ``.fp16``, ``.espresso(...)`` or ``.strategy(path)``.
        backward_passes_per_step: local backward passes accumulated before communicating.
        op: ``ReduceOp.AVERAGE`` or ``ReduceOp.SUM`` of the workers' gradients.
        gradient_predivide_factor: with AVERAGE, each gradient is divided by it before the
            sum and the sum by (world size / factor) after, as Horovod does.

    Returns:
        An optimizer of the same class whose ``step()`` synchronizes first.

    Raises:
        NotInitializedError: ``init()`` was not called.
        ValueError: duplicated or missing parameter names, or a bad
            ``backward_passes_per_step``.
    """
    current()
    if backward_passes_per_step < 1:
        raise ValueError(f"backward_passes_per_step must be >= 1, got {backward_passes_per_step}")
    op = resolve_op(None, op)
    if not gradient_predivide_factor > 0:
        raise ValueError(f"gradient_predivide_factor must be > 0, got {gradient_predivide_factor}")
    if gradient_predivide_factor != 1.0 and op is not ReduceOp.AVERAGE:
        raise ValueError("gradient_predivide_factor needs op=Average (it divides before the sum "
                         "and multiplies back after)")
    world = current().runtime.topology.world_size
    divisor = world / gradient_predivide_factor if op is ReduceOp.AVERAGE else 1.0
    if not isinstance(compression, CompressionSpec):
        raise TypeError("compression must be Compression.none, Compression.fp16, "
                        "Compression.espresso(...) or Compression.strategy(path)")
    named = _named(optimizer, named_parameters)
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,),
               dict(_DistributedOptimizer.__dict__))
    return cls(optimizer.param_groups, named, compression, backward_passes_per_step,
               (gradient_predivide_factor, divisor))
