# Generated from solutions/collectives.py by `python -m parlab.course.exercises build`.
# Write your code where it raises NotImplementedError, then run `parlab grade collectives`.
# parlab-generated sha256=73de7f0f23a36c7b1ba89ca7ea5d8e8d628b4d6cdc7e467ff8ae258bd1559540
"""Exercise: ring all-reduce, built from a ring reduce-scatter and a ring all-gather.

Write the three functions below with parlab's traced point-to-point calls only:
``p2p.send``/``p2p.recv`` (blocking) and ``p2p.isend``/``p2p.irecv`` (return a request to
``wait()`` on; ``p2p.wait_all(requests)`` waits for a list). No ``torch.distributed``
collectives: the grader counts the bytes every rank sends.

The ring. N ranks sit on a ring: rank r sends only to its right neighbour (r + 1) mod N and
receives only from its left neighbour (r - 1) mod N. Sum is the only reduction.

Chunks. Each function works in place on the flat view of a contiguous tensor of any length
and shape, cut into N chunks as even as possible: numel // N elements each, one more for
the first numel % N; chunks are empty when numel < N. ``ring_chunks(tensor)`` (from
``parlab.collectives``, whose own rings cut the same way) returns the N chunks as views:
writing into a chunk writes into the tensor.

Ownership. After ``ring_reduce_scatter`` rank r owns chunk r: it holds chunk r summed over
all ranks, as ``torch.distributed.reduce_scatter`` gives rank r chunk r.
``ring_all_gather`` starts from this ownership.

Blocking. ``p2p.send`` returns only once its message is received: a rank blocked in a send
does nothing else until its neighbour posts the matching receive.

Stuck? ``parlab.hint("collectives.ring_reduce_scatter")`` in a notebook (or
``parlab hint collectives.ring_reduce_scatter``) opens a hint, one level
at a time. Grade your work with ``parlab grade collectives`` (or
``parlab.check("collectives")`` in a notebook).
"""

import torch
import torch.distributed as dist

from parlab import p2p
from parlab.collectives import ring_chunks


def ring_reduce_scatter(tensor):
    """Ring reduce-scatter, in place: afterwards chunk r of rank r's tensor holds
    sum over k of chunk r of rank k's tensor. Returns r, the index of the chunk it owns.

    N - 1 steps; in each, every rank sends one chunk to its right neighbour and receives one
    chunk from its left neighbour. What the other chunks hold afterwards is not specified
    (partial sums, which nobody reads).

    Traffic: N - 1 messages of one chunk each, every chunk but the owned one: (N - 1)/N of the
    tensor's bytes when N divides numel.
    """
    rank, N = dist.get_rank(), dist.get_world_size()
    chunks = ring_chunks(tensor)
    raise NotImplementedError("ring_reduce_scatter is not implemented yet: the N - 1 steps of the ring")
    return rank


def ring_all_gather(tensor):
    """Ring all-gather, in place: given that chunk r of rank r's tensor is right (what
    ``ring_reduce_scatter`` leaves), afterwards every rank's tensor holds chunk k of rank k's
    tensor, for every k. What a rank's other chunks held before the call does not matter.
    Returns ``tensor``.

    N - 1 steps; in each, every rank sends one chunk to its right neighbour and receives one
    chunk from its left neighbour.

    Traffic: N - 1 messages of one chunk each, every chunk but (r + 1) mod N: (N - 1)/N of the
    tensor's bytes when N divides numel.
    """
    rank, N = dist.get_rank(), dist.get_world_size()
    chunks = ring_chunks(tensor)
    raise NotImplementedError("ring_all_gather is not implemented yet: the N - 1 steps of the ring")
    return tensor


def ring_all_reduce(tensor):
    """Ring all-reduce, in place: afterwards every rank's ``tensor`` holds the element-wise
    sum of all ranks' tensors, like ``dist.all_reduce(tensor)``. Returns ``tensor``.

    Traffic: 2 (N - 1) messages of one chunk each, 2 (N - 1)/N of the tensor's bytes when N
    divides numel, whatever N is. Gathering every rank's whole tensor and summing locally
    gives the same numbers but sends N - 1 whole tensors: the grader checks the bytes.
    """
    raise NotImplementedError("ring_all_reduce is not implemented yet: reduce-scatter, then all-gather")
    return tensor
