# ruff: noqa: PLR0917  (positional parameters in byteps.torch's and horovod.torch's order)
"""Drop-in for ``byteps.torch`` and ``horovod.torch``: change the import to this module.

Example:
    >>> import byteps_espresso.torch as bps                      # doctest: +SKIP
    >>> bps.init()
    >>> if torch.cuda.is_available(): torch.cuda.set_device(bps.local_rank())
    >>> model.cuda(); bps.broadcast_parameters(model.state_dict(), root_rank=0)
    >>> opt = bps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
    ...                                named_parameters=model.named_parameters(),
    ...                                compression=bps.Compression.espresso("randomk", ratio=0.01))
    >>> bps.broadcast_optimizer_state(opt, root_rank=0)

The environment is BytePS's (``DMLC_NUM_WORKER`` machines, ``BYTEPS_LOCAL_SIZE`` workers
each, ``DMLC_WORKER_ID``, ``BYTEPS_LOCAL_RANK``, ``DMLC_PS_ROOT_URI``/``_PORT``, ...), plus the
``ESPRESSO_*`` knobs; see the README's configuration table.

What each call does, with BytePS's and Horovod's semantics:

- ``push_pull`` / ``push_pull_async`` / ``push_pull_inplace`` / ``push_pull_async_inplace``
  (BytePS): sum or average through the job's uncompressed path (the parameter servers when
  there are any). ``version`` and ``priority`` are accepted and have no effect (scheduling
  hints); ``staleness`` other than 0 (pipe-SGD) is refused.
- ``allreduce`` / ``allreduce_`` / ``allreduce_async`` / ``allreduce_async_`` (Horovod): a
  collective over every rank, any dtype (integer averages round down, as Horovod's);
  ``op=Average|Sum`` supersedes the deprecated ``average``; ``prescale_factor`` and
  ``postscale_factor`` multiply before and after the sum.
- ``allgather`` / ``allgather_async``: concatenation along the first dimension, which may
  differ between ranks (the others may not).
- ``broadcast`` / ``broadcast_`` / ``broadcast_async`` / ``broadcast_async_``: ``root_rank``'s
  tensor on every rank; ``broadcast_object``: ``root_rank``'s Python object, and
  ``allgather_object``: every rank's, sent as JSON (types listed in
  :mod:`byteps_espresso.worker.objects`; never pickle).
- The out-of-place ``push_pull``, ``allreduce``, ``allgather`` and ``broadcast`` are
  differentiable, as in Horovod and BytePS.
- Asynchronous calls return a handle for ``poll`` / ``synchronize``. Every rank must make
  the same calls in the same order (tensor names default to a per-call-kind counter).
- ``init`` registers ``shutdown`` to run at interpreter exit, as BytePS and Horovod do, so a
  script that never calls it leaves the job cleanly; after an uncaught exception it does not
  (the scheduler then sees the worker lost and stops the job at once).
"""

from __future__ import annotations

import atexit
import dataclasses
import gc
import itertools
import logging
import math
import sys
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from byteps_espresso.config import Config
from byteps_espresso.strategy.options import Scope
from byteps_espresso.worker import optimizer as _optimizer
from byteps_espresso.worker.executor import Executor, Handle
from byteps_espresso.worker.objects import decode_object, encode_object
from byteps_espresso.worker.optimizer import Compression, CompressionSpec
from byteps_espresso.worker.optimizer_state import apply_description, describe, state_tensors
from byteps_espresso.worker.reduction import ReduceOp, resolve_op
from byteps_espresso.worker.runtime import Runtime
from byteps_espresso.worker.session import (
    NotInitializedError,
    Session,
    current,
    install,
    installed,
    uninstall,
)

__all__ = [
    "Adasum",
    "Average",
    "Compression",
    "CompressionSpec",
    "DistributedOptimizer",
    "NotInitializedError",
    "ReduceOp",
    "Sum",
    "allgather",
    "allgather_async",
    "allgather_object",
    "allreduce",
    "allreduce_",
    "allreduce_async",
    "allreduce_async_",
    "broadcast",
    "broadcast_",
    "broadcast_async",
    "broadcast_async_",
    "broadcast_object",
    "broadcast_object_bytes",
    "broadcast_optimizer_state",
    "broadcast_parameters",
    "cross_rank",
    "cross_size",
    "declare",
    "init",
    "is_initialized",
    "job_compression",
    "local_rank",
    "local_size",
    "planned_strategy",
    "poll",
    "push_pull",
    "push_pull_async",
    "push_pull_async_inplace",
    "push_pull_inplace",
    "rank",
    "shutdown",
    "size",
    "synchronize",
]

log = logging.getLogger("byteps_espresso")

Average = ReduceOp.AVERAGE
Sum = ReduceOp.SUM
Adasum = ReduceOp.ADASUM


@dataclasses.dataclass
class _Pending:
    """An asynchronous call: the lane's handle and what turns its result into the output."""

    handle: Handle
    finish: Callable[[Any], Any]


_pending: dict[int, _Pending] = {}
_handle_ids = itertools.count()
_counters: dict[str, itertools.count] = {}
_exit_registered = False


# ---- life cycle ------------------------------------------------------------------------------
def init(config: Config | None = None) -> None:
    """Join the job: topology, process groups, PS client (reads the environment once).

    Also registers :func:`shutdown` to run at interpreter exit, rank 0 logs one warning
    per unsupported BytePS variable that is set, and the objects that exist (the imports)
    are frozen out of the cyclic garbage collector's reach (``gc.freeze``).

    Args:
        config: a parsed Config (default: ``Config.from_env()``).

    Raises:
        ConfigError: a BytePS / ESPRESSO variable is missing or malformed.
        RuntimeError: already initialised, or the scheduler / other workers are unreachable.
    """
    global _exit_registered  # noqa: PLW0603  (one registration per process)
    if installed():
        raise RuntimeError("byteps_espresso.torch.init() was already called; call shutdown() "
                           "before initialising again")
    cfg = config or Config.from_env()
    logging.getLogger("byteps_espresso").setLevel(cfg.log_level)
    # What exists now (the imports: torch, numpy, numba, the script's own set-up) lives as
    # long as the job: out of the cyclic collector's reach, every full collection after
    # scans only what the job makes. The start-up (kernels, the planner's trees, the probes)
    # made each worker run one of 66-350 ms on the LSTM of benchmarks/ddp.py, 11-55 ms after
    # this, and the start-up took 0.54-0.59 s instead of 0.74-0.81 (BENCHMARKS.md, "The
    # imports out of the collector's reach"). Cyclic garbage made before init() is never
    # collected.
    gc.freeze()
    install(Session(Runtime(cfg)))
    if rank() == 0:
        for message in cfg.ignored_warnings():
            log.warning("%s", message)
    if not _exit_registered:
        atexit.register(_shutdown_at_exit)
        _exit_registered = True


def shutdown() -> None:
    """Leave the job: stop communication threads, close the PS client and process groups.

    Runs by itself at interpreter exit; calling it earlier (or twice) is fine.
    """
    session = uninstall()
    _pending.clear()
    _counters.clear()
    if session is not None:
        session.runtime.close()


def _shutdown_at_exit() -> None:
    if not installed():
        return
    if getattr(sys, "last_exc", None) is not None or getattr(sys, "last_value", None) is not None:
        # Leaving cleanly would tell the scheduler this worker finished; without it the
        # scheduler sees the connection drop and stops the other workers at once.
        log.error("exiting on an uncaught exception: not leaving the job cleanly, so that it "
                  "stops")
        return
    shutdown()


def is_initialized() -> bool:
    """True between :func:`init` and :func:`shutdown` (Horovod's ``is_initialized``)."""
    return installed()


def rank() -> int:
    """Global rank: machine id x local size + local rank."""
    return current().runtime.topology.rank


def size() -> int:
    """Number of training processes (machines x workers per machine)."""
    return current().runtime.topology.world_size


def local_rank() -> int:
    """This process's index on its machine; select its GPU with
    ``torch.cuda.set_device(bps.local_rank())``."""
    return current().runtime.topology.local_rank


def local_size() -> int:
    """Training processes per machine."""
    return current().runtime.topology.local_size


def cross_rank() -> int:
    """This process's machine index (Horovod's ``cross_rank``; BytePS's ``DMLC_WORKER_ID``)."""
    return current().runtime.topology.machine_id


def cross_size() -> int:
    """Number of machines (Horovod's ``cross_size``; BytePS's ``DMLC_NUM_WORKER``)."""
    return current().runtime.topology.machines


def planned_strategy() -> Any:
    """The Strategy in use (planned at start-up or loaded from a file), or None."""
    return current().strategy


def declare(name: str, staleness: int = 0, **kwargs: Any) -> int:
    """Declare a tensor name before its first ``push_pull`` (BytePS's ``declare``).

    BytePS assigns keys in declaration order; here keys are the names themselves, so the
    order does not matter, and declaring a name again is a no-op. Returns 0, as BytePS does.

    Raises:
        ValueError: an empty name, ``staleness`` other than 0 (pipe-SGD is not implemented),
            or per-tensor compressor arguments (compression is chosen per tensor by
            ``DistributedOptimizer(compression=...)`` and the planner).
    """
    session = current()
    if not isinstance(name, str) or not name:
        raise ValueError(f"declare needs a non-empty tensor name, got {name!r}")
    _check_staleness(staleness)
    if kwargs:
        raise ValueError(f"declare({name!r}) got per-tensor settings {sorted(kwargs)}: "
                         "byteps-espresso chooses each tensor's compression with "
                         "DistributedOptimizer(compression=Compression.espresso(...))")
    with session.lock:
        session.declared.setdefault(name, len(session.declared))
    return 0


# ---- handles ---------------------------------------------------------------------------------
def _auto_name(kind: str, name: str | None) -> str:
    if name is not None:
        return name
    counter = _counters.setdefault(kind, itertools.count())
    return f"{kind}.noname.{next(counter)}"


def _track(handle: Handle, finish: Callable[[Any], Any]) -> int:
    hid = next(_handle_ids)
    _pending[hid] = _Pending(handle, finish)
    return hid


def _on_lane(name: str, fn: Callable[[Executor, int], Any]) -> Handle:
    """Run ``fn(executor, lane)`` on the lane of ``name``, after the work queued there."""
    session = current()
    with session.lock:  # one submission order, as push_pull_async keeps it
        lane = session.plain.lane_of(name)
        return session.plain.call(lane, lambda ex: fn(ex, lane), name)


def poll(handle: int) -> bool:
    """True when the call of ``handle`` has finished (:func:`synchronize` will not block)."""
    return _lookup(handle).handle.done()


def synchronize(handle: int) -> Any:
    """Wait for ``handle``; returns the call's output (the in-place target for ``*_`` calls).

    Raises:
        ValueError: an unknown or already synchronized handle.
        ExecutionError: the call failed or took longer than ``ESPRESSO_TIMEOUT``.
    """
    pending = _lookup(handle)
    try:
        result = pending.handle.wait(current().runtime.cfg.op_timeout_s)
    finally:
        del _pending[handle]
    return pending.finish(result)


def _lookup(handle: int) -> _Pending:
    try:
        return _pending[handle]
    except KeyError:
        raise ValueError(f"unknown handle {handle}; it was already synchronized or never "
                         "returned by an *_async call") from None


def _wait(handle: Handle) -> Any:
    return handle.wait(current().runtime.cfg.op_timeout_s)


def _write(target: torch.Tensor | None, out: torch.Tensor) -> torch.Tensor:
    if target is None:
        return out
    with torch.no_grad():
        target.copy_(out)
    return target


class _Collective(torch.autograd.Function):
    """Makes a synchronous collective differentiable: ``backward`` runs ``grad_fn``."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, run: Callable[[torch.Tensor], torch.Tensor],
                grad_fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        ctx.grad_fn = grad_fn
        return run(tensor)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return ctx.grad_fn(grad), None, None


# ---- push_pull (BytePS) ----------------------------------------------------------------------
def push_pull_async(tensor: torch.Tensor, average: bool = True, name: str | None = None,
                    version: int = 0, priority: int = 0, *, inplace: bool = False) -> int:
    """Start summing ``tensor`` over all workers; returns a handle for :func:`synchronize`.

    Every rank must call it for the same tensors in the same order (as with BytePS).

    Args:
        tensor: this rank's values (float tensor; not modified unless ``inplace``).
        average: divide the sum by :func:`size`.
        name: the tensor's name (default: a counter, equal across ranks in call order).
        version, priority: accepted for BytePS compatibility; no effect.
        inplace: write the result into ``tensor`` at :func:`synchronize`.
    """
    session = current()
    if not torch.is_floating_point(tensor):
        raise TypeError(f"push_pull needs a floating-point tensor, got {tensor.dtype}; "
                        "bps.allreduce sums integer tensors")
    name = _auto_name("push_pull", name)
    with session.lock:
        handle = session.plain.submit(name, tensor.detach().float(), session.fp32)
    world = size()

    def finish(total: torch.Tensor) -> torch.Tensor:
        if average:
            total = total / world
        out = total.to(tensor.dtype).reshape(tensor.shape)
        return _write(tensor if inplace else None, out)

    return _track(handle, finish)


def push_pull(tensor: torch.Tensor, average: bool = True, name: str | None = None,
              version: int = 0, priority: int = 0,
              compression: CompressionSpec = Compression.none) -> torch.Tensor:
    """Sum (or average) ``tensor`` over all workers and return the result (differentiable:
    the gradient is push-pulled the same way).

    Raises:
        ValueError: ``compression`` other than ``Compression.none`` (gradients are compressed
            by ``DistributedOptimizer``).
    """
    if compression is not Compression.none:
        raise ValueError("push_pull sends its tensor uncompressed; compress gradients with "
                         "DistributedOptimizer(compression=...)")
    name = _auto_name("push_pull", name)

    def run(t: torch.Tensor) -> torch.Tensor:
        return synchronize(push_pull_async(t, average, name, version, priority))

    return _Collective.apply(tensor, run, run)


def push_pull_async_inplace(tensor: torch.Tensor, average: bool = True, name: str | None = None,
                            version: int = 0, priority: int = 0, staleness: int = 0) -> int:
    """:func:`push_pull_async` that writes the result into ``tensor`` at :func:`synchronize`."""
    _check_staleness(staleness)
    return push_pull_async(tensor, average, name, version, priority, inplace=True)


def push_pull_inplace(tensor: torch.Tensor, average: bool = True, name: str | None = None,
                      version: int = 0, priority: int = 0, staleness: int = 0) -> torch.Tensor:
    """Sum (or average) ``tensor`` over all workers into ``tensor`` itself; returns it."""
    return synchronize(push_pull_async_inplace(tensor, average, name, version, priority,
                                               staleness))


def _check_staleness(staleness: int) -> None:
    if staleness != 0:
        raise ValueError(f"staleness={staleness}: pipe-SGD (stale gradients) is not "
                         "implemented by byteps-espresso; use staleness=0")


# ---- allreduce (Horovod) ---------------------------------------------------------------------
def _allreduce_submit(tensor: torch.Tensor, average: bool | None, name: str | None,
                      op: ReduceOp | None, prescale: float, postscale: float,
                      target: torch.Tensor | None) -> int:
    op = resolve_op(average, op)
    floating = torch.is_floating_point(tensor) or torch.is_complex(tensor)
    if not floating and (prescale != 1.0 or postscale != 1.0):
        raise TypeError(f"prescale_factor / postscale_factor need a floating-point tensor, "
                        f"got {tensor.dtype}")
    name = _auto_name("allreduce", name)
    buf = tensor.detach() * prescale if prescale != 1.0 else tensor.detach()
    handle = _on_lane(name, lambda ex, _lane: ex.transport.allreduce(Scope.FLAT, buf))
    world = size()

    def finish(total: torch.Tensor) -> torch.Tensor:
        if op is ReduceOp.AVERAGE:
            total = total / world if floating else total.div(world, rounding_mode="floor")
        if postscale != 1.0:
            total = total * postscale
        return _write(target, total.to(tensor.dtype).reshape(tensor.shape))

    return _track(handle, finish)


def allreduce_async(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                    op: ReduceOp | None = None, prescale_factor: float = 1.0,
                    postscale_factor: float = 1.0) -> int:
    """Start reducing ``tensor`` over every rank (``op``: ``Average`` by default, or ``Sum``);
    returns a handle for :func:`synchronize`, which returns a new tensor.

    Raises:
        ValueError: both ``average`` and ``op`` given, or ``op=Adasum``.
    """
    return _allreduce_submit(tensor, average, name, op, prescale_factor, postscale_factor, None)


def allreduce_async_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                     op: ReduceOp | None = None, prescale_factor: float = 1.0,
                     postscale_factor: float = 1.0) -> int:
    """:func:`allreduce_async` that writes the result into ``tensor`` at :func:`synchronize`."""
    return _allreduce_submit(tensor, average, name, op, prescale_factor, postscale_factor,
                             tensor)


def allreduce(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
              compression: CompressionSpec = Compression.none, op: ReduceOp | None = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> torch.Tensor:
    """Reduce ``tensor`` over every rank and return the result (differentiable: the gradient
    is reduced with the same ``op`` and factors, as in Horovod).

    Raises:
        ValueError: both ``average`` and ``op``, ``op=Adasum``, or a ``compression`` other than
            ``Compression.none``.
    """
    if compression is not Compression.none:
        raise ValueError("allreduce sends its tensor uncompressed; compress gradients with "
                         "DistributedOptimizer(compression=...)")
    op = resolve_op(average, op)
    name = _auto_name("allreduce", name)

    def run(t: torch.Tensor) -> torch.Tensor:
        return synchronize(_allreduce_submit(t, None, name, op, prescale_factor,
                                             postscale_factor, None))

    return _Collective.apply(tensor, run, run)


def allreduce_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
               op: ReduceOp | None = None, prescale_factor: float = 1.0,
               postscale_factor: float = 1.0) -> torch.Tensor:
    """Reduce ``tensor`` over every rank in place; returns it."""
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor,
                                        postscale_factor))


# ---- allgather -------------------------------------------------------------------------------
# dtype codes exchanged before an allgather, so that ranks can check they agree.
_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.uint8, torch.int8,
           torch.int16, torch.int32, torch.int64, torch.bool, torch.complex64, torch.complex128)
_MAX_DIMS = 8  # dimensions an allgathered tensor may have (fixed-size shape exchange)


def _shape_record(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.dtype not in _DTYPES or tensor.dim() > _MAX_DIMS:
        raise TypeError(f"allgather takes tensors of up to {_MAX_DIMS} dimensions of dtypes "
                        f"{[str(d) for d in _DTYPES]}; got {tensor.dtype}, {tensor.dim()} dims")
    record = torch.full((2 + _MAX_DIMS,), -1, dtype=torch.int64)
    record[0], record[1] = _DTYPES.index(tensor.dtype), tensor.dim()
    record[2:2 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.int64)
    return record


def _gather(ex: Executor, tensor: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    """Every rank's ``tensor`` concatenated along dimension 0, and each rank's row count."""
    world = ex.topo.world_size
    mine = _shape_record(tensor)
    records = ex.transport.allgather(Scope.FLAT, mine, [mine.numel()] * world).reshape(world, -1)
    shapes = [tuple(int(d) for d in r[2:2 + int(r[1])]) for r in records]
    if len({int(r[0]) for r in records}) > 1 or len({s[1:] for s in shapes}) > 1:
        seen = [(str(_DTYPES[int(r[0])]), s) for r, s in zip(records, shapes, strict=True)]
        raise ValueError("allgather needs one dtype and equal shapes after the first dimension "
                         f"on every rank; got {seen}")
    rows, rest = [s[0] for s in shapes], shapes[0][1:]
    width = math.prod(rest)
    flat = ex.transport.allgather(Scope.FLAT, tensor.reshape(-1), [r * width for r in rows])
    return flat.reshape(sum(rows), *rest), rows


def allgather_async(tensor: torch.Tensor, name: str | None = None) -> int:
    """Start concatenating every rank's ``tensor`` along dimension 0 (whose length may differ
    between ranks); returns a handle for :func:`synchronize`.

    Raises (at :func:`synchronize`, on every rank):
        ValueError: ranks disagree on the dtype or on the dimensions after the first.
    """
    buf = tensor.detach()
    if buf.dim() == 0:
        buf = buf.reshape(1)
    handle = _on_lane(_auto_name("allgather", name), lambda ex, _lane: _gather(ex, buf))
    return _track(handle, lambda result: result[0])


def allgather(tensor: torch.Tensor, name: str | None = None) -> torch.Tensor:
    """Every rank's ``tensor`` concatenated along dimension 0 in rank order (differentiable:
    each rank's gradient is its own rows of the averaged output gradient, as in Horovod)."""
    name = _auto_name("allgather", name)
    rows = tensor.shape[0] if tensor.dim() else 1

    def grad_fn(grad: torch.Tensor) -> torch.Tensor:
        total = allreduce(grad, name=f"{name}.grad", op=Average)
        counts = allgather(torch.tensor([rows]), name=f"{name}.grad.rows")
        offset = int(counts[:rank()].sum())
        return total.narrow(0, offset, rows).reshape(tensor.shape)

    return _Collective.apply(tensor, lambda t: synchronize(allgather_async(t, name)), grad_fn)


# ---- broadcast -------------------------------------------------------------------------------
def _broadcast_submit(tensor: torch.Tensor, root_rank: int, name: str | None,
                      target: torch.Tensor | None) -> int:
    _check_root(root_rank)
    runtime = current().runtime
    buf = tensor.detach().clone()

    def run(_ex: Executor, lane: int) -> torch.Tensor:
        runtime.broadcast(buf, root_rank, lane)
        return buf

    handle = _on_lane(_auto_name("broadcast", name), run)
    return _track(handle, lambda out: _write(target, out))


def broadcast_async(tensor: torch.Tensor, root_rank: int, name: str | None = None) -> int:
    """Start copying ``root_rank``'s ``tensor`` to every rank; :func:`synchronize` returns a
    new tensor."""
    return _broadcast_submit(tensor, root_rank, name, None)


def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: str | None = None) -> int:
    """:func:`broadcast_async` that overwrites ``tensor`` at :func:`synchronize`."""
    return _broadcast_submit(tensor, root_rank, name, tensor)


def broadcast(tensor: torch.Tensor, root_rank: int, name: str | None = None) -> torch.Tensor:
    """``root_rank``'s ``tensor`` on every rank, as a new tensor (differentiable: the root gets
    the average of every rank's gradient, the others zero, as in Horovod)."""
    name = _auto_name("broadcast", name)

    def grad_fn(grad: torch.Tensor) -> torch.Tensor:
        total = allreduce(grad, name=f"{name}.grad", op=Average)
        return total if rank() == root_rank else torch.zeros_like(total)

    return _Collective.apply(tensor, lambda t: synchronize(broadcast_async(t, root_rank, name)),
                             grad_fn)


def broadcast_(tensor: torch.Tensor, root_rank: int, name: str | None = None) -> torch.Tensor:
    """Overwrite ``tensor`` with ``root_rank``'s values in place; returns it."""
    return synchronize(broadcast_async_(tensor, root_rank, name))


def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None) -> Any:
    """``root_rank``'s ``obj`` on every rank (Horovod's ``broadcast_object``).

    The object travels as JSON, never pickle: ``None``, ``bool``, ``int``, ``float``, ``str``,
    ``bytes``, ``list``, ``tuple``, ``dict`` with scalar keys, ``torch.Tensor`` (returned on
    the CPU) and numeric ``numpy.ndarray``, nested freely.

    Raises:
        TypeError: on the root, ``obj`` holds another type; the other ranks then raise
            ValueError naming it, so that no rank waits for a broadcast that never comes.
    """
    _check_root(root_rank)
    runtime = current().runtime
    data: bytes | None = None
    if rank() == root_rank:
        try:
            data = encode_object({"value": obj})
        except TypeError as exc:
            data = encode_object({"error": str(exc)})
    handle = _on_lane(_auto_name("broadcast_object", name),
                      lambda _ex, lane: runtime.broadcast_bytes(data, root_rank, lane))
    message = decode_object(_wait(handle))
    if "error" in message:
        if rank() == root_rank:
            raise TypeError(message["error"])
        raise ValueError(f"rank {root_rank} could not broadcast its object: {message['error']}")
    return message["value"]


def allgather_object(obj: Any, name: str | None = None) -> list[Any]:
    """Every rank's ``obj``, in rank order (Horovod's ``allgather_object``); the same JSON
    encoding and supported types as :func:`broadcast_object`.

    Raises:
        TypeError: ``obj`` holds an unsupported type (raised before anything is sent, so every
            rank must pass supported objects).
    """
    data = encode_object(obj)
    mine = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    handle = _on_lane(_auto_name("allgather_object", name), lambda ex, _lane: _gather(ex, mine))
    every, sizes = _wait(handle)
    pieces = torch.split(every, sizes)
    return [decode_object(piece.numpy().tobytes()) for piece in pieces]


def broadcast_object_bytes(data: bytes | None, root_rank: int = 0) -> bytes:
    """Broadcast raw bytes (e.g. a JSON document) from ``root_rank``; no pickle involved."""
    _check_root(root_rank)
    runtime = current().runtime
    return _wait(_on_lane(_auto_name("broadcast_bytes", None),
                          lambda _ex, lane: runtime.broadcast_bytes(data, root_rank, lane)))


def broadcast_parameters(params: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
                         root_rank: int) -> None:
    """Overwrite every rank's tensors with ``root_rank``'s, in place.

    Args:
        params: ``model.state_dict()`` or ``model.named_parameters()``.
        root_rank: the rank whose values win.
    """
    items = sorted(params.items() if isinstance(params, Mapping) else params,
                   key=lambda kv: kv[0])
    _check_root(root_rank)
    tensors = [v.data if v.requires_grad else v for _, v in items if isinstance(v, torch.Tensor)]
    _broadcast_all(tensors, root_rank, "broadcast_parameters")


def _broadcast_all(tensors: list[torch.Tensor], root_rank: int, name: str) -> None:
    runtime = current().runtime

    def run(_ex: Executor, lane: int) -> None:
        with torch.no_grad():
            for t in tensors:
                runtime.broadcast(t, root_rank, lane)

    _wait(_on_lane(name, run))


# ---- optimizer -------------------------------------------------------------------------------
def job_compression(cfg: Config, compression: CompressionSpec) -> CompressionSpec:
    """The compression a ``DistributedOptimizer`` uses, after the job-wide variables.

    ``ESPRESSO_STRATEGY`` replaces whatever the script passed (no profiling or planning);
    ``ESPRESSO_COMPRESSOR`` turns ``Compression.none`` into ``Compression.espresso(name)``
    (``Compression.powersgd()`` for ``powersgd``);
    ``ESPRESSO_SEED`` seeds a ``Compression.espresso`` compressor whose parameters name no
    seed.
    """
    from byteps_espresso.kernels import registry
    from byteps_espresso.worker.profiler import EspressoSpec, StrategyFileSpec

    if cfg.strategy_path:
        if not (isinstance(compression, StrategyFileSpec)
                and compression.path == cfg.strategy_path):
            log.info("ESPRESSO_STRATEGY=%s: using that strategy instead of the compression "
                     "the script passed", cfg.strategy_path)
        return StrategyFileSpec(cfg.strategy_path,
                                getattr(compression, "error_feedback", None))
    if cfg.compressor and compression is Compression.none:
        log.info("ESPRESSO_COMPRESSOR=%s: planning with it instead of Compression.none",
                 cfg.compressor)
        compression = (Compression.powersgd() if cfg.compressor == "powersgd"
                       else Compression.espresso(cfg.compressor))
    if (isinstance(compression, EspressoSpec) and "seed" not in compression.params
            and "seed" in registry.defaults(compression.compressor)):
        compression = dataclasses.replace(compression,
                                          params={**compression.params, "seed": cfg.seed})
    return compression


def DistributedOptimizer(optimizer: torch.optim.Optimizer,
                         named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None,
                         compression: CompressionSpec = Compression.none,
                         backward_passes_per_step: int = 1, op: ReduceOp = Average,
                         gradient_predivide_factor: float = 1.0) -> torch.optim.Optimizer:
    """Wrap ``optimizer`` so that ``step()`` applies the gradients combined over all workers.

    Args:
        optimizer: any ``torch.optim.Optimizer``; its class and hyper-parameters are kept.
        named_parameters: ``model.named_parameters()``; names select per-tensor strategies.
        compression: ``Compression.none``, ``.fp16``, ``.espresso(...)`` or ``.strategy(path)``
            (``ESPRESSO_STRATEGY`` / ``ESPRESSO_COMPRESSOR`` override it: see
            :func:`job_compression`).
        backward_passes_per_step: local backward passes accumulated before communicating.
        op: ``Average`` (default) or ``Sum`` of the workers' gradients.
        gradient_predivide_factor: with ``Average``, divide each gradient by this before the
            sum and multiply back after (Horovod's; keeps fp16 sums in range).

    Raises:
        NotInitializedError: ``init()`` was not called.
        ValueError: a bad ``op``/``gradient_predivide_factor`` pair, duplicated or missing
            parameter names, or a bad ``backward_passes_per_step``.
    """
    spec = job_compression(current().runtime.cfg, compression)
    return _optimizer.DistributedOptimizer(
        optimizer, named_parameters, spec, backward_passes_per_step, op=op,
        gradient_predivide_factor=gradient_predivide_factor)


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int) -> None:
    """Make every rank's optimizer state and hyper-parameters ``root_rank``'s.

    Works whatever state the other ranks hold, as in the resume pattern (rank 0 loads a
    checkpoint, the others start fresh): ``root_rank`` describes its state (per parameter:
    each entry's dtype and shape, or its value; every group's hyper-parameters), the other
    ranks create or drop entries to match, then every state tensor is broadcast. Horovod
    creates missing state with a zero-gradient ``step()`` instead; that moves parameters
    under weight decay and still leaves entries the root lacks, which this avoids.

    Raises:
        ValueError: on every rank, when the optimizers differ in parameter count or shapes.
        TypeError: on every rank, when ``root_rank``'s state holds an unsupported value.
    """
    _check_root(root_rank)
    me = rank() == root_rank
    description: Any = None
    if me:
        try:
            description = describe(optimizer)
            encode_object(description)
        except TypeError as exc:
            description = {"error": f"optimizer state: {exc}"}
    description = broadcast_object(description, root_rank, name="optimizer_state")
    if "error" in description:
        raise TypeError(f"rank {root_rank}'s {description['error']}")
    problem = None if me else apply_description(optimizer, description)
    _agree(problem, f"rank(s) could not take rank {root_rank}'s optimizer state")
    _broadcast_all(state_tensors(optimizer, description), root_rank, "optimizer_state.tensors")


def _agree(problem: str | None, what: str) -> None:
    """Raise on every rank when any rank has a ``problem`` (a count summed over ranks)."""
    flag = torch.tensor([0 if problem is None else 1], dtype=torch.int64)
    failed = int(_wait(_on_lane("agree", lambda ex, _lane: ex.transport.allreduce(
        Scope.FLAT, flag))).item())
    if failed:
        raise ValueError(problem or f"{failed} {what}; see their errors")


def _check_root(root_rank: int) -> None:
    if not 0 <= root_rank < size():
        raise ValueError(f"root_rank={root_rank} is not a rank of this job (0..{size() - 1})")
