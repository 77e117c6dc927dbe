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
    # BEGIN SOLUTION: the N - 1 steps of the ring
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
    # BEGIN SOLUTION: the N - 1 steps of the ring
    right, left = (rank + 1) % N, (rank - 1) % N
    for j in range(N - 1):
        sent, received = chunks[(rank - j) % N], chunks[(rank - j - 1) % N]
        p2p.wait_all([p2p.isend(sent, right), p2p.irecv(received, left)])
    # END SOLUTION
    return tensor


def ring_all_reduce(tensor):
    """Ring all-reduce, in place: afterwards every rank's ``tensor`` holds the element-wise
    sum of all ranks' tensors, like ``dist.all_reduce(tensor)``. Returns ``tensor``.

    Traffic: 2 (N - 1) messages of one chunk each, 2 (N - 1)/N of the tensor's bytes when N
    divides numel, whatever N is. Gathering every rank's whole tensor and summing locally
    gives the same numbers but sends N - 1 whole tensors: the grader checks the bytes.
    """
    # BEGIN SOLUTION: reduce-scatter, then all-gather
    ring_reduce_scatter(tensor)
    ring_all_gather(tensor)
    # END SOLUTION
    return tensor


# BEGIN HINTS
HINTS = {
    "ring_reduce_scatter": (
        """
        Follow one chunk around the ring. For rank r to end with the whole sum of chunk r,
        chunk r has to visit every other rank first, one step to the right at a time, each
        rank adding its own copy, and reach rank r last. Where must chunk r start, and where
        is it after step j?
        """,
        """
        Chunk c starts at rank c + 1 and moves one rank to the right per step; after N - 1
        steps it arrives, complete, at rank c. So at step j = 0, ..., N - 2 rank r

        - sends chunk (r - j - 1) mod N to rank (r + 1) mod N, and
        - receives chunk (r - j - 2) mod N from rank (r - 1) mod N and adds it into its own
          copy of that chunk.

        From step 1 on, the chunk a rank sends is the one it added into at the step before.
        Every rank sends at once: with the blocking p2p.send every rank would wait for a
        receive that no rank has posted. Post both together: p2p.isend and p2p.irecv, then
        p2p.wait_all on the two requests.
        """,
        """
        chunks = ring_chunks(tensor)
        incoming = torch.empty_like(chunks[0])           # chunk 0 is the largest
        for j in range(N - 1):
            received = chunks[(r - j - 2) % N]
            buffer = incoming[: received.numel()]        # this chunk's length
            isend chunks[(r - j - 1) % N] to the right, irecv buffer from the left, wait_all
            received += buffer
        return r

        Receive into a separate buffer and add it: receiving straight into the chunk would
        overwrite your own term. The buffer must have the received chunk's length (the first
        numel % N chunks are one element longer); a wrong length makes gloo abort the rank.
        """,
    ),
    "ring_all_gather": (
        """
        Rank r starts with one correct chunk, its own chunk r. At every step each rank passes
        one chunk to its right neighbour: which chunk should rank r pass at the first step,
        and which at the step after?
        """,
        """
        At step 0 rank r sends its own chunk r; from then on it forwards the chunk it
        received at the step before. So at step j = 0, ..., N - 2 rank r sends chunk
        (r - j) mod N to rank (r + 1) mod N and receives chunk (r - j - 1) mod N from rank
        (r - 1) mod N. Nothing is added here: the received chunk is written over the old one.
        Post the send and the receive together (p2p.isend, p2p.irecv, p2p.wait_all).
        """,
        """
        chunks = ring_chunks(tensor)
        for j in range(N - 1):
            isend chunks[(r - j) % N] to (r + 1) % N
            irecv straight into chunks[(r - j - 1) % N] from (r - 1) % N
            wait_all on both
        return tensor
        """,
    ),
    "ring_all_reduce": (
        """
        You have written both halves of it already.
        """,
        """
        The ring reduce-scatter leaves rank r with chunk r summed over all ranks; the ring
        all-gather then copies every rank's owned chunk to every rank. Together: every chunk,
        summed, everywhere.
        """,
        """
        ring_reduce_scatter(tensor)
        ring_all_gather(tensor)
        return tensor

        Anything that exchanges whole tensors gets the right numbers and loses the traffic
        points: a ring sends one chunk per message.
        """,
    ),
}
# END HINTS
