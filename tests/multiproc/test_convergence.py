"""Convergence: 4 workers (2 machines x 2) with one PS server train the example's MLP on the
learnable Markov task for a few hundred steps, uncompressed and with espresso-planned
compression (randomk 10% with error feedback, dgc 5% with its recipe, efsignsgd), every tensor
compressed (the uncompressed step kinds are forbidden by a planning constraint). The final
loss (mean of the last 30 steps, averaged over workers) of every compressed run is within 10%
of fp32's.

Measured here (2 busy cores): with 200 steps (mean of the last 40) in two runs: fp32 1.100;
randomk 10% 1.134 / 1.107; efsignsgd 1.100 / 1.100; dgc 1% 1.132 / 1.121 (initial 6.198, the
chain's entropy 0.945). Plans differ between runs because they follow the measured profile.
With 150 steps (mean of the last 30): fp32 1.150, randomk 1.161 (+1.0%), efsignsgd 1.157
(+0.6%), dgc 1% 1.181 (+2.7%); the run prints its own numbers with ``-s``. dgc 1% is too
sensitive to which tensors the (timing-dependent) plan compresses for a 150-step run: one run
under heavy load planned more of them and ended at 1.446 (+26%); dgc 5% ended at 1.166 (+1.4%).
Since the plans compress every tensor (the constraint): fp32 1.150, randomk 10% 1.207 (+5.0%),
efsignsgd 1.157 (+0.6%), dgc 5% 1.187 (+3.2%), the same in two runs. Once exchange
collectives were priced at their in-training latency, a randomk plan compressed two tensors
three times on their way (GatherC -> AllgatherC -> BroadcastC, each hop re-compressing a
partial sum at 10%) and ended at 1.524 (+33%); the plans are now held to one Comp per
Option (``Constraints(max_compressions=1)``, what a user who bounds compression error sets).
With DGC's recipe (momentum correction and masking in the codec, SGD's momentum moved before
communication): fp32 1.150, randomk 10% 1.208 (+5.0%), efsignsgd 1.153 (+0.3%), dgc 5% 1.161
(+1.0%, against +3.2% with plain error feedback and SGD's own momentum). On the example's
LSTM the recipe learns far slower (docs/worker.md, "Convergence"), so dgc runs without it by
default; both are held to 10% here (``dgc`` and ``dgc-recipe``).
PowerSGD at rank 4 (``Compression.powersgd``: every matrix compressed after its 10
uncompressed iterations, both sums through the server) ended at 1.175 (+2.2%) beside fp32's
1.150; it is held to the issue's 5%.
"""

import json

import numpy as np
import pytest

STEPS = 150
# randomk keeps 10%: at 1% its error-feedback delay (about 100 steps per entry) is half the
# run; dgc (top-k) keeps 5%, see the docstring.
RUNS = {"fp32": "fp32", "randomk": "randomk:0.1", "efsignsgd": "efsignsgd", "dgc": "dgc:0.05",
        "dgc-recipe": "dgc+recipe:0.05", "powersgd": "powersgd:4"}


@pytest.mark.timeout(400)
def test_compressed_training_reaches_fp32_loss(tmp_path, cluster):
    env = {"ESPRESSO_PROFILE_STEPS": "5"}
    with cluster.ps_job(servers=1, extra_env=env) as root:
        cluster.run_workers("convergence_worker.py",
                            [str(tmp_path), str(STEPS), *[f"{k}={v}" for k, v in RUNS.items()]],
                            root_port=root, servers=1, timeout=360, extra_env=env)
    results = {k: json.loads((tmp_path / f"{k}.json").read_text()) for k in RUNS}
    final = {k: float(np.mean(r["losses"][-30:])) for k, r in results.items()}
    start = float(np.mean(results["fp32"]["losses"][:5]))
    summary = ", ".join(f"{k} {v:.3f}" for k, v in final.items())
    print(f"initial loss {start:.3f}; final losses: {summary}; "
          f"entropy {results['fp32']['entropy']:.3f}")
    assert final["fp32"] < 0.5 * start, f"fp32 did not learn: {summary}"
    # PowerSGD (its own scheme, not planned) compresses every matrix: all three here
    assert results["powersgd"]["compressed_tensors"] == 3, results["powersgd"]
    assert final["powersgd"] <= 1.05 * final["fp32"], f"powersgd is not within 5%: {summary}"
    for name in ("randomk", "efsignsgd", "dgc", "dgc-recipe"):
        assert results[name]["compressed_tensors"] == results[name]["tensors"] > 0, \
            f"{name}: the plan leaves tensors uncompressed: {results[name]['options']}"
        assert final[name] <= 1.10 * final["fp32"], f"{name} is not within 10%: {summary}"
