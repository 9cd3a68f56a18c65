"""Machines x workers per machine, and the scope groups every Option step runs in.

BytePS counts machines (``DMLC_NUM_WORKER``) and training processes per machine
(``BYTEPS_LOCAL_SIZE``); a process's global rank is ``machine id x local size + local rank``.
The three scopes of :mod:`byteps_espresso.strategy.options` map to groups of global ranks:

- ``flat``: every rank, in rank order;
- ``intra``: the ranks of one machine, in local-rank order (one group per machine);
- ``inter``: the ranks with one local rank, one per machine, in machine order (one group per
  local rank).

Example:
    >>> topo = Topology(machines=2, local_size=2, machine_id=1, local_rank=0)
    >>> topo.rank, topo.group(Scope.INTER), topo.index(Scope.INTER)
    (2, (0, 2), 1)
"""

from __future__ import annotations

from dataclasses import dataclass

from byteps_espresso.config import Config
from byteps_espresso.strategy.options import Scope

__all__ = ["Topology", "TopologyError"]


class TopologyError(ValueError):
    """The machine / local-rank layout is inconsistent; the message says what to change."""


@dataclass(frozen=True)
class Topology:
    """The job's layout as seen from one rank.

    Attributes:
        machines: number of worker machines (``DMLC_NUM_WORKER``).
        local_size: training processes per machine (``BYTEPS_LOCAL_SIZE``).
        machine_id: this process's machine (``DMLC_WORKER_ID``).
        local_rank: this process's index on its machine (``BYTEPS_LOCAL_RANK``).
    """

    machines: int
    local_size: int
    machine_id: int = 0
    local_rank: int = 0

    def __post_init__(self) -> None:
        if self.machines < 1 or self.local_size < 1:
            raise TopologyError(
                f"need at least one machine and one worker per machine, got machines="
                f"{self.machines}, local_size={self.local_size}; set DMLC_NUM_WORKER and "
                "BYTEPS_LOCAL_SIZE to positive integers")
        if not 0 <= self.machine_id < self.machines:
            raise TopologyError(f"machine_id={self.machine_id} is not in [0, {self.machines}); "
                                "set DMLC_WORKER_ID to this machine's index")
        if not 0 <= self.local_rank < self.local_size:
            raise TopologyError(f"local_rank={self.local_rank} is not in [0, {self.local_size}); "
                                "set BYTEPS_LOCAL_RANK to this process's index")

    @classmethod
    def from_config(cls, cfg: Config) -> Topology:
        """The topology the environment describes (``Config`` already validated ranges)."""
        return cls(cfg.num_machines, cfg.local_size, cfg.machine_id, cfg.local_rank)

    @property
    def world_size(self) -> int:
        return self.machines * self.local_size

    @property
    def rank(self) -> int:
        """Global rank: machine id x local size + local rank (as BytePS derives it)."""
        return self.machine_id * self.local_size + self.local_rank

    def with_rank(self, rank: int) -> Topology:
        """The same layout seen from global rank ``rank``."""
        if not 0 <= rank < self.world_size:
            raise TopologyError(f"rank {rank} is not in [0, {self.world_size})")
        return Topology(self.machines, self.local_size, rank // self.local_size,
                        rank % self.local_size)

    # ---- groups ------------------------------------------------------------------------------
    def intra_group(self, machine: int) -> tuple[int, ...]:
        """Global ranks of ``machine``, in local-rank order."""
        base = machine * self.local_size
        return tuple(range(base, base + self.local_size))

    def inter_group(self, local_rank: int) -> tuple[int, ...]:
        """Global ranks with local rank ``local_rank``, in machine order."""
        return tuple(m * self.local_size + local_rank for m in range(self.machines))

    def all_groups(self, scope: Scope) -> list[tuple[int, ...]]:
        """Every group of ``scope``, in the order all ranks create them."""
        if scope is Scope.FLAT:
            return [tuple(range(self.world_size))]
        if scope is Scope.INTRA:
            return [self.intra_group(m) for m in range(self.machines)]
        return [self.inter_group(lr) for lr in range(self.local_size)]

    def group(self, scope: Scope) -> tuple[int, ...]:
        """This rank's group of ``scope`` (global ranks, in group-rank order)."""
        if scope is Scope.FLAT:
            return tuple(range(self.world_size))
        if scope is Scope.INTRA:
            return self.intra_group(self.machine_id)
        return self.inter_group(self.local_rank)

    def index(self, scope: Scope) -> int:
        """This rank's index (group rank) in its group of ``scope``."""
        return self.group(scope).index(self.rank)

    def size(self, scope: Scope) -> int:
        """Members of this rank's group of ``scope``."""
        return len(self.group(scope))
