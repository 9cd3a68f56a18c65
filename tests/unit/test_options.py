"""Step and Option values parse, print and refuse unknown names."""

import pytest

from byteps_espresso.strategy.options import Device, Kind, Option, OptionError, Scope, Step


def test_round_trip_through_names():
    text = ("Comp(gpu) -> AlltoallC(intra) -> Decomp(gpu) -> Comp(cpu) -> PushPullC(inter) "
            "-> Decomp(cpu) -> Allgather(intra)")
    option = Option.parse(text)
    assert str(option) == text
    assert Option.parse(option.names()) == option
    assert option.compressions == 2
    assert option.uses_cpu and option.uses_servers and option.is_hierarchical
    assert option.steps[1] == Step(Kind.ALLTOALL_C, scope=Scope.INTRA)
    assert option.steps[0] == Step(Kind.COMP, device=Device.GPU)


@pytest.mark.parametrize("bad", ["Compress(gpu)", "Comp(tpu)", "Allreduce(world)", "Comp gpu",
                                 "Allreduce(gpu)", "Comp(flat)"])
def test_unknown_names_raise(bad):
    with pytest.raises(OptionError):
        Step.parse(bad)


def test_empty_option_raises():
    with pytest.raises(OptionError):
        Option.parse([])
