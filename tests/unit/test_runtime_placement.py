"""Where the machines and servers are: whether the machines share one host, and the share of a
machine's push/pull bytes that stay on it."""

from __future__ import annotations

import zlib
from types import SimpleNamespace

import pytest
import torch
from byteps_espresso.server import shm
from byteps_espresso.server.client import address_host
from byteps_espresso.worker.runtime import _placement
from byteps_espresso.worker.topology import Topology


class _Gather:
    """A transport whose all-gather returns every rank's (host identity, count of local
    servers, kernel boot tag): ``hosts`` the rank's host, ``counts`` its servers at its own
    address, ``boots`` its kernel (by default, one per machine)."""

    def __init__(self, hosts: list[int], counts: list[int],
                 boots: list[int] | None = None) -> None:
        self.hosts, self.counts = hosts, counts
        self.boots = boots if boots is not None else [7, 7, 8, 8]

    def allgather(self, scope, tensor, sizes):  # type: ignore[no-untyped-def]
        assert list(sizes) == [3] * len(self.counts) and tensor.numel() == 3
        return torch.tensor([v for row in zip(self.hosts, self.counts, self.boots, strict=True)
                             for v in row], dtype=torch.int64)


def _cfg(servers: int) -> SimpleNamespace:
    return SimpleNamespace(num_servers=servers, advertise_host=lambda: "10.0.0.1")


APART = [1, 1, 2, 2]  # 2 machines x 2 workers, each machine its own host


def test_a_servers_host_is_read_from_its_address():
    assert address_host("tcp://10.213.0.3:9001") == "10.213.0.3"
    assert address_host("tcp://127.0.0.1:5") == "127.0.0.1"


@pytest.mark.parametrize(("counts", "servers", "share"), [
    ([1, 1, 1, 1], 2, 0.5),  # one server beside each of 2 machines
    ([2, 2, 1, 1], 4, 0.25),  # machine 1 has fewer: its link carries the most
    ([1, 1, 0, 0], 2, 0.0),  # both on machine 0: machine 1's bytes all cross its link
    ([2, 2, 2, 2], 2, 0.0),  # every server at every machine's address: one address
])
def test_the_share_is_the_least_over_the_machines(counts, servers, share):
    topo = Topology(2, 2)
    assert _placement(topo, _Gather(APART, counts), _cfg(servers), counts[0])[:2] == (
        False, share)


def test_no_share_without_servers_or_on_one_host():
    topo = Topology(2, 2)
    assert _placement(topo, _Gather(APART, [0] * 4), _cfg(0), 0)[:2] == (False, 0.0)
    # every rank with one host identity: the machines share this host
    assert _placement(topo, _Gather([7] * 4, [2] * 4), _cfg(2), 2)[:2] == (True, 0.0)
    never = _Gather([], [], [])  # an all-gather would fail its assertion
    assert _placement(Topology(1, 4), never, _cfg(2), 2)[:2] == (False, 0.0)


def test_the_ranks_on_this_kernel_share_its_cores(monkeypatch):
    """Emulated machines are namespaces of one kernel: every rank with this boot shares the
    cores; machines of their own share only their own ranks'."""
    monkeypatch.setattr(shm, "boot_id", lambda: "boot-a")
    here = zlib.crc32(b"boot-a")
    topo = Topology(2, 2)

    def sharers(boots: list[int]) -> int:
        return _placement(topo, _Gather(APART, [0] * 4, boots), _cfg(0), 0)[2]

    assert sharers([here] * 4) == 4
    assert sharers([here, here, 7, 7]) == 2
    never = _Gather([], [], [])  # one machine: no all-gather
    assert _placement(Topology(1, 3), never, _cfg(0), 0)[2] == 3
    monkeypatch.setattr(shm, "boot_id", lambda: "")  # unknown: this machine's ranks only
    assert sharers([-1, -1, here, here]) == 2
