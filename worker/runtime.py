"""One process's worker runtime: topology, process groups, PS client, host threads, engines.

Built once by ``byteps_espresso.torch.init()`` (or directly by tests and tools) from a
:class:`~byteps_espresso.config.Config`:

1. the topology from the BytePS environment;
2. ``torch.distributed`` joined through the TCPStore the scheduler hosts on
   ``cfg.store_port`` (rank 0 hosts it when ``DMLC_NUM_SERVER=0``: no scheduler runs then);
   gloo on CPU, NCCL when the training device is CUDA;
3. every scope group for each lane (:func:`~byteps_espresso.worker.transport.create_groups`);
4. the PS client when ``DMLC_NUM_SERVER`` > 0;
5. this process's share of ``ESPRESSO_CPU_THREADS`` (per machine) host threads for ``cpu``
   compute steps, also the numba kernels' thread count.

Example:
    >>> rt = Runtime(Config.from_env())           # doctest: +SKIP
    >>> engine = rt.engine(CodecPair("fp16"))     # doctest: +SKIP
"""

from __future__ import annotations

import functools
import gc
import logging
import os
import socket
import zlib
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from byteps_espresso.worker.codecs import CodecPair
from byteps_espresso.worker.executor import Engine, Executor
from byteps_espresso.worker.topology import Topology
from byteps_espresso.worker.transport import PSPath, create_groups, host_store, init_distributed

from byteps_espresso.config import Config
from byteps_espresso.strategy.options import Scope
from byteps_espresso.strategy.tree import PARTNER

__all__ = ["DEFAULT_LANES", "Runtime", "intra_op_threads"]

log = logging.getLogger(__name__)

# Independent sets of process groups (one communication thread each). Two lets one tensor's
# host compression overlap another tensor's collective while keeping a fixed order per lane.
DEFAULT_LANES = 2


def default_device(cfg: Config) -> torch.device:
    """The training device: ``cuda:<local rank mod GPUs>`` when CUDA is available, else CPU.

    Every process of a machine sees all of its GPUs (as with BytePS); the local rank picks
    one, as ``torch.cuda.set_device(bps.local_rank())`` does in a training script.
    """
    if torch.cuda.is_available():
        return torch.device("cuda", cfg.local_rank % torch.cuda.device_count())
    return torch.device("cpu")


class Runtime:
    """Everything one training process needs to run Options.

    Args:
        cfg: the parsed environment.
        device: training device (default: :func:`default_device`).
        lanes: independent communication lanes.
        backend: torch.distributed backend (default: NCCL for CUDA devices, else gloo).

    Raises:
        RuntimeError: the store, the other workers or the PS cannot be reached in time.
    """

    def __init__(self, cfg: Config, *, device: torch.device | str | None = None,
                 lanes: int = DEFAULT_LANES, backend: str | None = None) -> None:
        import torch.distributed as dist

        self.cfg = cfg
        self.topology = Topology.from_config(cfg)
        self.device = torch.device(device) if device is not None else default_device(cfg)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.backend = backend or ("nccl" if self.device.type == "cuda" else "gloo")
        comm_device = self.device if self.backend == "nccl" else torch.device("cpu")
        self._owns_world = not dist.is_initialized()
        self._store, self._store_socket, self._store_tunnel = None, None, None
        if self._owns_world:
            timeout_s = max(cfg.start_timeout_s, cfg.op_timeout_s)
            # gloo and NCCL pick their interface from the host name unless told; point them
            # at the one this process advertises (or the user's choice).
            interfaces = cfg.export_socket_interfaces()
            if cfg.num_servers == 0 and self.topology.rank == 0:
                # No PS scheduler in this job: rank 0 hosts the rendezvous store itself.
                self._store, self._store_socket = host_store(
                    cfg.bind_host(), cfg.root_uri, cfg.store_port, timeout_s, cfg.secret())
            ifname = interfaces.get("NCCL_SOCKET_IFNAME" if self.backend == "nccl"
                                    else "GLOO_SOCKET_IFNAME", "the host name's")
            self._store_tunnel = init_distributed(
                self.topology, cfg.root_uri, cfg.store_port, backend=self.backend,
                timeout_s=timeout_s, store=self._store, secret=cfg.secret(),
                address=f"{cfg.address()}, {self.backend} over {ifname}")
        self.transports = create_groups(self.topology, lanes, backend=self.backend,
                                        comm_device=comm_device)
        self.ps_client = None
        self.ps: PSPath | None = None
        if cfg.num_servers > 0:
            from byteps_espresso.server.client import PSClient

            self.ps_client = PSClient(cfg, rank=self.topology.rank)
            self.ps = PSPath(self.ps_client)
        self.shared_host, self.local_server_share, self.core_sharers = _placement(
            self.topology, self.transports[0], cfg,
            self.ps_client.local_servers if self.ps_client is not None else 0)
        if self.shared_host and self.topology.rank == 0:
            log.info("all %d machines run on this host (one host name and address): the "
                     "uncompressed path skips the intra-machine hierarchy",
                     self.topology.machines)
        # ESPRESSO_CPU_THREADS is per machine: this process's share runs its numba kernels
        # (parallel kernels otherwise start one thread per core in every worker process and
        # the processes of one machine oversubscribe its cores).
        # numba keeps the count per calling thread (a new thread starts with one per core),
        # so the lanes and the host pool set it too: otherwise each ran every parallel kernel
        # on its own team of one OpenMP thread per core.
        threads = max(1, cfg.cpu_threads // cfg.local_size)
        self._thread_init = functools.partial(_set_numba_threads, threads)
        self._thread_init()
        torch.set_num_threads(intra_op_threads(cfg.local_size, cfg.intra_op_threads))
        self.cpu_pool = ThreadPoolExecutor(threads, thread_name_prefix="espresso-cpu",
                                           initializer=self._thread_init)
        self._engines: list[Engine] = []
        self._counters: dict[str, int] = {}  # iterations per tensor, shared by the engines
        log.info("rank %d/%d (machine %d, local rank %d) on %s, %s, %d lanes, %d servers, "
                 "%d intra-op threads", self.topology.rank, self.topology.world_size,
                 self.topology.machine_id, self.topology.local_rank, self.device, self.backend,
                 lanes, cfg.num_servers, torch.get_num_threads())

    @property
    def counters(self) -> dict[str, int]:
        """Iterations per tensor name, shared by every engine of this process: they number
        the PS rounds and seed the random draws (a checkpoint saves and restores them)."""
        return self._counters

    @property
    def host_cores(self) -> dict[str, int]:
        """The cores this process may run on (``cpus``) and how many ranks share them
        (``ranks``: those on this machine's kernel, the emulated machines' too)."""
        return {"cpus": len(os.sched_getaffinity(0)), "ranks": self.core_sharers}

    @property
    def lanes(self) -> int:
        """Independent communication lanes (one set of process groups, one engine thread each)."""
        return len(self.transports)

    def engine(self, codec: CodecPair | None = None) -> Engine:
        """An asynchronous engine running Options with ``codec`` on every lane (and, in mixed
        Options, the tree's intra-machine partner)."""
        executors = [Executor(t, codec, self.ps, self.device, self.cpu_pool,
                              partners=None if codec is None
                              else {PARTNER: codec.partner(PARTNER)})
                     for t in self.transports]
        engine = Engine(executors, timeout_s=self.cfg.op_timeout_s, counters=self._counters,
                        thread_init=self._thread_init)
        self._engines.append(engine)
        return engine

    def barrier(self) -> None:
        """Wait for every rank (over the flat group of lane 0)."""
        import torch.distributed as dist

        dist.barrier(group=self.transports[0].groups[Scope.FLAT])

    def broadcast(self, tensor: torch.Tensor, root_rank: int, lane: int = 0) -> None:
        """Overwrite ``tensor`` in place with global rank ``root_rank``'s values.

        Args:
            lane: whose flat group to use; call it on that lane's thread (``Engine.call``)
                while the lane may be busy, so that it keeps its place in the lane's order.
        """
        import torch.distributed as dist

        group = self.transports[lane].groups[Scope.FLAT]
        comm = self.transports[lane].comm_device
        buf = tensor.detach().to(comm).contiguous()
        if self.topology.world_size > 1:
            dist.broadcast(buf, src=root_rank, group=group)
        if buf.data_ptr() != tensor.data_ptr():
            with torch.no_grad():
                tensor.copy_(buf)

    def broadcast_bytes(self, data: bytes | None, root_rank: int = 0, lane: int = 0) -> bytes:
        """``root_rank``'s bytes on every rank (length first, then a uint8 tensor)."""
        me = self.topology.rank == root_rank
        if me and data is None:
            raise ValueError("the broadcast root must pass the bytes to send")
        length = torch.tensor([len(data) if me else 0], dtype=torch.int64)  # type: ignore[arg-type]
        self.broadcast(length, root_rank, lane)
        if me and data:
            buf = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        else:
            buf = torch.empty(int(length.item()), dtype=torch.uint8)
        if buf.numel():
            self.broadcast(buf, root_rank, lane)
        return bytes(buf.numpy().tobytes())

    def close(self) -> None:
        """Stop engines, the host pool, the PS client and (if it created it) the world."""
        import torch.distributed as dist

        for engine in self._engines:
            engine.close()
        self._engines.clear()
        self.cpu_pool.shutdown(wait=True)
        if self.ps_client is not None:
            self.ps_client.close()
            self.ps_client, self.ps = None, None
        if self._owns_world and dist.is_initialized():
            dist.destroy_process_group()
        for transport in self.transports:
            transport.close()
        gc.collect()  # and whatever still holds them in a reference cycle
        if self._store_socket is not None:
            self._store_socket.close()
            self._store, self._store_socket = None, None
        if self._store_tunnel is not None:
            self._store_tunnel.close()
            self._store_tunnel = None


def _placement(topology: Topology, transport: Any, cfg: Config,
               local_servers: int) -> tuple[bool, float, int]:
    """Where the job's machines and servers are, from one all-gather of three int64 per rank
    at start-up: (shared_host, local_server_share, core_sharers).

    shared_host: every worker machine runs on this one host (espresso-launch --local): every
    rank has the same host name and advertised address. local_server_share: the share of a
    machine's push/pull bytes for servers on that machine (keys are spread evenly over the
    servers), the least over the machines of ``local_servers`` (a worker's count of servers
    at its own address) over the servers; 0 without servers or on one host (nothing crosses
    a machine's link there). core_sharers: the ranks on this process's kernel
    (:func:`~byteps_espresso.server.shm.boot_id`), which share its cores: this machine's,
    and those of every emulated machine on the same host (this machine's alone where the
    boot is unknown)."""
    if topology.machines == 1:
        return False, 0.0, topology.local_size
    from byteps_espresso.server.shm import boot_id

    me = f"{socket.gethostname()}|{cfg.advertise_host()}".encode()
    boot = boot_id()
    mine = torch.tensor([zlib.crc32(me), local_servers, zlib.crc32(boot.encode()) if boot
                         else -1], dtype=torch.int64)
    every = transport.allgather(Scope.FLAT, mine, [3] * topology.world_size).reshape(-1, 3)
    sharers = int((every[:, 2] == mine[2]).sum()) if boot else topology.local_size
    shared = len(set(every[:, 0].tolist())) == 1
    least = int(every[:, 1].min())
    # every server at every machine's address: the machines share one address, and no
    # push/pull crosses a link between them that the model could price
    if not cfg.num_servers or shared or least >= cfg.num_servers:
        return shared, 0.0, sharers
    return shared, least / cfg.num_servers, sharers


def intra_op_threads(local_size: int, requested: int | None = None) -> int:
    """torch's intra-op threads for one of the ``local_size`` workers sharing this machine.

    ``requested`` (``OMP_NUM_THREADS``, when set) is the user's choice. It is applied through
    the API because with the variable set and the count never set through ``set_num_threads``,
    2 machines x 2 workers on 2 cores ran about 10x slower (fp32: 710.8 against 64.1 ms per
    iteration). Otherwise each worker gets its share of the cores this process may run on,
    as torchrun sets ``OMP_NUM_THREADS=1`` when it starts several processes per node: with
    torch's default (one thread per core in every worker) the workers' OpenMP barriers spin
    while the threads they wait for are descheduled. Measured on 2 cores, 2 x 2 workers,
    examples/train.py: 2 threads each 76-90 ms per iteration for fp32 and 114-130 ms for
    Reduce -> PushPull -> Broadcast (local rank 1 used 13-16 s of CPU against 6 s for rank 0,
    spinning in libgomp); 1 thread each 66 and 45-50 ms.
    """
    if requested is not None:
        return requested
    return max(1, len(os.sched_getaffinity(0)) // max(1, local_size))


def _set_numba_threads(threads: int) -> None:
    import numba

    numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
