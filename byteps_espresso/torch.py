"""Drop-in for ``byteps.torch``: change ``import byteps.torch as bps`` to this module.

Example:
    >>> import byteps_espresso.torch as bps                      # doctest: +SKIP
    >>> bps.init()
    >>> model.to(device); bps.broadcast_parameters(model.state_dict(), root_rank=0)
    >>> opt = bps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
    ...                                named_parameters=model.named_parameters(),
    ...                                compression=bps.Compression.espresso("randomk", ratio=0.01))
    >>> bps.broadcast_optimizer_state(opt, root_rank=0)

The environment is BytePS's (``DMLC_NUM_WORKER`` machines, ``BYTEPS_LOCAL_SIZE`` workers
each, ``DMLC_WORKER_ID``, ``BYTEPS_LOCAL_RANK``, ``DMLC_PS_ROOT_URI``/``_PORT``, ...), plus the
``ESPRESSO_*`` knobs; see the README's configuration table.
"""

from __future__ import annotations

import itertools
import logging
import numbers
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from byteps_espresso.config import Config
from byteps_espresso.worker.executor import Handle
from byteps_espresso.worker.optimizer import Compression, CompressionSpec, DistributedOptimizer
from byteps_espresso.worker.runtime import Runtime
from byteps_espresso.worker.session import NotInitializedError, Session, current, install, uninstall

__all__ = [
    "Compression",
    "CompressionSpec",
    "DistributedOptimizer",
    "NotInitializedError",
    "broadcast_object_bytes",
    "broadcast_optimizer_state",
    "broadcast_parameters",
    "init",
    "local_rank",
    "local_size",
    "planned_strategy",
    "poll",
    "push_pull",
    "push_pull_async",
    "rank",
    "shutdown",
    "size",
    "synchronize",
]

log = logging.getLogger("byteps_espresso")

_handles: dict[int, tuple[Handle, torch.Tensor, bool, torch.Tensor | None]] = {}
_handle_ids = itertools.count()
_noname = itertools.count()


def init(config: Config | None = None) -> None:
    """Join the job: topology, process groups, PS client (reads the environment once).

    Args:
        config: a parsed Config (default: ``Config.from_env()``).

    Raises:
        ConfigError: a BytePS / ESPRESSO variable is missing or malformed.
        RuntimeError: already initialised, or the scheduler / other workers are unreachable.
    """
    cfg = config or Config.from_env()
    logging.getLogger("byteps_espresso").setLevel(cfg.log_level)
    install(Session(Runtime(cfg)))


def shutdown() -> None:
    """Leave the job: stop communication threads, close the PS client and process groups."""
    session = uninstall()
    _handles.clear()
    if session is not None:
        session.runtime.close()


def rank() -> int:
    """Global rank: machine id x local size + local rank."""
    return current().runtime.topology.rank


def size() -> int:
    """Number of training processes (machines x workers per machine)."""
    return current().runtime.topology.world_size


def local_rank() -> int:
    """This process's index on its machine."""
    return current().runtime.topology.local_rank


def local_size() -> int:
    """Training processes per machine."""
    return current().runtime.topology.local_size


def planned_strategy() -> Any:
    """The Strategy in use (planned at start-up or loaded from a file), or None."""
    return current().strategy


# ---- push_pull -------------------------------------------------------------------------------
def push_pull_async(tensor: torch.Tensor, average: bool = True, name: str | None = None,
                    *, inplace: bool = False) -> int:
    """Start summing ``tensor`` over all workers; returns a handle for :func:`synchronize`.

    Every rank must call it for the same tensors in the same order (as with BytePS).

    Args:
        tensor: this rank's values (float tensor; not modified unless ``inplace``).
        average: divide the sum by :func:`size`.
        name: the tensor's name (default: a counter, equal across ranks in call order).
        inplace: write the result into ``tensor`` at :func:`synchronize`.
    """
    session = current()
    if not torch.is_floating_point(tensor):
        raise TypeError(f"push_pull needs a floating-point tensor, got {tensor.dtype}")
    name = name if name is not None else f"push_pull.noname.{next(_noname)}"
    with session.lock:
        handle = session.plain.submit(name, tensor.float(), session.fp32)
        hid = next(_handle_ids)
        _handles[hid] = (handle, tensor, average, tensor if inplace else None)
    return hid


def poll(handle: int) -> bool:
    """True when the push_pull of ``handle`` has finished (synchronize will not block)."""
    return _lookup(handle)[0].done()


def synchronize(handle: int) -> torch.Tensor:
    """Wait for ``handle``; returns the sum (or average) with the input's shape and dtype."""
    op, tensor, average, target = _lookup(handle)
    total = op.wait(current().runtime.cfg.op_timeout_s)
    del _handles[handle]
    if average:
        total = total / size()
    out = total.to(tensor.dtype).reshape(tensor.shape)
    if target is not None:
        target.copy_(out)
        return target
    return out


def push_pull(tensor: torch.Tensor, average: bool = True, name: str | None = None) -> torch.Tensor:
    """Sum (or average) ``tensor`` over all workers and return the result."""
    return synchronize(push_pull_async(tensor, average, name))


def _lookup(handle: int) -> tuple[Handle, torch.Tensor, bool, torch.Tensor | None]:
    try:
        return _handles[handle]
    except KeyError:
        raise ValueError(f"unknown push_pull handle {handle}; it was already synchronized "
                         "or never returned by push_pull_async") from None


# ---- broadcasts ------------------------------------------------------------------------------
def broadcast_parameters(params: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
                         root_rank: int) -> None:
    """Overwrite every rank's tensors with ``root_rank``'s, in place.

    Args:
        params: ``model.state_dict()`` or ``model.named_parameters()``.
        root_rank: the rank whose values win.
    """
    items = sorted(params.items() if isinstance(params, Mapping) else params,
                   key=lambda kv: kv[0])
    runtime = current().runtime
    _check_root(root_rank)
    for _, value in items:
        if isinstance(value, torch.Tensor):
            with torch.no_grad():
                runtime.broadcast(value.data if value.requires_grad else value, root_rank)


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int) -> None:
    """Overwrite every rank's optimizer state and hyper-parameters with ``root_rank``'s.

    State tensors (momentum buffers, Adam moments, step counters) must exist with the same
    shapes on every rank: call it right after creating the optimizer (empty state) or after
    the same number of steps everywhere.
    """
    runtime = current().runtime
    _check_root(root_rank)
    for group in optimizer.param_groups:
        for key in sorted(k for k in group if k != "params"):
            value = group[key]
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                continue
            buf = torch.tensor([float(value)], dtype=torch.float64)
            runtime.broadcast(buf, root_rank)
            group[key] = type(value)(buf.item())
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for i, p in enumerate(params):
        state = optimizer.state.get(p, {})
        for key in sorted(state):
            value = state[key]
            if isinstance(value, torch.Tensor):
                runtime.broadcast(value, root_rank)
            elif isinstance(value, numbers.Real) and not isinstance(value, bool):
                buf = torch.tensor([float(value)], dtype=torch.float64)
                runtime.broadcast(buf, root_rank)
                state[key] = type(value)(buf.item())
            else:
                log.debug("not broadcasting optimizer state %r of parameter %d", key, i)


def broadcast_object_bytes(data: bytes | None, root_rank: int = 0) -> bytes:
    """Broadcast raw bytes (e.g. a JSON document) from ``root_rank``; no pickle involved."""
    return current().runtime.broadcast_bytes(data, root_rank)


def _check_root(root_rank: int) -> None:
    if not 0 <= root_rank < size():
        raise ValueError(f"root_rank={root_rank} is not a rank of this job (0..{size() - 1})")
