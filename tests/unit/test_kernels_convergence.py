"""The recipes keep accuracy on a fixed task: DGC (its paper's recipe) and PowerSGD (rank r,
error feedback, warm start, uncompressed first iterations) end within 5% of fp32's loss.

Four data-parallel workers in one process train the example's embedding MLP on the
learnable Markov task (examples/train.py; the sizes, batch and learning rate of
tests/multiproc/test_convergence.py) on their own batches. Their gradients are combined per
tensor exactly as a job combines them: DGC, each worker's payload decoded and summed in rank
order; PowerSGD, the two all-reduces as sums in rank order; fp32, the exact sum. The average
goes to SGD (momentum 0.9; DGC: none, its momentum is inside the correction). The loss is the
mean training loss of the last 30 steps over the workers, as in the multi-process test.

Measured here (2 shared cores, one thread): fp32 1.100; PowerSGD rank 4 1.124 (+2.2%); DGC's
recipe at 5% 1.133 (+3.0%). DGC at 1% is too sparse for a 150-step run, as the multi-process
test found: 1.243 (+13%) with the 50-step warm-up, 1.279 (+16%) without it; so this test
keeps 5%, like test_convergence.py.
"""

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from byteps_espresso.kernels import PowerSGD
from byteps_espresso.kernels.dgc import recipe

# examples/train.py by path, under its own name (benchmarks/ has a train.py too)
_SPEC = importlib.util.spec_from_file_location(
    "espresso_example_train", Path(__file__).resolve().parents[2] / "examples" / "train.py")
example = importlib.util.module_from_spec(_SPEC)
sys.modules[_SPEC.name] = example  # its dataclasses look their module up while it runs
_SPEC.loader.exec_module(example)

VOCAB, DIM, HIDDEN, BATCH, SEQ, LR, MOMENTUM = 500, 32, 64, 16, 8, 0.5, 0.9
WORKERS, STEPS, LAST = 4, 150, 30


def _sum(tensors):
    total = tensors[0].clone()
    for t in tensors[1:]:
        total += t
    return total


def _train(combine, momentum):
    """Mean loss of the last LAST steps; ``combine(name, grads, step)`` -> the summed gradient."""
    torch.manual_seed(0)
    task = example.MarkovTask(VOCAB, 0.9, 0)
    model = example.MLPModel(VOCAB, DIM, HIDDEN)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=momentum)
    gens = [torch.Generator().manual_seed(w + 1) for w in range(WORKERS)]
    losses = []
    for step in range(STEPS):
        grads: dict[str, list[torch.Tensor]] = {n: [] for n, _ in model.named_parameters()}
        step_loss = 0.0
        for gen in gens:
            x, y = task.batch(BATCH, SEQ, gen)
            model.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))
            loss.backward()
            step_loss += loss.item() / WORKERS
            for n, p in model.named_parameters():
                grads[n].append(p.grad.detach().clone())
        for n, p in model.named_parameters():
            p.grad = combine(n, grads[n], step).reshape(p.shape) / WORKERS
        opt.step()
        losses.append(step_loss)
    return float(np.mean(losses[-LAST:]))


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    # Four simulated workers on a shared 2-core host: one intra-op thread each pass keeps
    # the run at about 30 s instead of minutes of thread contention.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def fp32_loss():
    return _train(lambda name, grads, step: _sum(grads), MOMENTUM)


@pytest.mark.timeout(600)
def test_dgc_recipe_ends_within_5_percent_of_fp32(fp32_loss):
    # 95% sparsity after a 50-iteration warm-up from 75%, momentum correction and masking,
    # local clipping at the global threshold 5 (per worker 5 / sqrt(4)).
    workers = [recipe("torch", ratio=0.05, warmup_steps=50, momentum=MOMENTUM, clip_norm=5.0,
                      workers=WORKERS) for _ in range(WORKERS)]

    def combine(name, grads, step):
        decoded = []
        for dgc, g in zip(workers, grads, strict=True):
            payload, ctx = dgc.compress(g.reshape(-1).contiguous(), name=name, step=step)
            decoded.append(dgc.decompress(payload, ctx))
        return _sum(decoded)

    loss = _train(combine, 0.0)
    assert loss <= fp32_loss * 1.05, (loss, fp32_loss)


@pytest.mark.timeout(600)
def test_powersgd_ends_within_5_percent_of_fp32(fp32_loss):
    states = [PowerSGD(rank=4, start_iter=10) for _ in range(WORKERS)]
    compressed = set()

    def combine(name, grads, step):
        if not states[0].compresses(grads[0].shape, step):
            return _sum(grads)
        compressed.add(name)
        p_sum = _sum([s.start(name, g, step) for s, g in zip(states, grads, strict=True)])
        q_sum = _sum([s.middle(name, p_sum) for s in states])
        outs = [s.finish(name, q_sum, WORKERS) for s in states]
        assert all(torch.equal(o, outs[0]) for o in outs)  # every rank holds the same sum
        return outs[0]

    loss = _train(combine, MOMENTUM)
    assert loss <= fp32_loss * 1.05, (loss, fp32_loss)
    # the three weight matrices were compressed (biases are vectors: all-reduced as they are)
    assert compressed == {"embed.weight", "hidden.weight", "out.weight"}
