"""Run a set of processes as one job: prefixed output, fail-fast, no orphans.

Every launched process gets its own session (so its whole process group, including any
children it forks, can be signalled at once) and dies with the launcher if the launcher is
killed outright (``PR_SET_PDEATHSIG``). The supervisor copies each process's output line by
line with a ``[role rank]`` prefix, waits until every *worker* has exited successfully, and
stops the whole job as soon as any process fails, one has been stopped (SIGSTOP) for
``stopped_after_s``, or the launcher is interrupted.

The process that fails first is often a victim: a worker whose push failed because a server
stopped. The result names the culprit instead when there is one: the earliest report in the
job's fault file (``ESPRESSO_FAULT_FILE``, see :mod:`byteps_espresso.server.faults`), or else
a process of the job that is stopped.

Example:
    >>> import sys
    >>> spec = ProcessSpec("worker", 0, (sys.executable, "-c", "print('hi')"), {})
    >>> Supervisor([spec], out=open("/dev/null", "w")).run().exit_code
    0
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import IO, TYPE_CHECKING

from byteps_espresso.server import faults

if TYPE_CHECKING:
    from byteps_espresso.deploy.reaper import Reaper

__all__ = ["JobResult", "ProcessSpec", "Supervisor", "process_state", "stop_process_groups",
           "tagged_processes"]

log = logging.getLogger(__name__)

# Seconds between SIGTERM and SIGKILL when stopping a process group (BytePS and torch
# elastic use a few seconds; training processes only need to flush logs).
DEFAULT_GRACE_S = 5.0
# Seconds the scheduler and servers get to exit on their own once every worker has finished.
DEFAULT_LINGER_S = 10.0
# Seconds between two polls of the children's exit status.
_POLL_S = 0.05
# Seconds between two looks at whether a child is stopped (one /proc read per child).
_STOPPED_CHECK_S = 0.5
# Progress-bar updates (segments ending in '\r', as tqdm writes) are copied at most this
# often per process, in seconds; full lines are always copied.
_PROGRESS_EVERY_S = 1.0
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


@dataclass(frozen=True)
class ProcessSpec:
    """One process of the job.

    Attributes:
        role: ``scheduler``, ``server`` or ``worker``; only workers decide when the job is done.
        rank: index within the role (global rank for workers), shown in the output prefix.
        argv: the command line.
        env: the complete environment of the process.
        label: output prefix; defaults to ``"role rank"`` (``"scheduler"`` alone).
    """

    role: str
    rank: int
    argv: tuple[str, ...]
    env: Mapping[str, str]
    label: str = ""

    @property
    def name(self) -> str:
        if self.label:
            return self.label
        return self.role if self.role == "scheduler" else f"{self.role} {self.rank}"


@dataclass
class JobResult:
    """How the job ended.

    Attributes:
        exit_code: 0 when every worker succeeded; the failed process's code (or 1) when one
            failed; 128 + signal number when the launcher was interrupted.
        failed: name of the first process that failed (``"worker 3"``), or None.
        message: one line for the user saying what happened.
        codes: exit code of every process by name (negative: killed by that signal).
    """

    exit_code: int
    failed: str | None
    message: str
    codes: dict[str, int | None] = field(default_factory=dict)


def _die_with_parent() -> None:  # runs in the child between fork and exec
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def process_state(pid: int) -> str | None:
    """The state letter of process ``pid`` in ``/proc/<pid>/stat`` (``R``, ``S``, ``T`` for
    stopped, ``Z``, ...), or None when it is gone or unreadable."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(") ", 1)[-1][:1] or None
    except OSError:
        return None


def tagged_processes(variable: str, value: str) -> dict[int, dict[str, str]]:
    """Live processes of this user (not zombies, not this one) whose environment has
    ``variable=value``, with their environments: how tests and the fault matrix find what
    a job left behind, by a tag every process of the job inherits."""
    needle = f"{variable}={value}".encode()
    found = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry.name}/environ", "rb") as f:
                items = f.read().split(b"\0")
        except OSError:
            continue
        if needle in items and process_state(int(entry.name)) not in (None, "Z"):
            found[int(entry.name)] = dict(item.decode(errors="replace").split("=", 1)
                                          for item in items if b"=" in item)
    return found


def stop_process_groups(procs: Sequence[subprocess.Popen], grace_s: float) -> None:
    """SIGTERM every process group, wait up to ``grace_s``, then SIGKILL what is left.

    Each process must lead its own group (``start_new_session=True``). Groups are signalled
    even after their leader exited, so grandchildren it left behind are stopped too. Stopped
    groups are continued after the SIGTERM, so that they end now rather than at the SIGKILL.
    """
    for proc in procs:
        _signal_group(proc, signal.SIGTERM)
        _signal_group(proc, signal.SIGCONT)
    deadline = time.monotonic() + grace_s
    for proc in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
    for proc in procs:
        _signal_group(proc, signal.SIGKILL)
    for proc in procs:
        proc.wait()


def _signal_group(proc: subprocess.Popen, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


class _Pump(threading.Thread):
    """Copies one child's output to ``out`` with a prefix, one whole line per write."""

    def __init__(self, stream: IO[bytes], prefix: str, out: IO[str], lock: threading.Lock):
        super().__init__(daemon=True, name=f"pump {prefix}")
        self._stream, self._prefix, self._out, self._lock = stream, prefix, out, lock

    def run(self) -> None:
        last_progress = 0.0
        pending = b""
        while chunk := self._stream.read1(65536):
            pending += chunk
            while True:
                cut = min((i for i in (pending.find(b"\n"), pending.find(b"\r")) if i >= 0),
                          default=-1)
                if cut < 0:
                    break
                segment, ender, pending = pending[:cut], pending[cut:cut + 1], pending[cut + 1:]
                if ender == b"\r":
                    now = time.monotonic()
                    if not segment.strip() or now - last_progress < _PROGRESS_EVERY_S:
                        continue
                    last_progress = now
                self._emit(segment)
        if pending:
            self._emit(pending)

    def _emit(self, segment: bytes) -> None:
        text = segment.decode("utf-8", errors="replace").rstrip()
        with self._lock:
            self._out.write(f"[{self._prefix}] {text}\n")
            self._out.flush()


class Supervisor:
    """Starts the processes of one job and supervises them until it ends.

    Args:
        specs: the processes. The job ends when every worker exited 0 (or, with no worker
            among them, as a scheduler or server machine has none, when every process did).
        out: where prefixed output goes (default: ``sys.stdout``).
        grace_s: seconds between SIGTERM and SIGKILL when stopping.
        linger_s: seconds non-worker processes may take to exit on their own after the last
            worker finished, before they are stopped.
        reaper: told every process group, so that they are stopped even if this process is
            killed outright.
        fault_file: the job's ``ESPRESSO_FAULT_FILE``; reports in it written after
            :meth:`run` began name the culprit of a failure.
        stopped_after_s: a process stopped (SIGSTOP, state ``T``) this long fails the job
            (None: never; the launcher passes ``ESPRESSO_HEARTBEAT_TIMEOUT``).

    Raises:
        ValueError: ``specs`` is empty.
    """

    def __init__(self, specs: Sequence[ProcessSpec], out: IO[str] | None = None,
                 grace_s: float = DEFAULT_GRACE_S, linger_s: float = DEFAULT_LINGER_S,
                 reaper: Reaper | None = None, *, fault_file: str | None = None,
                 stopped_after_s: float | None = None):
        if not specs:
            raise ValueError("nothing to supervise: no process given")
        self.specs = list(specs)
        self.out = out if out is not None else sys.stdout
        self.grace_s, self.linger_s = grace_s, linger_s
        self.reaper = reaper
        self.fault_file = fault_file
        self.stopped_after_s = stopped_after_s
        self._stopped_since: dict[int, float] = {}  # spec index -> first seen stopped
        self._next_stopped_check = 0.0
        self._started_at = time.time()  # reports older than this belong to another run
        self.procs: list[subprocess.Popen] = []
        self._interrupt: int | None = None
        self._lock = threading.Lock()

    # ---- public -------------------------------------------------------------------------
    def run(self) -> JobResult:
        """Start every process, wait for the job to end, stop whatever is left.

        Returns:
            the :class:`JobResult`; nothing the job started is running any more.

        Raises:
            OSError: a command could not be started (the ones already started are stopped).
        """
        restore = self._install_signal_handlers()
        pumps: list[_Pump] = []
        self._started_at = time.time()
        try:
            self._start_all()
            pumps = [_Pump(p.stdout, s.name, self.out, self._lock)
                     for s, p in zip(self.specs, self.procs, strict=True) if p.stdout]
            for pump in pumps:
                pump.start()
            return self._watch()
        finally:
            stop_process_groups(self.procs, self.grace_s)
            for pump in pumps:
                pump.join(timeout=self.grace_s)
            restore()

    @property
    def pids(self) -> list[int]:
        """Process ids of the started processes, in spec order."""
        return [p.pid for p in self.procs]

    # ---- steps --------------------------------------------------------------------------
    def _start_all(self) -> None:
        # Children are forked before any pump thread exists, so the pre-exec hook runs in
        # a single-threaded parent.
        for spec in self.specs:
            try:
                proc = subprocess.Popen(
                    list(spec.argv), env=dict(spec.env), stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                    start_new_session=True, preexec_fn=_die_with_parent,  # noqa: PLW1509
                )
            except OSError as exc:
                raise OSError(f"cannot start {spec.name}: {' '.join(spec.argv)}: {exc}") from exc
            self.procs.append(proc)
            if self.reaper is not None:
                self.reaper.watch_group(proc.pid)
            log.debug("started %s pid %d: %s", spec.name, proc.pid, " ".join(spec.argv))

    def _watch(self) -> JobResult:
        workers = [i for i, s in enumerate(self.specs) if s.role == "worker"]
        what = "worker" if workers else "process"
        workers = workers or list(range(len(self.specs)))
        others = [i for i in range(len(self.specs)) if i not in workers]
        linger_until: float | None = None
        while True:
            if self._interrupt is not None:
                sig = signal.Signals(self._interrupt)
                return self._result(128 + sig.value, None,
                                    f"interrupted by {sig.name}; stopped every process")
            codes = [p.poll() for p in self.procs]
            for i, code in enumerate(codes):
                if code is not None and code != 0:
                    return self._failure(i, code)
            stopped = self._long_stopped()
            if stopped is not None:
                return stopped
            if all(codes[i] == 0 for i in workers):
                if all(codes[i] is not None for i in others):
                    return self._result(0, None, f"every {what} finished")
                if linger_until is None:
                    linger_until = time.monotonic() + self.linger_s
                elif time.monotonic() > linger_until:
                    return self._result(0, None, "every worker finished; stopped the "
                                        "scheduler and servers")
            time.sleep(_POLL_S)

    def _long_stopped(self) -> JobResult | None:
        """A failure when a child has been stopped for ``stopped_after_s``; checked every
        ``_STOPPED_CHECK_S``."""
        now = time.monotonic()
        if self.stopped_after_s is None or now < self._next_stopped_check:
            return None
        self._next_stopped_check = now + _STOPPED_CHECK_S
        for i, proc in enumerate(self.procs):
            if process_state(proc.pid) != "T":
                self._stopped_since.pop(i, None)
                continue
            since = self._stopped_since.setdefault(i, now)
            if now - since >= self.stopped_after_s:
                name = self.specs[i].name
                running = sum(p.poll() is None for p in self.procs) - 1
                return self._result(1, name, f"{name} has been stopped (SIGSTOP, or a debugger) "
                                    f"for {now - since:.1f} s (ESPRESSO_HEARTBEAT_TIMEOUT="
                                    f"{self.stopped_after_s:g}); stopping it and the other "
                                    f"{running} running process(es)")
        return None

    def _failure(self, index: int, code: int) -> JobResult:
        name = self.specs[index].name
        if code < 0:
            why = f"was killed by {signal.Signals(-code).name}"
        else:
            why = f"exited with code {code}"
        running = sum(p.poll() is None for p in self.procs)
        stop = f"stopping the other {running} running process(es)"
        culprit = None if code < 0 else self._culprit(name)
        if culprit is None:
            return self._result(code if code > 0 else 1, name, f"{name} {why}; {stop}")
        blamed, cause = culprit
        return self._result(code if code > 0 else 1, blamed,
                            f"{cause}; then {name} {why}; {stop}")

    def _culprit(self, failed: str) -> tuple[str, str] | None:
        """Another process to blame for ``failed``'s exit, and why: the earliest fault report
        of this run, else a process of the job that is stopped."""
        report = next((f for f in faults.read(self.fault_file) if f.time >= self._started_at),
                      None)
        stopped = [s.name for s, p in zip(self.specs, self.procs, strict=True)
                   if process_state(p.pid) == "T"]
        if report is not None and report.culprit != failed:
            cause = (report.reason if report.reason.startswith(report.culprit)
                     else f"{report.culprit} was lost: {report.reason}")
            if report.culprit in stopped:
                cause += " (it is stopped: SIGSTOP or a debugger)"
            return report.culprit, cause
        if stopped and failed not in stopped:
            return stopped[0], f"{stopped[0]} is stopped (SIGSTOP or a debugger)"
        return None

    def _result(self, exit_code: int, failed: str | None, message: str) -> JobResult:
        codes = {s.name: p.poll() for s, p in zip(self.specs, self.procs, strict=True)}
        return JobResult(exit_code, failed, message, codes)

    def _install_signal_handlers(self):
        if threading.current_thread() is not threading.main_thread():
            return lambda: None

        def handler(signum, _frame):
            self._interrupt = signum

        previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}

        def restore() -> None:
            for sig, old in previous.items():
                signal.signal(sig, old)

        return restore
