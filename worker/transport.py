"""Transports the executor receives: collectives per scope, and the parameter-server path.

:class:`Transport` is the interface (STYLE.md, "Inject the transport"); the executor never
imports ``torch.distributed`` itself. :class:`DistTransport` implements it over
``torch.distributed`` process groups created once at start-up by :func:`create_groups`
(world, one intra group per machine, one inter group per local rank; every rank creates every
group in the same order, as ``new_group`` requires). :class:`PSPath` wraps the PS client.

Dense collectives:
  - ``allreduce``: the backend's native all-reduce (every member gets the same bits).
  - ``reduce_scatter``: all-to-all of the shards, then a sum in group-rank order on the
    receiver, so the result is deterministic and equals the reference interpreter bit for
    bit; shards are padded to equal length for the exchange.
  - ``reduce``: a gather of the whole tensor to the root, summed there in group-rank order;
    for more than 2 members and at least ``program.REDUCE_SPLIT_BYTES``, a ``reduce_scatter``
    then a gather of the summed shards (the same sums, a quarter of the root's bytes at 8
    members).
  - ``allgather``: padded all-gather of the shards, trimmed and concatenated.
  - ``broadcast``: native broadcast from group rank 0.
Payload collectives move payloads packed into one ``uint8`` buffer (each array 8-byte
aligned), padded to the largest member's size; every size is known locally because payload
lengths are fixed for a given element count (``payload_spec``).

Tensors are moved to the group's communication device (CPU for gloo, the GPU for NCCL) and the
results back to the caller's device. The ``*_start`` calls (``allreduce``, ``allgather``,
``allreduce_payload``, ``allgather_payloads``) issue the collective with ``async_op=True``
and return the call that waits for it, so an Option's last collective can complete while the
lane issues the next Option's (benchmarks/collective_issue.py measured async issue at about
half the time of blocking calls). Their ``done`` is called once the collective has completed
(from the thread that completed it), so a timed run can time a collective it leaves in
flight (``Executor.timings``).
"""

from __future__ import annotations

import datetime
import functools
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np
import torch
from byteps_espresso.worker.topology import Topology

from byteps_espresso.strategy.options import Scope
from byteps_espresso.strategy.program import reduce_splits

__all__ = [
    "DistTransport",
    "Done",
    "PSPath",
    "PayloadSpec",
    "RendezvousError",
    "Transport",
    "create_groups",
    "host_store",
    "init_distributed",
    "pack",
    "packed_nbytes",
    "unpack",
]

log = logging.getLogger(__name__)

PayloadSpec = tuple[tuple[np.dtype, int], ...]  # (dtype, element count) per payload array
Done = Callable[[], None]  # called once an issued collective has completed (*_start's done)
_ALIGN = 8  # bytes; every payload array starts at a multiple of this in a packed buffer


class Transport(Protocol):
    """Collectives of one rank, per scope. Group members are ordered by group rank."""

    topology: Topology

    def allreduce(self, scope: Scope, x: torch.Tensor, *,
                  owned: bool = False) -> torch.Tensor: ...
    def allreduce_start(self, scope: Scope, x: torch.Tensor, *, owned: bool = False,
                        done: Done | None = None) -> Callable[[], torch.Tensor]: ...
    def reduce_scatter(self, scope: Scope, x: torch.Tensor,
                       sizes: Sequence[int]) -> torch.Tensor: ...
    def allgather(self, scope: Scope, shard: torch.Tensor,
                  sizes: Sequence[int]) -> torch.Tensor: ...
    def allgather_start(self, scope: Scope, shard: torch.Tensor, sizes: Sequence[int], *,
                        done: Done | None = None) -> Callable[[], torch.Tensor]: ...
    def reduce(self, scope: Scope, x: torch.Tensor) -> torch.Tensor | None: ...
    def broadcast(self, scope: Scope, x: torch.Tensor | None, numel: int) -> torch.Tensor: ...
    def allreduce_payload(self, scope: Scope, payload: tuple) -> tuple: ...
    def allreduce_payload_start(self, scope: Scope, payload: tuple, *,
                                done: Done | None = None) -> Callable[[], tuple]: ...
    def allgather_payloads(self, scope: Scope, payload: tuple,
                           specs: Sequence[PayloadSpec]) -> list[tuple]: ...
    def allgather_payloads_start(self, scope: Scope, payload: tuple,
                                 specs: Sequence[PayloadSpec], *,
                                 done: Done | None = None) -> Callable[[], list[tuple]]: ...
    def alltoall_payloads(self, scope: Scope, payloads: Sequence[tuple],
                          send_specs: Sequence[PayloadSpec],
                          recv_specs: Sequence[PayloadSpec]) -> list[tuple]: ...
    def gather_payloads(self, scope: Scope, payload: tuple,
                        specs: Sequence[PayloadSpec]) -> list[tuple] | None: ...
    def broadcast_payload(self, scope: Scope, payload: tuple | None,
                          spec: PayloadSpec) -> tuple: ...


# ---- payload packing -------------------------------------------------------------------------
def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


@functools.lru_cache(maxsize=1024)
def _layout(spec: PayloadSpec) -> tuple[tuple[tuple[int, int, torch.dtype], ...], int]:
    """Where each array of ``spec`` goes in a packed buffer, ((offset, bytes, torch dtype),
    ...), and the bytes of the whole: worked out once per layout, since every iteration
    packs and unpacks the same few (a bucket's payload per Option)."""
    arrays = []
    offset = 0
    for dtype, n in spec:
        size = np.dtype(dtype).itemsize * n
        arrays.append((offset, size, _torch_dtype(np.dtype(dtype))))
        offset += _aligned(size)
    return tuple(arrays), offset


def packed_nbytes(spec: PayloadSpec) -> int:
    """Bytes of a packed payload with layout ``spec``."""
    return _layout(spec)[1]


def _torch_dtype(dtype: np.dtype) -> torch.dtype:
    return torch.from_numpy(np.empty(0, dtype=dtype)).dtype


def _as_bytes(arr: Any) -> torch.Tensor:
    if isinstance(arr, torch.Tensor):
        return arr.detach().contiguous().reshape(-1).view(torch.uint8)
    return torch.from_numpy(np.ascontiguousarray(arr).reshape(-1).view(np.uint8))


def pack(payload: tuple, spec: PayloadSpec, nbytes: int, device: torch.device,
         out: torch.Tensor | None = None) -> torch.Tensor:
    """Pack ``payload``'s arrays into a ``uint8`` buffer of ``nbytes`` on ``device`` (or into
    ``out``, such a buffer: a slice of a collective's send buffer). Each byte is written once:
    the arrays where they go, zeros in the alignment gaps and after the last array.

    Raises:
        ValueError: the payload does not match ``spec`` (array count or byte size).
    """
    if len(payload) != len(spec):
        raise ValueError(f"payload has {len(payload)} arrays, its layout says {len(spec)}")
    buf = torch.empty(nbytes, dtype=torch.uint8, device=device) if out is None else out
    arrays, end = _layout(spec)
    for arr, (offset, size, _) in zip(payload, arrays, strict=True):
        raw = _as_bytes(arr)
        if raw.numel() != size:
            raise ValueError(f"payload array has {raw.numel()} bytes, its layout says {size}")
        buf[offset:offset + size].copy_(raw)
        gap = min(_aligned(size), nbytes - offset) - size
        if gap > 0:  # (an empty slice's zero_() still costs a dispatch)
            buf[offset + size:offset + size + gap].zero_()
    if end < nbytes:
        buf[end:].zero_()
    return buf


def unpack(buf: torch.Tensor, spec: PayloadSpec) -> tuple:
    """Split a packed buffer back into the payload arrays: views of ``buf`` (torch tensors on
    its device; every array starts 8-byte aligned), so ``buf`` must not be reused."""
    return tuple(buf[offset:offset + size].view(dtype) for offset, size, dtype in _layout(spec)[0])


# ---- torch.distributed -----------------------------------------------------------------------
def _when_done(works: Sequence[Any], done: Done | None) -> None:
    """Call ``done`` once every issued collective of ``works`` (None: not issued) has
    completed: at once where none was issued, else from the completing thread (the
    works' futures). On NCCL a work's future completes as its ``wait()`` returns, once the
    collective is ordered on the CUDA stream, not when the GPU has run it: what a blocking
    call's time measures there too."""
    if done is None:
        return
    futures = [w.get_future() for w in works if w is not None]
    if futures:
        torch.futures.collect_all(futures).then(lambda _: done())
    else:
        done()


def _waited(work: Any, buf: torch.Tensor) -> torch.Tensor:
    """``buf`` once the collective ``work`` (None: nothing was issued) has completed."""
    if work is not None:
        work.wait()
    return buf


class DistTransport:
    """:class:`Transport` over ``torch.distributed`` groups of one lane.

    Args:
        topology: this rank's view of the job.
        groups: this rank's process group per scope (``None`` for the default world group).
        comm_device: where tensors must be for these groups (CPU for gloo, CUDA for NCCL).
    """

    # The ``*_start`` calls return as soon as the collective is issued (``async_op``), so
    # the engine may issue an Option from the submitting thread (Engine.submit).
    issues_async = True

    def __init__(self, topology: Topology, groups: dict[Scope, Any],
                 comm_device: torch.device | str = "cpu") -> None:
        self.topology = topology
        self.groups = groups
        self.comm_device = torch.device(comm_device)
        # (group, members, my group rank) per scope, resolved once
        self._ctxs = {scope: (groups[scope], topology.group(scope), topology.index(scope))
                      for scope in groups}

    def _ctx(self, scope: Scope) -> tuple[Any, tuple[int, ...], int]:
        return self._ctxs[scope]

    def close(self) -> None:
        """Drop this lane's process groups (after ``destroy_process_group``).

        Executors, and through them the user's optimizer, keep this object alive until the
        interpreter exits. A group still referenced then is destroyed during finalization,
        where releasing the tensors of its last works takes an interpreter lock that is
        being torn down, and the process aborts with "terminate called without an active
        exception" (pytorch/pytorch#179291; a rank of a finished job here exited -6 with
        that line). Dropping the references here destroys the groups while the interpreter
        still runs.
        """
        self.groups = {}
        self._ctxs = {}

    def _to_comm(self, x: torch.Tensor) -> torch.Tensor:
        return x.detach().to(self.comm_device).contiguous()

    # dense ----------------------------------------------------------------------------------
    def allreduce(self, scope: Scope, x: torch.Tensor, *, owned: bool = False) -> torch.Tensor:
        """``owned``: ``x`` belongs to the caller's run (not a user's tensor) and may be
        overwritten with the sum instead of copied first."""
        return self.allreduce_start(scope, x, owned=owned)()

    def allreduce_start(self, scope: Scope, x: torch.Tensor, *, owned: bool = False,
                        done: Done | None = None) -> Callable[[], torch.Tensor]:
        """Issue :meth:`allreduce` (``async_op``); the returned call waits for the sum."""
        import torch.distributed as dist

        group, members, _ = self._ctx(scope)
        buf = self._to_comm(x)
        if not owned and buf.data_ptr() == x.data_ptr():  # x itself: copy, keep x intact
            buf = buf.clone()
        work = dist.all_reduce(buf, group=group, async_op=True) \
            if len(members) > 1 and buf.numel() > 0 else None
        _when_done([work], done)
        return lambda: _waited(work, buf).to(x.device)

    def reduce_scatter(self, scope: Scope, x: torch.Tensor, sizes: Sequence[int]) -> torch.Tensor:
        import torch.distributed as dist

        group, members, me = self._ctx(scope)
        xc = self._to_comm(x)
        width = max(sizes)
        if len(members) == 1 or width == 0:
            return xc.clone().to(x.device)
        if all(n == width for n in sizes):  # no padding needed: send the tensor itself
            send = xc
        else:
            send = torch.zeros(len(members) * width, dtype=xc.dtype, device=xc.device)
            for j, piece in enumerate(torch.split(xc, list(sizes))):
                send[j * width:j * width + piece.numel()] = piece
        recv = torch.empty(len(members) * width, dtype=xc.dtype, device=xc.device)
        dist.all_to_all_single(recv, send, group=group)
        mine = sizes[me]
        total = recv[:mine].clone()
        for j in range(1, len(members)):
            total += recv[j * width:j * width + mine]
        return total.to(x.device)

    def allgather(self, scope: Scope, shard: torch.Tensor, sizes: Sequence[int]) -> torch.Tensor:
        return self.allgather_start(scope, shard, sizes)()

    def allgather_start(self, scope: Scope, shard: torch.Tensor, sizes: Sequence[int], *,
                        done: Done | None = None) -> Callable[[], torch.Tensor]:
        """Issue :meth:`allgather` (``async_op``); the returned call waits and concatenates."""
        import torch.distributed as dist

        group, members, _ = self._ctx(scope)
        width = max(sizes)
        if len(members) == 1:
            _when_done([], done)
            return shard.clone
        if shard.numel() == width:  # the longest shard: no padding, no copy
            mine = self._to_comm(shard)
        else:
            mine = torch.zeros(width, dtype=shard.dtype, device=self.comm_device)
            mine[:shard.numel()] = self._to_comm(shard)
        outs = [torch.empty_like(mine) for _ in members]
        work = dist.all_gather(outs, mine, group=group, async_op=True) if width > 0 else None
        _when_done([work], done)

        def finish() -> torch.Tensor:
            _waited(work, mine)
            return torch.cat([o[:n] for o, n in zip(outs, sizes, strict=True)]).to(shard.device)
        return finish

    def reduce(self, scope: Scope, x: torch.Tensor) -> torch.Tensor | None:
        import torch.distributed as dist

        group, members, me = self._ctx(scope)
        xc = self._to_comm(x)
        if len(members) == 1:
            return xc.clone().to(x.device)
        p = len(members)
        if reduce_splits(p, xc.numel() * xc.element_size()):
            # Rabenseifner: each member sums its shard (group-rank order), the root gathers them
            base, extra = divmod(xc.numel(), p)
            sizes = [base + (1 if j < extra else 0) for j in range(p)]
            shard = self.reduce_scatter(scope, xc, sizes)
            width = sizes[0]
            mine = shard if shard.numel() == width else \
                torch.cat([shard, shard.new_zeros(width - shard.numel())])
            outs = [torch.empty_like(mine) for _ in members] if me == 0 else None
            dist.gather(mine, outs, dst=members[0], group=group)
            if me != 0:
                return None
            return torch.cat([o[:n] for o, n in zip(outs, sizes, strict=True)]).to(x.device)  # type: ignore[arg-type]
        outs = [torch.empty_like(xc) for _ in members] if me == 0 else None
        if xc.numel() > 0:
            dist.gather(xc, outs, dst=members[0], group=group)
        if me != 0:
            return None
        if xc.numel() == 0:
            return xc.clone().to(x.device)
        total = outs[0].clone()  # type: ignore[index]
        for o in outs[1:]:  # type: ignore[index]
            total += o
        return total.to(x.device)

    def broadcast(self, scope: Scope, x: torch.Tensor | None, numel: int) -> torch.Tensor:
        import torch.distributed as dist

        group, members, me = self._ctx(scope)
        if me == 0:
            if x is None:
                raise ValueError("the broadcast root holds no tensor")
            buf = self._to_comm(x).clone()
        else:
            buf = torch.empty(numel, dtype=torch.float32, device=self.comm_device)
        if len(members) > 1 and numel > 0:
            dist.broadcast(buf, src=members[0], group=group)
        return buf

    # payloads -------------------------------------------------------------------------------
    def allreduce_payload(self, scope: Scope, payload: tuple) -> tuple:
        """The members' payloads summed array by array in each array's own dtype (a linear
        compressor's: ``AllreduceC``); the arrays are the caller's and are summed in place
        where they already sit on the communication device."""
        return self.allreduce_payload_start(scope, payload)()

    def allreduce_payload_start(self, scope: Scope, payload: tuple, *,
                                done: Done | None = None) -> Callable[[], tuple]:
        """Issue :meth:`allreduce_payload` (``async_op``); the returned call waits."""
        import torch.distributed as dist

        group, members, _ = self._ctx(scope)
        bufs = tuple(a.detach().to(self.comm_device).contiguous() if isinstance(a, torch.Tensor)
                     else torch.from_numpy(np.ascontiguousarray(a)).to(self.comm_device)
                     for a in payload)
        works = [dist.all_reduce(b, group=group, async_op=True) for b in bufs
                 if b.numel()] if len(members) > 1 else []
        _when_done(works, done)

        def finish() -> tuple:
            for work in works:
                work.wait()
            return bufs
        return finish

    def allgather_payloads(self, scope: Scope, payload: tuple,
                           specs: Sequence[PayloadSpec]) -> list[tuple]:
        return self.allgather_payloads_start(scope, payload, specs)()

    def allgather_payloads_start(self, scope: Scope, payload: tuple,
                                 specs: Sequence[PayloadSpec], *,
                                 done: Done | None = None) -> Callable[[], list[tuple]]:
        """Issue :meth:`allgather_payloads` (``async_op``); the returned call waits and
        unpacks every member's payload."""
        import torch.distributed as dist

        group, members, me = self._ctx(scope)
        width = max(packed_nbytes(s) for s in specs)
        mine = pack(payload, specs[me], width, self.comm_device)
        if len(members) == 1:
            _when_done([], done)
            return lambda: [unpack(mine, specs[0])]
        outs = [torch.empty_like(mine) for _ in members]
        work = dist.all_gather(outs, mine, group=group, async_op=True) if width > 0 else None
        _when_done([work], done)

        def finish() -> list[tuple]:
            _waited(work, mine)
            return [unpack(o, s) for o, s in zip(outs, specs, strict=True)]
        return finish

    def alltoall_payloads(self, scope: Scope, payloads: Sequence[tuple],
                          send_specs: Sequence[PayloadSpec],
                          recv_specs: Sequence[PayloadSpec]) -> list[tuple]:
        import torch.distributed as dist

        group, members, _ = self._ctx(scope)
        width = max(packed_nbytes(s) for s in list(send_specs) + list(recv_specs))
        if len(members) == 1:
            return [unpack(pack(payloads[0], send_specs[0], width, self.comm_device),
                           recv_specs[0])]
        send = torch.empty(len(payloads) * width, dtype=torch.uint8, device=self.comm_device)
        for j, (p, s) in enumerate(zip(payloads, send_specs, strict=True)):
            pack(p, s, width, self.comm_device, out=send[j * width:(j + 1) * width])
        recv = torch.empty_like(send)
        if width > 0:
            dist.all_to_all_single(recv, send, group=group)
        return [unpack(recv[j * width:(j + 1) * width], s) for j, s in enumerate(recv_specs)]

    def gather_payloads(self, scope: Scope, payload: tuple,
                        specs: Sequence[PayloadSpec]) -> list[tuple] | None:
        import torch.distributed as dist

        group, members, me = self._ctx(scope)
        width = max(packed_nbytes(s) for s in specs)
        mine = pack(payload, specs[me], width, self.comm_device)
        if len(members) == 1:
            return [unpack(mine, specs[0])]
        outs = [torch.empty_like(mine) for _ in members] if me == 0 else None
        if width > 0:
            dist.gather(mine, outs, dst=members[0], group=group)
        if me != 0:
            return None
        if width == 0:
            return [unpack(mine, s) for s in specs]
        return [unpack(o, s) for o, s in zip(outs, specs, strict=True)]  # type: ignore[arg-type]

    def broadcast_payload(self, scope: Scope, payload: tuple | None,
                          spec: PayloadSpec) -> tuple:
        import torch.distributed as dist

        group, members, me = self._ctx(scope)
        width = packed_nbytes(spec)
        if me == 0:
            if payload is None:
                raise ValueError("the broadcast root holds no payload")
            buf = pack(payload, spec, width, self.comm_device)
        else:
            buf = torch.empty(width, dtype=torch.uint8, device=self.comm_device)
        if len(members) > 1 and width > 0:
            dist.broadcast(buf, src=members[0], group=group)
        return unpack(buf, spec)


def host_store(bind_host: str, advertise_host: str, port: int,
               timeout_s: float, secret: bytes | None = None) -> tuple[Any, Any]:
    """Host a TCPStore on ``port``, listening on ``bind_host`` only; returns (store, socket).

    Used by rank 0 when the job has no PS scheduler (``DMLC_NUM_SERVER=0``); with servers the
    scheduler hosts it the same way. With a job ``secret`` the port is an authenticated gate
    (:mod:`byteps_espresso.server.store_gate`) and the store listens on loopback; the second
    value is then the gate (close it with the store).

    Raises:
        RuntimeError: the port is taken.
    """
    import socket

    import torch.distributed as dist
    from byteps_espresso.server.auth import store_key
    from byteps_espresso.server.store_gate import StoreGate, loopback_listener

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((bind_host, port))
    except OSError as exc:
        sock.close()
        raise RuntimeError(f"cannot host the torch.distributed store on {bind_host}:{port} "
                           f"({exc.strerror}); DMLC_PS_ROOT_PORT + 1 must be free on rank 0's "
                           "host") from None
    sock.listen(1024)
    keep: Any = sock
    if secret is not None:
        inner = loopback_listener()
        keep = StoreGate(sock, inner, store_key(secret))
        sock, advertise_host, port = inner, "127.0.0.1", inner.getsockname()[1]
    store = dist.TCPStore(advertise_host, port, None, True, datetime.timedelta(seconds=timeout_s),
                          wait_for_workers=False, master_listen_fd=sock.fileno())
    return store, keep  # the caller keeps the listening socket (or gate) alive with the store


class RendezvousError(RuntimeError):
    """This process could not join the torch.distributed world; the message names the store
    and every address the ranks advertised."""


# Store key under which each rank publishes the address it advertises (read back only to
# name the addresses in a rendezvous error).
_ADDRESS_KEY = "espresso/address/{rank}"


def init_distributed(topology: Topology, host: str, port: int, *, backend: str = "gloo",
                     timeout_s: float = 60.0, store: Any = None, address: str = "",
                     secret: bytes | None = None) -> Any:
    """Join the job's ``torch.distributed`` world through the TCPStore at ``host:port``.

    The scheduler hosts the store (INTERFACES.md), or rank 0 when the job has no servers
    (pass its ``host_store`` as ``store``); every other process is a client. Each rank
    publishes ``address`` (what it advertises, and over which interface) in the store first,
    so that a rank that cannot complete the rendezvous says which peers it heard of, and at
    which addresses. With a job ``secret`` the store is reached through its authenticated
    gate (:class:`byteps_espresso.server.store_gate.StoreTunnel`).

    Returns:
        The StoreTunnel when one was opened (keep it, and close it after the process group
        is destroyed: the store's connection runs through it), else None.

    Raises:
        RendezvousError: the store cannot be reached or the world does not assemble in time;
            the message names the store's address and every rank's advertised address.
    """
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    rank, world = topology.rank, topology.world_size
    tunnel = None
    if store is None:
        if secret is not None:
            from byteps_espresso.server.auth import store_key
            from byteps_espresso.server.store_gate import StoreTunnel

            tunnel = StoreTunnel(host, port, store_key(secret))
        try:
            store = dist.TCPStore(*(("127.0.0.1", tunnel.port) if tunnel else (host, port)),
                                  is_master=False, timeout=timeout)
        except (RuntimeError, OSError) as exc:
            why = _first_line(exc) + (" (through the authenticated store gate: every process "
                                      "needs the job's ESPRESSO_JOB_SECRET)" if tunnel else "")
            raise RendezvousError(
                f"rank {rank} (advertising {address or 'unknown'}) cannot reach the "
                f"torch.distributed store at {host}:{port} within {timeout_s:g} s: "
                f"{why}. Check that DMLC_PS_ROOT_URI={host} is this job's "
                f"scheduler (rank 0 when DMLC_NUM_SERVER=0), that it runs, and that port "
                f"{port} (DMLC_PS_ROOT_PORT + 1) is reachable from this machine") from None
    store.set(_ADDRESS_KEY.format(rank=rank), address)
    try:
        dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                                timeout=timeout)
    except (RuntimeError, OSError) as exc:
        raise RendezvousError(
            f"rank {rank} could not form the {backend} world of {world} ranks through the "
            f"store at {host}:{port} within {timeout_s:g} s: {_first_line(exc)}. Addresses "
            f"the ranks advertised: {_advertised(store, world)}. Every rank must reach every "
            "other at its address: set DMLC_NODE_HOST or DMLC_INTERFACE (or "
            "GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME) where one is wrong") from None
    log.debug("rank %d joined torch.distributed (%s) via %s:%d as %s", rank, backend, host,
              port, address)
    return tunnel


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0].rstrip(".")


def _advertised(store: Any, world: int) -> str:
    """``rank N: address`` for every rank of the world, as published in ``store`` (never
    blocks on a rank that did not)."""
    parts = []
    for rank in range(world):
        key = _ADDRESS_KEY.format(rank=rank)
        try:
            known = store.check([key])
            value = store.get(key).decode() if known else "never reached the store"
        except (RuntimeError, OSError):
            value = "unknown (the store is gone)"
        parts.append(f"rank {rank}: {value}")
    return "; ".join(parts)


def create_groups(topology: Topology, lanes: int, *, backend: str | None = None,
                  comm_device: torch.device | str = "cpu") -> list[DistTransport]:
    """Create every scope group for ``lanes`` independent lanes; one transport per lane.

    Every rank must call this with the same arguments: ``new_group`` is collective and all
    ranks create all groups (also those they are not in) in the same order.

    Args:
        topology: this rank's view of the job.
        lanes: independent sets of groups; tensors on different lanes communicate
            concurrently while each lane keeps one global order.
        backend: group backend (default: the world's).
        comm_device: where the groups' tensors live (CPU for gloo, CUDA for NCCL).
    """
    import torch.distributed as dist

    out = []
    for _ in range(lanes):
        groups: dict[Scope, Any] = {}
        for scope in (Scope.FLAT, Scope.INTRA, Scope.INTER):
            mine = topology.group(scope)
            for members in topology.all_groups(scope):
                group = dist.new_group(list(members), backend=backend)
                if members == mine:
                    groups[scope] = group
        out.append(DistTransport(topology, groups, comm_device))
    return out


class PSPath:
    """The PS half of the transports: push/pull of dense tensors and payloads by key.

    One per process (keys are declared once per client). Declares each key on first use
    (``pushers`` = the global ranks that push it; compressed keys with the codec's name and
    parameters, and server-side error feedback when the workers use it). The round of a
    push is the tensor's iteration, the same on every pusher. Compressed partitions are
    compressed with the partition's key name and ``step=round``, the ctx the servers rebuild
    (``layout.pieces``).

    Args:
        client: a connected ``byteps_espresso.server.client.PSClient``.
    """

    def __init__(self, client: Any) -> None:
        self.client = client
        self._declared: dict[str, tuple[Any, ...]] = {}
        self._probe_rounds: dict[str, int] = {}
        self._lock = threading.Lock()

    @property
    def partition_bytes(self) -> int:
        """The largest PS key in bytes (``BYTEPS_PARTITION_BYTES``)."""
        return int(self.client.cfg.partition_bytes)

    def declare(self, key: str, numel: int, pushers: Sequence[int], codec: Any = None) -> None:
        """Declare ``key`` on first use; a later call with other arguments is an error.

        Args:
            codec: a :class:`~byteps_espresso.worker.codecs.CodecPair` for a compressed key,
                None for a dense float32 key.
        """
        want = (numel, tuple(pushers), codec.name if codec else None,
                tuple(sorted(codec.params.items())) if codec else ())
        with self._lock:
            have = self._declared.get(key)
            if have is not None:
                if have != want:
                    raise ValueError(f"PS key {key!r} was declared as {have}, now {want}")
                return
            params = None
            if codec is not None:
                params = dict(codec.params, server_error_feedback=codec.error_feedback)
            self.client.declare(key, numel, list(pushers),
                                compressor=codec.name if codec else None, params=params)
            self._declared[key] = want

    def partitions(self, key: str) -> list[tuple[int, int]]:
        """(offset, numel) of each server partition of a declared key."""
        return [tuple(p) for p in self.client.partitions(key)]  # type: ignore[misc]

    def push_pull(self, key: str, data: Any, round_: int) -> Any:
        """Push ``data`` (dense float32 array, or one payload per partition) for ``round_``
        (the tensor's iteration: strictly increasing per key); wait for the aggregate."""
        return self.client.push_pull_async(key, data, round_).wait()

    def next_probe_round(self, key: str) -> int:
        """Rounds for keys outside any Option (link probes): 0, 1, 2, ... per key."""
        with self._lock:
            round_ = self._probe_rounds.get(key, 0)
            self._probe_rounds[key] = round_ + 1
            return round_

    def close(self) -> None:
        self.client.close()
