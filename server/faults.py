"""Fault reports: which process a job lost, for whoever supervises the job.

When a process is lost, the first processes to exit are usually its victims (workers whose
pushes fail, servers told to abort), so the launcher cannot tell the culprit from exit codes.
Whoever finds a process lost appends one JSON line to ``ESPRESSO_FAULT_FILE``:

* the scheduler, when a node stopped sending heartbeats or its connection dropped;
* every node that receives the scheduler's ABORT, relaying the culprit it names (so that the
  launcher of each machine learns it, also when the scheduler runs elsewhere);
* a node whose own connection to the scheduler or to a server died.

Each line is ``{"culprit": "worker 1", "reason": "...", "reporter": "scheduler",
"time": 1700000000.0}``; culprits are named as the launcher names its processes
(``scheduler``, ``server N``, ``worker N``). The earliest report is the cause: a process that
fails because another one was lost reports only after that one was reported.

Example:
    >>> report("/tmp/faults", "worker 1", "worker 1 is lost: ...", "scheduler")  # doctest: +SKIP
    >>> read("/tmp/faults")[0].culprit                                           # doctest: +SKIP
    'worker 1'
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass

__all__ = ["Fault", "first", "read", "report"]

log = logging.getLogger(__name__)

# Longest reason kept, in characters: one line a launcher prints, not a log.
_MAX_REASON_CHARS = 1000


@dataclass(frozen=True)
class Fault:
    """One report: ``culprit`` was lost, as ``reporter`` saw it at ``time`` (Unix seconds)."""

    culprit: str
    reason: str
    reporter: str
    time: float


def report(path: str | None, culprit: str, reason: str, reporter: str) -> None:
    """Append a report to ``path`` (nothing when None); never raises.

    One ``write`` of one line to a file opened for appending, so that reports of several
    processes never interleave.
    """
    if not path:
        return
    line = json.dumps({"culprit": culprit, "reason": reason[:_MAX_REASON_CHARS],
                       "reporter": reporter, "time": time.time()}) + "\n"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)
    except OSError as exc:
        log.warning("cannot write the fault report to ESPRESSO_FAULT_FILE=%s (%s): %s", path,
                    exc.strerror, reason)


def read(path: str | None) -> list[Fault]:
    """The reports in ``path``, oldest first (none when it is missing; malformed lines are
    skipped)."""
    if not path:
        return []
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            lines = f.read(1 << 20).splitlines()
    except OSError:
        return []
    faults = []
    for line in lines:
        try:
            item = json.loads(line)
            fault = Fault(str(item["culprit"]), str(item["reason"]), str(item["reporter"]),
                          float(item["time"]))
        except (ValueError, KeyError, TypeError):
            continue
        faults.append(fault)
    return sorted(faults, key=lambda f: f.time)


def first(path: str | None) -> Fault | None:
    """The earliest report in ``path``, or None."""
    faults = read(path)
    return faults[0] if faults else None
