"""An in-memory :class:`~byteps_espresso.worker.transport.Transport`: ranks as threads.

One :class:`LocalHub` stands for the network of a whole job; each rank's
:class:`LocalTransport` exchanges values with the other members of its scope group through
it. Every collective is one *exchange* (each member deposits a value, all of them read the
list in group-rank order), so ranks running in threads of one process behave like ranks in
separate processes, including the requirement that all members call collectives in the same
order. It lets unit tests run the real executor over the whole decision tree in one process;
multi-process tests use :class:`~byteps_espresso.worker.transport.DistTransport`.

Dense sums are taken in group-rank order.

With ``LocalHub(..., count_traffic=True)`` every collective also records what
:class:`~byteps_espresso.worker.transport.DistTransport` sends for it over gloo, message by
message (ring, pairwise exchange, gather to the root, binomial tree; shards and payloads
padded and packed as that transport does): the messages and bytes at the group's busiest
member (:class:`Traffic`). Tests compare these with the cost model's terms.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from byteps_espresso.worker.topology import Topology
from byteps_espresso.worker.transport import Done, PayloadSpec, pack, packed_nbytes

from byteps_espresso.strategy.options import Scope
from byteps_espresso.strategy.program import reduce_splits

__all__ = ["LocalHub", "LocalTransport", "Traffic"]

FLOAT32_BYTES = 4


@dataclass(frozen=True)
class Traffic:
    """One collective's messages and bytes (sent or received) at its busiest member."""

    collective: str
    scope: Scope
    members: int
    msgs: int
    nbytes: float


class _Tally:
    """Per-member messages and bytes sent and received, for one collective's schedule."""

    def __init__(self, p: int) -> None:
        self.p = p
        self.sent = [[0, 0.0] for _ in range(p)]
        self.recv = [[0, 0.0] for _ in range(p)]

    def send(self, src: int, dst: int, nbytes: float) -> None:
        self.sent[src][0] += 1
        self.sent[src][1] += nbytes
        self.recv[dst][0] += 1
        self.recv[dst][1] += nbytes

    def ring(self, rounds: int, nbytes: float) -> _Tally:
        """``rounds`` steps of a ring: every member sends ``nbytes`` to the next."""
        for _ in range(rounds):
            for m in range(self.p):
                self.send(m, (m + 1) % self.p, nbytes)
        return self

    def pairwise(self, nbytes: float) -> _Tally:
        """Every member sends ``nbytes`` to every other (an all-to-all)."""
        for m in range(self.p):
            for d in range(self.p):
                if d != m:
                    self.send(m, d, nbytes)
        return self

    def gather(self, nbytes: float) -> _Tally:
        """Every member sends ``nbytes`` to the root (gloo's gather)."""
        for m in range(1, self.p):
            self.send(m, 0, nbytes)
        return self

    def tree(self, nbytes: float) -> _Tally:
        """A binomial tree from the root (gloo's broadcast): in round r, members below 2^r
        send to the member 2^r above them."""
        span = 1
        while span < self.p:
            for m in range(span):
                if m + span < self.p:
                    self.send(m, m + span, nbytes)
            span *= 2
        return self

    def busiest(self) -> tuple[int, float]:
        return (max(max(s[0], r[0]) for s, r in zip(self.sent, self.recv, strict=True)),
                max(max(s[1], r[1]) for s, r in zip(self.sent, self.recv, strict=True)))


class LocalHub:
    """The shared meeting point of every rank's :class:`LocalTransport`.

    Args:
        machines, local_size: the emulated layout.
        timeout_s: how long a member waits for the others before raising.
    """

    def __init__(self, machines: int, local_size: int, timeout_s: float = 30.0, *,
                 count_traffic: bool = False) -> None:
        self.topology = Topology(machines, local_size)
        self.timeout_s = timeout_s
        # What each collective sends, recorded by the group's rank 0 (one entry per call).
        self.traffic: list[Traffic] | None = [] if count_traffic else None
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


def _completed(out: Any, done: Done | None) -> Callable[[], Any]:
    """A ``*_start`` call's result for a collective that has completed already."""
    if done is not None:
        done()
    return lambda: out


class LocalTransport:
    """One rank's view of a :class:`LocalHub`; implements the Transport interface."""

    # Every collective is a blocking exchange, ``*_start`` ones too: an Option never runs on
    # the submitting thread (it would wait there for ranks the same thread submits later).
    issues_async = False

    def __init__(self, hub: LocalHub, topology: Topology, lane: int = 0) -> None:
        self.hub = hub
        self.topology = topology
        self.lane = lane

    def _all(self, scope: Scope, value: Any) -> tuple[list[Any], int]:
        members = self.topology.group(scope)
        values = self.hub.exchange(members, self.topology.rank, value, self.lane)
        return values, members.index(self.topology.rank)

    def _count(self, what: str, scope: Scope, me: int, schedule: str, nbytes: float, *,
               rounds: int = 1) -> None:
        """Record the collective's traffic once per group (by its rank 0) when asked to;
        DistTransport skips a collective of one member or of no bytes."""
        traffic = self.hub.traffic
        if traffic is None or me != 0:
            return
        p = self.topology.size(scope)
        tally = _Tally(p)
        if p > 1 and nbytes > 0:
            for part in schedule.split("+"):  # phases one after the other
                if part == "ring":
                    tally.ring(rounds, nbytes)
                else:
                    getattr(tally, part)(nbytes)
        msgs, total = tally.busiest()
        with self.hub._cond:
            traffic.append(Traffic(what, scope, p, msgs, total))

    def allreduce_start(self, scope: Scope, x: torch.Tensor, *, owned: bool = False,
                        done: Done | None = None) -> Callable[[], torch.Tensor]:
        return _completed(self.allreduce(scope, x, owned=owned), done)

    def allgather_start(self, scope: Scope, shard: torch.Tensor, sizes: Sequence[int], *,
                        done: Done | None = None) -> Callable[[], torch.Tensor]:
        return _completed(self.allgather(scope, shard, sizes), done)

    def allreduce(self, scope: Scope, x: torch.Tensor, *, owned: bool = False) -> torch.Tensor:
        values, me = self._all(scope, x.detach().clone())
        # gloo's ring all-reduce: a reduce-scatter then an all-gather of n/p chunks
        p = self.topology.size(scope)
        self._count("allreduce", scope, me, "ring", x.numel() * FLOAT32_BYTES / p,
                    rounds=2 * (p - 1))
        return _sum(values)

    def reduce_scatter(self, scope: Scope, x: torch.Tensor, sizes: Sequence[int]) -> torch.Tensor:
        values, me = self._all(scope, x.detach().clone())
        self._count("reduce_scatter", scope, me, "pairwise", max(sizes) * FLOAT32_BYTES)
        return _sum([torch.split(v, list(sizes))[me] for v in values])

    def allgather(self, scope: Scope, shard: torch.Tensor, sizes: Sequence[int]) -> torch.Tensor:
        values, me = self._all(scope, shard.detach().clone())
        self._count("allgather", scope, me, "ring", max(sizes) * FLOAT32_BYTES,
                    rounds=self.topology.size(scope) - 1)
        return torch.cat(values)

    def reduce(self, scope: Scope, x: torch.Tensor) -> torch.Tensor | None:
        values, me = self._all(scope, x.detach().clone())
        p = self.topology.size(scope)
        if reduce_splits(p, x.numel() * FLOAT32_BYTES):  # reduce-scatter, gather of shards
            self._count("reduce", scope, me, "pairwise+gather",
                        -(-x.numel() // p) * FLOAT32_BYTES)
        else:
            self._count("reduce", scope, me, "gather", x.numel() * FLOAT32_BYTES)
        return _sum(values) if me == 0 else None

    def broadcast(self, scope: Scope, x: torch.Tensor | None, numel: int) -> torch.Tensor:
        values, me = self._all(scope, None if x is None else x.detach().clone())
        self._count("broadcast", scope, me, "tree", numel * FLOAT32_BYTES)
        return values[0].clone()

    def allreduce_payload_start(self, scope: Scope, payload: tuple, *,
                                done: Done | None = None) -> Callable[[], tuple]:
        return _completed(self.allreduce_payload(scope, payload), done)

    def allreduce_payload(self, scope: Scope, payload: tuple) -> tuple:
        arrays = tuple(a.detach().clone() if isinstance(a, torch.Tensor)
                       else torch.from_numpy(np.array(a, copy=True)) for a in payload)
        values, me = self._all(scope, arrays)
        # DistTransport: one ring all-reduce per array, of its own bytes (not packed)
        p = self.topology.size(scope)
        for a in arrays:
            self._count("allreduce_payload", scope, me, "ring",
                        a.numel() * a.element_size() / p, rounds=2 * (p - 1))
        return tuple(_sum([v[j] for v in values]) for j in range(len(arrays)))

    def allgather_payloads(self, scope: Scope, payload: tuple,
                           specs: Sequence[PayloadSpec]) -> list[tuple]:
        _fits(payload, specs[self.topology.index(scope)])
        values, me = self._all(scope, tuple(payload))
        self._count("allgather_payloads", scope, me, "ring",
                    max(packed_nbytes(s) for s in specs), rounds=self.topology.size(scope) - 1)
        return list(values)

    def allgather_payloads_start(self, scope: Scope, payload: tuple,
                                 specs: Sequence[PayloadSpec], *,
                                 done: Done | None = None) -> Callable[[], list[tuple]]:
        return _completed(self.allgather_payloads(scope, payload, specs), done)

    def alltoall_payloads(self, scope: Scope, payloads: Sequence[tuple],
                          send_specs: Sequence[PayloadSpec],
                          recv_specs: Sequence[PayloadSpec]) -> list[tuple]:
        for payload, spec in zip(payloads, send_specs, strict=True):
            _fits(payload, spec)
        values, me = self._all(scope, list(payloads))
        self._count("alltoall_payloads", scope, me, "pairwise",
                    max(packed_nbytes(s) for s in [*send_specs, *recv_specs]))
        return [v[me] for v in values]

    def gather_payloads(self, scope: Scope, payload: tuple,
                        specs: Sequence[PayloadSpec]) -> list[tuple] | None:
        _fits(payload, specs[self.topology.index(scope)])
        values, me = self._all(scope, tuple(payload))
        self._count("gather_payloads", scope, me, "gather", max(packed_nbytes(s) for s in specs))
        return list(values) if me == 0 else None

    def broadcast_payload(self, scope: Scope, payload: tuple | None,
                          spec: PayloadSpec) -> tuple:
        if payload is not None:
            _fits(payload, spec)
        values, me = self._all(scope, payload)
        self._count("broadcast_payload", scope, me, "tree", packed_nbytes(spec))
        return tuple(values[0])


def _fits(payload: tuple, spec: PayloadSpec) -> None:
    """Refuse a payload that does not match its layout, as DistTransport's packing does.

    Raises:
        ValueError: the array count or an array's byte size differs from ``spec``.
    """
    pack(payload, spec, packed_nbytes(spec), torch.device("cpu"))
