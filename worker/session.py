"""The process-wide runtime behind ``byteps_espresso.torch`` (created by ``init()``).

Everything the drop-in API needs hangs off one :class:`~byteps_espresso.worker.runtime.Runtime`
and one uncompressed engine; :func:`current` raises a helpful error before ``init()``.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import torch
from byteps_espresso.worker.executor import Engine
from byteps_espresso.worker.runtime import Runtime
from byteps_espresso.worker.topology import Topology

from byteps_espresso.strategy import baselines
from byteps_espresso.strategy.options import Option, Scope

__all__ = ["NotInitializedError", "Session", "current", "every_rank", "fp32_option", "install",
           "installed", "slowest_across_ranks", "span_across_ranks", "uninstall"]


class NotInitializedError(RuntimeError):
    """An API call needs ``init()`` first."""


def fp32_option(topology: Topology, servers: int, shared_host: bool = False) -> Option:
    """This job's uncompressed path (:func:`byteps_espresso.strategy.baselines.fp32_option`,
    the planner's fp32 baseline)."""
    return baselines.fp32_option(topology.machines, topology.local_size, servers, shared_host)


class Session:
    """The runtime plus the uncompressed engine used by ``push_pull`` and profiling."""

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        self.plain: Engine = runtime.engine(None)
        self.fp32 = fp32_option(runtime.topology, runtime.cfg.num_servers, runtime.shared_host)
        # The uncompressed path on the collectives alone (what it is without servers).
        self.allreduce = fp32_option(runtime.topology, 0, runtime.shared_host)
        self.lock = threading.Lock()
        # The Strategy planned at start-up or loaded (set by the optimizer's compression).
        self.strategy: Any = None
        # Tensor names declared with ``declare()``, in declaration order.
        self.declared: dict[str, int] = {}


_session: Session | None = None


def install(session: Session) -> None:
    global _session  # noqa: PLW0603  (one runtime per process, like byteps.torch)
    if _session is not None:
        raise RuntimeError("byteps_espresso.torch.init() was already called; call shutdown() "
                           "before initialising again")
    _session = session


def uninstall() -> Session | None:
    global _session
    session, _session = _session, None
    return session


def installed() -> bool:
    """True while a session is installed (between ``init()`` and ``shutdown()``)."""
    return _session is not None


def current() -> Session:
    """The session of this process.

    Raises:
        NotInitializedError: ``init()`` has not been called (or ``shutdown()`` was).
    """
    if _session is None:
        raise NotInitializedError("byteps_espresso.torch is not initialised: call "
                                  "bps.init() before any other bps function")
    return _session


def every_rank(session: Session, values: np.ndarray) -> np.ndarray:
    """Every rank's ``values`` stacked (ranks x shape; all ranks call it while the engine's
    lanes are idle)."""
    transport = session.runtime.transports[0]
    world = session.runtime.topology.world_size
    mine = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float64).reshape(-1))
    every = transport.allgather(Scope.FLAT, mine, [mine.numel()] * world)
    return every.reshape(world, *np.shape(values)).numpy()


def slowest_across_ranks(session: Session, values: np.ndarray) -> np.ndarray:
    """The element-wise maximum of every rank's ``values`` (same shape on every rank; all
    ranks call it while the engine's lanes are idle). NaN anywhere stays NaN."""
    return every_rank(session, values).max(axis=0)


def span_across_ranks(session: Session, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The element-wise minimum and maximum over the ranks that hold a value, NaN where none
    does (a rank's NaN: it has none, e.g. a step it sleeps through). Called as
    :func:`slowest_across_ranks`."""
    every = every_rank(session, values)
    return np.fmin.reduce(every, axis=0), np.fmax.reduce(every, axis=0)
