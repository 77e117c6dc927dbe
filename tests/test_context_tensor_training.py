"""The small GPT trained with context parallelism x tensor parallelism (``ContextParallelTrainer``
on a mesh with a tp axis: ``ParallelGPT`` with a ``context_group``, ring attention on each
rank's a/t heads and zig-zag positions) gives one process's losses over 4 Adam steps and its
gradients of the first step: cp = 2 x tp = 2 on 4 ranks with and without sequence
parallelism, cp = 2 x tp = 2 x dp = 2 on 8 ranks with it.

The band is measured in the same run with the yardstick of
``tests/test_context_parallel_training.py`` (imported, not copied): the GPT in one process,
attention blockwise as the cp ranks' ring computes it, the gradient in dp x cp parts summed in
each ring order. Tensor parallelism adds rounding of the same size (the row-parallel layers'
and the cross-entropy's sums over t partial sums), which the band's factor 2 and floor cover;
a wrong position, a missing loss scale or a gradient not summed misses by far more. Also: full
recompute with cp gives the same gradients bit for bit, each rank's ring carries K/V of h/t
features (L attentions' ``bytes_per_rank`` with h/t), and what is refused says what to change."""

import pytest
import torch
import torch.distributed as dist
from test_context_parallel_training import CONFIG, LR, STEPS, B, as_the_ranks_compute, one_process

import parlab
from parlab import trace
from parlab.context_parallel import ContextParallelTrainer, bytes_per_rank, shard_sequence
from parlab.gpt import GPT, GPTConfig, batches
from parlab.numerics import assert_equivalent, ring_orders
from parlab.tensor_parallel import ParallelGPT


def train_on_mesh(shape, cases, references):
    """On every rank, for each case (``sequence_parallel``): (the full batch's mean loss before
    each step, this rank's summed gradients of step 1 by name); and the one-process
    ``references``' gradients of step 1 as this rank holds them (its tp shards)."""
    results = {}
    with parlab.Mesh(**shape) as mesh:
        expected = [shards_of(gradients, mesh.group("tp")) for _, gradients in references]
        for sequence_parallel in cases:
            torch.manual_seed(0)  # the GPT of train_in_one_process
            trainer = ContextParallelTrainer(GPT(CONFIG), mesh, sequence_parallel=sequence_parallel, lr=LR)
            losses, gradients = [], None
            for i, (tokens, targets) in enumerate(batches(B, CONFIG.s, STEPS, seed=1)):
                losses.append(trainer.step(tokens, targets, keep_gradients=i == 0))
                gradients = gradients or trainer.gradients
            total = torch.tensor(losses, dtype=torch.float64)
            dist.all_reduce(total, group=mesh.group("dp", "cp"))  # each dp x cp rank's share of the mean
            results[sequence_parallel] = total.float(), gradients
    return results, expected


def shards_of(named, group):
    """This rank's slices of the one-process tensors ``named``, by ParallelGPT's names."""
    holder = GPT(CONFIG)
    with torch.no_grad():
        for name, p in holder.named_parameters():
            p.copy_(named[name])
    return {name: p.detach() for name, p in ParallelGPT(holder, group).named_parameters()}


def assert_like_one_process(cluster, dp, cases):
    references = [one_process()] + [as_the_ranks_compute(dp, 2, tuple(order)) for order in ring_orders(dp * 2)]
    shape = dict(dp=dp, cp=2, tp=2)
    for rank, (results, expected) in enumerate(cluster.run(train_on_mesh, shape, cases, references, timeout=240)):
        for sequence_parallel, (losses, gradients) in results.items():
            what = f"cp = 2 x tp = 2 x dp = {dp}, sequence parallel {sequence_parallel}, rank {rank}"
            assert_equivalent(losses, references[0][0], [r[0] for r in references[1:]], f"{what}: losses")
            assert_equivalent(gradients, expected[0], expected[1:], f"{what}: gradients of step 1")


@pytest.mark.timeout(300)
def test_cp_2_by_tp_2_trains_like_one_process(cluster4):
    assert_like_one_process(cluster4, dp=1, cases=(False, True))


@pytest.mark.timeout(300)
def test_cp_2_by_tp_2_by_dp_2_trains_like_one_process(cluster8):
    assert_like_one_process(cluster8, dp=2, cases=(True,))


def first_gradients(recompute_layers):
    """Gradients of one step of ParallelGPT on Mesh(cp=2, tp=2), its layers recomputed or not."""
    with parlab.Mesh(cp=2, tp=2) as mesh:
        torch.manual_seed(0)
        model = ParallelGPT(GPT(CONFIG), mesh.group("tp"), True, recompute_layers=recompute_layers,
                            context_group=mesh.group("cp"))
        tokens, targets = (shard_sequence(x, 2, mesh.coordinate("cp"), "zigzag", dim=1)
                           for x in batches(B, CONFIG.s, 1, seed=1)[0])
        model.loss(tokens, targets).backward()
        return [p.grad for p in model.parameters()]


@pytest.mark.timeout(120)
def test_full_recompute_with_cp_gives_the_same_gradients_bit_for_bit(cluster4):
    # the recomputed layer runs the same operations, its ring attention's messages included
    for grads, kept in zip(cluster4.run(first_gradients, True, timeout=60),
                           cluster4.run(first_gradients, False, timeout=60)):
        assert all(torch.equal(g, k) for g, k in zip(grads, kept))


def traced_step():
    with parlab.Mesh(cp=2, tp=2) as mesh:
        torch.manual_seed(0)
        trainer = ContextParallelTrainer(GPT(CONFIG), mesh, sequence_parallel=True, lr=LR)
        trainer.step(*batches(B, CONFIG.s, 1, seed=1)[0])


@pytest.mark.timeout(120)
def test_each_rank_s_ring_carries_its_a_over_t_heads(cluster4):
    timeline = cluster4.trace(traced_step, timeout=60)
    for rank in range(4):
        cp_peer = rank ^ 2  # Mesh(cp=2, tp=2): rank 2 i_cp + i_tp
        for phase in ("forward", "backward"):
            span = timeline.select(rank=rank, name=phase)[0]
            sent = sum(ev.nbytes for ev in timeline.select(rank=rank, kind=trace.COMM)
                       if ev.name in ("send", "isend") and ev.peer == cp_peer and span.start <= ev.start <= span.end)
            assert sent == CONFIG.L * bytes_per_rank("ring", B, CONFIG.s, CONFIG.h // 2, 2, 4, phase), (rank, phase)


def learner_mistakes():
    messages = []
    with parlab.Mesh(cp=2, tp=2) as mesh:
        tp, cp = mesh.group("tp"), mesh.group("cp")
        tokens = batches(B, CONFIG.s, 1, seed=1)[0][0]
        attempts = [
            lambda: ParallelGPT(GPT(GPTConfig(V=64, s=16, h=32, a=4, L=2, dropout=0.1)), tp, context_group=cp),
            lambda: ParallelGPT(GPT(CONFIG), tp, recompute_attention=True, context_group=cp),
            lambda: ParallelGPT(GPT(CONFIG), tp, stage=(0, 2), context_group=cp),
            lambda: ParallelGPT(GPT(CONFIG), tp, context_group=cp, attention="ring"),
            lambda: ParallelGPT(GPT(GPTConfig(V=64, s=18, h=32, a=4, L=2)), tp, True, context_group=cp),
            lambda: ParallelGPT(GPT(CONFIG), tp, context_group=cp)(tokens),
        ]
        for attempt in attempts:
            try:
                attempt()
            except ValueError as error:
                messages.append(str(error))
    return messages


@pytest.mark.timeout(120)
def test_what_cp_refuses_says_what_to_change(cluster4):
    for messages in cluster4.run(learner_mistakes, timeout=60):
        dropout, recompute, stage, attention, sequence, length = messages
        assert "drops no probabilities, but the GPT has dropout = 0.1: build it with GPTConfig(dropout=0.0)" in dropout
        assert "leave recompute_attention=False, or recompute whole layers with recompute_layers=True" in recompute
        assert "not pipeline stage (0, 2): pass stage=(0, 1)" in stage
        assert "attention must be a function such as ring_attention" in attention
        assert "cuts s = 18 positions into cp x t = 2 x 2 parts: choose s a multiple of 4" in sequence
        assert "a sequence of 32 tokens is longer than the model's s = 16" in length
