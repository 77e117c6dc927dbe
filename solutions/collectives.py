"""Exercise: ring all-reduce, built from a ring reduce-scatter and a ring all-gather.

Write the three functions below using only parlab's traced point-to-point calls,
``p2p.send``/``p2p.recv`` (blocking) and ``p2p.isend``/``p2p.irecv`` (return a request to
``wait()`` on; ``p2p.wait_all(requests)`` waits for a list). No ``torch.distributed``
collectives: the grader counts the bytes every rank sends.

The ring. N ranks sit on a ring: rank r sends to its right neighbour (r + 1) mod N and
receives from its left neighbour (r - 1) mod N. Sum is the only reduction.

Chunks. Each function works in place on the flat view of a contiguous tensor of any length
and shape, cut into N chunks as even as possible: with numel elements, every chunk has
numel // N elements and the first numel % N chunks one more (``chunk_bounds`` below;
chunks may be empty when numel < N). ``ring_chunks(tensor)`` returns the N chunks as views:
writing into a chunk writes into the tensor.

Ownership. After ``ring_reduce_scatter`` rank r owns chunk r: that chunk holds the sum over
all ranks, as chunk r of ``torch.distributed.reduce_scatter``. ``ring_all_gather`` starts
from this ownership.

Deadlock. ``p2p.send`` waits for the matching ``recv``: if every rank sends first, every
rank waits forever. Post the receive and the send together (``irecv`` + ``isend``, then
``wait_all``), and the grader's timeout stays out of your way.

Grade your work with ``python -m parlab.grade collectives`` (or
``parlab.check("collectives.ring_reduce_scatter")`` in a notebook).
"""

import torch
import torch.distributed as dist

from parlab import p2p


def ring_reduce_scatter(tensor):
    """Ring reduce-scatter, in place: afterwards rank r owns chunk r, which holds the sum of
    that chunk over all ranks. Returns that chunk's index, r.

    N - 1 steps. At step j = 0, 1, ..., N - 2 rank r

    - sends chunk (r - j - 1) mod N to rank (r + 1) mod N, and
    - receives chunk (r - j - 2) mod N from rank (r - 1) mod N and adds it into its own
      chunk (r - j - 2) mod N (receive into a separate buffer, then add).

    From step 1 on, the chunk a rank sends is the one it added into at the step before, so
    each chunk travels around the ring collecting one term per rank. The other chunks hold
    partial sums afterwards (nobody should read them).

    Traffic: N - 1 messages of one chunk each; every chunk except the owned one, (N - 1)/N
    of the tensor's bytes when N divides numel.
    """
    rank, N = dist.get_rank(), dist.get_world_size()
    chunks = ring_chunks(tensor)
    # BEGIN SOLUTION: write the N - 1 ring steps of the docstring
    right, left = (rank + 1) % N, (rank - 1) % N
    incoming = torch.empty_like(chunks[0])  # chunk 0 is the largest
    for j in range(N - 1):
        received = chunks[(rank - j - 2) % N]
        buffer = incoming[: received.numel()]
        p2p.wait_all([p2p.isend(chunks[(rank - j - 1) % N], right), p2p.irecv(buffer, left)])
        received += buffer
    # END SOLUTION
    return rank


def ring_all_gather(tensor):
    """Ring all-gather, in place: starting with rank r holding the correct chunk r (what
    ``ring_reduce_scatter`` leaves), afterwards every rank holds every chunk: rank k's owned
    chunk k, copied to all ranks. Returns ``tensor``.

    N - 1 steps. At step j = 0, 1, ..., N - 2 rank r

    - sends chunk (r - j) mod N to rank (r + 1) mod N, and
    - receives chunk (r - j - 1) mod N from rank (r - 1) mod N, straight into that chunk.

    At step 0 a rank sends the chunk it owns; afterwards it forwards the chunk it received
    at the step before. What a rank's other chunks held before the call does not matter.

    Traffic: N - 1 messages of one chunk each; every chunk except (r + 1) mod N, (N - 1)/N
    of the tensor's bytes when N divides numel.
    """
    rank, N = dist.get_rank(), dist.get_world_size()
    chunks = ring_chunks(tensor)
    # BEGIN SOLUTION: write the N - 1 ring steps of the docstring
    right, left = (rank + 1) % N, (rank - 1) % N
    for j in range(N - 1):
        sent, received = chunks[(rank - j) % N], chunks[(rank - j - 1) % N]
        p2p.wait_all([p2p.isend(sent, right), p2p.irecv(received, left)])
    # END SOLUTION
    return tensor


def ring_allreduce(tensor):
    """Ring all-reduce, in place: afterwards every rank's ``tensor`` holds the element-wise
    sum of all ranks' tensors, like ``dist.all_reduce(tensor)``. Returns ``tensor``.

    A ring reduce-scatter (each rank ends up owning one fully summed chunk) followed by a
    ring all-gather of the owned chunks.

    Traffic: 2 (N - 1) messages of one chunk each, 2 (N - 1)/N of the tensor's bytes when N
    divides numel, whatever N is. Gathering every rank's whole tensor and summing locally
    gives the same numbers but sends N - 1 whole tensors: the grader checks the bytes.
    """
    # BEGIN SOLUTION: call the two functions above
    ring_reduce_scatter(tensor)
    ring_all_gather(tensor)
    # END SOLUTION
    return tensor


def ring_chunks(tensor):
    """The N chunks of ``tensor``'s flat view (N = world size), as views into it."""
    if not tensor.is_contiguous():
        raise ValueError(
            "ring collectives need a contiguous tensor; pass tensor.contiguous() and copy the result back."
        )
    flat = tensor.view(-1)
    return [flat[start:end] for start, end in chunk_bounds(flat.numel(), dist.get_world_size())]


def chunk_bounds(numel, world_size):
    """[(start, end)] of the ``world_size`` chunks of ``numel`` elements: numel // N each,
    and one more for the first numel % N chunks. chunk_bounds(10, 4) is
    [(0, 3), (3, 6), (6, 8), (8, 10)]."""
    base, extra = divmod(numel, world_size)
    bounds, start = [], 0
    for index in range(world_size):
        end = start + base + (1 if index < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds
