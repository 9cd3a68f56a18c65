"""Seeded random small planning problems, for checking the search against bruteforce.

Each instance has 2-4 tensors (sizes log-uniform in [2^10, 2^24] elements, ready gaps uniform
in [0, 5] ms), one of several cluster settings, and the least restrictive constraint set of
CONSTRAINT_LADDER whose tree keeps bruteforce under its limit.

Example:
    >>> inst = random_instance(7)
    >>> inst.workload, inst.cluster, inst.constraints
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from byteps_espresso.strategy.baselines import BRUTEFORCE_LIMIT
from byteps_espresso.strategy.cluster import Cluster
from byteps_espresso.strategy.tree import Constraints, enumerate_options
from byteps_espresso.strategy.workload import TensorProfile, Workload

__all__ = ["CLUSTERS", "CONSTRAINT_LADDER", "Instance", "random_instance"]

# (machines, gpus per machine, intra link, inter Gbit/s, servers)
CLUSTERS = (
    (2, 2, "nvlink", 100.0, 2),
    (2, 4, "pcie", 25.0, 0),
    (4, 1, "pcie", 10.0, 4),
    (2, 2, "pcie", 10.0, 1),
    (1, 4, "nvlink", 100.0, 0),
    (4, 2, "nvlink", 25.0, 2),
)
CONSTRAINT_LADDER = (
    (),
    ("max-compressions=1",),
    ("no-cpu",),
    ("no-cpu", "max-compressions=1"),
    ("no-cpu", "max-compressions=1", "flat-only"),
)


@dataclass(frozen=True)
class Instance:
    seed: int
    workload: Workload
    cluster: Cluster
    constraints: Constraints


def random_instance(seed: int) -> Instance:
    """The instance of ``seed`` (deterministic)."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(2, 5))
    sizes = np.exp2(rng.uniform(10, 24, size=n)).astype(int)
    gaps = np.round(rng.uniform(0, 5000, size=n), 1)
    tensors = tuple(TensorProfile(f"t{i}", int(sizes[i]), float(gaps[i])) for i in range(n))
    forward = float(np.round(rng.uniform(0, 10000), 1))
    workload = Workload(tensors, forward, f"random-{seed}", "byteps_espresso.strategy.instances")
    m, g, intra, inter, servers = CLUSTERS[int(rng.integers(len(CLUSTERS)))]
    cluster = Cluster.preset(m, g, intra, inter, servers=servers,
                             cpu_threads=int(rng.choice([2, 8, 16])))
    for ladder in CONSTRAINT_LADDER:
        constraints = Constraints.parse(ladder)
        if len(enumerate_options(cluster, constraints)) ** n <= BRUTEFORCE_LIMIT:
            break
    return Instance(seed, workload, cluster, constraints)
