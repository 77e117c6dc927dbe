# Generated from solutions/async_sgd.py by `python -m parlab.course.exercises build`.
# Write your code where it raises NotImplementedError, then run `parlab grade async_sgd`.
# parlab-generated sha256=ae8bf661ffdf3833d2f2e4629a2ba024819e924ffb7aa53c244cfa5e38a737cc
"""Exercise: gossip on a ring, a parameter-server worker that records staleness, and backup
workers' aggregation (lecture 06).

Three ways to pay less for synchronisation than an all-reduce of every gradient:

- gossip (D-PSGD): each rank averages with its ring neighbours only,
  x_r <- (x_{r-1} + x_r + x_{r+1}) / 3 - gamma g_r, two messages per step whatever N is;
- a parameter server: workers push gradients and pull weights without waiting for each
  other; a gradient computed on version v of the weights and applied at version v + tau has
  staleness tau;
- backup workers: run N + e workers, use the first N gradients of each step, drop the rest.

Talk only through ``parlab.p2p`` (``send``, ``recv``, ``isend``, ``irecv``, ``wait_all``), so
that the grader's trace sees your messages (neighbours with r - 1 and r + 1 taken mod N).

Stuck? ``parlab.hint("async_sgd.gossip_ring_step")`` in a notebook (or ``parlab hint
async_sgd.gossip_ring_step`` in a terminal) opens a hint, one level at a time. Grade your work
with ``parlab grade async_sgd`` (or ``parlab.check("async_sgd.gossip_ring_step")``).
"""

import torch
import torch.distributed as dist

from parlab import p2p

GRADIENT = 0.0  # the kind of a push message (the server also knows LEAVE = 1.0)


def gossip_ring_step(x, gradient=None, lr=0.0):
    """One gossip step on a ring of the N ranks of the default group, in place on this rank's
    1-D tensor ``x``, and return it:

        x_r <- (x_{r-1} + x_r + x_{r+1}) / 3 - lr * gradient(x_r)

    with the neighbours' x as they were BEFORE this step, r - 1 and r + 1 taken mod N. Start
    the exchanges before calling ``gradient(x)`` (when one is given) so that they overlap
    it. At N = 2 both neighbours are the same rank: send it one message and count its value
    twice. Each rank sends one message to each distinct neighbour per step, no more.
    """
    raise NotImplementedError("gossip_ring_step is not implemented yet: exchange with both neighbours, overlap the gradient, average")


def parameter_server_worker(gradient, numel, dtype=torch.float64, server=0):
    """The worker's loop of asynchronous SGD against the parameter server on rank ``server``
    (``parlab.async_sgd.parameter_server.serve``). Returns the list of the staleness tau of
    each of this worker's gradients, in order.

    Messages (every one a 1-D tensor of ``dtype``):
      - from the server, first the weights and then one reply per push:
        [w (numel), version, stop, tau], where ``version`` counts the gradients applied so
        far, ``stop`` is 1.0 when this worker must stop, and ``tau`` is the staleness the
        server gave the gradient it answers (0 in the first message);
      - to the server, one push per gradient: [g (numel), v, GRADIENT], with v the version
        of the weights g was computed at.

    Loop: receive the weights; then compute g = gradient(w, step) (step = 0, 1, ... this
    worker's count), push it, receive the reply (the newest weights), record tau, and stop
    after the reply whose ``stop`` is 1.0. Check tau: the server applies each gradient as it
    arrives, so it must equal (the reply's version - 1) - v.
    """
    raise NotImplementedError("parameter_server_worker is not implemented yet: pull, compute, push, record tau, until told to stop")


def first_n_average(arrivals, N, step):
    """Backup workers' aggregation at the server for step ``step``.

    ``arrivals``: the gradients in the order they arrived, as (worker, computed_at, g)
    tuples, where ``computed_at`` is the step whose weights g was computed at. Late
    gradients of earlier steps are among them and must be dropped. Use the first ``N``
    gradients computed at ``step``; return (their mean, the sorted list of their workers),
    the sum taken in ascending worker order (so that it is reproducible). Raise ValueError
    if fewer than N gradients of ``step`` arrived.
    """
    raise NotImplementedError("first_n_average is not implemented yet: keep this step's gradients, the first N, summed in worker order")
