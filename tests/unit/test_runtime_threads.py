"""The worker's intra-op thread count: its share of the machine's cores, or OMP_NUM_THREADS."""

from __future__ import annotations

import os

import pytest
import torch
from byteps_espresso.worker.runtime import intra_op_threads


@pytest.fixture
def cores(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    def set_cores(n: int) -> None:
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(n)))

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    return set_cores


@pytest.mark.parametrize(("n_cores", "local_size", "expected"),
                         [(2, 2, 1), (16, 4, 4), (16, 3, 5), (2, 8, 1), (8, 1, 8)])
def test_share_of_the_cores(cores, n_cores: int, local_size: int, expected: int) -> None:
    cores(n_cores)
    assert intra_op_threads(local_size) == expected


def test_omp_num_threads_is_the_users_choice(cores, monkeypatch: pytest.MonkeyPatch) -> None:
    cores(16)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(3)  # what torch read from the variable at start-up
        assert intra_op_threads(4) == 3
    finally:
        torch.set_num_threads(before)
