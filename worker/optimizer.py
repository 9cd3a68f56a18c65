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
    ``Compression.fp16``     every gradient as float16 payloads.
    ``Compression.espresso(compressor="randomk", ratio=0.01, ...)``  profile the first
        ``ESPRESSO_PROFILE_STEPS`` iterations uncompressed, then plan per tensor.
    ``Compression.strategy(path)``  a strategy planned offline (``espresso plan``).
"""

from __future__ import annotations

import abc
import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from byteps_espresso.worker.codecs import CodecPair
from byteps_espresso.worker.executor import Engine, Handle
from byteps_espresso.worker.reduction import ReduceOp, resolve_op
from byteps_espresso.worker.session import Session, current
from byteps_espresso.worker.trials import Trials

from byteps_espresso.strategy.options import Option

__all__ = ["Compression", "CompressionSpec", "DistributedOptimizer", "Plan", "StartupProfile"]

log = logging.getLogger(__name__)


# ---- compression choices ---------------------------------------------------------------------
class CompressionSpec(abc.ABC):
    """How a DistributedOptimizer picks each gradient's Option and compressor."""

    #: iterations to run uncompressed while profiling before :meth:`plan` (0: plan at once)
    def profile_steps(self, session: Session) -> int:
        return 0

    @abc.abstractmethod
    def codec(self, session: Session) -> CodecPair | None:
        """The compressor the Options use (None for uncompressed)."""

    def probes(self, session: Session, numels: Sequence[int]) -> Any | None:
        """Cost probes to run in the lanes during the profiled iterations (None: none)."""
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
    """

    options: dict[str, Option]
    order: list[str] | None = None
    finalists: tuple[Any, ...] = ()


@dataclass
class StartupProfile:
    """What the profiled iterations measured, handed to :meth:`CompressionSpec.plan`.

    Attributes:
        ready: per iteration, {tensor name: time its gradient was ready} (perf_counter s).
        starts: per iteration, when it began (the previous step's end).
        probes: the spec's lane probes (see :meth:`CompressionSpec.probes`), or None.
    """

    ready: list[dict[str, float]]
    starts: list[float]
    probes: Any | None = None


@dataclass(frozen=True)
class _Uniform(CompressionSpec):
    """The same Option for every tensor: uncompressed, or one fixed compressed path."""

    compressor: str | None = None
    params: Mapping[str, Any] = field(default_factory=dict)

    def codec(self, session: Session) -> CodecPair | None:
        if self.compressor is None:
            return None
        return CodecPair(self.compressor, dict(self.params), device=session.runtime.device)

    def option(self, session: Session) -> Option:
        if self.compressor is None:
            return session.fp32
        topo = session.runtime.topology
        if session.runtime.cfg.num_servers > 0:
            return Option.parse("Comp(gpu) -> PushPullC(flat) -> Decomp(gpu)")
        if topo.local_size > 1 and topo.machines > 1:
            return Option.parse("Comp(gpu) -> AlltoallC(intra) -> Decomp(gpu) -> Comp(gpu) -> "
                                "AllgatherC(inter) -> Decomp(gpu) -> Comp(gpu) -> "
                                "AllgatherC(intra) -> Decomp(gpu)")
        return Option.parse("Comp(gpu) -> AllgatherC(flat) -> Decomp(gpu)")

    def plan(self, session: Session, tensors: Sequence[tuple[str, int]],
             profile: Any | None) -> Plan:
        option = self.option(session)
        return Plan({name: option for name, _ in tensors})


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
                 **params: Any) -> CompressionSpec:
        """Profile, then plan a per-tensor strategy with the strategy engine.

        Args:
            compressor: a registered compressor (``espresso compressors`` lists them).
            error_feedback: wrap the compressor in error feedback (default: on for the
                biased sparsifiers and sign codecs, off for unbiased and fp16/bf16).
            algorithm: ``espresso`` or a baseline name of the strategy engine.
            constraints: a ``strategy.Constraints`` pruning the decision tree.
            **params: the compressor's parameters (``ratio=0.01``, ``seed=...``).
        """
        from byteps_espresso.worker.profiler import EspressoSpec

        return EspressoSpec(compressor, dict(params), error_feedback, algorithm, constraints)

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
        """Wait for every gradient of this iteration and write the averages into ``.grad``."""
        self._bps.synchronize()

    def step(self, closure: Any = None) -> Any:
        self._bps.synchronize()
        return super(self.__class__, self).step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._bps.pending():
            raise RuntimeError("zero_grad() called while gradients are being synchronized; "
                               "call optimizer.step() (or synchronize()) first")
        return super(self.__class__, self).zero_grad(set_to_none)


class _Sync:
    """Hook bookkeeping, submission order, profiling and planning of one optimizer."""

    def __init__(self, opt: torch.optim.Optimizer, named: Sequence[tuple[str, torch.Tensor]],
                 compression: CompressionSpec, passes: int,
                 scale: tuple[float, float | None] = (1.0, None)) -> None:
        self.session = current()
        self.compression = compression
        self.passes = passes
        self.params = {name: p for name, p in named}
        self.numel = {name: p.numel() for name, p in named}
        # Reverse registration order: the usual backward order.
        self.order = [name for name, p in reversed(named) if p.requires_grad]
        self.count: dict[str, int] = dict.fromkeys(self.order, 0)
        self.handles: dict[str, Handle] = {}
        self.next = 0
        self.iteration = 0
        self.ready_times: list[dict[str, float]] = []
        self.starts: list[float] = [time.perf_counter()]  # iteration i began at starts[i]
        self.ended = self.starts[0]  # when the last synchronize() returned
        self.codec = compression.codec(self.session)
        self.engine: Engine = self.session.plain
        self.options: dict[str, Option] | None = None
        self.world = self.session.runtime.topology.world_size
        # Each gradient is divided by `predivide` before it is sent and the sum by `divisor`
        # after (the world size: the average; 1: the sum; see DistributedOptimizer's op).
        self.predivide, divisor = scale
        self.divisor = self.world if divisor is None else divisor
        self._profile_steps = compression.profile_steps(self.session)
        self.probes = None
        self.trials: Trials | None = None
        if self._profile_steps == 0:
            self._apply_plan(None)
        else:
            self.probes = compression.probes(self.session,
                                             [self.numel[name] for name in self.order])
        for name in self.order:
            self.params[name].register_post_accumulate_grad_hook(self._hook(name))

    def _hook(self, name: str):  # type: ignore[no-untyped-def]
        def hook(p: torch.Tensor) -> None:
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

    def _ready(self, name: str) -> bool:
        return self.count[name] >= self.passes

    def _submit(self, name: str) -> None:
        p = self.params[name]
        grad = p.grad if p.grad is not None else torch.zeros_like(p)
        if self.predivide != 1.0:
            grad = grad / self.predivide
        option = self.options[name] if self.options is not None else self.session.fp32
        self.handles[name] = self.engine.submit(name, grad, option)

    def _dispatch(self) -> None:
        while self.next < len(self.order) and self._ready(self.order[self.next]):
            self._submit_next()

    def _submit_next(self) -> None:
        self._submit(self.order[self.next])
        self.next += 1
        # Probes follow the last gradient of a profiled iteration: the same point of every
        # rank's submission order, queued behind the synchronization they share the host with.
        if self.next == len(self.order) and self.options is None and self.probes is not None:
            self.probes.issue(self.engine, self.iteration)

    def pending(self) -> bool:
        return bool(self.handles)

    def synchronize(self) -> None:
        while self.next < len(self.order):  # parameters without (enough) gradients
            self._submit_next()
        timeout = self.session.runtime.cfg.op_timeout_s
        for name, handle in self.handles.items():
            total = handle.wait(timeout)
            p = self.params[name]
            avg = total.div_(self.divisor).to(p.dtype).reshape(p.shape)
            if p.grad is None:
                p.grad = avg
            else:
                p.grad.copy_(avg)
        self.handles.clear()
        self.count = dict.fromkeys(self.order, 0)
        self.next = 0
        self.iteration += 1
        if self.options is None:
            if self.probes is not None:  # they overlap this synchronization, not the next forward
                self.probes.wait(timeout)
            self.starts.append(time.perf_counter())
            if self.iteration >= self._profile_steps:
                self._apply_plan(StartupProfile(self.ready_times, self.starts, self.probes))
        elif self.trials is not None:
            self._trial_step()
        self.ended = time.perf_counter()

    def _trial_step(self) -> None:
        """Record the finalist's iteration; move to the next one, or keep the fastest."""
        trials = self.trials
        assert trials is not None
        trials.record(time.perf_counter() - self.ended)
        if not trials.done:
            self.options = self._checked(trials.current.options)
            return
        kept = trials.choose(self.session)
        self.session.strategy = kept
        self.options = self._checked(kept.options)
        self.trials = None

    def _checked(self, options: dict[str, Option]) -> dict[str, Option]:
        missing = [name for name in self.order if name not in options]
        if missing:
            raise ValueError(f"the strategy has no Option for {len(missing)} parameter(s), e.g. "
                             f"{missing[:3]}; plan it for this model's named_parameters")
        return options

    def _apply_plan(self, profile: Any | None) -> None:
        tensors = [(name, self.numel[name]) for name in self.order]
        plan = self.compression.plan(self.session, tensors, profile)
        if plan.order is not None:
            if sorted(plan.order) != sorted(self.order):
                raise ValueError("a planned tensor order must name every parameter once")
            self.order = list(plan.order)
        self.options = self._checked(plan.options)
        if plan.finalists:
            self.trials = Trials(plan.finalists, self.session.runtime.cfg.trial_steps)
        if self.codec is not None:
            self.engine = self.session.runtime.engine(self.codec)


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
