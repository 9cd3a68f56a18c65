"""A watchdog that cleans up after a launcher that was killed outright (SIGKILL, OOM).

The launcher normally stops its process groups and deletes its namespaces itself. If it dies
without running any cleanup code, its children die too (``PR_SET_PDEATHSIG``) but their own
children and any network namespaces would survive. The reaper is a small separate process
(own session) that learns every process group and namespace through a pipe from the
launcher; when the pipe closes without a final ``done`` line, the launcher is gone and the
reaper stops those groups and deletes those namespaces.

Pipe protocol (ASCII lines): ``pgid <n>``, ``netns <name>``, ``done``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

__all__ = ["Reaper"]

# Seconds between SIGTERM and SIGKILL when the reaper stops orphaned groups.
_GRACE_S = 3.0


class Reaper:
    """Handle on the watchdog process. Use as a context manager around a launch.

    Example:
        >>> with Reaper() as reaper:
        ...     reaper.watch_group(12345)
    """

    def __init__(self) -> None:
        self._proc: subprocess.Popen | None = None

    def __enter__(self) -> Reaper:
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "byteps_espresso.deploy.reaper"], stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL, start_new_session=True, text=True)
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()

    def _send(self, line: str) -> None:
        if self._proc is not None and self._proc.stdin is not None:
            with contextlib.suppress(BrokenPipeError, ValueError):
                self._proc.stdin.write(line + "\n")
                self._proc.stdin.flush()

    def watch_group(self, pgid: int) -> None:
        """Stop process group ``pgid`` if the launcher dies without cleaning up."""
        self._send(f"pgid {pgid}")

    def watch_namespace(self, name: str) -> None:
        """Delete network namespace ``name`` if the launcher dies without cleaning up."""
        self._send(f"netns {name}")

    def release(self) -> None:
        """The launcher cleaned up itself: let the watchdog exit without acting."""
        if self._proc is None:
            return
        self._send("done")
        with contextlib.suppress(BrokenPipeError, ValueError, OSError):
            self._proc.stdin.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._proc.wait(timeout=10)
        self._proc = None


def _kill_groups(pgids: list[int]) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pgid in pgids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, sig)
        if sig == signal.SIGTERM:
            time.sleep(_GRACE_S)


def _serve() -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is the launcher's job
    pgids: list[int] = []
    namespaces: list[str] = []
    for line in sys.stdin:
        word, _, value = line.strip().partition(" ")
        if word == "done":
            return 0
        if word == "pgid" and value.isdigit():
            pgids.append(int(value))
        elif word == "netns" and value:
            namespaces.append(value)
    # EOF without "done": the launcher died.
    _kill_groups(pgids)
    from byteps_espresso.deploy.emulate import delete_namespace

    for name in reversed(namespaces):
        delete_namespace(name)
    return 1


if __name__ == "__main__":
    sys.exit(_serve())
