"""Cluster descriptions: machines x GPUs, links, PS servers and host resources.

Bandwidths are in Gbit/s (10^9 bits per second) and latencies in microseconds, per direction.

Example:
    >>> c = Cluster.preset(machines=8, gpus_per_machine=8, intra="nvlink", inter_gbps=100)
    >>> c.world_size
    64
"""

from __future__ import annotations

import math
import os
import zlib
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from byteps_espresso.strategy.workload import read_json

__all__ = ["INTRA_PRESETS", "Cluster", "ClusterError", "LinkPreset", "lane_of"]


class ClusterError(ValueError):
    """A cluster description is malformed; the message names the field (and file)."""


def lane_of(name: str, lanes: int) -> int:
    """The executor lane of tensor ``name`` among ``lanes``: a hash of the name, the same on
    every rank and in the planner (CRC-32, stable across processes, unlike ``hash``)."""
    return zlib.crc32(name.encode()) % lanes


def _check(name: str, value: Any, *, low: float, integer: bool = False, strict: bool = False,
           below: float | None = None, optional: bool = False) -> None:
    """Raise ClusterError unless ``value`` is a number (an integer if ``integer``) >= ``low``
    (> if ``strict``) and < ``below`` when given, or None when ``optional``."""
    if value is None and optional:
        return
    kinds = int if integer else int | float
    if isinstance(value, bool) or not isinstance(value, kinds) or not math.isfinite(value) \
            or not (value > low if strict else value >= low) \
            or (below is not None and not value < below):
        what = "an integer" if integer else "a finite number"
        bound = f"{'>' if strict else '>='} {low:g}" + ("" if below is None else
                                                      f" and < {below:g}")
        raise ClusterError(f"field {name!r} must be {what} {bound}{' or null' if optional else ''}"
                           f", got {value!r}")


@dataclass(frozen=True)
class LinkPreset:
    """An intra-machine link: effective per-GPU bandwidth (Gbit/s) and per-hop latency (us)."""

    gbps: float
    latency_us: float
    source: str


INTRA_PRESETS: dict[str, LinkPreset] = {
    # V100 SXM2: six NVLink 2.0 links of 25 GB/s per direction each (NVIDIA Tesla V100
    # datasheet; DGX-1 with V100 system architecture white paper, 2017). A ring collective
    # drives two links per direction on the DGX-1 hybrid cube-mesh: 50 GB/s = 400 Gbit/s.
    # Latency: NCCL per-hop latency over NVLink of a few microseconds (NCCL tests, DGX-1).
    "nvlink": LinkPreset(400.0, 3.0, "V100 NVLink 2.0: 2 x 25 GB/s per direction per ring "
                                     "(NVIDIA V100 datasheet, DGX-1V white paper)"),
    # PCIe 3.0 x16: 8 GT/s x 16 lanes x 128/130 = 15.75 GB/s theoretical (PCI-SIG PCIe 3.0
    # base specification); about 12 GB/s = 96 Gbit/s measured by CUDA's bandwidthTest with
    # pinned memory. GPU peer traffic through the host bridge: ~10 us per hop.
    "pcie": LinkPreset(96.0, 10.0, "PCIe 3.0 x16: ~12 GB/s effective (PCI-SIG spec 15.75 GB/s; "
                                   "CUDA bandwidthTest)"),
}

# Host<->device copies go over the GPU's PCIe 3.0 x16 slot: ~12 GB/s (see "pcie" above).
DEFAULT_H2D_GBPS = 96.0
# One-way latency of a datacenter NIC hop (RDMA ~2-5 us, kernel TCP ~10-30 us); we take the
# middle: 10 us (Guo et al., "RDMA over Commodity Ethernet at Scale", SIGCOMM 2016).
DEFAULT_INTER_LATENCY_US = 10.0
# Host threads per machine available for CPU compression; a V100 server (e.g. AWS p3.16xlarge,
# 64 vCPUs for 8 GPUs) leaves a few cores per GPU after data loading.
DEFAULT_CPU_THREADS = 16
# Aggregation threads per PS server process (BYTEPS_SERVER_ENGINE_THREAD default, config.py).
DEFAULT_SERVER_THREADS = 4


@dataclass(frozen=True)
class Cluster:
    """Everything the cost model needs to know about the machines.

    Attributes:
        machines: worker machines.
        gpus_per_machine: training processes (GPUs) per machine.
        intra_gbps / intra_latency_us: intra-machine link per GPU (NVLink, PCIe).
        inter_gbps / inter_latency_us: each machine's NIC (shared by its GPUs).
        servers: PS server processes (0: no PushPull options).
        server_gbps: NIC bandwidth of each server.
        cpu_threads: host threads per worker machine for CPU compression.
        h2d_gbps: host<->device copy bandwidth per GPU.
        server_threads: aggregation threads per server.
        intra_link: the preset name the intra link came from, or "custom".
        server_latency_us: one-way latency of a push or a pull through the servers (None:
            ``inter_latency_us``). The PS path has its own transport, so a measured profile
            sets it apart from the collectives' per-hop latency.
        lanes: the executor's lanes per worker (None: no lane limit). A lane runs one
            tensor's Option at a time in submission order, up to the issue of its in-flight
            step or to its end (``Program.in_flight``), and a tensor's lane is
            :func:`lane_of` its name; a profile measured by the runtime sets it, so the
            timeline holds each Option's tasks until the previous Option of its lane lets
            the lane go.
        exchange_latency: multiplier on the per-hop latency of the collectives in which every
            member sends and receives (Allreduce, ReduceScatter, Allgather, AllgatherC,
            AlltoallC) over the intra-machine link; rooted ones (Reduce, Broadcast(C),
            GatherC) pay the latency as it is. 1 for the presets. A profile measured by the
            runtime sets it from the profiled iterations' own steps: on a host whose cores
            the workers share, exchanges issued during backward cost more per hop than the
            probes read.
        inter_exchange_latency: the same multiplier for the exchanges over the
            inter-machine link (``inter`` scope, and ``flat`` across machines), fitted apart:
            the hierarchical uncompressed path that start-up profiles exchanges only inside
            the machines, and its intra factor, applied to the inter link's latency too,
            priced an fp16 ``AllreduceC(flat)`` LSTM plan at 76.5 ms that ran at 27.9
            (BENCHMARKS.md, "Exchange latency per link; the kernels' lane timings"). 1 until a
            timed step measures it.
        rooted_latency: the same multiplier for the rooted collectives (Reduce, Broadcast(C),
            GatherC). 1 for the presets and for a start-up profile; the runtime's check of
            the kept strategy (``worker.check``) fits it where that strategy runs them.
        shared_host: every worker machine runs on one host (``espresso-launch --local``):
            there is no inter-machine link for a hierarchy to spare, and the uncompressed
            path is flat (:func:`~byteps_espresso.strategy.baselines.fp32_option`); no
            push/pull byte crosses a machine's link (:attr:`link_share`).
        local_server_share: the share of a machine's push/pull bytes that go to servers on
            that machine, which stay off its link: ``1 / machines`` where the servers are
            spread over the worker machines, as BytePS deploys one server per machine
            (keys are spread evenly over the servers). The worker runtime sets it from the
            servers' addresses; 0 (the presets): every push/pull crosses the machine's link.
        host_device: the workers train on the host's CPU (no accelerator): ``cpu``
            Comp/Decomp run on the cores that also run the backward pass and the ``gpu``
            ones, so the timeline places them on the ``gpu`` resource instead of a host pool
            of their own: without an accelerator, compression cannot overlap the backward
            pass, as the timeline's CPU offloading assumes. The worker runtime sets it when
            it trains on the CPU.
    """

    machines: int
    gpus_per_machine: int
    intra_gbps: float
    intra_latency_us: float
    inter_gbps: float
    inter_latency_us: float = DEFAULT_INTER_LATENCY_US
    servers: int = 0
    server_gbps: float = 0.0
    cpu_threads: int = DEFAULT_CPU_THREADS
    h2d_gbps: float = DEFAULT_H2D_GBPS
    server_threads: int = DEFAULT_SERVER_THREADS
    intra_link: str = "custom"
    server_latency_us: float | None = None
    lanes: int | None = None
    exchange_latency: float = 1.0
    inter_exchange_latency: float = 1.0
    rooted_latency: float = 1.0
    shared_host: bool = False
    host_device: bool = False
    local_server_share: float = 0.0

    def __post_init__(self) -> None:
        for name in ("machines", "gpus_per_machine", "cpu_threads", "server_threads"):
            _check(name, getattr(self, name), integer=True, low=1)
        _check("servers", self.servers, integer=True, low=0)
        for name in ("intra_gbps", "inter_gbps", "h2d_gbps"):
            _check(name, getattr(self, name), low=0, strict=True)
        for name in ("intra_latency_us", "inter_latency_us", "server_gbps", "exchange_latency",
                     "inter_exchange_latency", "rooted_latency"):
            _check(name, getattr(self, name), low=0)
        _check("server_latency_us", self.server_latency_us, low=0, optional=True)
        _check("lanes", self.lanes, integer=True, low=1, optional=True)
        for name in ("shared_host", "host_device"):
            if not isinstance(getattr(self, name), bool):
                raise ClusterError(f"field {name!r} must be true or false, not "
                                   f"{getattr(self, name)!r}")
        if self.servers and not self.server_gbps > 0:
            raise ClusterError("field 'server_gbps' must be > 0 when 'servers' > 0")
        # the share of a machine's push/pull bytes for its own servers: some always cross
        _check("local_server_share", self.local_server_share, low=0, below=1)

    @property
    def world_size(self) -> int:
        return self.machines * self.gpus_per_machine

    @property
    def ps_latency_us(self) -> float:
        """One-way latency of the PS path."""
        return self.inter_latency_us if self.server_latency_us is None else self.server_latency_us

    @property
    def link_share(self) -> float:
        """The share of a machine's push/pull bytes that crosses its link: none with every
        machine on one host (no NIC for a machine's workers to share; the push/pull probe,
        which every worker runs at once, measured the servers' whole path), else all but
        those for its own servers (:attr:`local_server_share`)."""
        return 0.0 if self.shared_host else 1.0 - self.local_server_share

    @property
    def hierarchical(self) -> bool:
        """Whether hierarchical paths exist (more than one machine and GPU per machine)."""
        return self.machines > 1 and self.gpus_per_machine > 1

    def describe(self) -> str:
        ps = f", {self.servers} servers x {self.server_gbps:g} Gbps" if self.servers else ""
        return (f"{self.machines} x {self.gpus_per_machine} GPUs, intra {self.intra_link} "
                f"{self.intra_gbps:g} Gbps, inter {self.inter_gbps:g} Gbps{ps}, "
                f"{self.cpu_threads} CPU threads/machine")

    @classmethod
    def preset(cls, machines: int, gpus_per_machine: int, intra: str | float = "nvlink",
               inter_gbps: float = 100.0, *, servers: int | None = None,
               cpu_threads: int = DEFAULT_CPU_THREADS, **overrides: Any) -> Cluster:
        """A cluster with a named intra link (``nvlink``, ``pcie``) or a bandwidth in Gbit/s.

        ``servers`` defaults to one per machine (BytePS' usual co-located layout), each with
        the machines' NIC bandwidth.

        Raises:
            ClusterError: unknown preset or bad value.
        """
        if isinstance(intra, str) and intra in INTRA_PRESETS:
            link = INTRA_PRESETS[intra]
            gbps, latency, label = link.gbps, link.latency_us, intra
        else:
            try:
                gbps = float(intra)
            except ValueError:
                raise ClusterError(f"unknown intra link {intra!r}; use "
                                   f"{', '.join(INTRA_PRESETS)} or a bandwidth in Gbit/s") from None
            latency, label = INTRA_PRESETS["pcie"].latency_us, "custom"
        n_servers = machines if servers is None else servers
        values: dict[str, Any] = {
            "machines": machines, "gpus_per_machine": gpus_per_machine, "intra_gbps": gbps,
            "intra_latency_us": latency, "inter_gbps": float(inter_gbps),
            "servers": n_servers, "server_gbps": float(inter_gbps) if n_servers else 0.0,
            "cpu_threads": cpu_threads, "intra_link": label,
        }
        values.update(overrides)
        return cls(**values)

    def with_(self, **changes: Any) -> Cluster:
        return replace(self, **changes)

    # ---- JSON ---------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Any, where: str = "cluster") -> Cluster:
        """Build from a JSON object; unknown or missing fields raise naming ``where``.

        Raises:
            ClusterError: a missing, unknown or malformed field.
        """
        if not isinstance(data, dict):
            raise ClusterError(f"{where}: expected a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ClusterError(f"{where}: unknown field {unknown[0]!r}; known fields: "
                               f"{', '.join(sorted(known))}")
        required = ("machines", "gpus_per_machine", "intra_gbps", "intra_latency_us",
                    "inter_gbps")
        for name in required:
            if name not in data:
                raise ClusterError(f"{where}: field {name!r} is missing")
        try:
            return cls(**data)
        except (ClusterError, TypeError) as exc:
            raise ClusterError(f"{where}: {exc}") from None

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Cluster:
        """Read a cluster JSON file (the fields of this class).

        Raises:
            ClusterError: unreadable file, bad JSON or malformed field (names the file).
        """
        return cls.from_dict(read_json(path, ClusterError, "cluster file"), str(path))
