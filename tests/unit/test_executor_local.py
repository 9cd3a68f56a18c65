"""The executor over the in-memory transport (ranks as threads) against the reference.

This runs the real executor code for many Options in one process; the multi-process tests
(tests/multiproc/test_executor.py) run it over gloo.
"""

import math
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from byteps_espresso.worker.codecs import CodecPair
from byteps_espresso.worker.executor import Engine, ExecutionError, Executor
from byteps_espresso.worker.local_transport import LocalHub
from byteps_espresso.worker.reference import Reference

from byteps_espresso.strategy.options import Option
from byteps_espresso.strategy.program import compile_option

OPTIONS = [
    "Allreduce(flat)",
    "ReduceScatter(intra) -> Allreduce(inter) -> Allgather(intra)",
    "Reduce(intra) -> Reduce(inter) -> Broadcast(inter) -> Broadcast(intra)",
    "Comp(gpu) -> AlltoallC(flat) -> Decomp(gpu) -> Comp(cpu) -> AllgatherC(flat) -> Decomp(cpu)",
    "Comp(cpu) -> GatherC(intra) -> Decomp(cpu) -> Comp(gpu) -> AlltoallC(inter) -> Decomp(gpu) "
    "-> Comp(gpu) -> AllgatherC(inter) -> Decomp(gpu) -> Comp(gpu) -> BroadcastC(intra) "
    "-> Decomp(gpu)",
    "ReduceScatter(intra) -> Comp(cpu) -> AllgatherC(inter) -> Decomp(cpu) -> Comp(gpu) "
    "-> AllgatherC(intra) -> Decomp(gpu)",
    "Reduce(intra) -> Comp(gpu) -> GatherC(inter) -> Decomp(gpu) -> Comp(cpu) "
    "-> BroadcastC(inter) -> Decomp(cpu) -> Broadcast(intra)",
    # gathered payloads forwarded undecoded (the Decomp sums every member's of each group)
    "Comp(gpu) -> GatherC(flat) -> BroadcastC(flat) -> Decomp(cpu)",
    "Comp(cpu) -> AlltoallC(intra) -> AllgatherC(inter) -> Decomp(gpu) -> Allgather(intra)",
    "Comp(gpu) -> GatherC(intra) -> GatherC(inter) -> BroadcastC(inter) -> BroadcastC(intra) "
    "-> Decomp(gpu)",
    "Comp(gpu) -> GatherC(intra) -> AllgatherC(inter) -> BroadcastC(intra) -> Decomp(cpu)",
    # fp16's payloads summed inside the collective
    "Comp(gpu) -> AllreduceC(flat) -> Decomp(cpu)",
    "ReduceScatter(intra) -> Comp(cpu) -> AllreduceC(inter) -> AllgatherC(intra) -> Decomp(gpu)",
    "Reduce(intra) -> Comp(gpu) -> AllreduceC(inter) -> BroadcastC(intra) -> Decomp(gpu)",
]


def run_threads(machines, local, option, inputs, codec_factory, *, steps=1):
    hub = LocalHub(machines, local, timeout_s=10)
    world = machines * local
    executors = [Executor(hub.transport(r), codec_factory()) for r in range(world)]
    outs = []
    with ThreadPoolExecutor(world) as pool:
        for step in range(steps):
            futs = [pool.submit(executors[r].run, option, inputs[step][r], name="w", step=step)
                    for r in range(world)]
            outs.append([f.result(timeout=30) for f in futs])
    return outs


@pytest.mark.parametrize("option", OPTIONS)
@pytest.mark.parametrize("layout", [(2, 2), (3, 2), (2, 3)])
@pytest.mark.parametrize("numel", [1, 5, 257])
# The executor's gpu steps on the torch backend (what runs on GPUs) and on numba (a CPU
# training device's default but for the casts); the reference on the default: both must give
# the same bits.
@pytest.mark.parametrize("kernels", ["numba", "torch"])
def test_threads_equal_reference(option, layout, numel, kernels):
    machines, local = layout
    world = machines * local
    g = torch.Generator().manual_seed(numel)
    inputs = [[torch.randn(numel, generator=g) for _ in range(world)] for _ in range(2)]
    got = run_threads(machines, local, Option.parse(option), inputs,
                      lambda: CodecPair("fp16", device_kernels=kernels), steps=2)
    ref = Reference(machines, local, [CodecPair("fp16") for _ in range(world)])
    for step in range(2):
        expected = ref.run(Option.parse(option), inputs[step], name="w", step=step)
        for r in range(world):
            assert torch.equal(got[step][r], expected[r]), f"rank {r}, step {step}"


@pytest.mark.parametrize("option", [
    "Comp(gpu) -> AllgatherC(flat) -> Decomp(gpu)",
    "ReduceScatter(intra) -> Comp(cpu) -> AllgatherC(inter) -> Decomp(cpu) -> Allgather(intra)",
    "Comp(gpu) -> AlltoallC(flat) -> Decomp(gpu) -> Comp(cpu) -> AllgatherC(flat) -> Decomp(cpu)"])
def test_a_compressor_schedule_runs_each_stage_with_its_own_layout(option):
    # dgc's warm-up from 25% to 1% over 6 iterations: 3 stages of 2, then the steady state;
    # every stage's payloads have their own length, bound once per stage.
    machines, local, steps, numel = 2, 2, 8, 1000
    world = machines * local
    g = torch.Generator().manual_seed(3)
    inputs = [[torch.randn(numel, generator=g) for _ in range(world)] for _ in range(steps)]

    def factory():
        return CodecPair("dgc", {"ratio": 0.01, "warmup_steps": 6})

    got = run_threads(machines, local, Option.parse(option), inputs, factory, steps=steps)
    ref = Reference(machines, local, [factory() for _ in range(world)])
    for step in range(steps):
        expected = ref.run(Option.parse(option), inputs[step], name="w", step=step)
        for r in range(world):
            assert torch.equal(got[step][r], expected[r]), f"rank {r}, step {step}"
    # the first stage keeps a quarter, the steady state 1%: the sums differ accordingly
    dense = sum(inputs[0][1:], inputs[0][0])
    assert int((got[0][0] != 0).sum()) > int((got[7][0] != 0).sum())
    assert int((got[0][0] != 0).sum()) <= int((dense != 0).sum())


def test_timings_leave_the_steps_a_rank_sleeps_through_untimed():
    """The non-roots of a rooted Option skip its steps between the Reduce and the Broadcast:
    they record NaN there (the check takes a step's time over the ranks that ran it), and a
    time for every step they run."""
    option = Option.parse("Reduce(intra) -> Comp(cpu) -> AllgatherC(inter) -> Decomp(cpu) "
                          "-> Broadcast(intra)")
    hub = LocalHub(2, 2, timeout_s=10)
    executors = [Executor(hub.transport(r), CodecPair("fp16")) for r in range(4)]
    for ex in executors:
        ex.timings = []
    with ThreadPoolExecutor(4) as pool:
        futs = [pool.submit(ex.run, option, torch.ones(7), name="w", step=0)
                for ex in executors]
        assert all(torch.equal(f.result(timeout=30), torch.full((7,), 4.0)) for f in futs)
    for rank, ex in enumerate(executors):
        root = rank % 2 == 0  # local rank 0 of each machine
        seconds = {i: sec for _, _, i, sec in ex.timings}
        assert sorted(seconds) == list(range(len(option.steps)))
        for i, sec in seconds.items():
            sleeps = not root and 0 < i < len(option.steps) - 1
            assert math.isnan(sec) if sleeps else sec >= 0.0, (rank, i, sec)


def test_engine_runs_lanes_concurrently_in_submission_order():
    hub = LocalHub(2, 2, timeout_s=10)
    engines = [Engine([Executor(hub.transport(r, 0)), Executor(hub.transport(r, 1))])
               for r in range(4)]
    option = Option.parse("ReduceScatter(intra) -> Allreduce(inter) -> Allgather(intra)")
    try:
        handles = [[e.submit(f"t{i}", torch.full((9,), float(r + i)), option)
                    for i in range(6)] for r, e in enumerate(engines)]
        for i in range(6):
            for r in range(4):
                assert torch.equal(handles[r][i].wait(10), torch.full((9,), 6.0 + 4 * i))
    finally:
        for e in engines:
            e.close()


def test_errors_name_tensor_and_step():
    hub = LocalHub(1, 1)
    ex = Executor(hub.transport(0))
    with pytest.raises(ExecutionError, match=r"tensor 'w', step 0 Comp\(gpu\).*no compressor"):
        ex.run(Option.parse("Comp(gpu) -> AllgatherC(flat) -> Decomp(gpu)"), torch.ones(3),
               name="w", step=0)
    with pytest.raises(ExecutionError, match="servers"):
        ex.run(Option.parse("PushPull(flat)"), torch.ones(3), name="w", step=0)
    topk = Executor(hub.transport(0), CodecPair("topk"))
    with pytest.raises(ExecutionError, match=r"step 1 AllreduceC\(flat\).*topk's payloads do "
                                             "not sum; use AllgatherC"):
        topk.run(Option.parse("Comp(gpu) -> AllreduceC(flat) -> Decomp(gpu)"), torch.ones(3),
                 name="w", step=0)


def test_only_options_that_issue_one_collective_may_run_on_the_submitting_thread():
    """Engine.submit issues an Option on its own thread (the lane idle) only when start()
    returns as soon as the Option's one collective is issued: compression on the training
    device before it, an async_op kind, an asynchronous transport, no timed run."""
    hub = LocalHub(1, 2)
    ex = Executor(hub.transport(0), CodecPair("fp16"))
    assert not ex.issues_at_once(Option.parse("Allreduce(flat)"))  # in-memory: blocking
    ex.transport.issues_async = True  # as DistTransport's
    for text in ("Allreduce(flat)", "Comp(gpu) -> AllreduceC(flat) -> Decomp(gpu)",
                 "Comp(gpu) -> AllreduceC(flat) -> Decomp(cpu)",
                 "Comp(gpu) -> AllgatherC(flat) -> Decomp(gpu)"):
        assert ex.issues_at_once(Option.parse(text)), text
    for text in ("Comp(cpu) -> AllreduceC(flat) -> Decomp(gpu)",  # the host pool first
                 "Comp(gpu) -> GatherC(flat) -> Decomp(gpu) -> Broadcast(flat)",  # rooted
                 "ReduceScatter(flat) -> Allgather(flat)",  # two collectives
                 "PushPull(flat)"):  # the PS client's own thread
        assert not ex.issues_at_once(Option.parse(text)), text
    ex.timings = []  # a timed run runs as it trains (its collective timed to completion)
    assert ex.issues_at_once(Option.parse("Allreduce(flat)"))
    ex.trace = lambda index, value: None  # a traced run sees every step's value, on the lane
    assert not ex.issues_at_once(Option.parse("Allreduce(flat)"))


class _CompletesLater:
    """The in-memory transport, but its in-flight collectives complete (``done``) LATER_S
    after they are issued, from another thread, as gloo's do."""

    LATER_S = 0.05
    issues_async = True

    def __init__(self, inner):
        self.inner = inner
        self.topology = inner.topology

    def _later(self, out, done):
        if done is not None:
            threading.Timer(self.LATER_S, done).start()
        return lambda: out

    def allreduce_start(self, scope, x, *, owned=False, done=None):
        return self._later(self.inner.allreduce(scope, x, owned=owned), done)

    def allreduce_payload_start(self, scope, payload, *, done=None):
        return self._later(self.inner.allreduce_payload(scope, payload), done)


@pytest.mark.parametrize("text", ["Allreduce(flat)",
                                  "Comp(gpu) -> AllreduceC(flat) -> Decomp(gpu)"])
def test_a_timed_run_times_the_collective_it_leaves_in_flight_to_its_completion(text):
    """The check and the profile time each step of the Options as they train: the last
    collective stays in flight (start() returns once it is issued) and is timed from its
    issue to its completion, not to the later wait; the Decomp after it is timed in the
    waiting call. The sum is the same."""
    hub = LocalHub(1, 1)
    ex = Executor(_CompletesLater(hub.transport(0)), CodecPair("fp16"))
    ex.timings = []
    x = torch.arange(8, dtype=torch.float32)
    option = Option.parse(text)
    tail = next(i for i, st in enumerate(option.steps) if not st.kind.is_compute)
    wait = ex.start(option, x, name="t", step=3)
    assert [i for _, _, i, _ in ex.timings] == list(range(tail))  # a Comp before it
    time.sleep(1.0)  # the backward pass goes on; the collective completed meanwhile
    assert torch.equal(wait(), x)
    names, iterations, indices, seconds = zip(*ex.timings, strict=True)
    assert (set(names), set(iterations)) == ({"t"}, {3})
    assert list(indices) == list(range(len(option.steps)))
    assert _CompletesLater.LATER_S <= seconds[tail] < 0.9, seconds[tail]
    assert ex.timed_runs == {"t": (option, 8)}


def _tree():
    from byteps_espresso.strategy import Cluster, enumerate_options

    return enumerate_options(Cluster.preset(2, 2, "pcie", 10, servers=1))


def covering(options, codecs=False):
    """One Option per (communication steps with scopes and the forms they take, devices used)
    signature: the form tells a step that forwards gathered payloads from one that does not;
    ``codecs``: and the compressor of the payloads each step moves."""
    seen = {}
    for o in options:
        comm = tuple((op.kind, op.scope, op.takes, op.codec if codecs else None)
                     for op in compile_option(o).ops if not op.kind.is_compute)
        seen.setdefault((comm, o.devices), o)
    return list(seen.values())


def _check_against_reference(options, codec_factory, partner=None):
    world, sizes = 4, [1, 6, 131]
    hub = LocalHub(2, 2, timeout_s=10)
    partners = {partner: CodecPair(partner)} if partner else None
    executors = [Executor(hub.transport(r), codec_factory(), partners=partners)
                 for r in range(world)]
    ref = Reference(2, 2, [codec_factory() for _ in range(world)],
                    partners={partner: [CodecPair(partner) for _ in range(world)]}
                    if partner else None)
    g = torch.Generator().manual_seed(0)
    with ThreadPoolExecutor(world) as pool:
        for idx, option in enumerate(options):
            xs = [torch.randn(sizes[idx % len(sizes)], generator=g) for _ in range(world)]
            futs = [pool.submit(executors[r].run, option, xs[r], name=f"t{idx}", step=0)
                    for r in range(world)]
            got = [f.result(timeout=30) for f in futs]
            expected = ref.run(option, xs, name=f"t{idx}", step=0)
            for r in range(world):
                assert torch.equal(got[r], expected[r]), f"{option}: rank {r}"


def test_covering_subset_of_the_tree_equals_reference():
    """One Option per (scheme x scopes x devices) of the 2 x 2 tree that needs no PS (PS
    Options run on real servers in tests/multiproc/test_executor.py), on threads."""
    options = covering(o for o in _tree() if not o.uses_servers)
    assert len(options) > 200
    _check_against_reference(options, lambda: CodecPair("topk", {"ratio": 0.3},
                                                        error_feedback=True))


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("ESPRESSO_SLOW_TESTS"),
                    reason="about a minute: set ESPRESSO_SLOW_TESTS=1")
def test_every_option_of_the_tree_without_servers_equals_reference():
    options = [o for o in _tree() if not o.uses_servers]
    assert len(options) > 2000
    _check_against_reference(options, lambda: CodecPair("topk", {"ratio": 0.3},
                                                        error_feedback=True))


def test_closing_an_engine_with_blocked_lanes_waits_one_timeout_in_all():
    """A lane stuck on a failed peer must not hold shutdown for a timeout per lane."""
    hub = LocalHub(1, 2)
    engine = Engine([Executor(hub.transport(0, 0)), Executor(hub.transport(0, 1))],
                    timeout_s=1.0)
    release = threading.Event()
    for lane in range(engine.lanes):
        engine.call(lane, lambda ex: release.wait(30))
    t0 = time.monotonic()
    engine.close()
    waited = time.monotonic() - t0
    release.set()
    assert 0.9 <= waited < 1.9  # one timeout (1.0 s), not one per lane (2.0 s)


def test_every_lane_thread_runs_the_thread_init_before_its_work():
    """numba keeps its thread count per calling thread: the runtime sets it in each lane."""
    import numba

    hub = LocalHub(1, 1)
    inits = []

    def init():
        numba.set_num_threads(1)
        inits.append(threading.current_thread().name)

    engine = Engine([Executor(hub.transport(0, 0)), Executor(hub.transport(0, 1))],
                    thread_init=init)
    try:
        counts = [engine.call(lane, lambda ex: numba.get_num_threads()).wait(10)
                  for lane in range(engine.lanes)]
    finally:
        engine.close()
    assert sorted(inits) == ["espresso-lane-0", "espresso-lane-1"]
    assert counts == [1, 1]



def test_mixed_options_equal_reference():
    """Every mixed-compressor signature of the 2 x 2 tree that needs no PS (fp16 inside the
    machine, the job's compressor between machines), on threads against the reference."""
    options = covering((o for o in _tree() if o.partners and not o.uses_servers), codecs=True)
    assert len(options) > 200
    _check_against_reference(options, lambda: CodecPair("topk", {"ratio": 0.3},
                                                        error_feedback=True), partner="fp16")

def test_a_mixed_option_without_its_partner_names_it():
    hub = LocalHub(2, 2)
    ex = Executor(hub.transport(0), CodecPair("topk", {"ratio": 0.3}))
    option = Option.parse("Comp(gpu,fp16) -> AlltoallC(intra) -> Decomp(gpu,fp16) -> Comp(gpu) "
                          "-> AllgatherC(inter) -> Decomp(gpu) -> Allgather(intra)")
    with pytest.raises(ExecutionError, match="compresses with fp16 inside the machine but no "
                                             "fp16 codec is configured"):
        ex.run(option, torch.ones(8), name="w", step=0)
