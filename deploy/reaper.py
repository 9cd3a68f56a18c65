"""A watchdog that cleans up after a launcher that was killed outright or stopped.

The launcher normally stops its process groups and deletes its namespaces itself. If it dies
without running any cleanup code (SIGKILL, OOM), its children die too (``PR_SET_PDEATHSIG``)
but their own children, network namespaces and files would survive; if it is stopped
(SIGSTOP), the job would run on unsupervised, or hang once its output pipes fill. The reaper
is a small separate process (own session) that learns every process group, namespace and
file through a pipe from the launcher, and hears a beat from it every ``BEAT_S``:

* the pipe closes without a final ``done`` line: the launcher is gone;
* no beat for ``--timeout`` seconds (``ESPRESSO_HEARTBEAT_TIMEOUT``): the launcher is stopped
  or hung, and is killed;

either way the reaper stops those groups, deletes those namespaces and files, and writes the
job's last line to the launcher's stderr, naming the launcher.

Pipe protocol (ASCII lines): ``pgid <n>``, ``netns <name>``, ``path <file>``, ``beat``,
``done``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import select
import signal
import subprocess
import sys
import threading
import time

__all__ = ["BEAT_S", "Reaper"]

# Seconds between two beats of the launcher: the PS heartbeat interval (server/link.py).
BEAT_S = 0.5
# Seconds between SIGTERM and SIGKILL when the reaper stops orphaned groups.
_GRACE_S = 3.0
# Seconds between two looks at whether the groups are gone.
_POLL_S = 0.05


class Reaper:
    """Handle on the watchdog process. Use as a context manager around a launch.

    Args:
        timeout_s: kill the launcher and its job when it has not beaten for this long
            (None: only act when the launcher dies).
        prog: the launcher's name, for the line the reaper writes.

    Example:
        >>> with Reaper() as reaper:
        ...     reaper.watch_group(12345)
    """

    def __init__(self, timeout_s: float | None = None, prog: str = "espresso-launch") -> None:
        self._proc: subprocess.Popen | None = None
        self._timeout_s, self._prog = timeout_s, prog
        self._lock = threading.Lock()
        self._released = threading.Event()

    def __enter__(self) -> Reaper:
        argv = [sys.executable, "-m", "byteps_espresso.deploy.reaper", "--prog", self._prog]
        if self._timeout_s is not None:
            argv += ["--timeout", str(self._timeout_s)]
        self._proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                      start_new_session=True, text=True)
        if self._timeout_s is not None:
            # A thread, so that the launcher beats while it waits for processes to exit.
            threading.Thread(target=self._beat, name="reaper-beat", daemon=True).start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()

    def _beat(self) -> None:
        while not self._released.wait(BEAT_S):
            self._send("beat")

    def _send(self, line: str) -> None:
        with self._lock:
            if self._proc is not None and self._proc.stdin is not None:
                with contextlib.suppress(BrokenPipeError, ValueError, OSError):
                    self._proc.stdin.write(line + "\n")
                    self._proc.stdin.flush()

    def watch_group(self, pgid: int) -> None:
        """Stop process group ``pgid`` if the launcher dies without cleaning up."""
        self._send(f"pgid {pgid}")

    def watch_namespace(self, name: str) -> None:
        """Delete network namespace ``name`` if the launcher dies without cleaning up."""
        self._send(f"netns {name}")

    def watch_path(self, path: str) -> None:
        """Delete file ``path`` if the launcher dies without cleaning up."""
        self._send(f"path {path}")

    def release(self) -> None:
        """The launcher cleaned up itself: let the watchdog exit without acting."""
        self._released.set()
        if self._proc is None:
            return
        self._send("done")
        with self._lock, contextlib.suppress(BrokenPipeError, ValueError, OSError):
            self._proc.stdin.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._proc.wait(timeout=10)
        self._proc = None


def _group_alive(pgid: int) -> bool:
    """Whether a process of group ``pgid`` is left (zombies count until init reaps them)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # a member that is not ours: still there
        pass
    return True


def _kill_groups(pgids: list[int]) -> None:
    """SIGTERM every group (continuing stopped ones), SIGKILL what is left after the grace."""
    for pgid in pgids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGTERM)
            os.killpg(pgid, signal.SIGCONT)  # a stopped group handles SIGTERM now
    deadline = time.monotonic() + _GRACE_S
    while any(_group_alive(g) for g in pgids) and time.monotonic() < deadline:
        time.sleep(_POLL_S)
    for pgid in pgids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(") ", 1)[-1][:1]
    except OSError:
        return "?"


def _serve(timeout_s: float | None, prog: str) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is the launcher's job
    signal.signal(signal.SIGTSTP, signal.SIG_IGN)  # and so is Ctrl-Z
    launcher = os.getppid()
    pgids: list[int] = []
    namespaces: list[str] = []
    paths: list[str] = []
    pending = b""
    last_heard = time.monotonic()
    silent_for: float | None = None
    while True:
        wait_s = None if timeout_s is None else max(0.0, last_heard + timeout_s - time.monotonic())
        ready, _, _ = select.select([0], [], [], wait_s)
        if not ready:
            silent_for = time.monotonic() - last_heard
            break
        chunk = os.read(0, 65536)
        if not chunk:
            break  # EOF without "done": the launcher died
        last_heard = time.monotonic()
        pending += chunk
        *lines, pending = pending.split(b"\n")
        for raw in lines:
            word, _, value = raw.decode("ascii", "replace").strip().partition(" ")
            if word == "done":
                return 0
            if word == "pgid" and value.isdigit():
                pgids.append(int(value))
            elif word == "netns" and value:
                namespaces.append(value)
            elif word == "path" and value:
                paths.append(value)
    if silent_for is None:
        what = f"the launcher (pid {launcher}) died without cleaning up"
    else:
        state = "it is stopped: SIGSTOP" if _state(launcher) == "T" else "it is hung"
        what = (f"the launcher (pid {launcher}) has not responded for {silent_for:.1f} s "
                f"({state}; ESPRESSO_HEARTBEAT_TIMEOUT={timeout_s:g})")
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(launcher, signal.SIGKILL)
    _kill_groups(pgids)
    from byteps_espresso.deploy.emulate import delete_namespace

    for name in reversed(namespaces):
        delete_namespace(name)
    for path in paths:
        with contextlib.suppress(OSError):
            os.unlink(path)
    ended = "; killed it" if silent_for is not None else ""
    print(f"{prog}: {what}{ended}; stopped its {len(pgids)} process group(s)",
          file=sys.stderr, flush=True)
    return 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="byteps_espresso.deploy.reaper",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--timeout", type=float, default=None,
                        help="seconds without a beat after which the launcher is killed")
    parser.add_argument("--prog", default="espresso-launch", help="the launcher's name")
    args = parser.parse_args(argv)
    return _serve(args.timeout, args.prog)


if __name__ == "__main__":
    sys.exit(main())
