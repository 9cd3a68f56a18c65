"""An emulated multi-machine cluster on one host: network namespaces and shaped links.

Topology of one run (every name starts with the run's unique prefix ``esp<pid>x<hex>``)::

    <prefix>-br:    bridge br0 ── veth ──┬── <prefix>-sched  eth0 10.213.0.1  (scheduler)
                                         ├── <prefix>-s0     eth0 10.213.0.2  (server 0) ...
                                         └── <prefix>-m0     eth0 10.213.0.N  (machine 0) ...

Every node's link is shaped in both directions (egress of the node's ``eth0`` and of its
peer on the bridge) with ``tbf`` to ``inter_gbps``, plus ``netem`` delay of half the one-way
latency on each side when ``inter_latency_ms > 0``. Workers of one machine share its
namespace and talk over its (unshaped) loopback, as GPUs of one machine share NVLink/PCIe.
With ``colocate`` the servers get no namespaces of their own: server ``j`` runs in machine
``j mod machines``'s, beside its workers, as BytePS deploys a server per worker machine. A
machine's traffic to its own server then stays off the link (and, being one host to the
runtime, goes through shared memory where ``BYTEPS_ENABLE_IPC`` allows).

The subnet exists only inside the run's namespaces: nothing is added to the host's network
stack, so traffic cannot leave them and concurrent runs (distinct prefixes) never collide.
:class:`EmulatedCluster` is a context manager that always deletes its namespaces, also on
errors and Ctrl-C; :func:`sweep_stale` removes namespaces of launchers that died by SIGKILL.

Example (as root)::

    with EmulatedCluster(machines=2, servers=1, inter_gbps=1.0) as cluster:
        where = cluster.placement("worker", 1)  # ip netns exec <prefix>-m1 ..., 10.213.0.4
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import re
import secrets
import shutil
import signal
import subprocess
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from byteps_espresso.deploy.reaper import Reaper

__all__ = [
    "DEFAULT_SUBNET",
    "EmulatedCluster",
    "EmulationError",
    "Placement",
    "check_host",
    "delete_namespace",
    "list_namespaces",
    "shape_args",
    "sweep_stale",
]

log = logging.getLogger(__name__)

# Private test subnet, configured only inside the namespaces a run creates.
DEFAULT_SUBNET = "10.213.0.0/24"
# gloo and NCCL pick their interface from the host name, which resolves to the host's
# loopback inside a namespace; point them at the namespace's link instead.
_NAMESPACE_ENV = (("GLOO_SOCKET_IFNAME", "eth0"), ("NCCL_SOCKET_IFNAME", "eth0"))
_PREFIX_RE = re.compile(r"^esp(\d+)x[0-9a-f]{4}-")
# tbf bucket: 1 ms of traffic at the shaped rate, at least 128 KiB so that a 64 KiB GSO
# segment always fits (tbf would otherwise split it). Queue: 50 ms at the shaped rate.
_BURST_S = 1e-3
_MIN_BURST_BYTES = 128 * 1024
_QUEUE_LATENCY_MS = 50
_TIMEOUT_S = 30.0  # any single ip/tc command


class EmulationError(RuntimeError):
    """The emulated cluster cannot be built here; the message says what to change."""


@dataclass(frozen=True)
class Placement:
    """Where a process runs.

    Attributes:
        prefix: command prefix, e.g. ``("ip", "netns", "exec", NS)``.
        host: the address the process binds and advertises (``DMLC_NODE_HOST``).
        env: extra variables for libraries the launcher does not configure otherwise.
    """

    prefix: tuple[str, ...] = ()
    host: str = "127.0.0.1"
    env: tuple[tuple[str, str], ...] = ()


def shape_args(gbps: float, one_way_ms: float) -> list[list[str]]:
    """tc arguments (after ``tc qdisc add dev DEV``) shaping one direction of one link.

    Args:
        gbps: rate in Gbit/s (> 0).
        one_way_ms: delay added in this direction, ms (>= 0; 0 adds no netem).

    Returns:
        one argument list per qdisc, root first.
    """
    rate_bytes = gbps * 1e9 / 8
    burst = max(_MIN_BURST_BYTES, int(rate_bytes * _BURST_S))
    tbf = ["tbf", "rate", f"{gbps * 1000:.3f}mbit", "burst", str(burst),
           "latency", f"{_QUEUE_LATENCY_MS}ms"]
    if one_way_ms <= 0:
        return [["root", "handle", "1:", *tbf]]
    return [["root", "handle", "1:", "netem", "delay", f"{one_way_ms:.3f}ms"],
            ["parent", "1:1", "handle", "10:", *tbf]]


def _sh(argv: Sequence[str]) -> str:
    try:
        done = subprocess.run(list(argv), capture_output=True, text=True, timeout=_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise EmulationError(f"`{' '.join(argv)}` did not finish in {_TIMEOUT_S:g} s") from None
    if done.returncode != 0:
        raise EmulationError(f"`{' '.join(argv)}` failed: {done.stderr.strip()}")
    return done.stdout


def list_namespaces() -> list[str]:
    """Names of the network namespaces on this host (``ip netns list``)."""
    return [line.split()[0] for line in _sh(["ip", "netns", "list"]).splitlines() if line]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale() -> list[str]:
    """Delete namespaces left by emulated runs whose launcher no longer exists.

    Returns:
        the deleted namespace names.
    """
    stale = []
    for name in list_namespaces():
        match = _PREFIX_RE.match(name)
        if match and not _pid_alive(int(match.group(1))):
            delete_namespace(name)
            stale.append(name)
    if stale:
        log.info("removed %d namespace(s) of dead emulated runs", len(stale))
    return stale


def delete_namespace(name: str) -> None:
    """Kill every process still inside namespace ``name`` and delete it (absent: no-op)."""
    with contextlib.suppress(EmulationError):
        for pid in _sh(["ip", "netns", "pids", name]).split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
    with contextlib.suppress(EmulationError):
        _sh(["ip", "netns", "delete", name])


def check_host() -> None:
    """Raise :class:`EmulationError` unless this host can build namespaces (root, ip, tc)."""
    if os.geteuid() != 0:
        raise EmulationError(
            "--emulate needs root (it creates network namespaces and shapes links with tc); "
            "run it as root, or use --local without --emulate")
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise EmulationError(f"--emulate needs iproute2 ({', '.join(missing)} not found); "
                             "install it, e.g. `apt-get install iproute2`")


class EmulatedCluster:
    """Namespaces for a scheduler, ``servers`` servers and ``machines`` worker machines.

    Args:
        machines: worker machines (one namespace each).
        servers: parameter-server processes (one namespace each, unless ``colocate``).
        inter_gbps: bandwidth of every node's link, Gbit/s.
        inter_latency_ms: one-way latency between two nodes, ms (half on each link).
        subnet: private IPv4 subnet for the bridge (default :data:`DEFAULT_SUBNET`).
        reaper: told about every namespace before it is created, so that it is deleted
            even if this process is killed outright.
        colocate: run server ``j`` in machine ``j mod machines``'s namespace instead of its
            own.

    Raises:
        EmulationError: not root, iproute2 missing, bad parameters, or the kernel lacks a
            qdisc (``netem`` is needed only for a latency > 0).
    """

    def __init__(self, machines: int, servers: int, inter_gbps: float,
                 inter_latency_ms: float = 0.0, *, subnet: str = DEFAULT_SUBNET,
                 reaper: Reaper | None = None, colocate: bool = False):
        if machines < 1 or servers < 0:
            raise EmulationError(f"need machines >= 1 and servers >= 0, got {machines}, "
                                 f"{servers}")
        if not inter_gbps > 0 or inter_latency_ms < 0:
            raise EmulationError("need --inter-gbps > 0 and --inter-latency-ms >= 0, got "
                                 f"{inter_gbps} and {inter_latency_ms}")
        self.machines, self.colocate = machines, colocate
        self.nodes = ["sched"] + [f"s{j}" for j in range(0 if colocate else servers)] + [
            f"m{i}" for i in range(machines)]
        hosts = list(ipaddress.ip_network(subnet).hosts())
        if len(hosts) < len(self.nodes):
            raise EmulationError(f"subnet {subnet} has {len(hosts)} addresses for "
                                 f"{len(self.nodes)} nodes; use a bigger one")
        self.prefixlen = ipaddress.ip_network(subnet).prefixlen
        self.addresses = {node: str(hosts[i]) for i, node in enumerate(self.nodes)}
        self.inter_gbps, self.inter_latency_ms = inter_gbps, inter_latency_ms
        self.prefix = f"esp{os.getpid()}x{secrets.token_hex(2)}"
        self.created: list[str] = []
        self.reaper = reaper

    # ---- naming ---------------------------------------------------------------------------
    def namespace(self, node: str) -> str:
        """Namespace name of ``node`` (``sched``, ``s<j>``, ``m<i>`` or ``br``)."""
        return f"{self.prefix}-{node}"

    def node_of(self, role: str, index: int) -> str:
        """Node hosting process ``index`` of ``role`` (machine id for workers)."""
        if role == "server" and self.colocate:
            return f"m{index % self.machines}"
        return {"scheduler": "sched", "server": f"s{index}", "worker": f"m{index}"}[role]

    def placement(self, role: str, index: int) -> Placement:
        """Where process ``index`` of ``role`` runs: ``ip netns exec`` prefix and address."""
        node = self.node_of(role, index)
        return Placement(("ip", "netns", "exec", self.namespace(node)), self.addresses[node],
                         _NAMESPACE_ENV)

    # ---- lifecycle ------------------------------------------------------------------------
    def __enter__(self) -> EmulatedCluster:
        check_host()
        sweep_stale()
        try:
            with _signals_blocked():
                self._build()
        except BaseException:
            self.teardown()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.teardown()

    def teardown(self) -> None:
        """Kill what still runs in the namespaces and delete them (idempotent)."""
        with _signals_blocked():
            for name in reversed(self.created):
                delete_namespace(name)
            self.created.clear()

    def _add_namespace(self, node: str) -> str:
        name = self.namespace(node)
        if self.reaper is not None:
            self.reaper.watch_namespace(name)
        _sh(["ip", "netns", "add", name])
        self.created.append(name)
        _sh(["ip", "-n", name, "link", "set", "lo", "up"])
        return name

    def _build(self) -> None:
        bridge = self._add_namespace("br")
        _sh(["ip", "-n", bridge, "link", "add", "br0", "type", "bridge"])
        _sh(["ip", "-n", bridge, "link", "set", "br0", "up"])
        for node in self.nodes:
            name = self._add_namespace(node)
            _sh(["ip", "-n", name, "link", "add", "eth0", "type", "veth", "peer", "name",
                 node, "netns", bridge])
            _sh(["ip", "-n", bridge, "link", "set", node, "master", "br0"])
            _sh(["ip", "-n", bridge, "link", "set", node, "up"])
            _sh(["ip", "-n", name, "addr", "add",
                 f"{self.addresses[node]}/{self.prefixlen}", "dev", "eth0"])
            _sh(["ip", "-n", name, "link", "set", "eth0", "up"])
            self._shape(name, "eth0")
            self._shape(bridge, node)
        log.info("emulated cluster %s: %d nodes on %g Gbit/s links, %g ms one-way latency",
                 self.prefix, len(self.nodes), self.inter_gbps, self.inter_latency_ms)

    def _shape(self, namespace: str, device: str) -> None:
        for qdisc in shape_args(self.inter_gbps, self.inter_latency_ms / 2):
            try:
                _sh(["tc", "-n", namespace, "qdisc", "add", "dev", device, *qdisc])
            except EmulationError as exc:
                if "unknown" in str(exc).lower():
                    raise EmulationError(
                        f"this kernel lacks the `{_kind(qdisc)}` qdisc ({exc}); "
                        + ("use --inter-latency-ms 0 or load sch_netem"
                           if _kind(qdisc) == "netem" else "load sch_tbf")) from None
                raise


def _kind(qdisc: list[str]) -> str:
    return next(word for word in qdisc if word in ("tbf", "netem"))


@contextlib.contextmanager
def _signals_blocked() -> Iterator[None]:
    """Defer SIGINT/SIGTERM while namespaces are created or deleted (no half-built state)."""
    blocked = {signal.SIGINT, signal.SIGTERM}
    old = signal.pthread_sigmask(signal.SIG_BLOCK, blocked)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)
