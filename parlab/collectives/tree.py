"""Collectives through a root: the naive all-reduce (every rank talks to the root, a tree of
depth one) and the binomial tree's broadcast and reduce, in ceil(log2 N) rounds."""

import torch.distributed as dist

from parlab import p2p
from parlab.collectives._common import _average, _reduce, _scratch
from parlab.collectives.ring import _prepare


def naive_all_reduce(tensor, op="sum", root=0, check=True):
    """All-reduce through one rank: every rank sends its tensor to ``root``, the root reduces
    the N tensors and sends the result back to every rank. Returns ``tensor``, now reduced.

    Traffic: each other rank sends D and receives D; the root receives (N - 1) D and sends
    (N - 1) D, one message at a time: time 2 (N - 1) (alpha + D beta).
    """
    flat, op = _prepare("naive_all_reduce", tensor, op, root, check)
    rank, N = dist.get_rank(), dist.get_world_size()
    if rank != root:
        p2p.send(flat, root)
        p2p.recv(flat, root)
        return tensor
    others = [peer for peer in range(N) if peer != root]
    incoming = _scratch(flat, flat.numel())
    for peer in others:
        _reduce(op, flat, p2p.recv(incoming, peer))
    _average(op, flat, N)
    for peer in others:
        p2p.send(flat, peer)
    return tensor


def tree_broadcast(tensor, root=0, check=True):
    """Binomial-tree broadcast of ``root``'s tensor, in ceil(log2 N) rounds. Returns ``tensor``.

    Number the ranks by distance from the root, v = (r - root) mod N. In the round with
    m = 1, 2, 4, ... the m ranks v < m that hold the data send it to v + m: the number of
    ranks holding it doubles each round. Time ceil(log2 N) (alpha + D beta).
    """
    flat, _ = _prepare("tree_broadcast", tensor, None, root, check)
    rank, N = dist.get_rank(), dist.get_world_size()
    v = (rank - root) % N
    m = 1
    while m < N:
        if v < m and v + m < N:
            p2p.send(flat, (rank + m) % N)
        elif m <= v < 2 * m:
            p2p.recv(flat, (rank - m) % N)
        m *= 2
    return tensor


def tree_reduce(tensor, root=0, op="sum", check=True):
    """Binomial-tree reduce to ``root``, in ceil(log2 N) rounds: the broadcast run backwards.

    With v = (r - root) mod N, in the round with m = 1, 2, 4, ... a rank whose bit m is
    set sends its partial result to v - m and is done; the others receive from v + m (if
    it exists) and reduce. Only the root's tensor holds the result afterwards (like
    ``dist.reduce``); other ranks are left with partial results. Returns ``tensor``.
    """
    flat, op = _prepare("tree_reduce", tensor, op, root, check)
    rank, N = dist.get_rank(), dist.get_world_size()
    v = (rank - root) % N
    incoming = _scratch(flat, flat.numel())
    m = 1
    while m < N:
        if v & m:
            p2p.send(flat, (rank - m) % N)
            return tensor
        if v + m < N:
            _reduce(op, flat, p2p.recv(incoming, (rank + m) % N))
        m *= 2
    _average(op, flat, N)
    return tensor
