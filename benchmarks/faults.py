"""Fault matrix: kill -9 and SIGSTOP of each process of a local job, in each phase of training.

Every cell starts a real job, ``espresso-launch --local --machines 2 --workers-per-machine 1
--servers 1`` running examples/train.py with ``Compression.espresso`` (random-k), injects one
fault into one process and watches the job end:

    targets  worker 1, server 0, the scheduler, the launcher itself
    signals  SIGKILL (kill -9) and SIGSTOP
    phases   start-up   0.5 s after the scheduler listens (workers still import torch)
             profiling  1 s after rank 0's runtime started (uncompressed profiled steps)
             trials     0.5 s after the finalists' measured trials began
             steady     1 s after the trials ended (the kept strategy trains)

Phases are recognised from the job's own log lines; ESPRESSO_PROFILE_STEPS and
ESPRESSO_TRIAL_STEPS are raised so that each lasts seconds, and the phase the fault actually
landed in is recorded ("hit"). Per cell: did the job end (the launcher exited within
``--limit-s``), does the launcher's last line name the culprit, the seconds from the fault to
that last line (detection plus stopping the others), and what was left behind: processes of
the job (found by a tag variable in their environment), listening sockets on the job's ports,
new /dev/shm entries, and any file in the job's own TMPDIR (the launcher's fault file lives
there). Prints the table and writes
benchmarks/results/faults.json.

In that matrix the launcher itself also watches its children for the stopped state, so a
second table measures the heartbeats alone: a scheduler, a server and two workers pushing and
pulling in a loop, started without the launcher; one of them is stopped, and the time to the
first report in ESPRESSO_FAULT_FILE (written by whoever found it, before anything else) is
the detection time of the heartbeats (``--repeats`` times per target). A third table runs
the same job as on a cluster, one ``bpslaunch`` per role and worker machine (each with its
own fault file), stops a process under another launcher, and reads the last line of worker
0's launcher, which can only learn the culprit through the reports of its own worker.

    .venv/bin/python benchmarks/faults.py
    .venv/bin/python benchmarks/faults.py --targets worker --signals STOP --phases steady
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

from byteps_espresso.deploy.supervisor import tagged_processes

ROOT = Path(__file__).resolve().parents[1]
LAUNCHER = str(Path(sys.executable).with_name("espresso-launch"))
TARGETS = {"worker": "worker 1", "server": "server 0", "scheduler": "scheduler",
           "launcher": "the launcher"}
SIGNALS = {"KILL": signal.SIGKILL, "STOP": signal.SIGSTOP}
# Phase -> (log line that starts it, seconds after it to inject, line that would end it).
PHASES = {
    "start-up": (r"\[scheduler\] .*scheduler listening on", 0.5, r"rank 0/\d+ "),
    "profiling": (r"\[worker 0\] .*rank 0/\d+ ", 1.0, r"planned in "),
    "trials": (r"measuring \d+ finalists", 0.5, r"trials \(median"),
    "steady": (r"trials \(median", 1.0, r"every worker finished"),
}
# Entries of the job's TMPDIR that are caches kept across runs by design, not leftovers:
# torch's per-user compile cache (torch._inductor's default cache_dir).
CACHES = ("torchinductor_",)
# Uncompressed steps profiled and measured steps per finalist: long enough (seconds each on a
# 2-core machine) to inject a fault in the middle of the phase.
PROFILE_STEPS, TRIAL_STEPS = 150, 300


# A worker of the heartbeat-only jobs: push and pull one key in a loop until it is killed.
LOOP = r"""
import pathlib, sys, time
import numpy as np
from byteps_espresso.config import Config
from byteps_espresso.server.client import PSClient

cfg = Config.from_env()
client = PSClient(cfg, rank=cfg.rank)
client.declare("k", 1024, pushers=list(range(cfg.world_size)))
for round_ in range(10**9):
    client.push_pull("k", np.ones(1024, np.float32), round_)
    if round_ == 0:
        pathlib.Path(sys.argv[1], f"ready{cfg.rank}").touch()
    time.sleep(0.01)
"""


@dataclass
class Cell:
    target: str
    signal: str
    phase: str
    hit: str = ""  # the phase the fault landed in, from the log lines seen before it
    ended: bool = False
    exit_code: int | None = None
    named: bool = False
    last_line: str = ""
    to_last_line_s: float | None = None
    left_processes: list[int] = field(default_factory=list)
    left_ports: list[int] = field(default_factory=list)
    left_shm: list[str] = field(default_factory=list)
    left_files: list[str] = field(default_factory=list)
    note: str = ""


class _Lines(threading.Thread):
    """Collects one stream's lines with their arrival time (monotonic)."""

    def __init__(self, stream) -> None:
        super().__init__(daemon=True)
        self.stream, self.lines = stream, []

    def run(self) -> None:
        for line in self.stream:
            self.lines.append((time.monotonic(), line.rstrip("\n")))

    def first(self, pattern: str) -> float | None:
        rx = re.compile(pattern)
        return next((t for t, line in list(self.lines) if rx.search(line)), None)

    def match(self, pattern: str) -> re.Match | None:
        rx = re.compile(pattern)
        return next((m for _, line in list(self.lines) if (m := rx.search(line))), None)


def _job_command(args: argparse.Namespace) -> list[str]:
    return [LAUNCHER, "--local", "--machines", "2", "--workers-per-machine", "1",
            "--servers", "1", "--", sys.executable, str(ROOT / "examples" / "train.py"),
            "--compression", "espresso", "--compressor", "randomk", "--model", "mlp",
            "--vocab", "2000", "--dim", "32", "--hidden", "64", "--epochs", "1",
            "--steps-per-epoch", str(args.steps), "--quiet"]


def _environ(tag: str, tmp: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("DMLC_", "BYTEPS_", "ESPRESSO_", "CUDA_VISIBLE"))}
    env.update(FAULT_MATRIX_TAG=tag, OMP_NUM_THREADS="1", TMPDIR=tmp,
               ESPRESSO_PROFILE_STEPS=str(PROFILE_STEPS), ESPRESSO_TRIAL_STEPS=str(TRIAL_STEPS))
    return env


def _tagged(tag: str) -> dict[int, dict[str, str]]:
    return tagged_processes("FAULT_MATRIX_TAG", tag)


def _target_pid(tag: str, target: str, launcher: int) -> int | None:
    if target == "launcher":
        return launcher
    for pid, env in _tagged(tag).items():
        role = env.get("DMLC_ROLE", "")
        if target == role == "scheduler" or target == role == "server":
            return pid
        if target == role == "worker" and env.get("DMLC_WORKER_ID") == "1":
            return pid
    return None


def _listening(ports: set[int]) -> list[int]:
    """Those of ``ports`` with a listening TCP socket on this host."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as f:
            for row in f.readlines()[1:]:
                local, state = row.split()[1], row.split()[3]
                port = int(local.rsplit(":", 1)[1], 16)
                if state == "0A" and port in ports:
                    found.add(port)
    return sorted(found)


def _shm() -> set[str]:
    with contextlib.suppress(OSError):
        return set(os.listdir("/dev/shm"))
    return set()


def run_cell(target: str, sig: str, phase: str, args: argparse.Namespace) -> Cell:
    cell = Cell(target, sig, phase)
    tag = uuid.uuid4().hex
    tmp = tempfile.mkdtemp(prefix="fault-matrix-")  # the job's own TMPDIR
    shm_before = _shm()
    proc = subprocess.Popen(_job_command(args), env=_environ(tag, tmp), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            cwd=ROOT)
    out, err = _Lines(proc.stdout), _Lines(proc.stderr)
    out.start()
    err.start()
    start_marker, delay_s, _ = PHASES[phase]
    injected = None
    try:
        deadline = time.monotonic() + args.limit_s
        while (seen := out.first(start_marker)) is None:
            if proc.poll() is not None or time.monotonic() > deadline:
                cell.note = f"the phase never began (launcher exit {proc.poll()})"
                return cell
            time.sleep(0.02)
        time.sleep(max(0.0, seen + delay_s - time.monotonic()))
        pid = _target_pid(tag, target, proc.pid)
        if pid is None:
            cell.note = f"no {target} process to signal"
            return cell
        cell.hit = next((p for p in reversed(PHASES) if out.first(PHASES[p][0]) is not None),
                        "start-up")
        os.kill(pid, SIGNALS[sig])
        injected = time.monotonic()
        try:
            proc.wait(timeout=args.limit_s)
            cell.ended = True
        except subprocess.TimeoutExpired:
            cell.note = f"the launcher still ran {args.limit_s:g} s after the fault"
        # The reaper, when it acts, writes the last line after the launcher is gone.
        err.join(timeout=15)
        out.join(timeout=15)
    finally:
        cell.exit_code = proc.poll()
        lines = [(t, line) for t, line in err.lines if line.strip()]
        if lines:
            when, cell.last_line = lines[-1]
            if injected is not None and when >= injected:
                cell.to_last_line_s = round(when - injected, 2)
        culprit = TARGETS[target]
        cell.named = (cell.last_line.startswith(f"espresso-launch: {culprit} ")
                      or (target == "launcher" and culprit in cell.last_line))
        ports = {int(m[1]) for m in [out.match(r"scheduler listening on [\d.]+:(\d+)")] if m}
        ports |= {p + 1 for p in ports}
        ports |= {int(m[1]) for m in [out.match(r"serving on tcp://[\d.]+:(\d+)")] if m}
        settle = time.monotonic() + 15  # the reaper's grace period, reaping
        while _tagged(tag) and time.monotonic() < settle:
            time.sleep(0.2)
        cell.left_processes = sorted(_tagged(tag))
        cell.left_ports = _listening(ports)
        cell.left_shm = sorted(_shm() - shm_before)
        cell.left_files = sorted(p.name for p in Path(tmp).iterdir()
                                 if not p.name.startswith(CACHES))
        for pid in [*cell.left_processes, *([proc.pid] if proc.poll() is None else [])]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)
        shutil.rmtree(tmp, ignore_errors=True)
    return cell


def heartbeat_cell(target: str, tmp: Path, tag: str) -> dict:
    """Stop ``target`` (``worker``, ``server``, ``scheduler``) of a job started without the
    launcher; the first fault report, its delay from the SIGSTOP in seconds."""
    from byteps_espresso.server import faults

    fault_file = tmp / "faults.jsonl"
    env = {**_ps_env(tag), "ESPRESSO_FAULT_FILE": str(fault_file)}
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    procs = {role: subprocess.Popen([sys.executable, "-m", "byteps_espresso.server"],
                                    env={**env, "DMLC_ROLE": role}, **quiet)
             for role in ("scheduler", "server")}
    for rank in range(2):
        procs[f"worker{rank}"] = subprocess.Popen(
            [sys.executable, "-c", LOOP, str(tmp)],
            env={**env, "DMLC_ROLE": "worker", "DMLC_WORKER_ID": str(rank)}, **quiet)
    try:
        deadline = time.monotonic() + 120
        while not all((tmp / f"ready{r}").exists() for r in range(2)):
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs.values()):
                return {"target": target, "note": "the job did not start"}
            time.sleep(0.05)
        time.sleep(1.0)
        stopped_at = time.time()
        os.kill(procs["worker1" if target == "worker" else target].pid, signal.SIGSTOP)
        deadline = time.monotonic() + 60
        while (first := faults.first(str(fault_file))) is None and time.monotonic() < deadline:
            time.sleep(0.02)
        if first is None:
            return {"target": target, "note": "no report within 60 s"}
        return {"target": target, "culprit": first.culprit, "reporter": first.reporter,
                "detected_s": round(first.time - stopped_at, 2)}
    finally:
        for proc in procs.values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGCONT)
                proc.kill()
            proc.wait()


def _ps_env(tag: str) -> dict[str, str]:
    from byteps_espresso.deploy.launch import free_port_pair

    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("DMLC_", "BYTEPS_", "ESPRESSO_"))}
    env.update(DMLC_NUM_WORKER="2", DMLC_NUM_SERVER="1", DMLC_PS_ROOT_URI="127.0.0.1",
               DMLC_PS_ROOT_PORT=str(free_port_pair()), ESPRESSO_LOG_LEVEL="ERROR",
               OMP_NUM_THREADS="1", FAULT_MATRIX_TAG=tag)
    return env


def cluster_cell(target: str, tmp: Path, tag: str) -> dict:
    """Stop ``target``'s process, each role under its own ``bpslaunch`` as on a cluster; the
    last line of worker 0's launcher and its delay from the SIGSTOP in seconds."""
    env = {**_ps_env(tag), "TMPDIR": str(tmp)}
    bpslaunch = str(Path(sys.executable).with_name("bpslaunch"))
    roles = {"scheduler": {"DMLC_ROLE": "scheduler"}, "server": {"DMLC_ROLE": "server"},
             **{f"worker{r}": {"DMLC_ROLE": "worker", "DMLC_WORKER_ID": str(r)}
                for r in range(2)}}
    launchers = {name: subprocess.Popen(
        [bpslaunch, *([sys.executable, "-c", LOOP, str(tmp)] if "worker" in name else [])],
        env={**env, **role}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        start_new_session=True) for name, role in roles.items()}
    err = _Lines(launchers["worker0"].stderr)
    err.start()
    try:
        deadline = time.monotonic() + 120
        while not all((tmp / f"ready{r}").exists() for r in range(2)):
            if time.monotonic() > deadline or any(p.poll() is not None
                                                  for p in launchers.values()):
                return {"target": target, "note": "the job did not start"}
            time.sleep(0.05)
        time.sleep(1.0)
        name = "worker1" if target == "worker" else target
        want = roles[name]
        # The role's own process: not its launcher, nor the launcher's reaper (both carry
        # the same environment).
        pid = next(pid for pid, penv in _tagged(tag).items()
                   if pid not in {p.pid for p in launchers.values()}
                   and b"deploy.reaper" not in Path(f"/proc/{pid}/cmdline").read_bytes()
                   and all(penv.get(k) == v for k, v in want.items()))
        os.kill(pid, signal.SIGSTOP)
        stopped_at = time.monotonic()
        with contextlib.suppress(subprocess.TimeoutExpired):
            launchers["worker0"].wait(timeout=60)
        err.join(timeout=10)
        lines = [(t, line) for t, line in err.lines if line.strip()]
        if not lines:
            return {"target": target, "note": "worker 0's launcher wrote nothing"}
        when, last = lines[-1]
        return {"target": target, "last_line": last, "to_last_line_s": round(when - stopped_at, 2),
                "named": last.startswith(f"bpslaunch: {TARGETS[target]} ")}
    finally:
        for proc in launchers.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=15)
        for pid in _tagged(tag):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
                os.kill(pid, signal.SIGKILL)


def _row(c: Cell) -> str:
    left = [f"{len(c.left_processes)} proc" if c.left_processes else "",
            f"ports {c.left_ports}" if c.left_ports else "",
            f"shm {c.left_shm}" if c.left_shm else "",
            f"files {c.left_files}" if c.left_files else ""]
    left_text = ", ".join(x for x in left if x) or "none"
    took = "-" if c.to_last_line_s is None else f"{c.to_last_line_s:.1f}"
    hit = c.hit if c.hit == c.phase else f"{c.hit or '-'}!"
    return (f"| {c.target} | {c.signal} | {c.phase} | {hit} | {'yes' if c.ended else 'NO'} | "
            f"{'yes' if c.named else 'NO'} | {took} | {left_text} | {c.last_line[:150]} |")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--targets", nargs="+", default=list(TARGETS), choices=list(TARGETS))
    p.add_argument("--signals", nargs="+", default=list(SIGNALS), choices=list(SIGNALS))
    p.add_argument("--phases", nargs="+", default=list(PHASES), choices=list(PHASES))
    p.add_argument("--steps", type=int, default=4000,
                   help="training steps of the job (it must still train when the fault comes)")
    p.add_argument("--limit-s", type=float, default=240.0,
                   help="seconds a phase may take to begin, and the job to end after the fault")
    p.add_argument("--repeats", type=int, default=3,
                   help="stops per target in the heartbeat-only table (0: skip it)")
    p.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "faults.json"))
    args = p.parse_args()
    # Stopped by SIGTERM: unwind, so that each cell's clean-up stops the job it started.
    signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(128 + signum))
    beats = []
    if args.repeats:
        print("| stopped | culprit named | found by | detected after (s) |")
        print("| --- | --- | --- | --- |", flush=True)
    for target in ("worker", "server", "scheduler"):
        for _ in range(args.repeats):
            with tempfile.TemporaryDirectory(prefix="fault-beats-") as tmp:
                beat = heartbeat_cell(target, Path(tmp), uuid.uuid4().hex)
            beats.append(beat)
            print(f"| {target} | {beat.get('culprit', '-')} | {beat.get('reporter', '-')} | "
                  f"{beat.get('detected_s', beat.get('note'))} |", flush=True)
    remote = []
    if args.repeats:
        print("| stopped (another launcher's) | worker 0's launcher's last line names it | "
              "stop to that line (s) | the line |")
        print("| --- | --- | --- | --- |", flush=True)
        for target in ("worker", "server", "scheduler"):
            with tempfile.TemporaryDirectory(prefix="fault-cluster-") as tmp:
                row = cluster_cell(target, Path(tmp), uuid.uuid4().hex)
            remote.append(row)
            print(f"| {target} | {'yes' if row.get('named') else 'NO'} | "
                  f"{row.get('to_last_line_s', '-')} | "
                  f"{row.get('last_line', row.get('note', ''))[:200]} |", flush=True)
    cells = []
    print("| target | signal | phase | hit | ended | culprit named | fault to last line (s) | "
          "left behind | launcher's last line |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |", flush=True)
    for phase in args.phases:
        for target in args.targets:
            for sig in args.signals:
                cell = run_cell(target, sig, phase, args)
                cells.append(cell)
                print(_row(cell), flush=True)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({
        "command": " ".join(_job_command(args)),
        "profile_steps": PROFILE_STEPS, "trial_steps": TRIAL_STEPS,
        "host": platform.node(), "cpus": os.cpu_count(),
        "heartbeats": beats, "cluster": remote,
        "cells": [asdict(c) for c in cells]}, indent=1) + "\n")
    print(f"wrote {args.json}")
    bad = [c for c in cells if not (c.ended and c.named) or c.left_processes or c.left_ports
           or c.left_shm or c.left_files]
    culprits = {"worker": "worker 1", "server": "server 0", "scheduler": "scheduler"}
    bad_beats = [b for b in beats if b.get("culprit") != culprits[b["target"]]]
    bad_remote = [r for r in remote if not r.get("named")]
    return 1 if bad or bad_beats or bad_remote else 0


if __name__ == "__main__":
    sys.exit(main())
