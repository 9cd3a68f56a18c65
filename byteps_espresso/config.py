"""Every environment variable byteps-espresso reads, declared once and parsed once.

The BytePS / ps-lite variables keep their names and meaning so that a BytePS job's
environment works unchanged; the project's own knobs are prefixed ``ESPRESSO_``. Nothing
below this module reads ``os.environ``: callers build a :class:`Config` with
:func:`Config.from_env` and pass it down.

Example:
    >>> cfg = Config.from_env({"DMLC_ROLE": "worker", "DMLC_NUM_WORKER": "2",
    ...                        "DMLC_NUM_SERVER": "1", "DMLC_PS_ROOT_URI": "127.0.0.1",
    ...                        "DMLC_PS_ROOT_PORT": "9000"})
    >>> cfg.world_size
    2
"""

from __future__ import annotations

import enum
import ipaddress
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

__all__ = ["VARIABLES", "Config", "ConfigError", "Role", "Secret", "Variable", "markdown_table"]


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
    level = text.strip().upper()
    if level not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
        raise ValueError("must be one of DEBUG, INFO, WARNING, ERROR, CRITICAL")
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
             "Address this process binds to and advertises (default: the address of "
             "`DMLC_INTERFACE`, else 127.0.0.1)."),
    Variable("DMLC_INTERFACE", "interface", _optional, None,
             "Network interface whose IPv4 address is bound and advertised."),
    Variable("DMLC_WORKER_ID", "machine_id", _int(0), 0,
             "Index of this worker machine, in [0, DMLC_NUM_WORKER)."),
    Variable("BYTEPS_LOCAL_RANK", "local_rank", _int(0), 0,
             "Index of this training process on its machine, in [0, BYTEPS_LOCAL_SIZE)."),
    Variable("BYTEPS_LOCAL_SIZE", "local_size", _int(1), 1,
             "Training processes (GPUs) per worker machine."),
    Variable("CUDA_VISIBLE_DEVICES", "visible_devices", _optional, None,
             "GPUs the launcher hands out, one per training process, which each get one "
             "of them (default: every GPU `nvidia-smi -L` lists; none: CPU training)."),
    Variable("OMP_NUM_THREADS", "intra_op_threads", _optional_int(1), None,
             "torch intra-op threads per training process (default: this machine's cores / "
             "`BYTEPS_LOCAL_SIZE`, at least 1, as torchrun does)."),
    Variable("BYTEPS_PARTITION_BYTES", "partition_bytes", _int(1024), 4_096_000,
             "Largest PS key in bytes; bigger tensors are split into several keys "
             "(BytePS default 4096000)."),
    Variable("BYTEPS_SERVER_ENGINE_THREAD", "server_threads", _int(1, 256), 4,
             "Aggregation threads per server process (numba kernels)."),
    # ---- byteps-espresso knobs -----------------------------------------------------------
    Variable("ESPRESSO_BIND_ALL", "bind_all", _flag, False,
             "Bind listening sockets to 0.0.0.0 instead of the configured interface. "
             "Off by default; only for containers whose pod IP is not known up front."),
    Variable("ESPRESSO_START_TIMEOUT", "start_timeout_s", _float(0.0), 60.0,
             "Seconds the scheduler waits for every node to register before every "
             "process exits with an error listing the missing ones."),
    Variable("ESPRESSO_TIMEOUT", "op_timeout_s", _float(0.0), 60.0,
             "Seconds any single push/pull or collective may wait before it fails "
             "naming the key, round and peer."),
    Variable("ESPRESSO_MAX_MESSAGE_BYTES", "max_message_bytes", _int(1024), 1 << 30,
             "Largest wire message accepted, in bytes; bigger ones are rejected before "
             "anything is allocated."),
    Variable("ESPRESSO_COMPRESSOR", "compressor", _optional, None,
             "Default compressor name for `Compression.espresso()` (see `espresso "
             "compressors`)."),
    Variable("ESPRESSO_STRATEGY", "strategy_path", _optional, None,
             "Strategy JSON planned offline (`espresso plan`); skips start-up planning."),
    Variable("ESPRESSO_PROFILE_STEPS", "profile_steps", _int(0), 5,
             "Uncompressed iterations profiled before planning."),
    Variable("ESPRESSO_TRIAL_STEPS", "trial_steps", _int(0), 6,
             "Iterations each finalist strategy runs after planning (the first is a "
             "warm-up; the fastest measured is kept). Below 2: use the planned strategy "
             "at once."),
    Variable("ESPRESSO_PROFILE_OUT", "profile_out", _optional, None,
             "Directory where rank 0 writes the measured workload and planned strategy."),
    Variable("ESPRESSO_CPU_THREADS", "cpu_threads", _int(1, 1024), 2,
             "Host threads per machine for CPU (numba) compression on workers."),
    Variable("ESPRESSO_SEED", "seed", _int(0), 0,
             "Seed of every stochastic compressor (random-k, QSGD, TernGrad, ...)."),
    Variable("ESPRESSO_LOG_LEVEL", "log_level", _log_level, "INFO",
             "Logging level of library code."),
    Variable("ESPRESSO_JOB_SECRET", "job_secret", _secret, None,
             "Per-job secret (at least 16 characters) that authenticates every scheduler and "
             "server message; `espresso-launch --local/--emulate` generates one. Unset: the "
             "job runs unauthenticated, as BytePS does, and says so once."),
    Variable("ESPRESSO_JOB_SECRET_FILE", "job_secret_file", _optional, None,
             "File holding the job secret (e.g. a mounted Kubernetes Secret), instead of "
             "`ESPRESSO_JOB_SECRET`."),
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
    bind_all: bool = False
    start_timeout_s: float = 60.0
    op_timeout_s: float = 60.0
    max_message_bytes: int = 1 << 30
    compressor: str | None = None
    strategy_path: str | None = None
    profile_steps: int = 5
    trial_steps: int = 6
    profile_out: str | None = None
    cpu_threads: int = 2
    seed: int = 0
    log_level: str = "INFO"
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
        for var in VARIABLES:
            raw = env.get(var.name)
            if raw is None or raw == "":
                if role in var.required_for:
                    raise ConfigError(
                        f"{var.name} is not set; a {role.value} needs it: {var.doc}"
                    )
                values[var.attr] = var.default
            else:
                values[var.attr] = _parse_one(var, raw)
        present = frozenset(v.name for v in VARIABLES if env.get(v.name))
        return cls(**values, explicit=present)

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
        """Address other nodes use to reach this process."""
        if self.node_host:
            return self.node_host
        if self.interface:
            return interface_address(self.interface)
        return "127.0.0.1"

    def as_env(self) -> dict[str, str]:
        """The variables that reproduce this Config, for child processes."""
        out: dict[str, str] = {}
        by_attr = {f.name: getattr(self, f.name) for f in fields(self)}
        for var in VARIABLES:
            value = by_attr[var.attr]
            if value is None:
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


def _parse_one(var: Variable, raw: str | None) -> Any:
    try:
        return var.parse(raw if raw is not None else "")
    except (ValueError, TypeError) as exc:
        shown = "(hidden)" if var.parse is _secret else repr(raw)
        raise ConfigError(f"{var.name}={shown} is invalid: {exc}. {var.doc}") from None


def interface_address(name: str) -> str:
    """IPv4 address of network interface ``name`` (Linux), for DMLC_INTERFACE.

    Raises:
        ConfigError: the interface does not exist or has no IPv4 address.
    """
    import fcntl
    import socket
    import struct

    siocgifaddr = 0x8915  # ioctl number from <linux/sockios.h>
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            packed = fcntl.ioctl(sock.fileno(), siocgifaddr,
                                 struct.pack("256s", name.encode()[:15]))
        except OSError as exc:
            raise ConfigError(
                f"DMLC_INTERFACE={name!r} has no IPv4 address ({exc.strerror}); "
                "set it to an interface listed by `ip -4 addr`, or set DMLC_NODE_HOST."
            ) from None
    return str(ipaddress.IPv4Address(packed[20:24]))


def markdown_table() -> str:
    """The README's configuration table, generated from :data:`VARIABLES`."""
    rows = ["| variable | default | meaning |", "| --- | --- | --- |"]
    for var in VARIABLES:
        default = var.default.value if isinstance(var.default, enum.Enum) else var.default
        if var.required_for == _EVERY_ROLE:
            default_text = "required"
        elif default is None:
            default_text = "unset"
        else:
            default_text = f"`{default}`"
        rows.append(f"| `{var.name}` | {default_text} | {var.doc} |")
    return "\n".join(rows)
