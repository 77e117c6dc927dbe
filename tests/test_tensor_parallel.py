"""parlab.tensor_parallel on real ranks: the small GPT split over t = 2 and 4 ranks (with and
without sequence parallelism) gives the one-process model's loss, gradients and parameters
after 5 SGD steps, within the rounding band of the same model computed in the ranks' split
arithmetic in one process; the trace counts the collectives of each layer; a 2 x 2 grid of
data x tensor parallelism trains like one process on the full batch."""

import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from parlab import trace
from parlab.gpt import GPT, CharDataset, GPTConfig
from parlab.numerics import assert_equivalent, backward_in_shards, ring_orders
from parlab.runtime.mesh import axis_groups
from parlab.tensor_parallel import ParallelGPT
from parlab.tensor_parallel.grid import TensorDataParallel

CONFIG = GPTConfig(V=64, s=16, h=32, a=4, L=2)
B, STEPS, LR = 4, 5, 0.5


def build_gpt(seed=0):
    torch.manual_seed(seed)
    return GPT(CONFIG)


@functools.cache
def batches():
    generator, data = torch.Generator().manual_seed(1), CharDataset()
    return [data.batch(B, CONFIG.s, generator) for _ in range(STEPS)]


def split_linear(module, t, order, kind, x):
    """One process, the ranks' arithmetic: a row-parallel layer sums t partial products in
    ``order``; a column-parallel one computes its t row blocks apart."""
    if kind == "row":
        parts = [F.linear(xr, wr) for xr, wr in zip(x.chunk(t, -1), module.weight.chunk(t, 1))]
        total = functools.reduce(torch.add, [parts[r] for r in order])
        return total if module.bias is None else total + module.bias
    biases = [None] * t if module.bias is None else module.bias.chunk(t)
    return torch.cat([F.linear(x, w, c) for w, c in zip(module.weight.chunk(t), biases)], -1)


def split_cross_entropy(logits, targets, t, order):
    """``parallel_cross_entropy``'s arithmetic in one process: partial sums added in ``order``."""
    m = logits.detach().amax(-1, keepdim=True)
    shifted = logits - m
    sums = [part.exp().sum(-1) for part in shifted.chunk(t, -1)]
    sum_exp = functools.reduce(torch.add, [sums[r] for r in order])
    return (sum_exp.log() - shifted.gather(-1, targets[..., None])[..., 0]).mean()


def train_one_process(t=1, order=None, shards=1):
    """(loss of step 1, gradients of step 1, parameters after STEPS steps) of the one-process
    model; with t > 1 in the split arithmetic of t ranks (summed in ``order``), with shards > 1
    each batch in ``shards`` parts whose gradients are averaged (a data-parallel grid's)."""
    model = build_gpt()
    if t > 1:
        for name, module in model.named_modules():
            if isinstance(module, nn.Linear):
                kind = "row" if name.endswith(("proj", "fc2")) else "column"
                module.forward = functools.partial(split_linear, module, t, order, kind)
    loss_of = (lambda x, y: split_cross_entropy(model(x), y, t, order)) if t > 1 else model.loss
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for step, (x, y) in enumerate(batches()):
        optimizer.zero_grad()
        if step == 0:
            loss = loss_of(x, y).detach()
        backward_in_shards(loss_of, model.parameters(), list(zip(x.chunk(shards), y.chunk(shards))))
        if step == 0:
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        optimizer.step()
    return loss, grads, {n: p.detach().clone() for n, p in model.named_parameters()}


@functools.cache
def reference(t=1, order=None, shards=1):
    return train_one_process(t, order, shards)


def expected_shards(named, group):
    """This rank's slices of the one-process tensors ``named`` (by the full model's names),
    by the names of ``ParallelGPT``'s parameters: a ParallelGPT built from a GPT holding them."""
    holder = build_gpt()
    with torch.no_grad():
        for name, p in holder.named_parameters():
            p.copy_(named[name])
    return {n: p.detach() for n, p in ParallelGPT(holder, group).named_parameters()}


def train_parallel(sequence_parallel):
    model = ParallelGPT(build_gpt(), sequence_parallel=sequence_parallel)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for step, (x, y) in enumerate(batches()):
        optimizer.zero_grad()
        loss = model.loss(x, y)
        loss.backward()
        model.reduce_sequence_parallel_gradients()
        if step == 0:
            first = (loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})
        optimizer.step()
    ref = [reference(), *(reference(dist.get_world_size(), tuple(o)) for o in ring_orders(dist.get_world_size()))]
    expected = [(loss, expected_shards(grads, None), expected_shards(params, None)) for loss, grads, params in ref]
    return first[0], first[1], {n: p.detach().clone() for n, p in model.named_parameters()}, expected


@pytest.mark.timeout(240)
@pytest.mark.parametrize("t, sequence_parallel", [(2, False), (2, True), (4, False), (4, True)])
def test_the_tensor_parallel_gpt_trains_like_one_process(t, sequence_parallel, request):
    cluster = request.getfixturevalue(f"cluster{t}")
    for rank, (loss, grads, params, expected) in enumerate(cluster.run(train_parallel, sequence_parallel, timeout=180)):
        (ref_loss, ref_grads, ref_params), decomposed = expected[0], expected[1:]
        assert_equivalent(loss, ref_loss, [d[0] for d in decomposed], f"t = {t}, rank {rank}: loss")
        assert_equivalent(grads, ref_grads, [d[1] for d in decomposed], f"t = {t}, rank {rank}: gradients")
        assert_equivalent(params, ref_params, [d[2] for d in decomposed], f"t = {t}, rank {rank}: parameters")


def train_on_grid(sequence_parallel):
    """2 x 2: replica d = rank // 2 starts from other weights (the grid copies replica 0's)."""
    grid = TensorDataParallel(build_gpt(seed=dist.get_rank() // 2 * 100), 2, sequence_parallel)
    optimizer = torch.optim.SGD(grid.model.parameters(), lr=LR)
    for step, (x, y) in enumerate(batches()):
        optimizer.zero_grad()
        grid.step(x, y)
        if step == 0:
            grads = {n: p.grad.clone() for n, p in grid.model.named_parameters()}
        optimizer.step()
    group = grid.tensor_parallel_group
    ref = [reference(), *(reference(2, tuple(order), 2) for order in ring_orders(2))]
    expected = [(expected_shards(g, group), expected_shards(p, group)) for _, g, p in ref]
    return grads, {n: p.detach().clone() for n, p in grid.model.named_parameters()}, expected


@pytest.mark.timeout(240)
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_a_2_by_2_grid_of_data_and_tensor_parallelism_trains_like_one_process(sequence_parallel, cluster4):
    assert axis_groups("tp", dp=2, tp=2) == [[0, 1], [2, 3]]  # the rows: tensor parallelism innermost
    for rank, (grads, params, expected) in enumerate(cluster4.run(train_on_grid, sequence_parallel, timeout=180)):
        (ref_grads, ref_params), decomposed = expected[0], expected[1:]
        assert_equivalent(grads, ref_grads, [d[0] for d in decomposed], f"grid rank {rank}: gradients")
        assert_equivalent(params, ref_params, [d[1] for d in decomposed], f"grid rank {rank}: parameters")


def learner_mistakes():
    messages = []
    for attempt in (lambda: ParallelGPT(GPT(GPTConfig(V=64, s=16, h=24, a=3, L=1))),
                    lambda: ParallelGPT(GPT(GPTConfig(V=64, s=18, h=32, a=4, L=1)), sequence_parallel=True),
                    lambda: ParallelGPT(GPT(GPTConfig(V=66, s=16, h=32, a=4, L=1))),
                    lambda: TensorDataParallel(build_gpt(), 3),
                    lambda: TensorDataParallel(build_gpt(), 2).step(*(z[:3] for z in batches()[0])),
                    lambda: ParallelGPT(nn.Linear(2, 2))):
        try:
            attempt()
        except ValueError as error:
            messages.append(str(error))
    return messages


@pytest.mark.timeout(120)
def test_sizes_that_do_not_split_raise_value_errors_that_say_what_to_change(cluster4):
    for messages in cluster4.run(learner_mistakes, timeout=60):
        heads, sequence, vocabulary, world, batch, model = messages
        assert "a = 3 heads do not split over t = 4 ranks; choose a multiple of t heads" in heads
        assert "cuts s = 18 positions into t = 4 parts: choose s a multiple of 4" in sequence
        assert "the embedding table (V rows) has 66 rows" in vocabulary and "multiples of t" in vocabulary
        assert "N_d = 3 replicas needs a world of N_d x t ranks, but 4 are running" in world
        assert "a batch of 3 sequences does not split into N_d = 2 equal shards" in batch
        assert "ParallelGPT splits a parlab.gpt.GPT, got Linear" in model


def train_grid_with_zero(zero):
    """3 Adam steps on the 2 x 2 grid, with ZeRO-1 along the columns or with torch's Adam over
    the averaged gradients: (parameters, optimizer-state elements on this rank)."""
    optimizer_kwargs = {"lr": 1e-2}
    if zero:
        grid = TensorDataParallel(build_gpt(), 2, optimizer_class=torch.optim.Adam, **optimizer_kwargs)
    else:
        grid = TensorDataParallel(build_gpt(), 2)
    optimizer = grid.optimizer or torch.optim.Adam(grid.model.parameters(), **optimizer_kwargs)
    for x, y in batches()[:3]:
        if not zero:
            optimizer.zero_grad()
        with trace.span("step"):
            grid.step(x, y)
        if not zero:
            optimizer.step()
    state = sum(t.numel() for s in optimizer.state.values() for t in s.values() if t.dim())
    return {n: p.detach().clone() for n, p in grid.model.named_parameters()}, state


@pytest.mark.timeout(240)
def test_zero_1_along_the_data_axis_takes_adam_s_steps_with_half_the_state(cluster4):
    plain = cluster4.run(train_grid_with_zero, False, timeout=180)
    timeline = cluster4.trace(train_grid_with_zero, True, timeout=180)
    for rank, ((params, state), (zero_params, zero_state)) in enumerate(zip(plain, timeline.results)):
        # the same averaged gradients (a ring all-reduce is its reduce-scatter then its all-gather)
        # and the same elementwise Adam, on a flat shard instead of per parameter: equal
        assert all(torch.equal(zero_params[n], params[n]) for n in params), f"rank {rank}"
        assert zero_state * 2 == pytest.approx(state, abs=4)  # exp_avg and exp_avg_sq of 1/N_d, padding aside
    step = timeline.window("step", -1)
    for rank in range(4):
        column = {rank % 2, rank % 2 + 2} - {rank}
        for name in ("data-parallel reduce-scatter", "data-parallel all-gather"):
            (span,) = step.select(rank=rank, name=name)
            peers = {ev.peer for ev in step.select(rank=rank, kind=trace.COMM) if span.start <= ev.start <= span.end}
            assert peers == column  # the column's collectives stay in the column


def first_step_with_dropout(recompute_attention):
    """Loss and gradients of one step of ParallelGPT with dropout 0.1 (the ranks seeded alike)."""
    torch.manual_seed(0)
    model = ParallelGPT(GPT(GPTConfig(V=64, s=16, h=32, a=4, L=2, dropout=0.1)),
                        recompute_attention=recompute_attention)
    x, y = batches()[0]
    torch.manual_seed(5)
    loss = model.loss(x, y)
    loss.backward()
    return loss.detach(), [p.grad for p in model.parameters()]


@pytest.mark.timeout(120)
def test_selective_recompute_gives_the_same_loss_and_gradients_bit_for_bit(cluster2):
    # the recomputed attention core runs the same operations on the same q, k, v with the same
    # dropout mask (its RNG state restored): backward sees identical tensors
    for (loss, grads), (kept_loss, kept_grads) in zip(cluster2.run(first_step_with_dropout, True, timeout=60),
                                                      cluster2.run(first_step_with_dropout, False, timeout=60)):
        assert torch.equal(loss, kept_loss)
        assert all(torch.equal(g, kept) for g, kept in zip(grads, kept_grads))
