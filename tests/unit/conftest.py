"""Fixtures shared by the unit tests."""

import threading

import pytest
from byteps_espresso.worker.local_transport import LocalHub

WORLD = 4  # 2 machines x 2 workers


def _run_on_every_rank(fn):
    """``fn(hub, rank)`` on every rank of a 2 x 2 in-memory cluster, ranks as threads, so
    collectives run their real code path; returns {rank: result} (re-raises a rank's error)."""
    hub = LocalHub(2, 2, timeout_s=20.0)
    results: dict[int, object] = {}
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            results[rank] = fn(hub, rank)
        except BaseException as exc:  # re-raised in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(WORLD)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    if errors:
        raise errors[0]
    assert len(results) == WORLD
    return results


@pytest.fixture
def on_every_rank():
    """Runs ``fn(hub, rank)`` on the 4 ranks of a 2 x 2 in-memory cluster (see above)."""
    return _run_on_every_rank
