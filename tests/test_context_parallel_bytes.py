"""The traffic of context parallelism, counted from the trace: the bytes each rank sends in
forward and in backward equal ``bytes_per_rank`` for every method at cp = 2 (two groups of 2
ranks, every message inside its group) and cp = 4; and ring attention posts each K/V
exchange before it computes the block it holds and waits for it after, so the message
travels while the block is computed (an ordering read from the trace, not a timing)."""

import pytest
import torch
import torch.distributed as dist

from parlab import trace
from parlab.context_parallel import ATTENTION, METHODS, bytes_per_rank, shard_sequence

B, A, S, HEAD = 2, 4, 16, 8
GROUPS_OF_2 = [[0, 1], [2, 3]]
SENDS = ("send", "isend")


def group_of(cp):
    """This rank's group of cp ranks: the world for cp = 4, its half for cp = 2."""
    if cp == dist.get_world_size():
        return None
    groups = [dist.new_group(ranks) for ranks in GROUPS_OF_2]  # every rank makes every group
    return groups[dist.get_rank() // 2]


def traced_attention(method, cp, causal, split):
    group = group_of(cp)
    r = dist.get_rank(group)
    generator = torch.Generator().manual_seed(0)
    q, k, v, grad_out = (shard_sequence(torch.randn(B, A, S, HEAD, generator=generator), cp, r, split)
                         for _ in range(4))
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    with trace.span("forward"):
        out = ATTENTION[method](q, k, v, causal=causal, split=split, group=group)
    with trace.span("backward"):
        out.backward(grad_out)


def sent_in(timeline, rank, span):
    """The sends of ``rank`` that start inside its span named ``span``."""
    window = timeline.select(rank=rank, kind=trace.COMPUTE, name=span)[0]
    return [ev for ev in timeline.events if ev.rank == rank and ev.kind == trace.COMM and ev.name in SENDS
            and window.start <= ev.start <= window.end]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("method", METHODS)
def test_each_rank_sends_the_bytes_of_the_formula(method, cp, cluster4):
    timeline = cluster4.trace(traced_attention, method, cp, True, "zigzag", timeout=120)
    for rank in range(4):
        members = GROUPS_OF_2[rank // 2] if cp == 2 else range(4)
        for phase in ("forward", "backward"):
            sends = sent_in(timeline, rank, phase)
            assert sum(ev.nbytes for ev in sends) == bytes_per_rank(method, B, S, A * HEAD, cp, 4, phase), (
                f"{method}, cp = {cp}, rank {rank}, {phase}")
            assert {ev.peer for ev in sends} <= set(members) - {rank}  # every message inside the group
    assert sum(timeline.bytes_sent()) == sum(timeline.bytes_received())


@pytest.mark.timeout(120)
def test_ring_attention_posts_each_exchange_before_the_block_it_overlaps(cluster4):
    cp = 4
    timeline = cluster4.trace(traced_attention, "ring", cp, False, "contiguous", timeout=60)
    for rank in range(cp):
        forward = timeline.select(rank=rank, name="forward")[0]
        blocks = [ev for ev in timeline.select(rank=rank, name="attention") if ev.start < forward.end]
        sends = [ev for ev in timeline.select(rank=rank, name="isend") if forward.start <= ev.start <= forward.end]
        assert len(blocks) == cp and len(sends) == cp - 1  # non-causal: every block, cp - 1 hops
        for send, block in zip(sends, blocks):  # step i: posted before block i starts, done after it ends
            assert send.start <= block.start and block.end <= send.end
