"""The butterfly all-reduce: recursive halving, then recursive doubling, in 2 log2 N rounds
that move as many bytes as the ring's 2 (N - 1) steps."""

import torch.distributed as dist

from parlab import p2p
from parlab.collectives._common import _average, _exchange, _reduce, _scratch
from parlab.collectives.ring import _prepare, chunk_bounds


def butterfly_all_reduce(tensor, op="sum", check=True):
    """Butterfly all-reduce: recursive halving (a reduce-scatter), then recursive doubling
    (an all-gather), log2 N rounds each. Returns ``tensor``.

    Halving: in the round at distance d = N/2, N/4, ..., 1, rank r and its partner r XOR d
    split the chunks they are responsible for in two; each keeps one half, sends the other
    and reduces the partner's copy of the kept half into its own. Rank r ends owning chunk r
    of N. Doubling replays the rounds backwards (d = 1, 2, ..., N/2), swapping owned halves.
    Time 2 log2(N) alpha + 2 (N - 1)/N D beta.

    N not a power of two: with P the largest power of two below N, rank P + i first folds
    its tensor into rank i, ranks 0..P-1 run the butterfly, and rank i sends the result back
    (unfold): 2 log2(P) alpha + 2 (P - 1)/P D beta + 2 (alpha + D beta).
    """
    flat, op = _prepare("butterfly_all_reduce", tensor, op, None, check)
    rank, N = dist.get_rank(), dist.get_world_size()
    P = 1 << (N.bit_length() - 1)
    if rank >= P:  # an extra rank: fold into rank - P, wait for the unfold
        p2p.send(flat, rank - P)
        p2p.recv(flat, rank - P)
        return tensor
    if rank + P < N:
        _reduce(op, flat, p2p.recv(_scratch(flat, flat.numel()), rank + P))

    bounds = chunk_bounds(flat.numel(), P)
    incoming = _scratch(flat, bounds[P // 2][0])  # the first half is the largest
    lo, hi = 0, P  # the chunks [lo, hi) this rank is responsible for
    distance = P // 2
    while distance >= 1:  # recursive halving
        partner, mid = rank ^ distance, (lo + hi) // 2
        keep, give = ((mid, hi), (lo, mid)) if rank & distance else ((lo, mid), (mid, hi))
        kept = _span(flat, bounds, *keep)
        buffer = incoming[: kept.numel()]
        _exchange(_span(flat, bounds, *give), partner, buffer, partner)
        _reduce(op, kept, buffer)
        (lo, hi), distance = keep, distance // 2
    _average(op, _span(flat, bounds, lo, hi), N)

    distance = 1
    while distance < P:  # recursive doubling: the partner owns the sibling range
        partner, width = rank ^ distance, hi - lo
        sibling = (lo - width, lo) if rank & distance else (hi, hi + width)
        _exchange(_span(flat, bounds, lo, hi), partner, _span(flat, bounds, *sibling), partner)
        lo, hi, distance = min(lo, sibling[0]), max(hi, sibling[1]), distance * 2

    if rank + P < N:
        p2p.send(flat, rank + P)
    return tensor


def _span(flat, bounds, lo, hi):
    """The chunks lo..hi-1 of ``flat`` (``bounds`` from ``chunk_bounds``), as one view."""
    return flat[bounds[lo][0] : bounds[hi - 1][1]]
