"""``espresso-launch`` / ``bpslaunch``: start a byteps-espresso job.

Two ways to use it:

* **BytePS contract** (one launcher per machine, as on a cluster or in Kubernetes)::

      DMLC_ROLE=worker DMLC_NUM_WORKER=2 DMLC_NUM_SERVER=1 DMLC_PS_ROOT_URI=10.0.0.1 \\
      DMLC_PS_ROOT_PORT=9000 DMLC_WORKER_ID=0 BYTEPS_LOCAL_SIZE=4 bpslaunch python train.py

  As a worker it starts one copy of the command per GPU, as BytePS's launcher does
  (``BYTEPS_LOCAL_SIZE`` if set, else one per GPU listed in ``NVIDIA_VISIBLE_DEVICES``, else
  one), each with its ``BYTEPS_LOCAL_RANK``; every copy sees all of the machine's GPUs and
  picks ``cuda:<local rank>``. As scheduler or server it runs ``python -m
  byteps_espresso.server`` (the command is ignored, as BytePS does).

* **Local** (the embedded default: the whole job on this host)::

      espresso-launch --local --machines 2 --workers-per-machine 2 --servers 1 -- python train.py

  starts the scheduler, the servers and every worker with free loopback ports (each emulated
  machine gets its share of this host's GPUs in ``CUDA_VISIBLE_DEVICES``); with
  ``--emulate`` each machine gets its own network namespace and shaped links instead
  (see :mod:`byteps_espresso.deploy.emulate`).

Either way output lines carry a ``[role rank]`` prefix, the first process to fail stops the
others and the launcher exits non-zero naming it, and Ctrl-C stops everything. The name is
the culprit's, not that of the first victim to exit: processes report the process they lost
to a fault file (``ESPRESSO_FAULT_FILE``), and a process stopped for
``ESPRESSO_HEARTBEAT_TIMEOUT`` fails the job too. ``--max-restarts N`` (torchrun's flag)
starts the whole job again after a failure, up to N times, logging each cause; the training
script resumes from its own checkpoints (``examples/train.py --checkpoint-dir``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence

from byteps_espresso.deploy.emulate import EmulationError, Placement, check_host
from byteps_espresso.deploy.reaper import Reaper
from byteps_espresso.deploy.supervisor import DEFAULT_GRACE_S, ProcessSpec, Supervisor

from byteps_espresso.config import Config, ConfigError, Role, variable

__all__ = [
    "PS_COMMAND",
    "cluster_specs",
    "free_port_pair",
    "gpu_ids",
    "local_size",
    "machine_specs",
    "main",
]

log = logging.getLogger("espresso-launch")

# What the scheduler and server roles run; DMLC_ROLE tells the module which one it is.
PS_COMMAND: tuple[str, ...] = (sys.executable, "-m", "byteps_espresso.server")

# Variables the launcher sets for every process it starts; inherited values are replaced.
_MANAGED = (
    "DMLC_ROLE", "DMLC_NUM_WORKER", "DMLC_NUM_SERVER", "DMLC_PS_ROOT_URI", "DMLC_PS_ROOT_PORT",
    "DMLC_NODE_HOST", "DMLC_INTERFACE", "DMLC_WORKER_ID", "BYTEPS_LOCAL_RANK",
    "BYTEPS_LOCAL_SIZE",
)
# Default scheduler port inside emulated namespaces: each run has its own network stack.
_EMULATED_PORT = 9000


# ---- building blocks ------------------------------------------------------------------------
def free_port_pair(host: str = "127.0.0.1", attempts: int = 50) -> int:
    """A port ``p`` such that ``p`` and ``p + 1`` are free on ``host`` right now.

    The scheduler listens on ``p`` and the torch.distributed store on ``p + 1``.

    Raises:
        OSError: no such pair found in ``attempts`` tries.
    """
    for _ in range(attempts):
        with socket.socket() as first:
            first.bind((host, 0))
            port = first.getsockname()[1]
            if port >= 65535:
                continue
            with socket.socket() as second:
                try:
                    second.bind((host, port + 1))
                except OSError:
                    continue
                return port
    raise OSError(f"found no two adjacent free ports on {host} in {attempts} attempts")


def gpu_ids(cfg: Config) -> list[str]:
    """GPUs this launcher may hand out: ``CUDA_VISIBLE_DEVICES`` if set, else ``nvidia-smi -L``.

    Returns:
        device ids as strings (empty without GPUs: processes then train on the CPU).
    """
    if cfg.visible_devices is not None:
        return [d.strip() for d in cfg.visible_devices.split(",") if d.strip()]
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    try:
        listing = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [str(i) for i, line in
            enumerate(ln for ln in listing.stdout.splitlines() if ln.startswith("GPU "))]


def _machine_gpus(machine: int, per_machine: int, gpus: Sequence[str]) -> dict[str, str]:
    """``CUDA_VISIBLE_DEVICES`` for emulated machine ``machine`` of a local job: its own
    ``per_machine`` GPUs, round-robin (and shared, with a warning) when there are too few."""
    if not gpus:
        return {}
    wanted = [gpus[(machine * per_machine + k) % len(gpus)] for k in range(per_machine)]
    if (machine + 1) * per_machine > len(gpus):
        log.warning("%d GPUs for more training processes: machine %d shares GPU(s) %s",
                    len(gpus), machine, ",".join(dict.fromkeys(wanted)))
    return {"CUDA_VISIBLE_DEVICES": ",".join(dict.fromkeys(wanted))}


# NVIDIA_VISIBLE_DEVICES values of the NVIDIA container runtime that expose no GPU.
_NO_GPU = ("", "none", "void")


def local_size(cfg: Config, gpus: Sequence[str] | None = None) -> int:
    """Training processes a worker machine starts, as BytePS's launcher decides it.

    ``BYTEPS_LOCAL_SIZE`` when set; else one per GPU in ``NVIDIA_VISIBLE_DEVICES`` (``all``:
    per GPU in ``gpus``, default :func:`gpu_ids`); else one.
    """
    if "BYTEPS_LOCAL_SIZE" in cfg.explicit or cfg.nvidia_visible_devices is None:
        return cfg.local_size
    listed = cfg.nvidia_visible_devices.strip().lower()
    if listed in _NO_GPU:
        return 1
    if listed == "all":
        count = len(gpus if gpus is not None else gpu_ids(cfg))
        if count == 0:
            log.warning("NVIDIA_VISIBLE_DEVICES=all but nvidia-smi lists no GPU: starting one "
                        "training process; set BYTEPS_LOCAL_SIZE to start more")
        return max(1, count)
    return len([d for d in listed.split(",") if d.strip()])


def _checked(env: dict[str, str]) -> dict[str, str]:
    Config.from_env(env)  # raises ConfigError naming the variable
    return env


def _loopback(_role: str, _index: int) -> Placement:
    return Placement()


def cluster_specs(command: Sequence[str], *, machines: int, workers_per_machine: int,
                  servers: int, base_env: Mapping[str, str], root_port: int,
                  place: Callable[[str, int], Placement] = _loopback,
                  auth: bool = False) -> list[ProcessSpec]:
    """Every process of a whole job: scheduler, servers and workers.

    Args:
        command: the training command each worker runs.
        machines: worker machines (``DMLC_NUM_WORKER``).
        workers_per_machine: training processes per machine (``BYTEPS_LOCAL_SIZE``).
        servers: parameter-server processes (``DMLC_NUM_SERVER``).
        base_env: environment inherited by every process (launcher-managed variables in it
            are replaced).
        root_port: scheduler port; the store uses the next one.
        place: ``(role, index) -> Placement`` saying where each process runs (``index`` is
            the machine id for workers); the default puts everything on 127.0.0.1.
        auth: give every process one new job secret (unless ``base_env`` has one).

    Returns:
        the process specs, scheduler first, workers last.

    Raises:
        ValueError: a count is out of range or the command is empty.
        ConfigError: the resulting environment is invalid (e.g. a malformed ESPRESSO_ knob).
    """
    if machines < 1 or workers_per_machine < 1 or servers < 1:
        raise ValueError("need --machines >= 1, --workers-per-machine >= 1 and --servers >= 1; "
                         f"got {machines}, {workers_per_machine}, {servers}")
    if not command:
        raise ValueError("no training command given: espresso-launch --local ... -- python "
                         "train.py")
    common = {k: v for k, v in base_env.items() if k not in _MANAGED}
    common["PYTHONUNBUFFERED"] = "1"
    given = common.get("ESPRESSO_JOB_SECRET") or common.get("ESPRESSO_JOB_SECRET_FILE")
    if auth and not given:
        # One secret per job authenticates every PS message (server/auth.py); 256 bits. Asked
        # for (--auth), not the default: a 64 MB dense push/pull runs at 0.76-0.82x of its
        # unauthenticated speed on 2 cores here (BENCHMARKS.md, "Parameter server").
        common["ESPRESSO_JOB_SECRET"] = secrets.token_hex(32)
    scheduler = place(Role.SCHEDULER.value, 0)
    common.update({
        "DMLC_NUM_WORKER": str(machines), "DMLC_NUM_SERVER": str(servers),
        "DMLC_PS_ROOT_URI": scheduler.host, "DMLC_PS_ROOT_PORT": str(root_port),
        "BYTEPS_LOCAL_SIZE": str(workers_per_machine),
    })
    gpus = gpu_ids(Config.from_env({**common, "DMLC_ROLE": "scheduler"}))
    cpu_only = {"CUDA_VISIBLE_DEVICES": ""}  # servers aggregate on host CPUs
    # A local machine's own GPUs are decided here: a NVIDIA_VISIBLE_DEVICES inherited from
    # this host must not make the machines' launch logic count them again.
    common.pop("NVIDIA_VISIBLE_DEVICES", None)

    def ps_spec(role: Role, index: int) -> ProcessSpec:
        where = place(role.value, index)
        env = {**common, **dict(where.env), **cpu_only, "DMLC_ROLE": role.value,
               "DMLC_NODE_HOST": where.host}
        return ProcessSpec(role.value, index, (*where.prefix, *PS_COMMAND), _checked(env))

    specs = [ps_spec(Role.SCHEDULER, 0)] + [ps_spec(Role.SERVER, j) for j in range(servers)]
    for machine in range(machines):
        where = place(Role.WORKER.value, machine)
        machine_gpus = _machine_gpus(machine, workers_per_machine, gpus)
        for local in range(workers_per_machine):
            rank = machine * workers_per_machine + local
            env = {**common, **dict(where.env), **machine_gpus, "DMLC_ROLE": "worker",
                   "DMLC_NODE_HOST": where.host, "DMLC_WORKER_ID": str(machine),
                   "BYTEPS_LOCAL_RANK": str(local)}
            specs.append(ProcessSpec("worker", rank, (*where.prefix, *command), _checked(env)))
    return specs


def machine_specs(command: Sequence[str], environ: Mapping[str, str]) -> list[ProcessSpec]:
    """The processes one machine runs under the BytePS contract (role from ``DMLC_ROLE``).

    Raises:
        ConfigError: the environment is incomplete or malformed.
        ValueError: a worker has no command to run.
    """
    cfg = Config.from_env(environ)
    base = {**environ, "PYTHONUNBUFFERED": "1"}
    if cfg.role is not Role.WORKER:
        return [ProcessSpec(cfg.role.value, 0, PS_COMMAND, base)]
    if not command:
        raise ValueError("no training command given: bpslaunch python train.py ...")
    gpus = gpu_ids(cfg)
    size = local_size(cfg, gpus)
    if 0 < len(gpus) < size:
        log.warning("%d training processes but %d GPU(s) visible: local ranks >= %d cannot "
                    "use torch.cuda.set_device(bps.local_rank()); set BYTEPS_LOCAL_SIZE or "
                    "NVIDIA_VISIBLE_DEVICES to the GPU count", size, len(gpus), len(gpus))
    specs = []
    for local in range(size):
        # Every process sees all of the machine's GPUs (CUDA_VISIBLE_DEVICES untouched), as
        # with BytePS: the script selects one with torch.cuda.set_device(bps.local_rank()).
        env = {**base, "BYTEPS_LOCAL_SIZE": str(size), "BYTEPS_LOCAL_RANK": str(local)}
        rank = cfg.machine_id * size + local
        specs.append(ProcessSpec("worker", rank, tuple(command), _checked(env)))
    return specs


# ---- command line ---------------------------------------------------------------------------
def build_parser(prog: str = "espresso-launch") -> argparse.ArgumentParser:
    """The launcher's argument parser (``bpslaunch`` accepts the same)."""
    parser = argparse.ArgumentParser(
        prog=prog, description=__doc__.splitlines()[0],
        usage=f"{prog} [--local [--emulate] ...] [--] command ...")
    local = parser.add_argument_group("local mode (whole job on this host)")
    local.add_argument("--local", action="store_true",
                       help="start scheduler, servers and all workers on this host")
    local.add_argument("--machines", type=int, default=1, help="worker machines (default 1)")
    local.add_argument("--workers-per-machine", type=int, default=1,
                       help="training processes per machine (default 1)")
    local.add_argument("--servers", type=int, default=1,
                       help="parameter-server processes (default 1)")
    local.add_argument("--port", type=int, default=0,
                       help="scheduler port (default: a free one; the store uses port+1)")
    local.add_argument("--auth", action="store_true",
                       help="generate a job secret (ESPRESSO_JOB_SECRET) that authenticates "
                            "every PS message, unless one is set")
    emu = parser.add_argument_group("emulated cluster (needs root)")
    emu.add_argument("--emulate", action="store_true",
                     help="one network namespace per machine joined by shaped links "
                          "(implies --local)")
    emu.add_argument("--inter-gbps", type=float, default=10.0,
                     help="bandwidth of every machine's link, Gbit/s (default 10)")
    emu.add_argument("--colocate", action="store_true",
                     help="run each server in a machine's namespace (server j on machine "
                          "j mod machines), beside its workers, instead of on a node of its "
                          "own")
    emu.add_argument("--inter-latency-ms", type=float, default=0.0,
                     help="one-way latency between two machines, ms (default 0; needs "
                          "the kernel's netem qdisc)")
    parser.add_argument("--max-restarts", "--max_restarts", type=int, default=0, metavar="N",
                        help="after a failure, start the whole job again, up to N times "
                             "(default 0); the script resumes from its checkpoints")
    parser.add_argument("--grace-s", type=float, default=DEFAULT_GRACE_S,
                        help="seconds between SIGTERM and SIGKILL when stopping (default "
                             f"{DEFAULT_GRACE_S:g})")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument("command", nargs=argparse.REMAINDER,
                        help="the training command (workers run it)")
    return parser


def _run(args: argparse.Namespace, environ: Mapping[str, str], prog: str,
         reaper: Reaper) -> int:
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if args.max_restarts < 0:
        raise ValueError(f"--max-restarts must be >= 0, got {args.max_restarts}")
    if not (args.local or args.emulate):
        return _supervise(lambda: machine_specs(command, environ), args, prog, reaper)
    if not args.emulate:
        def local_specs() -> list[ProcessSpec]:  # fresh ports for every (re)start
            port = args.port or free_port_pair()
            return cluster_specs(command, machines=args.machines,
                                 workers_per_machine=args.workers_per_machine,
                                 servers=args.servers, base_env=environ, root_port=port,
                                 auth=args.auth)

        return _supervise(local_specs, args, prog, reaper)
    from byteps_espresso.deploy.emulate import EmulatedCluster

    with EmulatedCluster(args.machines, args.servers, args.inter_gbps,
                         args.inter_latency_ms, reaper=reaper,
                         colocate=args.colocate) as cluster:
        return _supervise(lambda: cluster_specs(
            command, machines=args.machines, workers_per_machine=args.workers_per_machine,
            servers=args.servers, base_env=environ, root_port=args.port or _EMULATED_PORT,
            place=cluster.placement, auth=args.auth), args, prog, reaper)


def _supervise(make_specs: Callable[[], list[ProcessSpec]], args: argparse.Namespace,
               prog: str, reaper: Reaper) -> int:
    """Run the job, and again after a failure up to ``--max-restarts`` times.

    Every process gets ``ESPRESSO_FAULT_FILE`` (a file of this launcher's unless the
    environment names one), where the culprit of a failure is reported.
    """
    fault_file, own = _fault_file(make_specs())
    if own:
        reaper.watch_path(fault_file)
    try:
        for attempt in range(args.max_restarts + 1):
            specs = [dataclasses.replace(s, env={**s.env, "ESPRESSO_FAULT_FILE": fault_file})
                     for s in make_specs()]
            stopped_after_s = Config.from_env(specs[0].env).heartbeat_timeout_s
            result = Supervisor(specs, grace_s=args.grace_s, reaper=reaper,
                                fault_file=fault_file, stopped_after_s=stopped_after_s).run()
            interrupted = result.exit_code > 128 and result.failed is None
            if result.exit_code == 0 or interrupted or attempt == args.max_restarts:
                break
            log.warning("restart %d of %d: %s", attempt + 1, args.max_restarts, result.message)
    finally:
        if own:
            with contextlib.suppress(OSError):
                os.unlink(fault_file)
    message = result.message
    if args.max_restarts and result.exit_code:
        message += f" (after {attempt} restart(s) of at most {args.max_restarts})"
    stream = sys.stderr if result.exit_code else sys.stdout
    print(f"{prog}: {message}", file=stream, flush=True)
    return result.exit_code


def _fault_file(specs: Sequence[ProcessSpec]) -> tuple[str, bool]:
    """The job's ``ESPRESSO_FAULT_FILE``: the one the environment names (kept), else a new
    empty file of this launcher's (deleted at the end); and whether it is the launcher's."""
    given = specs[0].env.get("ESPRESSO_FAULT_FILE") if specs else None
    if given:
        return given, False
    fd, path = tempfile.mkstemp(prefix="espresso-faults-", suffix=".jsonl")
    os.close(fd)
    return path, True


def main(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None,
         prog: str | None = None) -> int:
    """Entry point of ``espresso-launch`` and ``bpslaunch``.

    Args:
        argv: arguments (default ``sys.argv[1:]``).
        environ: the environment handed to the job (default: this process's).
        prog: name used in messages.

    Returns:
        0 when every worker succeeded; otherwise the failed process's exit code (2 for a
        usage or configuration error, 128 + signal number when interrupted).
    """
    if prog is None:  # the console script's name; `python -m ...launch` is espresso-launch
        name = os.path.basename(sys.argv[0])
        prog = name if name in ("bpslaunch", "espresso-launch") else "espresso-launch"
    args = build_parser(prog).parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format=f"{prog}: %(message)s")
    environ = dict(os.environ if environ is None else environ)

    def terminate(signum, _frame):  # SIGTERM outside supervision: unwind and clean up
        raise SystemExit(128 + signum)

    def suspend(_signum, _frame):  # the job runs in other sessions: Ctrl-Z would stop only us
        log.warning("Ctrl-Z ignored: the job's processes cannot be suspended with the "
                    "launcher; Ctrl-C stops the job")

    previous = signal.signal(signal.SIGTERM, terminate)
    previous_tstp = signal.signal(signal.SIGTSTP, suspend)
    try:
        if args.colocate and not args.emulate:
            raise ValueError("--colocate places the servers in emulated machines and needs "
                             "--emulate; with --local every process shares this host "
                             "already")
        if args.emulate:
            check_host()  # refuse before anything starts
        timeout_s = variable("ESPRESSO_HEARTBEAT_TIMEOUT", environ)
        with Reaper(timeout_s, prog) as reaper:
            return _run(args, environ, prog, reaper)
    except (ConfigError, ValueError, EmulationError, OSError) as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr, flush=True)
        return 2
    except KeyboardInterrupt:
        print(f"{prog}: interrupted; stopped every process", file=sys.stderr, flush=True)
        return 128 + signal.SIGINT
    finally:
        with contextlib.suppress(ValueError):
            signal.signal(signal.SIGTERM, previous)
            signal.signal(signal.SIGTSTP, previous_tstp)


def bpslaunch() -> int:
    """``bpslaunch`` console script: :func:`main` under BytePS's name."""
    return main(prog="bpslaunch")


if __name__ == "__main__":
    sys.exit(main())
