"""The decision tree: count, uniqueness, validity, hand-derived options, constraints."""

import dataclasses
import itertools

import pytest

from byteps_espresso.strategy import (
    Cluster,
    ConstraintError,
    Constraints,
    Kind,
    Option,
    OptionError,
    count_decomposition,
    enumerate_options,
    validate,
)
from byteps_espresso.strategy.options import Scope
from byteps_espresso.strategy.tree import option_forms

BIG = Cluster.preset(8, 8, "nvlink", 100)  # hierarchical, with servers

HAND_DERIVED = [
    "Allreduce(flat)",
    "Comp(gpu) -> AllgatherC(flat) -> Decomp(gpu)",
    "ReduceScatter(flat) -> Allgather(flat)",
    "Comp(cpu) -> AlltoallC(flat) -> Decomp(cpu) -> Comp(gpu) -> AllgatherC(flat) -> Decomp(gpu)",
    "Reduce(intra) -> PushPull(inter) -> Broadcast(intra)",  # BytePS
    "ReduceScatter(intra) -> Allreduce(inter) -> Allgather(intra)",  # Horovod hierarchical
    # HiTopKComm
    "ReduceScatter(intra) -> Comp(gpu) -> AllgatherC(inter) -> Decomp(gpu) -> Allgather(intra)",
    # BytePS-Compress
    "Reduce(intra) -> Comp(cpu) -> PushPullC(inter) -> Decomp(cpu) -> Broadcast(intra)",
    # the DESIGN.md example
    "Comp(gpu) -> AlltoallC(intra) -> Decomp(gpu) -> Comp(cpu) -> PushPullC(inter) "
    "-> Decomp(cpu) -> Allgather(intra)",
    # a payload forwarded through two steps without decoding
    "Reduce(intra) -> Comp(gpu) -> PushPullC(inter) -> BroadcastC(intra) -> Decomp(gpu)",
    # a compressed second half (concatenating AllgatherC)
    "ReduceScatter(intra) -> ReduceScatter(inter) -> Comp(gpu) -> AllgatherC(inter) "
    "-> Decomp(gpu) -> Allgather(intra)",
    # gathered payloads forwarded undecoded, decoded once at the end
    "Comp(gpu) -> GatherC(flat) -> BroadcastC(flat) -> Decomp(gpu)",
    "Comp(gpu) -> AlltoallC(intra) -> AllgatherC(inter) -> Decomp(gpu) -> Allgather(intra)",
    "Comp(gpu) -> GatherC(intra) -> AllgatherC(inter) -> BroadcastC(intra) -> Decomp(cpu)",
    "Reduce(intra) -> Comp(gpu) -> GatherC(inter) -> BroadcastC(inter) -> Decomp(gpu) "
    "-> Broadcast(intra)",
    "Comp(gpu) -> GatherC(intra) -> GatherC(inter) -> BroadcastC(inter) -> BroadcastC(intra) "
    "-> Decomp(gpu)",
    # re-compressing after a Decomp that summed forwarded payloads
    "Comp(gpu) -> AlltoallC(intra) -> AllgatherC(inter) -> Decomp(gpu) -> Comp(gpu) "
    "-> AllgatherC(intra) -> Decomp(gpu)",
]

INVALID = [
    "Comp(gpu) -> Allreduce(flat) -> Decomp(gpu)",  # Allreduce needs dense values
    "AllgatherC(flat)",  # nothing compressed
    "Comp(gpu) -> AllgatherC(flat)",  # ends compressed
    "Comp(gpu) -> AlltoallC(flat) -> Allgather(flat)",  # gathering step without Decomp
    "ReduceScatter(intra) -> Allreduce(inter)",  # divisible step never closed
    "ReduceScatter(intra) -> Broadcast(intra)",  # wrong closing family
    "Allreduce(intra)",  # intra alone is not a path
    "Reduce(intra) -> Comp(gpu) -> PushPullC(inter) -> Decomp(gpu) -> Comp(gpu) "
    "-> BroadcastC(intra) -> Decomp(gpu)",  # re-compression after decoding one payload
    "Comp(gpu) -> Comp(cpu) -> AllgatherC(flat) -> Decomp(gpu)",
    "Allreduce(flat) -> Allreduce(flat)",
    # gathered payloads forwarded where no step can take them
    "Comp(gpu) -> AlltoallC(flat) -> AllgatherC(flat) -> Decomp(gpu)",  # shard gather
    "Comp(gpu) -> AlltoallC(intra) -> PushPullC(inter) -> Decomp(gpu) -> Allgather(intra)",
    "Comp(gpu) -> GatherC(intra) -> AlltoallC(inter) -> Decomp(gpu) -> Allgather(inter) "
    "-> Broadcast(intra)",
    "Reduce(intra) -> ReduceScatter(inter) -> Comp(gpu) -> AllgatherC(inter) "
    "-> BroadcastC(intra) -> Decomp(gpu)",  # gathered shards travel on
    "Comp(gpu) -> BroadcastC(flat) -> Decomp(gpu)",  # nothing to close
]


ONE_COMPRESSOR = Constraints(partner=None)  # no mixed Options (``no-mixed``)


def test_count_and_decomposition():
    options = enumerate_options(BIG, ONE_COMPRESSOR)
    parts = count_decomposition(BIG, ONE_COMPRESSOR)
    assert len(options) == parts["total"] == 2776
    assert sum(v for k, v in parts.items() if k != "total") == 2776
    assert parts["flat allreduce(flat)"] == 5  # Allreduce + Comp(d)->AllgatherC->Decomp(d')
    assert parts["flat ps(flat)"] == 5
    # 25 without forwarding, + Comp(d) -> GatherC -> BroadcastC -> Decomp(d')
    assert parts["flat reduce/broadcast(flat)"] == 29
    # a shard gather does not forward the AlltoallC's payloads: unchanged
    assert parts["flat scatter/gather(flat)"] == 25
    assert parts["hierarchical scatter/gather(inter)"] == 1250
    assert (parts["hierarchical allreduce(inter)"], parts["hierarchical ps(inter)"],
            parts["hierarchical reduce/broadcast(inter)"]) == (314, 130, 1018)
    assert len(enumerate_options(BIG, Constraints.parse(["no-ps", "no-mixed"]))) == 2641
    assert len(enumerate_options(BIG, Constraints.parse(["no-cpu", "no-mixed"]))) == 139


@pytest.mark.parametrize("items", [[], ["no-cpu"], ["no-ps", "max-compressions=1"]])
def test_the_forms_hold_the_tree_in_order_with_their_placements(items):
    """tree.option_forms: the tree's Options in enumerate_options' order, grouped by form;
    in a group every Option has the first's steps but the devices at the markers, which
    ``devices`` records per Option (what the planner's lower bound compiles once per form)."""
    constraints = Constraints.parse(items)
    forms = option_forms(BIG, constraints)
    assert [o for g in forms for o in g.options] == enumerate_options(BIG, constraints)
    for group in forms:
        first = group.options[0]
        assert len(group.devices) == len(group.options)
        for option, devices in zip(group.options, group.devices, strict=True):
            assert [option.steps[i].device for i in group.markers] == list(devices)
            assert option.steps == tuple(
                first.steps[i].on(devices[group.markers.index(i)]) if i in group.markers
                else step for i, step in enumerate(first.steps))
    assert option_forms(BIG, constraints) is forms  # cached: one object per tree
    assert option_forms(BIG, constraints, "powersgd") is None


def test_mixed_options_add_hierarchical_ones_only():
    """fp16 as the intra partner: 4,800 more Options, all hierarchical (the partner needs an
    intra step), none with the partner alone."""
    parts, alone = count_decomposition(BIG), count_decomposition(BIG, ONE_COMPRESSOR)
    assert parts["total"] == len(enumerate_options(BIG)) == 7576
    for path in parts:
        if path.startswith("flat"):
            assert parts[path] == alone[path]
    mixed = [o for o in enumerate_options(BIG) if o.partners]
    assert len(mixed) == 7576 - 2776
    assert all(o.is_hierarchical and o.partners == {"fp16"} for o in mixed)


def test_mixed_options_are_the_valid_relabelings():
    """Oracle: the mixed Options are exactly the Options of the one-compressor tree with some
    Comp/Decomp steps relabelled to the partner that pass :func:`validate` (a compressor
    does not change forms, so the tree's walk and the relabelling must agree)."""
    gpu_only = Constraints(allow_cpu=False)
    found = set()
    for option in enumerate_options(BIG, dataclasses.replace(gpu_only, partner=None)):
        where = [j for j, st in enumerate(option.steps) if st.device is not None]
        for labels in itertools.product((None, "fp16"), repeat=len(where)):
            steps = list(option.steps)
            for j, label in zip(where, labels, strict=True):
                steps[j] = steps[j].with_codec(label)
            candidate = Option(tuple(steps))
            try:
                validate(candidate, BIG)
            except OptionError:
                continue
            found.add(candidate)
    tree = set(enumerate_options(BIG, gpu_only))
    assert found == tree
    assert sum(1 for o in tree if o.partners) == 96


MIXED = [
    # fp16 inside the machine, the job's compressor between machines (the Espresso
    # authors' schemes 3 and 2)
    "Comp(gpu,fp16) -> AlltoallC(intra) -> Decomp(gpu,fp16) -> Comp(gpu) -> AllgatherC(inter) "
    "-> Decomp(gpu) -> Comp(gpu,fp16) -> AllgatherC(intra) -> Decomp(gpu,fp16)",
    "Comp(cpu,fp16) -> GatherC(intra) -> Decomp(cpu,fp16) -> Comp(gpu) -> GatherC(inter) "
    "-> Decomp(gpu) -> Broadcast(inter) -> Comp(gpu,fp16) -> BroadcastC(intra) "
    "-> Decomp(gpu,fp16)",
    # the servers aggregate the job's compressor; the machine's sum travels in fp16
    "Comp(gpu,fp16) -> GatherC(intra) -> Decomp(gpu,fp16) -> Comp(gpu) -> PushPullC(inter) "
    "-> BroadcastC(intra) -> Decomp(gpu)",
]

MIXED_INVALID = {
    "Comp(gpu,fp16) -> AlltoallC(intra) -> Decomp(gpu) -> Comp(gpu) -> AllgatherC(inter) "
    "-> Decomp(gpu) -> Allgather(intra)": r"payloads here are fp16's; write Decomp\(gpu,fp16\)",
    "Reduce(intra) -> Comp(gpu,fp16) -> PushPullC(inter) -> Decomp(gpu,fp16) "
    "-> Broadcast(intra)": "servers aggregate payloads of the job's compressor",
    "Comp(gpu) -> AlltoallC(intra) -> Decomp(gpu) -> Comp(gpu,fp16) -> AllgatherC(inter) "
    "-> Decomp(gpu,fp16) -> Allgather(intra)": "move only inside the machine",
    "Comp(gpu,fp16) -> AlltoallC(intra) -> Decomp(gpu,fp16) -> Allreduce(inter) "
    "-> Allgather(intra)": "add a Comp of the job's compressor",
    "Comp(gpu,fp16) -> GatherC(intra) -> AllgatherC(inter) -> BroadcastC(intra) "
    "-> Decomp(gpu,fp16)": "move only inside the machine",
}


@pytest.mark.parametrize("text", MIXED)
def test_mixed_options_appear_and_round_trip(text):
    option = Option.parse(text)
    assert option in set(enumerate_options(BIG))
    assert option not in set(enumerate_options(BIG, ONE_COMPRESSOR))
    assert Option.parse(str(option)) == option and option.partners == {"fp16"}


@pytest.mark.parametrize("text", sorted(MIXED_INVALID))
def test_invalid_mixed_options_say_why(text):
    with pytest.raises(OptionError, match=MIXED_INVALID[text]):
        validate(Option.parse(text), BIG)


@pytest.mark.parametrize("bad", ["Allreduce(flat,fp16)", "Comp(gpu,FP16)", "Comp(gpu,)"])
def test_only_compute_steps_name_a_compressor(bad):
    with pytest.raises(OptionError):
        Option.parse(bad)


def test_fp16_partner_is_not_a_lossy_compression():
    """max-lossy counts compressions that lose information; fp16's rounding (relative error
    <= 2^-11 per element) is not one, so one-compression plans keep the mixed schemes."""
    option = Option.parse(MIXED[0])
    assert option.compressions == 3 and option.lossy_compressions == 1
    once = Constraints.parse(["max-lossy=1"])
    assert once.allows(option)
    assert len(enumerate_options(BIG, once)) == 1604
    assert len(enumerate_options(BIG, dataclasses.replace(once, partner=None))) == 196


@pytest.mark.parametrize(("items", "partner"), [(["no-mixed"], None),
                                                (["partner=topk"], "topk"), ([], "fp16")])
def test_partner_constraints_round_trip(items, partner):
    c = Constraints.parse(items)
    assert c.partner == partner
    assert c.to_strings() == items
    assert Constraints.parse(c.to_strings()) == c


def test_forwarding_adds_options_that_decode_once():
    """The options in which a step forwards gathered payloads are the ones the tree gained;
    they compress once, so one-compression plans (max-lossy=1) get more schemes."""
    from byteps_espresso.strategy.program import compile_option

    forwarding = [o for o in enumerate_options(BIG, ONE_COMPRESSOR)
                  if any(op.forwards for op in compile_option(o).ops)]
    assert len(forwarding) == 2776 - 2340
    once = Constraints.parse(["max-lossy=1", "no-mixed"])
    assert len(enumerate_options(BIG, once)) == 196  # 144 without forwarding
    assert Option.parse("Comp(gpu) -> GatherC(intra) -> AllgatherC(inter) -> BroadcastC(intra) "
                        "-> Decomp(gpu)") in enumerate_options(BIG, once)


def test_a_compressor_whose_payloads_sum_adds_the_payload_allreduce():
    """fp16 (``Capabilities.linear``): the allreduce family gains AllreduceC beside
    AllgatherC, in the flat and the inter scheme; every other Option stays as it is."""
    summing = enumerate_options(BIG, ONE_COMPRESSOR, "fp16")
    plain = enumerate_options(BIG, ONE_COMPRESSOR)
    added = [o for o in summing if any(s.kind is Kind.ALLREDUCE_C for s in o.steps)]
    assert [o for o in summing if o not in set(added)] == plain
    parts, base = (count_decomposition(BIG, ONE_COMPRESSOR, c) for c in ("fp16", None))
    # flat: Comp(d) -> AllreduceC(flat) -> Decomp(d'), 4 placements
    assert parts["flat allreduce(flat)"] - base["flat allreduce(flat)"] == 4
    assert parts["hierarchical allreduce(inter)"] - base["hierarchical allreduce(inter)"] == 80
    assert len(added) == 84 and {k for k in parts if parts[k] != base[k]} == {
        "flat allreduce(flat)", "hierarchical allreduce(inter)", "total"}
    for option in added:
        validate(option, BIG, "fp16")
        assert all(s.scope is not Scope.INTRA for s in option.steps
                   if s.kind is Kind.ALLREDUCE_C)
        with pytest.raises(OptionError, match="only a compressor whose payloads sum"):
            validate(option, BIG, "randomk")
    for text in ("Comp(gpu) -> AllreduceC(flat) -> Decomp(gpu)",
                 "ReduceScatter(intra) -> Comp(gpu) -> AllreduceC(inter) -> Decomp(gpu) "
                 "-> Allgather(intra)",
                 "ReduceScatter(intra) -> Comp(gpu) -> AllreduceC(inter) -> AllgatherC(intra) "
                 "-> Decomp(gpu)"):
        assert Option.parse(text) in set(added)
    assert enumerate_options(BIG, ONE_COMPRESSOR, "randomk") == plain


@pytest.mark.parametrize("text, why", [
    ("Comp(gpu) -> AlltoallC(intra) -> AllreduceC(inter) -> Decomp(gpu) -> Allgather(intra)",
     "AllreduceC sums one payload per member"),
    ("Comp(gpu) -> AllreduceC(intra) -> Decomp(gpu)", "one flat scheme, or intra-open"),
    # the decoded sum is the payload's own values: encoding them again changes nothing
    ("ReduceScatter(intra) -> Comp(gpu) -> AllreduceC(inter) -> Decomp(gpu) -> Comp(gpu) "
     "-> AllgatherC(intra) -> Decomp(gpu)", "re-compression only after"),
])
def test_misplaced_payload_allreduces_are_refused(text, why):
    with pytest.raises(OptionError, match=why):
        validate(Option.parse(text), BIG, "fp16")


def test_no_duplicates_and_every_option_validates():
    options = enumerate_options(BIG)
    assert len(set(options)) == len(options)
    for opt in options:
        validate(opt, BIG)
        assert Option.parse(opt.names()) == opt


@pytest.mark.parametrize("text", HAND_DERIVED)
def test_hand_derived_options_appear(text):
    assert Option.parse(text) in set(enumerate_options(BIG))


@pytest.mark.parametrize("text", INVALID)
def test_invalid_options_are_rejected(text):
    with pytest.raises(OptionError):
        validate(Option.parse(text), BIG)


def test_cluster_shape_prunes_paths():
    flat_cluster = Cluster.preset(4, 1, "pcie", 25, servers=0)
    options = enumerate_options(flat_cluster)
    assert all(not o.is_hierarchical and not o.uses_servers for o in options)
    with pytest.raises(OptionError):
        validate(Option.parse("Reduce(intra) -> PushPull(inter) -> Broadcast(intra)"),
                 flat_cluster)


def test_constraints_prune():
    c = Constraints.parse(["no-cpu", "max-compressions=1", "forbid=AlltoallC", "no-ps"])
    options = enumerate_options(BIG, c)
    assert options
    for o in options:
        assert not o.uses_cpu and o.compressions <= 1 and not o.uses_servers
        assert all(s.kind is not Kind.ALLTOALL_C for s in o.steps)
    assert all(not o.is_hierarchical
               for o in enumerate_options(BIG, Constraints(flat_only=True)))
    assert enumerate_options(BIG, Constraints(max_compressions=0)) == [
        o for o in enumerate_options(BIG) if not o.is_compressed]
    assert Constraints.parse(c.to_strings()) == c


@pytest.mark.parametrize("bad", ["no-gpus", "forbid=Bogus", "max-compressions=x",
                                 "flat-only=1"])
def test_bad_constraints_name_the_problem(bad):
    with pytest.raises(ConstraintError, match="--constraint"):
        Constraints.parse([bad])
    with pytest.raises(ConstraintError):
        Constraints.parse(["flat-only", "hierarchical-only"])


def test_max_lossy_counts_every_comp_and_the_servers_recompression():
    ps = Option.parse("Reduce(intra) -> Comp(cpu) -> PushPullC(inter) -> Decomp(cpu) -> "
                      "Broadcast(intra)")
    hitopk = Option.parse("ReduceScatter(intra) -> Comp(gpu) -> AllgatherC(inter) -> "
                          "Decomp(gpu) -> Allgather(intra)")
    twice = Option.parse("Comp(cpu) -> AlltoallC(flat) -> Decomp(cpu) -> Comp(gpu) -> "
                         "AllgatherC(flat) -> Decomp(gpu)")
    assert (ps.lossy_compressions, hitopk.lossy_compressions, twice.lossy_compressions) == (2, 1, 2)
    once = Constraints.parse(["max-lossy=1"])
    assert Constraints.parse(once.to_strings()) == once
    options = enumerate_options(BIG, once)
    assert hitopk in options and ps not in options and twice not in options
    assert all(o.lossy_compressions <= 1 for o in options)
    assert {o for o in enumerate_options(BIG) if o.lossy_compressions <= 1} == set(options)
    with pytest.raises(ConstraintError, match="max-lossy"):
        Constraints.parse(["max-lossy=x"])
