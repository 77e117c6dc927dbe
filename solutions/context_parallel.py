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
    # BEGIN SOLUTION: the merged lse with the max taken out, then each output weighted
    m = torch.maximum(lse_a, lse_b)  # (b, a, n)
    lse = m + torch.log(torch.exp(lse_a - m) + torch.exp(lse_b - m))
    out = torch.exp(lse_a - lse)[..., None] * out_a + torch.exp(lse_b - lse)[..., None] * out_b
    return out, lse
    # END SOLUTION


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
    # BEGIN SOLUTION: the own block, then cp - 1 passes, each block merged in
    out, lse = attention_block(q, k, v, masked=causal)  # (b, a, s/cp, h/a), (b, a, s/cp)
    for i in range(1, cp):
        k, v = pass_kv(k, v, group)
        src = (r - i) % cp  # whose block this rank holds now
        if causal and src > r:
            continue  # above the diagonal: every key comes after every query
        out, lse = merge_partial(out, lse, *attention_block(q, k, v))
    # END SOLUTION
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
    # BEGIN SOLUTION: chunk r, then chunk 2 cp - 1 - r
    n = s // (2 * cp)  # positions per chunk
    head, tail = rank, 2 * cp - 1 - rank
    return torch.cat([torch.arange(head * n, (head + 1) * n), torch.arange(tail * n, (tail + 1) * n)])
    # END SOLUTION


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


# BEGIN HINTS
HINTS = {
    "merge_partial": (
        """
        Each partial out is already normalised over its own keys. To get the softmax over
        A and B together, each one's weight must be its share of the total normaliser:
        exp(lse_a) out of exp(lse_a) + exp(lse_b).
        """,
        """
        m = the element-wise max of lse_a and lse_b (torch.maximum). Then
        lse = m + log(exp(lse_a - m) + exp(lse_b - m)): the same number as
        log(exp(lse_a) + exp(lse_b)), but every exponent is <= 0, so nothing overflows.
        The weights exp(lse_a - lse) and exp(lse_b - lse) sum to 1. lse has one value per
        query, (b, a, n); out has h/a more: add a last dimension ([..., None]) to multiply.
        """,
        """
        m = torch.maximum(lse_a, lse_b)
        lse = m + torch.log(torch.exp(lse_a - m) + torch.exp(lse_b - m))
        out = torch.exp(lse_a - lse)[..., None] * out_a + (the same for b)
        return out, lse

        Averaging the two outputs is right only when both sets of keys weigh the same;
        exp(lse_a) alone, without "- lse", is not normalised at all.
        """,
    ),
    "ring_attention_forward": (
        """
        Start with the block you hold: your own keys. Then, cp - 1 times, pass the block on
        and merge the one that arrives into your running result.
        """,
        """
        out, lse = attention_block(q, k, v, masked=causal) covers your own block (the
        diagonal one). Then for i = 1 .. cp - 1: k, v = pass_kv(k, v, group); the block now
        came from src = (r - i) mod cp; merge attention_block(q, k, v) into (out, lse) with
        merge_partial. Causal: the blocks of ranks after you (src > r) are all above the
        diagonal: do not merge them, but do pass them on, or your right neighbour waits
        forever. Take r and cp from the group (dist.get_rank(group)), not the world.
        """,
        """
        out, lse = attention_block(q, k, v, masked=causal)
        for i in range(1, cp):
            k, v = pass_kv(k, v, group)
            src = (r - i) % cp
            if causal and src > r: continue
            out, lse = merge_partial(out, lse, *attention_block(q, k, v))
        return out
        """,
    ),
    "zigzag_indices": (
        """
        Cut the sequence into 2 cp chunks and deal them out from both ends: rank 0 gets the
        first and the last, rank 1 the second and the second to last, and so on.
        """,
        """
        n = s // (2 cp) positions per chunk. Chunk c is positions c n .. (c + 1) n - 1.
        Rank r holds chunk r (its head) and chunk 2 cp - 1 - r (its tail), head first.
        Chunk cp + r would be a strided split, whose causal work still grows with r.
        """,
        """
        head, tail = rank, 2 * cp - 1 - rank
        torch.cat([torch.arange(head * n, (head + 1) * n), torch.arange(tail * n, (tail + 1) * n)])
        """,
    ),
}
# END HINTS
