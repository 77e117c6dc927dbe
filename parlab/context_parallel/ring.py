"""Ring attention (Liu, Zaharia and Abbeel 2023): the keys and values travel round the ring
of cp ranks while each rank computes its queries against the block it holds.

    forward, step i = 0 .. cp - 1: rank r holds the K/V block of rank src = r - i (mod cp)
        post   isend(block -> r + 1), irecv(next block <- r - 1)    the wire works ...
        attend block_task(r, src): merge into the running (out, lse)  ... while the rank computes
        wait   for the exchange (none after the last step)
    backward, step i: the same ring of K/V blocks, and dK, dV of block src travelling with it
        post   the K/V exchange, and irecv(dK, dV of block src so far <- r - 1)
        recompute the block's probabilities from the saved lse; dQ += this block's part
        add this rank's part to block src's dK, dV; isend(-> r + 1)
    after the last step block r + 1's dK, dV go home: rank r receives its own from r - 1.

Bytes sent per rank (b s h / cp elements is one rank's Q, K or V): forward cp - 1 K/V blocks,
2 (cp - 1) b s h / cp elements; backward cp - 1 K/V blocks and cp dK/dV blocks,
2 (2 cp - 1) b s h / cp. Memory beyond Q, K, V, out: two K/V blocks (the one computed, the one
arriving), 4 b s h / cp elements, the scores of one block b a (s/cp)^2, and lse, b a s/cp;
backward adds the dK/dV blocks in flight, 4 b s h / cp more.
"""

import torch

from parlab import p2p, trace
from parlab.context_parallel.blocks import accumulate, attention_block_backward
from parlab.context_parallel.communication import place_in_cp_group, ring_neighbours
from parlab.context_parallel.splits import block_task, check_shards, ring_sources

KV_TAG, GRAD_TAG = 1, 2  # the two streams of backward share a link: tags keep them apart


def ring_attention(q, k, v, causal=False, split="contiguous", group=None, scale=None):
    """Attention of this rank's queries over the whole sequence, K/V passed round the ring.

    q, k, v: this rank's positions under ``split`` ("contiguous" or "zigzag", ``splits``),
    (b, a, s/cp, h/a), cp the size of ``group`` (default: the world). causal: query i sees
    keys j <= i only; blocks above the diagonal are skipped (``block_task``). Returns this
    rank's positions of softmax(Q K^T x scale) V, (b, a, s/cp, h/a), as
    torch.nn.functional.scaled_dot_product_attention on the whole sequence gives them.
    Backward is the ring backward of the module docstring: distributed, recomputing each block.
    """
    _, cp = place_in_cp_group(group)
    check_shards(q, k, v, cp, split)
    return _RingAttention.apply(q, k, v, causal, split, group, scale)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, split, group, scale):
        r, cp = place_in_cp_group(group)
        right, left = ring_neighbours(group, r, cp)
        block = torch.stack([k, v])  # (2, b, a, s/cp, h/a): one message a step
        out = lse = None
        for i, src in enumerate(ring_sources(r, cp)):
            if i < cp - 1:  # post the next block's exchange first, so it travels while this one is computed
                arriving = torch.empty_like(block)
                exchange = [p2p.isend(block, right, KV_TAG), p2p.irecv(arriving, left, KV_TAG)]
            task = block_task(r, src, cp, split, causal)
            if task is not None:  # step 0, the rank's own block, always covers every row
                with trace.span("attention"):
                    out, lse = accumulate(out, lse, task, q, block[0], block[1], scale)
            if i < cp - 1:
                p2p.wait_all(exchange)
                block = arriving
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.split, ctx.group, ctx.scale = causal, split, group, scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        r, cp = place_in_cp_group(ctx.group)
        right, left = ring_neighbours(ctx.group, r, cp)
        delta = (grad_out * out).sum(-1)  # D = rowsum(dO * O), (b, a, s/cp)
        grad_q = torch.zeros_like(q)
        block = torch.stack([k, v])
        grads, sent = torch.zeros_like(block), None  # dK, dV of the block held, so far
        for i, src in enumerate(ring_sources(r, cp)):
            if i < cp - 1:
                arriving = torch.empty_like(block)
                exchange = [p2p.isend(block, right, KV_TAG), p2p.irecv(arriving, left, KV_TAG)]
            if i > 0:  # block src's dK, dV, summed by the ranks that held it before this one
                grads_in = p2p.irecv(torch.empty_like(block), left, GRAD_TAG)
            task = block_task(r, src, cp, ctx.split, ctx.causal)
            if task is not None:
                with trace.span("attention backward"):
                    part_q, part_k, part_v = attention_block_backward(
                        task, q, block[0], block[1], lse, delta, grad_out, ctx.scale)
            if i > 0:
                grads = grads_in.wait()
            if task is not None:
                rows, keys = task.query_rows(q.shape[2]), task.key_rows(q.shape[2])
                grad_q[:, :, rows] += part_q
                grads[0][:, :, keys] += part_k
                grads[1][:, :, keys] += part_v
            if cp > 1:  # on to the next holder of block src; after the last step, home to rank src
                if sent is not None:
                    sent.wait()
                sent = p2p.isend(grads, right, GRAD_TAG)
            if i < cp - 1:
                p2p.wait_all(exchange)
                block = arriving
        if cp > 1:
            grads = p2p.irecv(torch.empty_like(block), left, GRAD_TAG).wait()  # this rank's block, from all
            sent.wait()
        return grad_q, grads[0], grads[1], None, None, None, None
