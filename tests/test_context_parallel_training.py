"""parlab.context_parallel's GPT trained on a cp x dp mesh (each rank its zig-zag positions of
its replica's sequences, the attention's K/V from the cp group, every gradient summed over
the dp x cp ranks, then Adam) gives one process's losses over 4 Adam steps and its gradients
of the first step: cp = 2 x dp = 2 and cp = 4 on 4 ranks, cp = 4 x dp = 2 on 8 ranks, with
each of the three attentions (ring, all-gather, Ulysses).

The band (``parlab.numerics``) is measured in the same run. The reference is
``parlab.gpt.train_in_one_process`` on the full batch. The yardstick is the same training in
one process computed as the ranks compute it, written apart from the package's code (a bug
there must not widen the band), once per ring order of the N = dp cp ranks:

- the gradient in N parts, one per rank: the mean loss of replica i_dp's sequences at cp
  rank r's zig-zag positions, summed in the ring's order, divided by N
  (``backward_in_shards``; ranks sum their token losses over B s instead, which differs
  from it by powers of two only here, B s and N being powers of two);
- the attention blockwise, as ring attention computes it: each rank's queries against each
  rank's keys in the ring's order (r, r - 1, ...), only what the causal mask leaves, the
  blocks merged by log-sum-exp (``blockwise_attention``): the online softmax rounds
  otherwise than one softmax over the whole row, and Adam amplifies such differences over
  the steps.

The ranks group the sums otherwise still (a weight's gradient is summed over a rank's
positions of the activations, where the yardstick sums over the positions of its loss), and
Ulysses attends with SDPA over a/cp heads rather than blockwise: both are rounding of the
same size, which the band's factor 2 and floor cover (the test prints nothing; a failure
gives the difference, the band and its parts). Also: the bytes each rank sends in forward and
backward are L attentions' ``bytes_per_rank``, and a learner's mistakes get sentences."""

import functools
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import parlab
from parlab import trace
from parlab.context_parallel import (
    ATTENTION,
    METHODS,
    ContextParallelTrainer,
    bytes_per_rank,
    ring_sources,
    zigzag_indices,
)
from parlab.gpt import GPT, GPTConfig, batches, train_in_one_process
from parlab.numerics import assert_equivalent, backward_in_shards, max_abs_difference, ring_orders, rounding_band
from parlab.processes_vs_threads import _one_intra_op_thread as one_thread

CONFIG = GPTConfig(V=64, s=16, h=32, a=4, L=2)  # s a multiple of 2 cp for cp = 2 and 4; a of cp for Ulysses
B, STEPS, LR = 8, 4, 1e-2


def train_on_mesh(dp, cp, methods):
    """On every rank, for each method: (the full batch's mean loss before each step, this
    rank's summed gradients of step 1 by name)."""
    results = {}
    with parlab.Mesh(dp=dp, cp=cp) as mesh:
        for method in methods:
            torch.manual_seed(0)  # the GPT of train_in_one_process
            trainer = ContextParallelTrainer(GPT(CONFIG), mesh, ATTENTION[method], lr=LR)
            losses, gradients = [], None
            for i, (tokens, targets) in enumerate(batches(B, CONFIG.s, STEPS, seed=1)):
                losses.append(trainer.step(tokens, targets, keep_gradients=i == 0))
                gradients = gradients or trainer.gradients
            total = torch.tensor(losses, dtype=torch.float64)
            dist.all_reduce(total)  # each rank's share of the mean
            results[method] = total.float(), gradients
    return results


def blockwise_attention(q, k, v, cp):
    """Causal attention of q, k, v (b, a, s, h/a) computed as cp ranks holding zig-zag
    positions compute it with ring attention: rank r's queries against rank src's keys for
    src = r, r - 1, ... (mod cp), each block only where some key is visible, merged by
    log-sum-exp."""
    s = q.shape[2]
    outs, held = [], []
    for r in range(cp):
        positions = zigzag_indices(s, cp, r)
        q_r = q[:, :, positions]
        out, lse = torch.zeros_like(q_r), torch.full(q_r.shape[:3], -math.inf)
        for src in ring_sources(r, cp):
            keys = zigzag_indices(s, cp, src)
            visible = keys[None, :] <= positions[:, None]  # (queries, keys)
            rows, cols = visible.any(1).nonzero()[:, 0], visible.any(0).nonzero()[:, 0]
            if not len(rows):
                continue
            scores = q_r[:, :, rows] @ k[:, :, keys[cols]].transpose(-2, -1) / q.shape[-1] ** 0.5
            scores = scores.masked_fill(~visible[rows][:, cols], -math.inf)
            block_out = torch.zeros_like(out).index_copy(2, rows, torch.softmax(scores, -1) @ v[:, :, keys[cols]])
            block_lse = torch.full_like(lse, -math.inf).index_copy(2, rows, torch.logsumexp(scores, -1))
            merged = torch.logaddexp(lse, block_lse)
            out = (lse - merged).exp()[..., None] * out + (block_lse - merged).exp()[..., None] * block_out
            lse = merged
        outs.append(out)
        held.append(positions)
    return torch.zeros_like(q).index_copy(2, torch.cat(held), torch.cat(outs, 2))


class BlockwiseSelfAttention(nn.Module):
    """The GPT's attention layer (its query, key, value and proj) attending blockwise."""

    def __init__(self, layer, cp):
        super().__init__()
        self.query, self.key, self.value, self.proj = layer.query, layer.key, layer.value, layer.proj
        self.head_size, self.cp = layer.head_size, cp

    def forward(self, n):
        b, s, h = n.shape
        q, k, v = (layer(n).view(b, s, -1, self.head_size).transpose(1, 2) for layer in (self.query, self.key,
                                                                                        self.value))
        return self.proj(blockwise_attention(q, k, v, self.cp).transpose(1, 2).reshape(b, s, h))


# The one-process runs take one thread, as each rank of a cluster on a 2-core machine does: the
# tiny model's kernels gain nothing from more, and on a loaded 2-core machine OpenMP's threads
# wait on each other (a yardstick's run took 42 s on two threads, 2.5 s on one).
@functools.cache
def one_process():
    """(losses, gradients of step 1) of the GPT on the full batch in one process."""
    with one_thread():
        return train_in_one_process(CONFIG, batches(B, CONFIG.s, STEPS, seed=1), LR)


@functools.cache
def as_the_ranks_compute(dp, cp, order):
    """The yardstick's run (module docstring): the GPT in one process, attention blockwise
    over cp, each gradient in dp cp parts (replica, cp rank) summed in ``order``."""
    torch.manual_seed(0)
    model = GPT(CONFIG)
    for block in model.blocks:
        block.attention = BlockwiseSelfAttention(block.attention, cp)
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)

    def part_loss(tokens, targets, r):
        positions = zigzag_indices(CONFIG.s, cp, r)
        return F.cross_entropy(model(tokens)[:, positions].flatten(0, 1), targets[:, positions].flatten())

    losses, first = [], None
    with one_thread():
        for tokens, targets in batches(B, CONFIG.s, STEPS, seed=1):
            with torch.no_grad():
                losses.append(model.loss(tokens, targets))
            parts = [(x, y, r) for x, y in zip(tokens.tensor_split(dp), targets.tensor_split(dp)) for r in range(cp)]
            backward_in_shards(part_loss, model.parameters(), parts, order)
            first = first or {name: p.grad.clone() for name, p in model.named_parameters()}
            optimizer.step()
    return torch.stack(losses), first


def assert_like_one_process(cluster, dp, cp, methods=METHODS):
    losses, gradients = one_process()
    yardstick = [as_the_ranks_compute(dp, cp, tuple(order)) for order in ring_orders(dp * cp)]
    for rank, results in enumerate(cluster.run(train_on_mesh, dp, cp, methods, timeout=240)):
        for method, (parallel_losses, parallel_gradients) in results.items():
            what = f"{method} attention, cp = {cp} x dp = {dp}, rank {rank}"
            assert_equivalent(parallel_losses, losses, [y[0] for y in yardstick], f"{what}: losses")
            assert_equivalent(parallel_gradients, gradients, [y[1] for y in yardstick], f"{what}: gradients of step 1")


@pytest.mark.timeout(300)
def test_cp_2_by_dp_2_trains_like_one_process(cluster4):
    assert_like_one_process(cluster4, dp=2, cp=2)


@pytest.mark.timeout(300)
def test_cp_4_trains_like_one_process(cluster4):
    assert_like_one_process(cluster4, dp=1, cp=4)


@pytest.mark.timeout(300)
def test_cp_4_by_dp_2_trains_like_one_process(cluster8):
    assert_like_one_process(cluster8, dp=2, cp=4, methods=("ring",))


def test_the_band_is_far_below_a_missing_gradient_part():
    """The band of the gradients is rounding: a hundred times below what leaving one replica's
    part out of the sum (a rank missing from the all-reduce) misses by."""
    _, gradients = one_process()
    band, _, _ = rounding_band(gradients, [as_the_ranks_compute(2, 2, tuple(order))[1] for order in ring_orders(4)])
    torch.manual_seed(0)
    model = GPT(CONFIG)
    tokens, targets = batches(B, CONFIG.s, 1, seed=1)[0]
    model.loss(tokens[: B // 2], targets[: B // 2]).backward()  # replica 0's gradient alone
    assert 100 * band < max_abs_difference({name: p.grad for name, p in model.named_parameters()}, gradients)


def traced_step(method):
    with parlab.Mesh(dp=2, cp=2) as mesh:
        torch.manual_seed(0)
        trainer = ContextParallelTrainer(GPT(CONFIG), mesh, ATTENTION[method], lr=LR)
        tokens, targets = batches(B, CONFIG.s, 1, seed=1)[0]
        trainer.step(tokens, targets)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("method", METHODS)
def test_each_rank_sends_L_attentions_bytes_in_its_cp_group(method, cluster4):
    timeline = cluster4.trace(traced_step, method, timeout=60)
    for rank in range(4):
        cp_group = {rank - rank % 2, rank - rank % 2 + 1}  # Mesh(dp=2, cp=2): ranks 2 i_dp + i_cp
        for phase in ("forward", "backward"):
            span = timeline.select(rank=rank, name=phase)[0]
            sends = [ev for ev in timeline.select(rank=rank, kind=trace.COMM) if ev.name in ("send", "isend")
                     and span.start <= ev.start <= span.end]
            expected = CONFIG.L * bytes_per_rank(method, B // 2, CONFIG.s, CONFIG.h, 2, 4, phase)
            assert sum(ev.nbytes for ev in sends) == expected, f"{method}, rank {rank}, {phase}"
            assert {ev.peer for ev in sends} == cp_group - {rank}


def learner_mistakes():
    messages = []
    tokens, targets = batches(B, CONFIG.s, 1, seed=1)[0]
    attempts = [
        lambda mesh: ContextParallelTrainer(GPT(CONFIG), mesh, "ring"),
        lambda mesh: ContextParallelTrainer(GPT(GPTConfig(V=64, s=16, h=32, a=4, L=2, dropout=0.1)), mesh),
        lambda mesh: ContextParallelTrainer(GPT(CONFIG), mesh).step(tokens[:7], targets[:7]),
        lambda mesh: ContextParallelTrainer(GPT(CONFIG), mesh).step(tokens[:, :10], targets[:, :10]),
    ]
    with parlab.Mesh(dp=2, cp=2) as mesh:
        for attempt in attempts:
            try:
                attempt(mesh)
            except ValueError as error:
                messages.append(str(error))
    with parlab.Mesh(pp=2, cp=2) as mesh:
        try:
            ContextParallelTrainer(GPT(CONFIG), mesh)
        except ValueError as error:
            messages.append(str(error))
    return messages


@pytest.mark.timeout(120)
def test_learner_mistakes_say_what_to_change(cluster4):
    with pytest.raises(ValueError, match="mesh must be a parlab.Mesh"):
        ContextParallelTrainer(GPT(CONFIG), (2, 2))
    for messages in cluster4.run(learner_mistakes, timeout=60):
        attention, dropout, batch, sequence, mesh = messages
        assert "attention must be a function such as ring_attention" in attention
        assert "build it with GPTConfig(dropout=0.0)" in dropout
        assert "a batch of 7 sequences does not split over dp = 2 replicas" in batch
        assert "zigzag split cuts s = 10 positions into 2 cp = 4 chunks" in sequence
        assert "this mesh has pp = 2: build it with dp, cp and tp only" in mesh
