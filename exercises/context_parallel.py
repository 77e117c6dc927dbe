# Generated from solutions/context_parallel.py by `python -m parlab.course.exercises build`.
# Write your code where it raises NotImplementedError, then run `parlab grade context_parallel`.
# parlab-generated sha256=fdfb19f0f09d1f2547f3b0cfed2f7956eb2ebb68af7f403199e44640b4520165
"""Exercise: the merge of partial attention results, ring attention's forward, and the
zig-zag split of the sequence (context parallelism).

Context parallelism splits the sequence over the cp ranks of a group: each rank holds the
queries, keys and values of its s/cp positions, (b, a, s/cp, h/a), and must compute its
queries' attention over the keys of the whole sequence.

One block. ``attention_block(q, k, v, masked)`` (from ``parlab.context_parallel``) gives a
block's result as two tensors: out = softmax(S) V and lse = log sum_k exp(S), the softmax's
log-normaliser of each query, with S = Q K^T / sqrt(h/a). ``masked``: the causal mask of a
diagonal block, where queries and keys hold the same positions (query i sees keys 0 .. i).
Two results over disjoint sets of keys hold all that the result over their union needs:
``merge_partial`` writes that merge.

The ring. Rank r of the group starts with its own K/V block. ``pass_kv(k, v, group)``
(below) sends the block a rank holds to its right neighbour r + 1 and returns the block of
its left neighbour r - 1 (mod cp): after i passes rank r holds the block of rank r - i
(mod cp). Every rank of the group must call it the same number of times.

The split. Which positions a rank holds: the contiguous split gives rank r positions
[r s/cp, (r + 1) s/cp); causal attention then gives the last rank cp times the first rank's
work. ``zigzag_indices`` is the split that evens it out.

Stuck? ``parlab.hint("context_parallel.merge_partial")`` in a notebook (or ``parlab hint
context_parallel.merge_partial`` in a terminal) opens a hint, one level at a time. Grade your
work with ``parlab grade context_parallel`` (or ``parlab.check("context_parallel")``).
"""

import torch
import torch.distributed as dist

from parlab import p2p
from parlab.context_parallel import attention_block
from parlab.context_parallel.communication import ring_neighbours


def merge_partial(out_a, lse_a, out_b, lse_b):
    """The attention result over two disjoint sets of keys, A and B, from the results over
    each: out_* (b, a, n, h/a), lse_* (b, a, n), as ``attention_block`` returns them.
    Returns (out, lse) over A and B together, as ``attention_block`` would give them:

        lse = log(exp(lse_a) + exp(lse_b))
        out = exp(lse_a - lse) out_a + exp(lse_b - lse) out_b

    (the online softmax, FlashAttention's inner step). Scores in the hundreds are common
    (long sequences, large activations) and exp(100) is already beyond float32: compute lse
    with the larger of lse_a and lse_b, m, taken out, m + log(exp(lse_a - m) + exp(lse_b - m)),
    so that nothing overflows."""
    raise NotImplementedError("merge_partial is not implemented yet: the merged lse with the max taken out, then each output weighted")


def ring_attention_forward(q, k, v, group=None, causal=False):
    """Ring attention's forward: this rank's queries over the keys of the whole sequence.

    q, k, v: this rank's positions of the queries, keys and values under the contiguous
    split, (b, a, s/cp, h/a), cp the size of ``group`` (None: the world). Returns this
    rank's positions of softmax(Q K^T / sqrt(h/a)) V over the whole sequence,
    (b, a, s/cp, h/a): what torch.nn.functional.scaled_dot_product_attention (with
    ``is_causal=causal``) gives for these positions.

    The K/V blocks go round the ring with ``pass_kv``: cp - 1 passes, one block merged in
    after each with your ``merge_partial``. causal: query i sees keys j <= i only. With the
    contiguous split, rank r's own block is the diagonal one (``masked``), the blocks of
    ranks before it are visible whole, and those of ranks after it lie wholly above the
    diagonal: skip them (but keep passing them on)."""
    r, cp = dist.get_rank(group), dist.get_world_size(group)
    raise NotImplementedError("ring_attention_forward is not implemented yet: the own block, then cp - 1 passes, each block merged in")
    return out


def zigzag_indices(s, cp, rank):
    """The positions rank ``rank`` of cp holds under the zig-zag split, as a 1-D int64 tensor
    in increasing order: the sequence of s positions cut into 2 cp chunks of s/(2 cp)
    consecutive positions, rank r holds chunk r and chunk 2 cp - 1 - r.

        cp = 2, s = 8:   rank 0: [0 1 6 7]   rank 1: [2 3 4 5]

    Every rank then holds one early chunk and one late one: under causal attention each does
    the same work. Raises ValueError when 2 cp does not divide s."""
    if s % (2 * cp):
        raise ValueError(f"the zig-zag split cuts s = {s} positions into 2 cp = {2 * cp} equal chunks: choose s a "
                         f"multiple of {2 * cp}.")
    raise NotImplementedError("zigzag_indices is not implemented yet: chunk r, then chunk 2 cp - 1 - r")


def pass_kv(k, v, group=None):
    """One pass of the ring: send this rank's K/V block (k, v) to its right neighbour in
    ``group`` and return the block of its left neighbour, (k, v) of the same shapes, new
    tensors. One message of 2 k.numel() elements each way, through ``parlab.p2p``."""
    r, cp = dist.get_rank(group), dist.get_world_size(group)
    right, left = ring_neighbours(group, r, cp)
    block = torch.stack([k, v])  # (2, b, a, s/cp, h/a): one message
    arriving = torch.empty_like(block)
    p2p.wait_all([p2p.isend(block, right), p2p.irecv(arriving, left)])
    return arriving[0], arriving[1]
