"""A worker process for the PS tests: a real PSClient driven by the environment.

Usage: ps_worker.py MODE OUTDIR
    roundtrip  declare a dense key and one key per compressor, run ROUNDS rounds, save every
               input and result to OUTDIR/worker<rank>.npz
    killed     run round 0 of a key spread over every server, write OUTDIR/ready<rank>; rank 0
               then starts round 1 at once, other ranks wait for OUTDIR/go first
    connect    only register (start-up tests)
    loop       push/pull one key round after round until a rank finds OUTDIR/stop (every
               rank stops after that same round), writing
               OUTDIR/ready<rank> after the first round; a file OUTDIR/hold<rank> holding a
               number of seconds makes the worker hold the GIL that long once, in a native
               call, as a busy training step can
Errors propagate: a failed PS call ends the process with a traceback and status 1.
"""

from __future__ import annotations

import ctypes
import sys
import time
from pathlib import Path

import numpy as np
import torch
from byteps_espresso.kernels import create, names
from byteps_espresso.kernels.base import to_numpy
from byteps_espresso.server.client import PSClient

from byteps_espresso.config import Config

NUMEL = 20_001  # 80 KB of float32: two partitions at BYTEPS_PARTITION_BYTES=64 KiB
ROUNDS = 2


def roundtrip(client: PSClient, out: Path) -> None:
    ranks = list(range(client.num_workers))
    saved: dict[str, np.ndarray] = {}
    client.declare("dense", NUMEL, pushers=ranks)
    for codec in names():
        client.declare(codec, NUMEL, pushers=ranks, compressor=codec)
    for round_ in range(ROUNDS):
        x = np.random.default_rng([client.rank, round_]).standard_normal(NUMEL, np.float32)
        saved[f"dense/{round_}/in"] = x
        saved[f"dense/{round_}/out"] = client.push_pull("dense", x, round_)
        for codec in names():
            comp = create(codec, backend="torch")
            payloads = []
            for key_name, (off, n) in zip(client.key_names(codec), client.partitions(codec),
                                          strict=True):
                payload, _ = comp.compress(torch.from_numpy(x[off:off + n].copy()),
                                           name=key_name, step=round_)
                payloads.append(to_numpy(payload))
            result = client.push_pull(codec, payloads, round_)
            for i, (sent, got) in enumerate(zip(payloads, result, strict=True)):
                for j, (a, b) in enumerate(zip(sent, got, strict=True)):
                    saved[f"{codec}/{round_}/{i}/{j}/in"] = a
                    saved[f"{codec}/{round_}/{i}/{j}/out"] = b
    np.savez(out / f"worker{client.rank}.npz", **saved)


def killed(client: PSClient, out: Path) -> None:
    ranks = list(range(client.num_workers))
    numel = 4 * client.cfg.partition_bytes // 4  # four partitions over the servers
    client.declare("k", numel, pushers=ranks)
    x = np.ones(numel, np.float32)
    client.push_pull("k", x, 0)
    (out / f"ready{client.rank}").touch()
    if client.rank != 0:
        while not (out / "go").exists():
            time.sleep(0.05)
    client.push_pull("k", x, 1)
    raise SystemExit("round 1 unexpectedly completed")


def loop(client: PSClient, out: Path) -> None:
    client.declare("k", 1024, pushers=list(range(client.num_workers)))
    x = np.ones(1024, np.float32)
    hold = out / f"hold{client.rank}"
    round_ = 0
    while True:
        # Whether OUTDIR/stop exists travels in the sum, so every rank stops after the same
        # round: checked on its own, one rank could see it a round before another, which then
        # waited for that rank's push until ESPRESSO_TIMEOUT and failed.
        x[-1] = float((out / "stop").exists())
        total = client.push_pull("k", x, round_)
        assert total[0] == client.num_workers, total[:4]
        if total[-1] > 0:
            break
        if round_ == 0:
            (out / f"ready{client.rank}").touch()
        if hold.exists():
            seconds = float(hold.read_text())
            hold.unlink()
            # A PyDLL call keeps the GIL for its whole duration: no Python thread runs.
            ctypes.PyDLL(None).sleep(ctypes.c_uint(round(seconds)))
            (out / f"held{client.rank}").touch()
        round_ += 1
        time.sleep(0.01)


MODES = {"roundtrip": roundtrip, "killed": killed, "loop": loop,
         "connect": lambda client, out: None}


def main() -> None:
    mode, out = sys.argv[1], Path(sys.argv[2])
    client = PSClient(Config.from_env())
    try:
        MODES[mode](client, out)
    finally:
        client.close()


if __name__ == "__main__":
    main()
