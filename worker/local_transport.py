"""An in-memory :class:`~byteps_espresso.worker.transport.Transport`: ranks as threads.

One :class:`LocalHub` stands for the network of a whole job; each rank's
:class:`LocalTransport` exchanges values with the other members of its scope group through
it. Every collective is one *exchange* (each member deposits a value, all of them read the
list in group-rank order), so ranks running in threads of one process behave like ranks in
separate processes, including the requirement that all members call collectives in the same
order. It lets unit tests run the real executor over the whole decision tree in one process;
multi-process tests use :class:`~byteps_espresso.worker.transport.DistTransport`.

Dense sums are taken in group-rank order.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import torch
from byteps_espresso.worker.topology import Topology
from byteps_espresso.worker.transport import PayloadSpec

from byteps_espresso.strategy.options import Scope

__all__ = ["LocalHub", "LocalTransport"]


class LocalHub:
    """The shared meeting point of every rank's :class:`LocalTransport`.

    Args:
        machines, local_size: the emulated layout.
        timeout_s: how long a member waits for the others before raising.
    """

    def __init__(self, machines: int, local_size: int, timeout_s: float = 30.0) -> None:
        self.topology = Topology(machines, local_size)
        self.timeout_s = timeout_s
        self._cond = threading.Condition()
        # Keyed by ((lane, *members), sequence number of the collective in that group).
        self._slots: dict[tuple[tuple[int, ...], int], dict[int, Any]] = {}
        self._reads: dict[tuple[tuple[int, ...], int], int] = {}
        self._seq: dict[tuple[tuple[int, ...], int], int] = {}

    def transport(self, rank: int, lane: int = 0) -> LocalTransport:
        """Rank ``rank``'s transport on ``lane`` (lanes are independent sets of groups)."""
        return LocalTransport(self, self.topology.with_rank(rank), lane)

    def exchange(self, members: tuple[int, ...], rank: int, value: Any,
                 lane: int = 0) -> list[Any]:
        """Deposit ``value``; return every member's value in group order.

        Raises:
            TimeoutError: a member did not arrive within ``timeout_s`` (it runs a different
                sequence of collectives, or failed).
        """
        group = (lane, *members)
        with self._cond:
            seq = self._seq.get((group, rank), 0)
            self._seq[group, rank] = seq + 1
            key = (group, seq)
            self._slots.setdefault(key, {})[rank] = value
            self._cond.notify_all()
            if not self._cond.wait_for(lambda: len(self._slots[key]) == len(members),
                                       self.timeout_s):
                raise TimeoutError(f"rank {rank}: group {members} collective #{seq} timed out; "
                                   f"arrived: {sorted(self._slots[key])}")
            values = [self._slots[key][m] for m in members]
            self._reads[key] = self._reads.get(key, 0) + 1
            if self._reads[key] == len(members):
                del self._slots[key], self._reads[key]
            return values


def _sum(values: Sequence[torch.Tensor]) -> torch.Tensor:
    total = values[0].clone()
    for v in values[1:]:
        total += v
    return total


class LocalTransport:
    """One rank's view of a :class:`LocalHub`; implements the Transport interface."""

    def __init__(self, hub: LocalHub, topology: Topology, lane: int = 0) -> None:
        self.hub = hub
        self.topology = topology
        self.lane = lane

    def _all(self, scope: Scope, value: Any) -> tuple[list[Any], int]:
        members = self.topology.group(scope)
        values = self.hub.exchange(members, self.topology.rank, value, self.lane)
        return values, members.index(self.topology.rank)

    def allreduce(self, scope: Scope, x: torch.Tensor, *, owned: bool = False) -> torch.Tensor:
        values, _ = self._all(scope, x.detach().clone())
        return _sum(values)

    def reduce_scatter(self, scope: Scope, x: torch.Tensor, sizes: Sequence[int]) -> torch.Tensor:
        values, me = self._all(scope, x.detach().clone())
        return _sum([torch.split(v, list(sizes))[me] for v in values])

    def allgather(self, scope: Scope, shard: torch.Tensor, sizes: Sequence[int]) -> torch.Tensor:
        values, _ = self._all(scope, shard.detach().clone())
        return torch.cat(values)

    def reduce(self, scope: Scope, x: torch.Tensor) -> torch.Tensor | None:
        values, me = self._all(scope, x.detach().clone())
        return _sum(values) if me == 0 else None

    def broadcast(self, scope: Scope, x: torch.Tensor | None, numel: int) -> torch.Tensor:
        values, _ = self._all(scope, None if x is None else x.detach().clone())
        return values[0].clone()

    def allgather_payloads(self, scope: Scope, payload: tuple,
                           specs: Sequence[PayloadSpec]) -> list[tuple]:
        values, _ = self._all(scope, tuple(payload))
        return list(values)

    def alltoall_payloads(self, scope: Scope, payloads: Sequence[tuple],
                          send_specs: Sequence[PayloadSpec],
                          recv_specs: Sequence[PayloadSpec]) -> list[tuple]:
        values, me = self._all(scope, list(payloads))
        return [v[me] for v in values]

    def gather_payloads(self, scope: Scope, payload: tuple,
                        specs: Sequence[PayloadSpec]) -> list[tuple] | None:
        values, me = self._all(scope, tuple(payload))
        return list(values) if me == 0 else None

    def broadcast_payload(self, scope: Scope, payload: tuple | None,
                          spec: PayloadSpec) -> tuple:
        values, _ = self._all(scope, payload)
        return tuple(values[0])
