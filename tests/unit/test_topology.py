"""Topology: ranks and scope groups as BytePS derives them."""

import pytest
from byteps_espresso.worker.topology import Topology, TopologyError

from byteps_espresso.config import Config
from byteps_espresso.strategy.options import Scope


def test_rank_is_machine_times_local_size_plus_local_rank():
    cfg = Config.from_env({"DMLC_NUM_WORKER": "3", "DMLC_NUM_SERVER": "0",
                           "DMLC_PS_ROOT_URI": "127.0.0.1", "DMLC_PS_ROOT_PORT": "9000",
                           "DMLC_WORKER_ID": "2", "BYTEPS_LOCAL_SIZE": "4",
                           "BYTEPS_LOCAL_RANK": "1"})
    topo = Topology.from_config(cfg)
    assert (topo.rank, topo.world_size) == (9, 12) == (cfg.rank, cfg.world_size)


def test_groups_and_indices_2x2():
    topo = Topology(2, 2, machine_id=1, local_rank=0)
    assert topo.group(Scope.FLAT) == (0, 1, 2, 3)
    assert topo.group(Scope.INTRA) == (2, 3)
    assert topo.group(Scope.INTER) == (0, 2)
    assert [topo.index(s) for s in Scope] == [2, 0, 1]
    assert topo.all_groups(Scope.INTRA) == [(0, 1), (2, 3)]
    assert topo.all_groups(Scope.INTER) == [(0, 2), (1, 3)]


def test_every_rank_is_in_exactly_one_group_per_scope():
    topo = Topology(3, 4)
    for scope in Scope:
        members = sorted(r for g in topo.all_groups(scope) for r in g)
        assert members == list(range(12))
        for rank in range(12):
            view = topo.with_rank(rank)
            assert rank in view.group(scope)
            assert view.group(scope)[view.index(scope)] == rank


@pytest.mark.parametrize("kwargs", [{"machines": 0, "local_size": 1},
                                    {"machines": 2, "local_size": 2, "machine_id": 2},
                                    {"machines": 2, "local_size": 2, "local_rank": -1}])
def test_bad_layout_says_what_to_set(kwargs):
    with pytest.raises(TopologyError, match=r"DMLC_|BYTEPS_"):
        Topology(**kwargs)
