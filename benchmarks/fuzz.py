"""Fuzzing a live PS job at scale: hostile and malformed messages against its scheduler and
its server while the job's own workers run rounds.

The job is real and authenticated (ESPRESSO_JOB_SECRET): a scheduler, one server and two
worker processes. The workers run dense push/pull rounds whose sums they check exactly;
every POISON_EVERY rounds rank 1 pushes a NaN on a second key (both ranks must get a
``non_finite`` error naming rank 1) and rank 0 sends a malformed PLACE (it must be refused).
Meanwhile SENDERS processes send the attacks of :data:`ATTACKS`, each signed in turn
without a MAC, with another job's key, and with the job's own key (the server's job key,
the scheduler's registration key: what a member process that misbehaves holds). Their
sockets never read a reply, so replies pile up at the server and scheduler until the
per-peer reply cap drops them; every few thousand messages a sender reconnects and opens a
raw TCP connection that sends garbage (to the server, the scheduler and the store gate in
turn).

Pass criteria (issue 16): 0 crashes (every job process exits 0 at the end), 0 hangs (every
legitimate round completes, the job keeps making rounds during and after the fuzzing, and
shuts down on its own), retained memory growth of the scheduler and server <= 32 MiB
(VmRSS before the first and after the last hostile message), every legitimate round correct.

    python benchmarks/fuzz.py                       # 10^6 messages (a few minutes)
    python benchmarks/fuzz.py --messages 20000      # quick

Writes benchmarks/results/fuzz.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import secrets
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

RESULTS = Path(__file__).parent / "results" / "fuzz.json"
MESSAGES = 10**6
SENDERS = 4
NUMEL = 4096  # the legitimate key: 16 KB of float32
POISON_EVERY = 10  # rounds between a NaN push (rank 1) and a malformed PLACE (rank 0)
TARGET_GROWTH_MIB = 32  # issue 16: retained memory growth of the scheduler and the server
RECONNECT_EVERY = 5000  # messages between a sender's reconnects (fresh connections)
RAW_TCP_EVERY = 2000  # messages between raw TCP connections that send garbage
OP_TIMEOUT_S = 30  # ESPRESSO_TIMEOUT of the job: a legitimate round slower than this hangs
SETTLE_S = 3.0  # seconds after the last hostile message before memory is read again
WARMUP = 20_000  # hostile messages sent before memory is first read


# ---- the legitimate job's workers -----------------------------------------------------------
def legit_worker(run: Path) -> dict[str, Any]:
    """Run checked rounds until the round named in ``run/stop`` (both ranks stop at the same
    one); rank 0 first writes what the senders need (addresses, key ids, the job key) to
    ``run/job.json``."""
    from byteps_espresso.server import protocol as P
    from byteps_espresso.server.client import PSClient, PSError

    from byteps_espresso.config import Config

    client = PSClient(Config.from_env())
    rank, ranks = client.rank, [0, 1]
    client.declare("legit", NUMEL, pushers=ranks)
    client.declare("poison", 64, pushers=ranks)
    if rank == 0:
        info = {"server": client.servers[0], "scheduler": client._link.endpoint,
                "key": client._tensors["legit"].parts[0].key,
                "poison_key": client._tensors["poison"].parts[0].key,
                "job_key": client._auth.key.hex()}
        _write(run / "job.json", json.dumps(info))
    base = np.arange(NUMEL, dtype=np.float32)
    wrong: list[str] = []
    times: list[float] = []
    rounds = poisoned = refused = 0
    stop = run / "stop"
    while not stop.exists() or rounds < int(stop.read_text()):
        x = base * (rank + 1) + rounds  # the sum is exact in float32: small integers
        start = time.monotonic()
        total = client.push_pull("legit", x, rounds)
        times.append(time.monotonic() - start)
        if not np.array_equal(total, base * 3 + 2 * rounds):
            wrong.append(f"round {rounds}: got {total[:3]}...")
        if rounds % POISON_EVERY == 0:
            bad = np.full(64, np.nan if rank == 1 else 1.0, np.float32)
            try:
                client.push_pull("poison", bad, rounds // POISON_EVERY)
                wrong.append(f"poison round {rounds // POISON_EVERY} was accepted")
            except PSError as exc:
                if "non_finite" not in str(exc) or "[1]" not in str(exc):
                    wrong.append(f"poison round: unexpected error {exc}")
                poisoned += 1
            if rank == 0:
                try:
                    client._call(-1, P.encode_json(P.MsgType.PLACE, {"spec": []}, sender=0),
                                 P.MsgType.PLACE, 0, "place")
                    wrong.append("a malformed PLACE was accepted")
                except PSError:
                    refused += 1
        rounds += 1
        if rounds % 10 == 0:
            _write(run / f"progress{rank}", str(rounds))
    client.close()
    return {"rank": rank, "rounds": rounds, "wrong": wrong, "poisoned": poisoned,
            "refused_place": refused, "round_ms_median": float(np.median(times) * 1e3),
            "round_ms_max": float(max(times) * 1e3)}


def _write(path: Path, text: str) -> None:
    path.with_suffix(".tmp").write_text(text)
    os.replace(path.with_suffix(".tmp"), path)  # never seen half-written


# ---- attacks --------------------------------------------------------------------------------
def _attacks(info: dict[str, Any]) -> dict[str, tuple[str, Callable[[Any], list[bytes]]]]:
    """Attack name -> (target, rng -> frames). Frames are unsigned; the sender signs them."""
    from byteps_espresso.server import protocol as P

    key, future = info["key"], 10**12
    spec = {"name": "flood", "numel": 16, "dtype": "float32", "compressor": None,
            "params": {}, "pushers": [0, 1]}

    def header(rng: Any) -> bytes:
        return bytes(P.encode(P.MsgType.PULL, key=key, round=int(rng.integers(0, 99)),
                              sender=int(rng.integers(-1, 4)))[0])

    def mutate(rng: Any) -> list[bytes]:
        head = bytearray(header(rng))
        for _ in range(int(rng.integers(1, 4))):  # magic, version, type, flags, nframes...
            head[int(rng.integers(0, len(head)))] = int(rng.integers(0, 256))
        return [bytes(head), rng.bytes(int(rng.integers(0, 64)))]

    def lying_lengths(rng: Any) -> list[bytes]:
        claim = int(rng.choice([0, 1, 2**31, 2**62]))
        frames = P.encode(P.MsgType.PUSH, key=key, round=1, sender=1, dtype=P.DType.FLOAT32,
                          numel=NUMEL, frames=[np.zeros(4, np.float32)])
        head = bytearray(bytes(frames[0]))
        head[P.HEADER.size:P.HEADER.size + 8] = claim.to_bytes(8, "little")
        return [bytes(head), b"\0" * 16]

    def push(values: float, sender: int) -> Callable[[Any], list[bytes]]:
        def make(rng: Any) -> list[bytes]:
            x = np.full(NUMEL, values, np.float32)
            return [bytes(f) for f in P.encode(
                P.MsgType.PUSH, key=key, round=int(rng.integers(0, 3)), sender=sender,
                dtype=P.DType.FLOAT32, numel=NUMEL, frames=[x], flags=P.FLAG_PULL)]
        return make

    def declare(rng: Any) -> list[bytes]:
        body = dict(spec, name=f"flood{int(rng.integers(0, 2**40))}")
        return P.encode_json(P.MsgType.DECLARE, body, key=int(rng.integers(10**6, 2**62)),
                             sender=int(rng.integers(-1, 3)))

    def bad_declare(rng: Any) -> list[bytes]:
        body = rng.choice([dict(spec, numel=-1), dict(spec, numel=2**62),
                           dict(spec, pushers=list(range(5000))), dict(spec, dtype="int8"),
                           dict(spec, compressor="nope"), {"name": 7}, {}])
        return P.encode_json(P.MsgType.DECLARE, body, key=key, sender=0)

    def json_frame(kind: Any, body: Any, sender: int = 0) -> Callable[[Any], list[bytes]]:
        return lambda rng: P.encode_json(kind, body, sender=sender)

    return {
        "garbage": ("server", lambda rng: [rng.bytes(int(rng.integers(0, 2048)))
                                           for _ in range(int(rng.integers(1, 4)))]),
        "garbage_scheduler": ("scheduler", lambda rng: [rng.bytes(int(rng.integers(0, 512)))]),
        "truncated_header": ("server", lambda rng: [header(rng)[:int(rng.integers(0, 40))]]),
        "mutated_header": ("server", mutate),
        "mutated_header_scheduler": ("scheduler", mutate),
        "lying_lengths": ("server", lying_lengths),
        "forged_push": ("server", push(1e6, 1)),
        "nonfinite_push": ("server", push(np.nan, 1)),
        "far_future_pull": ("server", lambda rng: P.encode(
            P.MsgType.PULL, key=key, round=future + int(rng.integers(0, 10**6)),
            sender=int(rng.integers(-1, 2)))),
        "declare_flood": ("server", declare),
        "bad_declare": ("server", bad_declare),
        "stats": ("server", lambda rng: P.encode(P.MsgType.STATS, sender=-1)),
        "unexpected_type": ("server", lambda rng: P.encode(P.MsgType.SHUTDOWN)),
        "rogue_register_server": ("scheduler", json_frame(
            P.MsgType.REGISTER, {"role": "server", "address": "tcp://127.0.0.1:1"}, -1)),
        "huge_world_size": ("scheduler", lambda rng: P.encode_json(
            P.MsgType.REGISTER, {"role": "worker", "rank": int(rng.integers(0, 2**40)),
                                 "world_size": 2**40}, sender=0)),
        "bad_place": ("scheduler", lambda rng: P.encode_json(P.MsgType.PLACE, rng.choice([
            {"spec": []}, {"spec": spec, "parts": [[2**40, 4]]}, {"spec": "x"},
            {"parts": None}]), sender=0)),
        "forged_done": ("scheduler", json_frame(P.MsgType.DONE, {"failed": "forged"})),
        "forged_barrier": ("scheduler", lambda rng: P.encode(P.MsgType.BARRIER, sender=1)),
        "bad_json": ("scheduler", lambda rng: P.encode(P.MsgType.PLACE, sender=0,
                                                        frames=[b"{]"])),
    }


def sender(info: dict[str, Any], count: int, seed: int) -> dict[str, Any]:
    """Send ``count`` hostile messages, cycling attacks and signers; never read a reply."""
    import zmq
    from byteps_espresso.server.auth import Authenticator

    rng = np.random.default_rng(seed)
    job = Authenticator(bytes.fromhex(info["job_key"]))
    signers = {"none": Authenticator(None),
               "other_job": Authenticator.boot(b"another job's secret").for_job(
                   b"another job's secret", "x"),
               "member": None}  # the target's own key: job key (server), boot key (scheduler)
    member = {"server": job, "scheduler": Authenticator.boot(info["secret"].encode())}
    attacks = list(_attacks(info).items())
    address = {"server": info["server"], "scheduler": info["scheduler"]}
    host, port = info["scheduler"].rsplit(":", 1)
    raw = [info["server"], info["scheduler"], f"{host}:{int(port) + 1}"]
    ctx = zmq.Context()
    socks: dict[tuple[str, str], Any] = {}

    def connect() -> None:
        for sock in socks.values():
            sock.close(linger=0)
        for target, where in address.items():
            for name in signers:
                sock = ctx.socket(zmq.DEALER)
                sock.setsockopt(zmq.RCVHWM, 16)  # unread replies back up to the target
                sock.setsockopt(zmq.SNDHWM, 1000)
                sock.setsockopt(zmq.LINGER, 0)
                sock.connect(where)
                socks[target, name] = sock

    sent: Counter[str] = Counter()
    stalled_s = 0.0
    connect()
    names = list(signers)
    for i in range(count):
        if i and i % RECONNECT_EVERY == 0:
            connect()
        if i % RAW_TCP_EVERY == 0:  # the server, the scheduler, the store gate in turn
            _raw_tcp(raw[(i // RAW_TCP_EVERY) % len(raw)], rng)
            sent["raw_tcp"] += 1
        name, (target, make) = attacks[i % len(attacks)]
        signer = names[(i // len(attacks)) % len(names)]
        auth = member[target] if signer == "member" else signers[signer]
        frames = auth.sign([bytes(f) for f in make(rng)])
        sock = socks[target, signer]
        while True:
            try:
                sock.send_multipart(frames, flags=zmq.NOBLOCK)
                break
            except zmq.Again:  # the target applies back-pressure: wait for it
                start = time.monotonic()
                sock.poll(100, zmq.POLLOUT)
                stalled_s += time.monotonic() - start
        sent[name] += 1
    for sock in socks.values():
        sock.close(linger=0)
    ctx.term()
    return {"sent": dict(sent), "stalled_s": stalled_s}


def _raw_tcp(address: str, rng: Any) -> None:
    """A plain TCP connection that sends bytes that are not ZMTP, then closes."""
    host, port = address.removeprefix("tcp://").rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=2) as conn:
            conn.sendall(rng.choice([b"\xff" + rng.bytes(9), b"GET / HTTP/1.0\r\n\r\n",
                                     rng.bytes(4096)]))
    except OSError:
        pass


# ---- orchestration --------------------------------------------------------------------------
def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def _spawn(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, __file__, *args], env=env,
                            stdout=log.open("w"), stderr=subprocess.STDOUT)


def _progress(run: Path, among: Callable[[list[int]], int] = min) -> int:
    """Rounds the workers reported (the slower one's by default)."""
    done = [int(p.read_text()) for p in run.glob("progress*") if p.suffix != ".tmp"]
    return among(done) if len(done) == 2 else 0


def _steady_rss(pids: dict[str, int], timeout_s: float = 120) -> None:
    """Wait until no process grows by more than 1 MiB in 2 s (the scheduler imports torch
    for its store in the background after start-up)."""
    deadline = time.monotonic() + timeout_s
    last = {n: _rss_mib(p) for n, p in pids.items()}
    while time.monotonic() < deadline:
        time.sleep(2)
        now = {n: _rss_mib(p) for n, p in pids.items()}
        if all(now[n] - last[n] < 1 for n in pids):
            return
        last = now


def _wait_until(what: str, check: Callable[[], bool], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} within {timeout_s:g} s")
        time.sleep(0.1)


def _stats(info: dict[str, Any]) -> dict[str, Any]:
    """The server's STATS, asked with the job key (as a member of the job)."""
    import zmq
    from byteps_espresso.server import protocol as P
    from byteps_espresso.server.auth import Authenticator

    auth = Authenticator(bytes.fromhex(info["job_key"]))
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(info["server"])
    try:
        sock.send_multipart(auth.sign(P.encode(P.MsgType.STATS, sender=-1)))
        if not sock.poll(OP_TIMEOUT_S * 1000):
            raise TimeoutError("the server did not answer STATS: it hangs")
        return P.decode_json(P.decode(auth.verify(sock.recv_multipart()), 1 << 20))
    finally:
        sock.close()
        ctx.term()


def run(messages: int, senders: int, tmp: Path) -> dict[str, Any]:
    """Start the job, fuzz it, stop it; the measured figures (raises on a hang)."""
    from byteps_espresso.deploy.launch import free_port_pair

    secret = secrets.token_hex(32)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("DMLC_", "BYTEPS_", "ESPRESSO_"))}
    env.update({"DMLC_NUM_WORKER": "2", "DMLC_NUM_SERVER": "1", "DMLC_PS_ROOT_URI": "127.0.0.1",
                "DMLC_PS_ROOT_PORT": str(free_port_pair()), "ESPRESSO_JOB_SECRET": secret,
                "ESPRESSO_START_TIMEOUT": "60", "ESPRESSO_TIMEOUT": str(OP_TIMEOUT_S),
                "ESPRESSO_LOG_LEVEL": "WARNING", "BYTEPS_SERVER_ENGINE_THREAD": "1"})
    run_dir = tmp / "run"
    run_dir.mkdir()
    roles = {"scheduler": _spawn(["_role"], {**env, "DMLC_ROLE": "scheduler"},
                                 tmp / "scheduler.log"),
             "server": _spawn(["_role"], {**env, "DMLC_ROLE": "server"}, tmp / "server.log")}
    workers = [_spawn(["_worker", str(run_dir), str(tmp / f"worker{r}.json")],
                      {**env, "DMLC_ROLE": "worker", "DMLC_WORKER_ID": str(r)},
                      tmp / f"worker{r}.log") for r in range(2)]
    procs = [*roles.values(), *workers]
    fuzzers: list[subprocess.Popen] = []
    try:
        _wait_until("the job did not start", lambda: _progress(run_dir) >= 20, 120)
        info = {**json.loads((run_dir / "job.json").read_text()), "secret": secret}
        (tmp / "info.json").write_text(json.dumps(info))
        _steady_rss({name: p.pid for name, p in roles.items()})
        # A warm-up burst first: one-time allocations (caches, first connections) are not
        # growth.
        warm = _spawn(["_sender", str(tmp / "info.json"), str(min(WARMUP, messages // 5)), "99",
                       str(tmp / "warmup.json")], env, tmp / "warmup.log")
        if warm.wait(timeout=600) != 0:
            raise RuntimeError(f"the warm-up sender failed:\n{(tmp / 'warmup.log').read_text()}")
        time.sleep(SETTLE_S)
        stats0 = _stats(info)
        before = {name: _rss_mib(p.pid) for name, p in roles.items()}
        rounds0, started = _progress(run_dir), time.monotonic()
        share = [messages // senders + (i < messages % senders) for i in range(senders)]
        fuzzers = [_spawn(["_sender", str(tmp / "info.json"), str(n), str(i),
                           str(tmp / f"sender{i}.json")], env, tmp / f"sender{i}.log")
                   for i, n in enumerate(share)]
        for f in fuzzers:
            if f.wait(timeout=3600) != 0:
                raise RuntimeError(f"a sender failed:\n{(tmp / 'sender0.log').read_text()}")
        fuzz_s = time.monotonic() - started
        rounds1 = _progress(run_dir)
        time.sleep(SETTLE_S)
        after = {name: _rss_mib(p.pid) for name, p in roles.items()}
        alive = {name: p.poll() is None for name, p in roles.items()}
        stats1 = _stats(info)
        # The job keeps making rounds after the fuzzing: nothing hangs.
        _wait_until("no legitimate round completed after the fuzzing",
                    lambda: _progress(run_dir) >= rounds1 + 20, 120)
        _write(run_dir / "stop", str(_progress(run_dir, max) + 100))
        codes = {name: p.wait(timeout=120) for name, p in
                 (*roles.items(), *((f"worker{r}", w) for r, w in enumerate(workers)))}
    finally:
        for p in procs + fuzzers:
            if p.poll() is None:
                p.kill()
    sent: Counter[str] = Counter()
    stalled = 0.0
    for i in range(senders):
        result = json.loads((tmp / f"sender{i}.json").read_text())
        sent.update(result["sent"])
        stalled += result["stalled_s"]
    legit = [json.loads((tmp / f"worker{r}.json").read_text())
             if (tmp / f"worker{r}.json").exists() else
             {"rank": r, "rounds": 0, "wrong": [f"worker {r} failed: "
                                                + (tmp / f"worker{r}.log").read_text()[-3000:]],
              "poisoned": 0, "refused_place": 0, "round_ms_median": 0.0, "round_ms_max": 0.0}
             for r in range(2)]
    rejected = Counter(stats1["rejected"])
    rejected.subtract(Counter(stats0["rejected"]))
    return {"sent": dict(sent), "messages": sum(v for k, v in sent.items() if k != "raw_tcp"),
            "fuzz_s": fuzz_s, "sender_stalled_s": stalled, "rss_before_mib": before,
            "rss_after_mib": after, "alive_after_fuzz": alive, "exit_codes": codes,
            "legit": legit, "rounds_during_fuzz": rounds1 - rounds0,
            "server_rejected_during_fuzz": {k: v for k, v in rejected.items() if v},
            "server_handled_during_fuzz": sum(v for v in rejected.values() if v > 0),
            "logs_bytes": {p.name: p.stat().st_size for p in tmp.glob("*.log")}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=MESSAGES)
    parser.add_argument("--senders", type=int, default=SENDERS)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--logs", type=Path, default=None,
                        help="keep the processes' logs in this (new) folder")
    args = parser.parse_args(argv)
    if args.logs is not None:
        args.logs.mkdir(parents=True)
        res = run(args.messages, args.senders, args.logs)
    else:
        with tempfile.TemporaryDirectory(prefix="fuzz-") as tmp:
            res = run(args.messages, args.senders, Path(tmp))
    growth = {n: res["rss_after_mib"][n] - res["rss_before_mib"][n]
              for n in res["rss_before_mib"]}
    wrong = [w for r in res["legit"] for w in r["wrong"]]
    crashes = sum(code != 0 for code in res["exit_codes"].values())
    checks = {"crashes": crashes == 0, "hangs": all(res["alive_after_fuzz"].values()),
              "memory": max(growth.values()) <= TARGET_GROWTH_MIB, "correct": not wrong,
              "messages": res["messages"] >= args.messages}
    print(f"{'attack':>26} {'sent':>9}")
    for name, n in sorted(res["sent"].items()):
        print(f"{name:>26} {n:>9}")
    print(f"{res['messages']} messages in {res['fuzz_s']:.0f} s "
          f"({res['messages'] / res['fuzz_s']:.0f}/s, senders waited {res['sender_stalled_s']:.0f} "
          "s on back-pressure)")
    for n, grew in growth.items():
        print(f"{n:>10} RSS {res['rss_before_mib'][n]:7.1f} -> {res['rss_after_mib'][n]:7.1f} "
              f"MiB ({grew:+.1f}; target <= {TARGET_GROWTH_MIB})")
    rounds = [r["rounds"] for r in res["legit"]]
    print(f"legitimate rounds: {min(rounds)} ({res['rounds_during_fuzz']} during the fuzzing), "
          f"wrong {len(wrong)}, NaN rounds refused {res['legit'][0]['poisoned']}, malformed "
          f"PLACEs refused {res['legit'][0]['refused_place']}, slowest round "
          f"{max(r['round_ms_max'] for r in res['legit']):.0f} ms")
    print(f"exit codes {res['exit_codes']}")
    print(f"server rejections during the fuzzing ({res['server_handled_during_fuzz']} of the "
          f"messages sent to it; the rest were still queued when their sender reconnected): "
          f"{res['server_rejected_during_fuzz']}")
    print("PASS" if all(checks.values()) else f"FAIL: {[k for k, ok in checks.items() if not ok]}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "benchmark": "fuzz", "command": " ".join(["python benchmarks/fuzz.py", *(argv or
                                                                              sys.argv[1:])]),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                    "python": platform.python_version(),
                    "load_avg_1m_at_end": os.getloadavg()[0]},
        "rss_growth_mib": growth, "checks": checks, **res}, indent=2))
    return 0 if all(checks.values()) else 1


def _entry() -> int:
    if len(sys.argv) > 1 and sys.argv[1].startswith("_"):
        role, *rest = sys.argv[1:]
        if role == "_role":
            from byteps_espresso.server.__main__ import main as role_main

            return role_main()
        if role == "_worker":
            _write(Path(rest[1]), json.dumps(legit_worker(Path(rest[0]))))
            return 0
        info = json.loads(Path(rest[0]).read_text())
        _write(Path(rest[3]), json.dumps(sender(info, int(rest[1]), int(rest[2]))))
        return 0
    return main()


if __name__ == "__main__":
    sys.exit(_entry())
