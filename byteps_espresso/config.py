"""Every environment variable byteps-espresso reads, declared once and parsed once.

The BytePS / ps-lite variables keep their names and meaning so that a BytePS job's
environment works unchanged; the project's own knobs are prefixed ``ESPRESSO_``. Nothing
below this module reads ``os.environ``: callers build a :class:`Config` with
:func:`Config.from_env` and pass it down. The one write is
:meth:`Config.export_socket_interfaces`, which hands gloo and NCCL (libraries that read only
the environment) the interface this process advertises.

Example:
    >>> cfg = Config.from_env({"DMLC_ROLE": "worker", "DMLC_NUM_WORKER": "2",
    ...                        "DMLC_NUM_SERVER": "1", "DMLC_PS_ROOT_URI": "127.0.0.1",
    ...                        "DMLC_PS_ROOT_PORT": "9000"})
    >>> cfg.world_size
    2
"""

from __future__ import annotations

import enum
import functools
import ipaddress
import logging
import os
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

__all__ = ["UNSUPPORTED", "VARIABLES", "Address", "Config", "ConfigError", "Role", "Secret",
           "Unsupported", "Variable", "interface_address", "interfaces", "markdown_table",
           "variable"]

log = logging.getLogger(__name__)


class ConfigError(ValueError):
    """A variable is missing or malformed; the message names it and says what to change."""


class Role(str, enum.Enum):
    SCHEDULER = "scheduler"
    SERVER = "server"
    WORKER = "worker"


def _int(low: int, high: int | None = None) -> Callable[[str], int]:
    def parse(text: str) -> int:
        value = int(text)
        if value < low or (high is not None and value > high):
            bound = f">= {low}" if high is None else f"in [{low}, {high}]"
            raise ValueError(f"must be an integer {bound}")
        return value

    return parse


def _optional_int(low: int) -> Callable[[str], int | None]:
    def parse(text: str) -> int | None:
        return _int(low)(text) if text.strip() else None

    return parse


def _float(low: float) -> Callable[[str], float]:
    def parse(text: str) -> float:
        value = float(text)
        if not value > low:
            raise ValueError(f"must be a number > {low}")
        return value

    return parse


def _patterns(text: str) -> tuple[str, ...] | None:
    stripped = text.strip()
    if not stripped:
        return None
    if stripped.lower() == "none":
        return ()
    patterns = tuple(p.strip() for p in stripped.split(","))
    if not all(patterns):
        raise ValueError("must be comma-separated name globs without empty items, or `none`")
    return patterns


def _optional_float(low: float) -> Callable[[str], float | None]:
    def parse(text: str) -> float | None:
        return _float(low)(text) if text.strip() else None

    return parse


def _budget(text: str) -> float | None:
    if text.strip().lower() == "none":
        return None
    value = float(text)
    if not value >= 0:
        raise ValueError("must be a number of fp32 iterations >= 0, or `none`")
    return value


def _bucket_cap(text: str) -> float | None:
    lowered = text.strip().lower()
    if lowered in ("", "auto"):
        return None
    value = float(lowered)
    if not value >= 0:
        raise ValueError("must be `auto` or a number of MiB >= 0")
    return value


def _nonfinite(text: str) -> str:
    mode = text.strip().lower()
    if mode not in ("error", "skip"):
        raise ValueError("must be `error` (stop the job) or `skip` (skip the step)")
    return mode


# ESPRESSO_DEVICE_KERNELS: the kernels of Comp(gpu)/Decomp(gpu) (worker.codecs.device_backend).
DEVICE_KERNELS = ("auto", "torch", "numba")


def _device_kernels(text: str) -> str:
    choice = text.strip().lower()
    if choice not in DEVICE_KERNELS:
        raise ValueError(f"must be one of {', '.join(DEVICE_KERNELS)}")
    return choice


def _role(text: str) -> Role:
    return Role(text.strip().lower())


def _host(text: str) -> str:
    text = text.strip()
    if not text:
        raise ValueError("must be a host name or IP address")
    return text


def _optional(text: str) -> str | None:
    return text or None


def _flag(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off", ""):
        return False
    raise ValueError("must be 0/1, true/false, yes/no or on/off")


# BytePS's level names (BYTEPS_LOG_LEVEL: TRACE, DEBUG, INFO, WARNING, ERROR, FATAL) mapped to
# Python's; Python's own names map to themselves.
_LEVEL_NAMES = {"TRACE": "DEBUG", "DEBUG": "DEBUG", "INFO": "INFO", "WARN": "WARNING",
                "WARNING": "WARNING", "ERROR": "ERROR", "FATAL": "CRITICAL",
                "CRITICAL": "CRITICAL"}


# Shortest job secret accepted, in characters: 16 random characters already put guessing out of
# reach; `espresso-launch` generates 64 hex digits (256 bits).
MIN_SECRET_CHARS = 16


class Secret(str):
    """A string that never shows itself in ``repr``/``str`` (so not in logs or `espresso
    config`); :meth:`reveal` gives the value."""

    def reveal(self) -> str:
        return str.__str__(self)

    def __repr__(self) -> str:
        return "Secret('***')"

    def __str__(self) -> str:
        return "***"


def _secret(text: str) -> Secret:
    if len(text.strip()) < MIN_SECRET_CHARS:
        raise ValueError(f"must have at least {MIN_SECRET_CHARS} characters")
    return Secret(text.strip())


def _log_level(text: str) -> str:
    level = _LEVEL_NAMES.get(text.strip().upper())
    if level is None:
        raise ValueError("must be one of DEBUG, INFO, WARNING, ERROR, CRITICAL (BytePS's "
                         "TRACE and FATAL are read as DEBUG and CRITICAL)")
    return level


@dataclass(frozen=True)
class Variable:
    """One environment variable: where it lands in :class:`Config` and how it is parsed."""

    name: str
    attr: str
    parse: Callable[[str], Any]
    default: Any
    doc: str
    # Roles for which the variable must be set (no default applies to them).
    required_for: frozenset[Role] = frozenset()
    # Other names read, in order, when this one is unset (same parser, same meaning).
    fallbacks: tuple[str, ...] = ()


_EVERY_ROLE = frozenset(Role)

VARIABLES: tuple[Variable, ...] = (
    # ---- BytePS / ps-lite contract -------------------------------------------------------
    Variable("DMLC_ROLE", "role", _role, Role.WORKER,
             "Process role: `scheduler`, `server` or `worker`."),
    Variable("DMLC_NUM_WORKER", "num_machines", _int(1), 1,
             "Number of worker machines (BytePS counts machines, not processes).",
             _EVERY_ROLE),
    Variable("DMLC_NUM_SERVER", "num_servers", _int(0), 0,
             "Number of parameter-server processes.", _EVERY_ROLE),
    Variable("DMLC_PS_ROOT_URI", "root_uri", _host, "127.0.0.1",
             "Address of the scheduler; also the torch.distributed rendezvous host.",
             _EVERY_ROLE),
    Variable("DMLC_PS_ROOT_PORT", "root_port", _int(1, 65535), 9000,
             "Scheduler port; the torch.distributed store listens on the next port.",
             _EVERY_ROLE),
    Variable("DMLC_NODE_HOST", "node_host", _optional, None,
             "Address this process binds to and advertises. Unset: as ps-lite, the address "
             "of `DMLC_INTERFACE`, else of the interface that routes to `DMLC_PS_ROOT_URI`, "
             "else of the first non-loopback interface (127.0.0.1 only when the root URI is "
             "loopback)."),
    Variable("DMLC_INTERFACE", "interface", _optional, None,
             "Network interface whose IPv4 address is bound and advertised."),
    Variable("DMLC_WORKER_ID", "machine_id", _int(0), 0,
             "Index of this worker machine, in [0, DMLC_NUM_WORKER)."),
    Variable("BYTEPS_LOCAL_RANK", "local_rank", _int(0), 0,
             "Index of this training process on its machine, in [0, BYTEPS_LOCAL_SIZE)."),
    Variable("BYTEPS_LOCAL_SIZE", "local_size", _int(1), 1,
             "Training processes (GPUs) per worker machine."),
    Variable("CUDA_VISIBLE_DEVICES", "visible_devices", _optional, None,
             "GPUs of this machine. Every training process of a machine sees all of them "
             "and uses `cuda:<BYTEPS_LOCAL_RANK>` (`torch.cuda.set_device(bps.local_rank())`); "
             "`espresso-launch --local` gives each emulated machine its share (default: "
             "every GPU `nvidia-smi -L` lists; none: CPU training)."),
    Variable("OMP_NUM_THREADS", "intra_op_threads", _optional_int(1), None,
             "torch intra-op threads per training process (default: this machine's cores / "
             "`BYTEPS_LOCAL_SIZE`, at least 1, as torchrun does)."),
    Variable("BYTEPS_PARTITION_BYTES", "partition_bytes", _int(1024), 4_096_000,
             "Largest PS key in bytes; bigger tensors are split into several keys "
             "(BytePS default 4096000)."),
    Variable("BYTEPS_SERVER_ENGINE_THREAD", "server_threads", _int(1, 256), 4,
             "Aggregation threads per server process (numba kernels)."),
    Variable("BYTEPS_ENABLE_IPC", "enable_ipc", _flag, True,
             "Dense float32 keys go through shared memory (`/dev/shm`) between a worker and a "
             "server on the same host (the same boot, network namespace and `/dev/shm`), as "
             "BytePS's IPC mode for colocated servers (which BytePS leaves off by default); "
             "other pairs stay on TCP. `0`: every key on TCP."),
    # ---- addresses and GPUs as BytePS / ps-lite / the container runtime hand them out ------
    Variable("NVIDIA_VISIBLE_DEVICES", "nvidia_visible_devices", _optional, None,
             "GPUs the container runtime exposes, as BytePS's launcher reads them: with "
             "`BYTEPS_LOCAL_SIZE` unset, a worker's `bpslaunch` starts one training process "
             "per listed GPU (`all`: per GPU `nvidia-smi -L` lists; `none`/`void`: one, on "
             "the CPU)."),
    Variable("GLOO_SOCKET_IFNAME", "gloo_ifname", _optional, None,
             "Interface gloo connects over (default: the one holding the address this "
             "process advertises)."),
    Variable("NCCL_SOCKET_IFNAME", "nccl_ifname", _optional, None,
             "Interface NCCL bootstraps over (default: the one holding the address this "
             "process advertises)."),
    # ---- byteps-espresso knobs -----------------------------------------------------------
    Variable("ESPRESSO_BIND_ALL", "bind_all", _flag, False,
             "Bind listening sockets to 0.0.0.0 instead of the configured interface. "
             "Off by default; only for containers whose pod IP is not known up front."),
    Variable("ESPRESSO_SERVER_PORT", "server_port", _int(0, 65535), 0,
             "Port a server process listens on (0: a free port; set a fixed one where a "
             "firewall or NetworkPolicy admits only declared ports, as the Kubernetes "
             "manifests do)."),
    Variable("ESPRESSO_START_TIMEOUT", "start_timeout_s", _float(0.0), 60.0,
             "Seconds the scheduler waits for every node to register before every "
             "process exits with an error listing the missing ones."),
    Variable("ESPRESSO_TIMEOUT", "op_timeout_s", _float(0.0), 60.0,
             "Seconds any single push/pull or collective may wait before it fails "
             "naming the key, round and peer."),
    Variable("ESPRESSO_HEARTBEAT_TIMEOUT", "heartbeat_timeout_s", _float(1.0), 5.0,
             "Seconds without a heartbeat after which a stopped or unreachable scheduler, "
             "server or worker is declared lost and the job ends naming it. ZeroMQ's I/O "
             "thread sends and answers these heartbeats, so a worker whose Python code holds "
             "the GIL for longer stays alive; `espresso-launch` also ends a job one of whose "
             "processes (or itself) has been stopped this long."),
    Variable("ESPRESSO_FAULT_FILE", "fault_file", _optional, None,
             "File to which a process that finds another one lost appends one JSON line "
             "naming it (`espresso-launch` sets it, so that its last line names the culprit "
             "rather than the first process that exited because of it)."),
    Variable("ESPRESSO_MAX_MESSAGE_BYTES", "max_message_bytes", _int(1024), 1 << 30,
             "Largest wire message accepted, in bytes; bigger ones are rejected before "
             "anything is allocated."),
    Variable("ESPRESSO_COMPRESSOR", "compressor", _optional, None,
             "Compressor (see `espresso compressors`) that a `DistributedOptimizer` created "
             "with `Compression.none` (the default, as unchanged BytePS scripts create it) "
             "plans with instead, as `Compression.espresso(name)` with the compressor's "
             "default parameters (`powersgd`: `Compression.powersgd()`, rank 1)."),
    Variable("ESPRESSO_STRATEGY", "strategy_path", _optional, None,
             "Strategy JSON planned offline (`espresso plan`): every `DistributedOptimizer` "
             "uses it whatever compression the script passes; no profiling or planning at "
             "start-up."),
    Variable("ESPRESSO_PROFILE_STEPS", "profile_steps", _int(0), 4,
             "Uncompressed iterations profiled before planning (the first max(2, lanes) "
             "also probe links and the compressor in the lanes; below 2: probes with "
             "training paused)."),
    Variable("ESPRESSO_TRIAL_STEPS", "trial_steps", _int(0), 6,
             "Iterations each finalist strategy runs after planning (the first is a "
             "warm-up; the fastest measured is kept; one trailing the fastest so far, or "
             "the profiled fp32 iterations, by over 1.3x after 2 timed iterations stops "
             "there; the fp32 finalist is measured by the profiled iterations that ran no "
             "probes). They begin after the compressor's schedule (dgc's warm-up), which "
             "the planned strategy trains through. Below 2: use the planned strategy at "
             "once."),
    Variable("ESPRESSO_CHECK_STEPS", "check_steps", _int(0), 6,
             "Iterations of the kept strategy (after the compressor's schedule) timed step "
             "by step and checked against the model: the first is a warm-up; the latencies "
             "and the kernels' costs are refitted to the steps, the model re-plans once, "
             "and a plan predicted 10% faster runs as many iterations and stays only if it "
             "measures faster; fall-backs are checked instead, by the same rule: for fp16 "
             "DDP's fp16-hook plan (every bucket cast and all-reduced), then the fp32 path "
             "where the profiled fp32 iterations measured 10% faster "
             "(`check.json` in `ESPRESSO_PROFILE_OUT`). Below 2: no check."),
    Variable("ESPRESSO_STARTUP_BUDGET", "startup_budget", _budget, 10.0,
             "Start-up budget, in fp32 iterations (the fastest profiled one, over all "
             "ranks): from the first step to the first iteration under the kept strategy. "
             "The trials "
             "spend what profiling, planning and a compressor's warm-up leave of it: a "
             "finalist runs only where its iterations fit (priced at its prediction times "
             "the model's error seen so far); none fits: the planned strategy is kept "
             "untried (0: no trials). `none`: every finalist runs."),
    Variable("ESPRESSO_BUCKET_CAP_MB", "bucket_cap_mb", _bucket_cap, None,
             "Tensor fusion: gradients ready together in backward order are synchronized as "
             "one bucket of at most this many MiB (0: every gradient alone). `auto`: the "
             "planner picks the cap with `Compression.espresso`, DDP's 25 MiB otherwise."),
    Variable("ESPRESSO_NONFINITE", "nonfinite", _nonfinite, "error",
             "A NaN or Inf gradient on any rank: `error` stops every rank naming the tensor, "
             "rank and step; `skip` makes every rank skip that optimizer step (as AMP's "
             "GradScaler does) and count it."),
    Variable("ESPRESSO_EXCLUDE", "exclude", _patterns, None,
             "Parameters `Compression.espresso` keeps uncompressed, as comma-separated name "
             "globs (`*.bias,*norm*`; `none`: compress any). Unset: those of at most one "
             "dimension (biases, normalization scales), none for fp16. `exclude=` in code wins."),
    Variable("ESPRESSO_COMPRESSION_ERROR_EVERY", "compression_error_every", _int(0), 100,
             "Every this many iterations each rank measures the relative compression error "
             "of every compressed bucket (norm of what it sent minus its gradient over the "
             "gradient's norm; error feedback's carried residual counted) and rank 0 logs "
             "them. 0: never."),
    Variable("ESPRESSO_COMPRESSION_ERROR_BUDGET", "compression_error_budget",
             _optional_float(0.0), None,
             "When set, a compressed bucket whose measured error (the largest over ranks) "
             "exceeds it is synchronized uncompressed from then on, on every rank."),
    Variable("ESPRESSO_PROFILE_OUT", "profile_out", _optional, None,
             "Directory where rank 0 writes the measured workload and planned strategy."),
    Variable("ESPRESSO_CPU_THREADS", "cpu_threads", _int(1, 1024), 2,
             "Host threads per machine for CPU (numba) compression on workers."),
    Variable("ESPRESSO_DEVICE_KERNELS", "device_kernels", _device_kernels, "auto",
             "Kernels of `Comp(gpu)`/`Decomp(gpu)`: `torch` ops on the training device, or "
             "`numba` (host memory only; bit-identical payloads). `auto`: torch on GPUs; on "
             "a CPU training device numba, but torch for fp16 and bf16 (faster there)."),
    Variable("ESPRESSO_SEED", "seed", _int(0), 0,
             "Seed of every stochastic compressor (random-k, QSGD, TernGrad, ...) planned "
             "with `Compression.espresso` unless its parameters name one (a strategy file "
             "keeps the seed it was planned with)."),
    Variable("ESPRESSO_LOG_LEVEL", "log_level", _log_level, "INFO",
             "Logging level of library code (unset: `BYTEPS_LOG_LEVEL`, whose TRACE and "
             "FATAL read as DEBUG and CRITICAL).", fallbacks=("BYTEPS_LOG_LEVEL",)),
    Variable("ESPRESSO_JOB_SECRET", "job_secret", _secret, None,
             "Per-job secret (at least 16 characters) that authenticates every scheduler and "
             "server message; `espresso-launch --local/--emulate --auth` generates one. "
             "Unset: the "
             "job runs unauthenticated, as BytePS does, and says so once."),
    Variable("ESPRESSO_JOB_SECRET_FILE", "job_secret_file", _optional, None,
             "File holding the job secret (e.g. a mounted Kubernetes Secret), instead of "
             "`ESPRESSO_JOB_SECRET`."),
)


@dataclass(frozen=True)
class Unsupported:
    """A BytePS / ps-lite variable this project does not implement.

    Attributes:
        name: the variable.
        why: what setting it would ask for, and what to do instead.
        fatal: set to a true value it would change the training result, so the job refuses to
            start; otherwise a warning (once per job, from rank 0).
    """

    name: str
    why: str
    fatal: bool = False


# From BytePS's docs/env.md (and ps-lite's environment). Values that mean "off" (0, false, an
# empty string) are accepted silently: they ask for what this project does anyway.
UNSUPPORTED: tuple[Unsupported, ...] = (
    Unsupported("BYTEPS_ENABLE_ASYNC", "asks for asynchronous training, which is not "
                "implemented here: every step would still be synchronous. Unset it (or set 0)",
                fatal=True),
    Unsupported("DMLC_ENABLE_RDMA", "asks for RDMA; the PS speaks TCP (ZeroMQ) and the "
                "collectives use gloo or NCCL's own transports"),
    Unsupported("PS_VERBOSE", "is ps-lite's verbosity; set ESPRESSO_LOG_LEVEL=DEBUG instead"),
    Unsupported("BYTEPS_ENABLE_GDB", "(run under gdb) is not supported by bpslaunch; run "
                "the command under gdb yourself"),
    Unsupported("BYTEPS_DEBUG_SAMPLE_TENSOR", "(print a key's values) is not supported; set "
                "ESPRESSO_LOG_LEVEL=DEBUG"),
    Unsupported("BYTEPS_FORCE_DISTRIBUTED", "has no effect: the parameter servers are used "
                "whenever DMLC_NUM_SERVER > 0, also with one machine"),
    Unsupported("BYTEPS_PCIE_SWITCH_SIZE", "has no effect: the planner chooses each tensor's "
                "intra-machine path"),
    Unsupported("BYTEPS_NCCL_NUM_RINGS", "has no effect: NCCL's own variables apply"),
    Unsupported("BYTEPS_NCCL_GROUP_SIZE", "has no effect: NCCL's own variables apply"),
    Unsupported("BYTEPS_SERVER_ENABLE_SCHEDULE", "has no effect: servers serve keys in "
                "arrival order"),
    Unsupported("BYTEPS_NUMA_ON", "has no effect: no core pinning here"),
    Unsupported("BYTEPS_NUMA_DEFAULT_QUOTA", "has no effect: no core pinning here; set "
                "OMP_NUM_THREADS and ESPRESSO_CPU_THREADS"),
    Unsupported("BYTEPS_CPU_BLACKLIST", "has no effect: no core pinning here"),
    Unsupported("BYTEPS_VISIBLE_CPU_CORES", "has no effect: no core pinning here; pin "
                "with taskset or your container's cpuset"),
    Unsupported("BYTEPS_MULTITHREADED_CPU", "has no effect: no core pinning here"),
    Unsupported("BYTEPS_REDUCE_ROOTS", "has no effect: the planner chooses reduce or "
                "reduce-scatter per tensor"),
    Unsupported("BYTEPS_DISABLE_P2P", "has no effect: there is no peer-to-peer send/recv "
                "API here"),
    Unsupported("BYTEPS_DISABLE_CPU_ALLREDUCE", "has no effect: Options choose the "
                "collectives per tensor"),
    Unsupported("BYTEPS_DISABLE_GPU_ALLREDUCE", "has no effect: Options choose the "
                "collectives per tensor"),
    Unsupported("BYTEPS_TRACE_ON", "(BytePS's timeline) is not supported; `espresso plan "
                "--timeline` draws the predicted one"),
    Unsupported("DMLC_USE_KUBERNETES", "is not read; set ESPRESSO_BIND_ALL=1 where pods must "
                "bind all interfaces"),
)


@dataclass(frozen=True)
class Config:
    """The parsed environment of one process. Build it with :meth:`from_env`."""

    role: Role = Role.WORKER
    num_machines: int = 1
    num_servers: int = 0
    root_uri: str = "127.0.0.1"
    root_port: int = 9000
    node_host: str | None = None
    interface: str | None = None
    machine_id: int = 0
    local_rank: int = 0
    local_size: int = 1
    visible_devices: str | None = None
    intra_op_threads: int | None = None
    partition_bytes: int = 4_096_000
    server_threads: int = 4
    enable_ipc: bool = True
    server_port: int = 0
    bind_all: bool = False
    start_timeout_s: float = 60.0
    op_timeout_s: float = 60.0
    heartbeat_timeout_s: float = 5.0
    fault_file: str | None = None
    max_message_bytes: int = 1 << 30
    compressor: str | None = None
    strategy_path: str | None = None
    profile_steps: int = 4
    trial_steps: int = 6
    check_steps: int = 6
    startup_budget: float | None = 10.0
    bucket_cap_mb: float | None = None
    nonfinite: str = "error"
    exclude: tuple[str, ...] | None = None
    compression_error_every: int = 100
    compression_error_budget: float | None = None
    profile_out: str | None = None
    cpu_threads: int = 2
    device_kernels: str = "auto"
    seed: int = 0
    log_level: str = "INFO"
    # Addresses and GPUs as BytePS / ps-lite / the container runtime hand them out.
    nvidia_visible_devices: str | None = None
    gloo_ifname: str | None = None
    nccl_ifname: str | None = None
    # Unsupported BytePS / ps-lite variables set to a true value: (name, value), see
    # :data:`UNSUPPORTED`; reported by :meth:`ignored_warnings`.
    ignored: tuple[tuple[str, str], ...] = field(default=(), compare=False, repr=False)
    job_secret: Secret | None = field(default=None, repr=False)
    job_secret_file: str | None = None
    # Variables present in the environment, for error messages and `espresso config`.
    explicit: frozenset[str] = field(default=frozenset(), compare=False, repr=False)

    def __post_init__(self) -> None:
        self._check_range("DMLC_WORKER_ID", self.machine_id, self.num_machines,
                          "DMLC_NUM_WORKER")
        self._check_range("BYTEPS_LOCAL_RANK", self.local_rank, self.local_size,
                          "BYTEPS_LOCAL_SIZE")
        self.secret()  # a missing or short secret file fails here, naming the variable

    def secret(self) -> bytes | None:
        """The job secret from ``ESPRESSO_JOB_SECRET`` or ``ESPRESSO_JOB_SECRET_FILE``, or
        None when the job runs unauthenticated.

        Raises:
            ConfigError: both variables are set, or the file is unreadable or too short.
        """
        if self.job_secret_file is None:
            return None if self.job_secret is None else self.job_secret.reveal().encode()
        if self.job_secret is not None:
            raise ConfigError("ESPRESSO_JOB_SECRET and ESPRESSO_JOB_SECRET_FILE are both set; "
                              "set only one")
        try:
            with open(self.job_secret_file, "rb") as f:
                text = f.read(1 << 16).strip()
        except OSError as exc:
            raise ConfigError(f"ESPRESSO_JOB_SECRET_FILE={self.job_secret_file!r} cannot be "
                              f"read ({exc.strerror}); point it at the job's secret file") from None
        if len(text) < MIN_SECRET_CHARS:
            raise ConfigError(f"ESPRESSO_JOB_SECRET_FILE={self.job_secret_file!r} holds "
                              f"{len(text)} characters; a job secret needs at least "
                              f"{MIN_SECRET_CHARS}")
        return text

    @staticmethod
    def _check_range(name: str, value: int, bound: int, bound_name: str) -> None:
        if not 0 <= value < bound:
            raise ConfigError(
                f"{name}={value} is out of range: it must be in [0, {bound}) because "
                f"{bound_name}={bound}; set {name} to this process's index."
            )

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Config:
        """Parse ``env`` (default: ``os.environ``) into a validated Config.

        Raises:
            ConfigError: a variable required for this role is missing, or one is malformed;
                the message names the variable and the accepted values.
        """
        env = os.environ if env is None else env
        values: dict[str, Any] = {}
        role_var = VARIABLES[0]
        role = _parse_one(role_var, env.get(role_var.name)) if role_var.name in env else Role.WORKER
        present: set[str] = set()
        for var in VARIABLES:
            name = next((n for n in (var.name, *var.fallbacks) if env.get(n)), var.name)
            raw = env.get(name)
            if raw is None or raw == "":
                if role in var.required_for:
                    raise ConfigError(
                        f"{var.name} is not set; a {role.value} needs it: {var.doc}"
                    )
                values[var.attr] = var.default
            else:
                values[var.attr] = _parse_one(var, raw, name)
                present.add(name)
        return cls(**values, ignored=_unsupported(env), explicit=frozenset(present))

    # ---- derived topology ------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        """Training processes in the job: machines x processes per machine."""
        return self.num_machines * self.local_size

    @property
    def rank(self) -> int:
        """Global rank, derived as BytePS does: machine id x local size + local rank."""
        return self.machine_id * self.local_size + self.local_rank

    @property
    def store_port(self) -> int:
        """Port of the torch.distributed TCPStore, next to the scheduler's."""
        return self.root_port + 1

    def bind_host(self) -> str:
        """Address to bind listening sockets to: never all interfaces unless asked."""
        if self.bind_all:
            return "0.0.0.0"
        return self.advertise_host()

    def advertise_host(self) -> str:
        """Address other nodes use to reach this process (see :meth:`address`)."""
        return self.address().host

    def address(self) -> Address:
        """The address this process binds and advertises, chosen as ps-lite does.

        ``DMLC_NODE_HOST``; else the address of ``DMLC_INTERFACE``; else the source address
        of the route to ``DMLC_PS_ROOT_URI`` (loopback exactly when the root is); else the
        first non-loopback interface's; else 127.0.0.1. Chosen once per process.

        Raises:
            ConfigError: ``DMLC_INTERFACE`` names no interface with an IPv4 address.
        """
        return _select_address(self.node_host, self.interface, self.root_uri, self.root_port)

    def socket_interfaces(self) -> dict[str, str]:
        """``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME`` for this process.

        The configured ones; else the interface holding :meth:`address` (left out when the
        address is on no local interface, e.g. a NAT address in ``DMLC_NODE_HOST``), so
        that collectives use the network the PS uses rather than whatever the host name
        resolves to (loopback in a network namespace or a container).
        """
        own = self.address().interface
        chosen = {"GLOO_SOCKET_IFNAME": self.gloo_ifname or own,
                  "NCCL_SOCKET_IFNAME": self.nccl_ifname or own}
        return {name: value for name, value in chosen.items() if value}

    def export_socket_interfaces(self) -> dict[str, str]:
        """Put :meth:`socket_interfaces` into this process's environment, where gloo and NCCL
        read them; call it before ``torch.distributed.init_process_group``.

        Returns:
            the variables set.
        """
        chosen = self.socket_interfaces()
        os.environ.update(chosen)
        return chosen

    def ignored_warnings(self) -> list[str]:
        """One message per unsupported BytePS / ps-lite variable that is set (not fatal)."""
        why = {u.name: u.why for u in UNSUPPORTED}
        return [f"{name}={value!r} is ignored: it {why[name]}." for name, value in self.ignored]

    def as_env(self) -> dict[str, str]:
        """The variables that reproduce this Config, for child processes."""
        out: dict[str, str] = {}
        by_attr = {f.name: getattr(self, f.name) for f in fields(self)}
        for var in VARIABLES:
            value = by_attr[var.attr]
            if value is None:  # unset, or a limit set to `none` where one is the default
                if var.default is not None:
                    out[var.name] = "none"
                continue
            if isinstance(value, bool):
                out[var.name] = "1" if value else "0"
            elif isinstance(value, Secret):
                out[var.name] = value.reveal()
            elif isinstance(value, Role):
                out[var.name] = value.value
            else:
                out[var.name] = str(value)
        return out


def variable(name: str, env: Mapping[str, str] | None = None) -> Any:
    """One declared variable's parsed value in ``env`` (default ``os.environ``), or its default,
    for a process that has no role of its own (the launcher).

    Raises:
        KeyError: ``name`` is not declared in :data:`VARIABLES`.
        ConfigError: the value is malformed.
    """
    env = os.environ if env is None else env
    var = next((v for v in VARIABLES if v.name == name), None)
    if var is None:
        raise KeyError(f"{name} is not a declared variable")
    raw = next((env[n] for n in (var.name, *var.fallbacks) if env.get(n)), None)
    return var.default if raw is None else _parse_one(var, raw)


def _parse_one(var: Variable, raw: str | None, name: str | None = None) -> Any:
    try:
        return var.parse(raw if raw is not None else "")
    except (ValueError, TypeError) as exc:
        shown = "(hidden)" if var.parse is _secret else repr(raw)
        raise ConfigError(f"{name or var.name}={shown} is invalid: {exc}. {var.doc}") from None


# Values of an unsupported variable that ask for nothing (BytePS reads them as "off").
_OFF = ("", "0", "false", "no", "off")


def _unsupported(env: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    """The unsupported variables set to a true value; raises for those that change results."""
    found = []
    for item in UNSUPPORTED:
        raw = env.get(item.name)
        if raw is None or raw.strip().lower() in _OFF:
            continue
        if item.fatal:
            raise ConfigError(f"{item.name}={raw!r} {item.why}.")
        found.append((item.name, raw))
    return tuple(found)


# ---- addresses ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Address:
    """The address a process binds and advertises, and why.

    Attributes:
        host: the address (or host name, when ``DMLC_NODE_HOST`` gives one).
        interface: the local interface holding it (None when it is on none of them).
        reason: which rule chose it, for logs and error messages.
    """

    host: str
    interface: str | None
    reason: str

    def __str__(self) -> str:
        where = f"interface {self.interface}" if self.interface else "no local interface"
        return f"{self.host} ({where}; {self.reason})"


def _interface_ipv4(name: str) -> str | None:
    """IPv4 address of interface ``name`` (Linux SIOCGIFADDR: the primary one), or None."""
    import fcntl
    import struct

    siocgifaddr = 0x8915  # ioctl number from <linux/sockios.h>
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            packed = fcntl.ioctl(sock.fileno(), siocgifaddr,
                                 struct.pack("256s", name.encode()[:15]))
        except OSError:
            return None
    return str(ipaddress.IPv4Address(packed[20:24]))


def interfaces() -> list[tuple[str, str]]:
    """``(name, IPv4 address)`` of this host's interfaces that have one, in index order."""
    found = []
    for _, name in socket.if_nameindex():
        address = _interface_ipv4(name)
        if address is not None:
            found.append((name, address))
    return found


def interface_address(name: str) -> str:
    """IPv4 address of network interface ``name`` (Linux), for DMLC_INTERFACE.

    Raises:
        ConfigError: the interface does not exist or has no IPv4 address.
    """
    address = _interface_ipv4(name)
    if address is None:
        known = ", ".join(n for n, _ in interfaces()) or "none"
        raise ConfigError(
            f"DMLC_INTERFACE={name!r} is not an interface with an IPv4 address (this host "
            f"has: {known}); set it to one of them, or set DMLC_NODE_HOST.")
    return address


def _resolve(host: str, port: int = 0) -> list[str]:
    try:
        infos = socket.getaddrinfo(host, port, socket.AF_INET, socket.SOCK_DGRAM)
    except (socket.gaierror, UnicodeError):
        return []
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


def _interface_of(host: str) -> str | None:
    """The local interface holding ``host``'s address (resolved), or None."""
    addresses = set(_resolve(host))
    return next((name for name, address in interfaces() if address in addresses), None)


def _route_source(host: str, port: int) -> str | None:
    """The source address the kernel would use to reach ``host`` (a UDP connect sends
    nothing), or None when it does not resolve or has no route."""
    for address in _resolve(host, port):
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            try:
                sock.connect((address, port))
            except OSError:
                continue
            return str(sock.getsockname()[0])
    return None


@functools.lru_cache(maxsize=16)
def _select_address(node_host: str | None, interface: str | None, root_uri: str,
                    root_port: int) -> Address:
    if node_host:
        chosen = Address(node_host, _interface_of(node_host), "DMLC_NODE_HOST")
    elif interface:
        chosen = Address(interface_address(interface), interface, "DMLC_INTERFACE")
    elif (routed := _route_source(root_uri, root_port)) is not None:
        chosen = Address(routed, _interface_of(routed),
                         f"the route to DMLC_PS_ROOT_URI={root_uri}")
    else:
        outside = [(n, a) for n, a in interfaces() if not ipaddress.ip_address(a).is_loopback]
        if outside:
            chosen = Address(outside[0][1], outside[0][0],
                             f"the first non-loopback interface: DMLC_PS_ROOT_URI={root_uri} "
                             "has no route from here")
        else:
            chosen = Address("127.0.0.1", _interface_of("127.0.0.1"),
                             "this host has no other interface")
    log.info("advertising %s", chosen)
    return chosen


def markdown_table() -> str:
    """The README's configuration tables, generated from :data:`VARIABLES` and
    :data:`UNSUPPORTED`."""
    rows = ["| variable | default | meaning |", "| --- | --- | --- |"]
    for var in VARIABLES:
        default = var.default.value if isinstance(var.default, enum.Enum) else var.default
        if var.required_for == _EVERY_ROLE:
            default_text = "required"
        elif default is None:
            default_text = "unset"
        else:
            default_text = f"`{default}`"
        names = " or ".join(f"`{n}`" for n in (var.name, *var.fallbacks))
        rows.append(f"| {names} | {default_text} | {var.doc} |")
    rows += ["", "BytePS and ps-lite variables that are not implemented: set to a true value, "
             "each is reported once per job (rank 0 logs a warning), or refused before "
             "anything starts where ignoring it would change the result.", "",
             "| variable | when set |", "| --- | --- |"]
    for item in UNSUPPORTED:
        rows.append(f"| `{item.name}` | {'error' if item.fatal else 'warning'}: it "
                    f"{item.why}. |")
    return "\n".join(rows)
