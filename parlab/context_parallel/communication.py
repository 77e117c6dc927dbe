"""The collectives of context parallelism, as autograd functions, all inside ``group``:

    operator             forward                                backward
    gather_blocks        all-gather of every rank's K/V block   reduce-scatter of dK, dV
    all_to_all           piece j of x to rank j, pieces joined  all-to-all back (dims swapped)

Both talk through parlab's traced point-to-point layer: the all-gather and reduce-scatter are
``parlab.collectives``' rings, the all-to-all its ``all_to_all`` (ring shifts: at step
j = 1 .. cp - 1 rank r sends piece r + j to rank r + j and receives piece r from rank r - j),
so ``cluster.trace`` counts every byte and an emulated link shapes every message. gloo's own
``dist.all_to_all_single`` works on CPU too (torch 2.13), but bypasses both.
"""

import torch

from parlab import collectives, trace
from parlab._checks import place_in
from parlab.collectives import ring_all_gather, ring_reduce_scatter
from parlab.p2p import global_rank


def place_in_cp_group(group):
    """(r, cp): this rank's place in ``group`` and its size; a ValueError on a rank outside it."""
    return place_in(group, "call the attention on every rank of its group (e.g. mesh.group(\"cp\")), passing "
                           "that group.")


def ring_neighbours(group, r, cp):
    """(right, left): the global ranks of group ranks r + 1 and r - 1 (mod cp)."""
    return global_rank(group, r + 1), global_rank(group, r - 1)


def gather_blocks(block, group=None):
    """Every rank's ``block`` (any shape, the same on every rank) stacked in group-rank order:
    (cp, *block.shape). Ring all-gather: each rank sends (cp - 1) x block.numel() elements.
    Backward: the gradient reduce-scattered, each rank keeping the sum of its own block's."""
    return _GatherBlocks.apply(block, group)


def all_to_all(x, scatter_dim, gather_dim, group=None):
    """``x`` cut into cp equal pieces along ``scatter_dim``: piece j goes to group rank j, and
    the pieces received from ranks 0 .. cp - 1 are joined along ``gather_dim``. Each rank
    sends cp - 1 pieces, (cp - 1)/cp x x.numel() elements. Backward: the gradient's all-to-all
    with the two dims swapped."""
    return _AllToAll.apply(x, scatter_dim, gather_dim, group)


class _GatherBlocks(torch.autograd.Function):
    @staticmethod
    def forward(ctx, block, group):
        r, cp = place_in_cp_group(group)
        ctx.group, ctx.r = group, r
        blocks = torch.empty((cp, *block.shape), dtype=block.dtype, device=block.device)
        blocks[r] = block  # rank r starts owning chunk r of the flat tensor, as the ring all-gather expects
        with trace.span("all-gather"):
            ring_all_gather(blocks, check=False, group=group)
        return blocks

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()  # (cp, *block.shape): every rank's part of every block's gradient
        with trace.span("reduce-scatter"):
            ring_reduce_scatter(grad, check=False, group=ctx.group)
        return grad[ctx.r].clone(), None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scatter_dim, gather_dim, group):
        ctx.dims, ctx.group = (scatter_dim, gather_dim), group
        return _exchange_pieces(x, scatter_dim, gather_dim, group)

    @staticmethod
    def backward(ctx, grad):
        scatter_dim, gather_dim = ctx.dims
        return _exchange_pieces(grad, gather_dim, scatter_dim, ctx.group), None, None, None


def _exchange_pieces(x, scatter_dim, gather_dim, group):
    _, cp = place_in_cp_group(group)
    if x.shape[scatter_dim] % cp:
        raise ValueError(f"an all-to-all cuts dim {scatter_dim} of a {tuple(x.shape)} tensor into cp = {cp} equal "
                         f"pieces: make that size a multiple of {cp}.")
    pieces = torch.stack(x.chunk(cp, scatter_dim))  # (cp, *piece): piece j for rank j
    with trace.span("all-to-all"):
        received = collectives.all_to_all(pieces, group=group)  # (cp, *piece): row i from rank i
    return torch.cat(received.unbind(0), gather_dim)
