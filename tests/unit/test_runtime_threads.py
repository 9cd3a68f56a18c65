"""The worker's intra-op thread count: its share of the machine's cores, or OMP_NUM_THREADS."""

from __future__ import annotations

import os

import pytest
from byteps_espresso.worker.runtime import intra_op_threads

from byteps_espresso.config import Config, ConfigError

# A worker's required variables (the PS contract), as the launcher sets them.
WORKER = {"DMLC_NUM_WORKER": "2", "DMLC_NUM_SERVER": "1", "DMLC_PS_ROOT_URI": "127.0.0.1",
          "DMLC_PS_ROOT_PORT": "9100"}


@pytest.fixture
def cores(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    def set_cores(n: int) -> None:
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(n)))

    return set_cores


@pytest.mark.parametrize(("n_cores", "local_size", "expected"),
                         [(2, 2, 1), (16, 4, 4), (16, 3, 5), (2, 8, 1), (8, 1, 8)])
def test_share_of_the_cores(cores, n_cores: int, local_size: int, expected: int) -> None:
    cores(n_cores)
    assert intra_op_threads(local_size) == expected


def test_omp_num_threads_is_the_users_choice(cores) -> None:
    cores(16)
    cfg = Config.from_env({**WORKER, "OMP_NUM_THREADS": "3", "BYTEPS_LOCAL_SIZE": "4"})
    assert cfg.intra_op_threads == 3
    assert intra_op_threads(cfg.local_size, cfg.intra_op_threads) == 3
    assert Config.from_env(WORKER).intra_op_threads is None


def test_omp_num_threads_must_be_a_positive_integer() -> None:
    with pytest.raises(ConfigError, match="OMP_NUM_THREADS"):
        Config.from_env({**WORKER, "OMP_NUM_THREADS": "0"})
