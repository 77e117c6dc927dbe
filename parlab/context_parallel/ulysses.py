"""DeepSpeed-Ulysses (Jacobs et al. 2023): trade the sequence split for a head split, attend
as one process would, and trade back.

    rank r:  q, k, v (b, a, s/cp, h/a)          all heads, its positions
    all-to-all [q, k, v]: heads out, positions in  -> (3, b, a/cp, s, h/a)   a/cp heads, every position
    ordinary attention (torch's scaled_dot_product_attention) on the whole sequence
    all-to-all out: positions out, heads in        -> (b, a, s/cp, h/a)
    backward: autograd, the two all-to-alls' backward being all-to-alls the other way

Heads are independent, so once a rank holds every position of a/cp heads nothing else is
needed: a must be a multiple of cp (so cp <= a). With the zig-zag split the gathered
positions arrive in the ranks' order and are put in sequence order before attending.

Bytes sent per rank (b s h / cp elements is one rank's Q, K or V): an all-to-all of x sends
(cp - 1)/cp of it, so forward (Q, K, V in, out back) 4 (cp - 1) b s h / cp^2 elements, and
backward (dO in, dQ, dK, dV back) the same: cp times less than the ring's, and falling with
cp. Memory beyond Q, K, V, out: Q, K, V and out of a/cp heads, 4 b s h / cp elements, and the
attention of a/cp heads over all s positions (b a s^2 / cp scores unless the kernel is blocked).
"""

import torch
import torch.nn.functional as F

from parlab.context_parallel.communication import all_to_all, place_in_cp_group
from parlab.context_parallel.splits import check_shards, reassembly_order


def ulysses_attention(q, k, v, causal=False, split="contiguous", group=None, scale=None):
    """Attention of this rank's queries over the whole sequence, by two all-to-alls.

    q, k, v: this rank's positions under ``split`` ("contiguous" or "zigzag", ``splits``),
    (b, a, s/cp, h/a), cp the size of ``group`` (default: the world), a a multiple of cp.
    Returns this rank's positions of softmax(Q K^T x scale) V, (b, a, s/cp, h/a), as
    torch.nn.functional.scaled_dot_product_attention on the whole sequence gives them.
    """
    _, cp = place_in_cp_group(group)
    _, a, _, _ = check_shards(q, k, v, cp, split)
    if a % cp:
        raise ValueError(f"Ulysses gives each rank a/cp heads, but a = {a} heads do not split over cp = {cp} ranks: "
                         f"choose a multiple of {cp} heads, or ring attention, which splits any number of heads.")
    qkv = all_to_all(torch.stack([q, k, v]), scatter_dim=2, gather_dim=3, group=group)  # (3, b, a/cp, s, h/a)
    s = qkv.shape[3]
    order = reassembly_order(s, cp, split).to(qkv.device)  # the ranks' positions in rank order -> in sequence order
    q, k, v = qkv.index_select(3, order).unbind(0)  # each (b, a/cp, s, h/a)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)  # (b, a/cp, s, h/a)
    out = out.index_select(2, torch.argsort(order))  # back to the ranks' order
    return all_to_all(out, scatter_dim=2, gather_dim=1, group=group)  # (b, a, s/cp, h/a)
