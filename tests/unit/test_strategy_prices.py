"""The task table's prices equal the per-option walk of costs.py, bit for bit.

:meth:`Pricer.tasks` and :meth:`Pricer.batch` read each option's tasks from a table of step
settings priced once; :meth:`Pricer.walk` walks the option's program step by step (the
reference). Every Option of the tree is compared, for several sizes, clusters and
compressors, with the walk of a new pricer per option (nothing shared with the table).
"""

import numpy as np
import pytest

from byteps_espresso.strategy import Cluster, CompressorCosts, TensorProfile, Workload
from byteps_espresso.strategy.context import PlanContext
from byteps_espresso.strategy.costs import CompressedSizes, Pricer
from byteps_espresso.strategy.tree import Constraints, enumerate_options

NUMELS = [1, 1000, 65_536, 3_000_000, 25_557_032]
CASES = [
    (Cluster.preset(8, 8, "nvlink", 100), "randomk", {"ratio": 0.01}),
    (Cluster.preset(4, 2, "pcie", 25, servers=2), "dgc", {"ratio": 0.01}),
    (Cluster.preset(8, 8, "pcie", 25, servers=8), "efsignsgd", {}),
]


def _partner_tree(cluster):
    """The tree with the mixed Options (fp16 inside the machine)."""
    return enumerate_options(cluster, Constraints(partner="fp16"))


@pytest.mark.parametrize("cluster,compressor,params", CASES)
def test_table_and_batch_equal_the_walk_on_every_option(cluster, compressor, params):
    costs = CompressorCosts.default()
    sizes = CompressedSizes(compressor, params)
    options = _partner_tree(cluster)
    table = Pricer(cluster, compressor, sizes, costs, NUMELS)
    order = np.random.default_rng(0).permutation(len(options)).tolist()
    got = {options[k]: table.tasks(options[k]) for k in order}
    batches = table.batch(options)
    assert sorted(p for b in batches for p in b.positions.tolist()) == list(range(len(options)))
    for b in batches:
        for row, pos in enumerate(b.positions.tolist()):
            want = Pricer(cluster, compressor, sizes, costs, NUMELS).walk(options[pos])
            tasks = got[options[pos]]
            assert np.array_equal(tasks.resource, want.resource)
            assert np.array_equal(tasks.step, want.step)
            assert np.array_equal(tasks.duration, want.duration)
            assert np.array_equal(tasks.busy, want.busy)
            assert np.array_equal(tasks.total, want.total)
            assert np.array_equal(b.resource[row], want.resource)
            assert np.array_equal(b.duration[row], want.duration)
            assert np.array_equal(b.busy[row], want.busy)  # as the one-hot product sums
            assert np.array_equal(b.total[row], want.total)


def test_free_compression_and_host_device_equal_the_walk():
    costs = CompressorCosts.default()
    for cluster, free in ((Cluster.preset(2, 4, "pcie", 10), True),
                          (Cluster.preset(2, 2, "pcie", 1).with_(host_device=True), False)):
        sizes = CompressedSizes("randomk", {"ratio": 0.01})
        options = enumerate_options(cluster)
        table = Pricer(cluster, "randomk", sizes, costs, NUMELS, free_compression=free)
        for b in table.batch(options):
            for row, pos in enumerate(b.positions.tolist()):
                want = Pricer(cluster, "randomk", sizes, costs, NUMELS,
                              free_compression=free).walk(options[pos])
                assert np.array_equal(b.resource[row], want.resource)
                assert np.array_equal(b.duration[row], want.duration)
                assert np.array_equal(b.busy[row], want.busy)
                assert np.array_equal(b.total[row], want.total)


def test_catalogue_rows_equal_the_walk():
    """The catalogue the search reads (rows added in batches, placements derived from the
    all-GPU and all-CPU forms) holds every option's walked tasks."""
    cluster = Cluster.preset(4, 4, "pcie", 25)
    wl = Workload(tuple(TensorProfile(f"t{i}", n, 10.0) for i, n in enumerate(NUMELS)), 50.0)
    ctx = PlanContext(wl, cluster, "dgc", {"ratio": 0.01})
    ctx.prepare()
    for k in ctx.fronts(ctx.primary_device()).fastest_alone.tolist():
        ctx.placements(k)
    cat = ctx.evaluator.catalogue
    walker = Pricer(cluster, "dgc", ctx.pricer.sizes, ctx.costs, ctx.numels)
    assert len(cat.options) > 100
    for row, option in enumerate(cat.options):
        want = walker.walk(option)
        n = int(cat.len[row])
        assert n == len(want.resource)
        assert np.array_equal(cat.res[row, :n], want.resource)
        assert np.array_equal(cat.dur[row, :, :n], want.duration)
        assert not cat.dur[row, :, n:].any()
        assert np.array_equal(cat.busy[row], want.busy)
        assert np.array_equal(cat.total[row], want.total)


@pytest.mark.parametrize("cluster,compressor,params", CASES)
def test_dense_us_is_a_dense_options_tasks_end_to_end(cluster, compressor, params):
    from byteps_espresso.strategy.costs import dense_us

    costs = CompressorCosts.default()
    pricer = Pricer(cluster, compressor, CompressedSizes(compressor, params), costs, NUMELS)
    options = enumerate_options(cluster, Constraints())
    dense = [o for o in options if not o.is_compressed]
    assert dense
    for option in dense:
        want = pricer.walk(option).duration.sum(axis=1)
        got = [dense_us(cluster, option, n) for n in NUMELS]
        np.testing.assert_allclose(got, want, rtol=1e-12)
    with pytest.raises(ValueError, match="compresses"):
        dense_us(cluster, next(o for o in options if o.is_compressed), 1000)
