"""Worker of test_executor: runs every case's Option for several iterations, saves results.

Usage: options_worker.py CASES.json OUT_DIR. Inputs come from
OUT_DIR/in_CASE_ITER_RANK.npy, written by the test. Results are
written as .npy (no pickle).
"""

import json
import sys
from pathlib import Path

import numpy as np
import torch
from byteps_espresso.worker.codecs import CodecPair
from byteps_espresso.worker.runtime import Runtime

from byteps_espresso.config import Config
from byteps_espresso.strategy.options import Option


def main() -> None:
    cases = json.loads(Path(sys.argv[1]).read_text())
    out = Path(sys.argv[2])
    rt = Runtime(Config.from_env())
    rank = rt.topology.rank
    try:
        by_codec: dict[str, list[int]] = {}
        for idx, case in enumerate(cases):
            by_codec.setdefault(json.dumps(case["codec"], sort_keys=True), []).append(idx)
        for key, idxs in by_codec.items():
            spec = json.loads(key)
            codec = None if spec is None else CodecPair(spec["name"], spec["params"],
                                                        error_feedback=spec["ef"])
            engine = rt.engine(codec)
            iters = max(cases[i]["iters"] for i in idxs)
            for it in range(iters):
                handles = []
                for idx in idxs:  # submitted asynchronously, in the same order on every rank
                    case = cases[idx]
                    if it < case["iters"]:
                        x = torch.from_numpy(np.load(out / f"in_{idx}_{it}_{rank}.npy"))
                        handles.append((idx, engine.submit(f"t{idx}", x,
                                                           Option.parse(case["option"]))))
                for idx, h in handles:
                    np.save(out / f"{idx}_{it}_{rank}.npy", h.wait(60).numpy(),
                            allow_pickle=False)
    finally:
        rt.close()


if __name__ == "__main__":
    main()
