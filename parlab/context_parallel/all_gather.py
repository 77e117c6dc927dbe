"""Context parallelism by all-gathering the keys and values: every rank gets all of K and V,
then attends with its own queries, as one process would.

    rank r:  q, k, v (b, a, s/cp, h/a)                 its positions of the sequence
    all-gather [k, v]        -> (cp, 2, b, a, s/cp, h/a)  every rank's block, in rank order
    for src = r, r - 1, ..., r + 1 (mod cp):            the ring's order, so both methods add alike
        accumulate block_task(r, src)                  skipped above the diagonal (causal)
    backward: autograd through the blocks; dK, dV reduce-scattered home (``gather_blocks``)

Bytes sent per rank (b s h / cp elements is one rank's Q, K or V): forward, a ring all-gather
of K and V, 2 (cp - 1) b s h / cp elements; backward, a ring reduce-scatter of dK and dV, the
same. Memory beyond Q, K, V, out: the gathered K and V, 2 b s h elements (cp times one rank's
share: what context parallelism set out to cut), and for backward autograd keeps the
probabilities of every block computed, b a (s/cp)^2 elements a block pair, up to b a s^2 / cp.
The same bytes as ring attention's forward, but sent before any compute: nothing overlaps.
"""

import torch

from parlab import trace
from parlab.context_parallel.blocks import accumulate
from parlab.context_parallel.communication import gather_blocks, place_in_cp_group
from parlab.context_parallel.splits import block_task, check_shards, ring_sources


def all_gather_attention(q, k, v, causal=False, split="contiguous", group=None, scale=None):
    """Attention of this rank's queries over the whole sequence, from all-gathered K and V.

    q, k, v: this rank's positions under ``split`` ("contiguous" or "zigzag", ``splits``),
    (b, a, s/cp, h/a), cp the size of ``group`` (default: the world). causal: query i sees
    keys j <= i only; blocks above the diagonal are skipped (``block_task``). Returns this
    rank's positions of softmax(Q K^T x scale) V, (b, a, s/cp, h/a), as
    torch.nn.functional.scaled_dot_product_attention on the whole sequence gives them.
    """
    r, cp = place_in_cp_group(group)
    check_shards(q, k, v, cp, split)
    blocks = gather_blocks(torch.stack([k, v]), group)  # (cp, 2, b, a, s/cp, h/a)
    out = lse = None
    for src in ring_sources(r, cp):
        task = block_task(r, src, cp, split, causal)
        if task is not None:  # the first, the rank's own block, always covers every row
            with trace.span("attention"):
                out, lse = accumulate(out, lse, task, q, blocks[src, 0], blocks[src, 1], scale)
    return out
