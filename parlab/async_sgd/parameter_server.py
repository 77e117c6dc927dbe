"""Asynchronous SGD through a parameter server: workers never wait for each other.

    log = parameter_server(weights, gradient, lr=0.1, updates=100, servers=(0,))   # on every rank

Server ranks hold the weights w (``servers``; with several, the s-th holds chunk s of the
flat weights, ``chunk_bounds(d, len(servers))``: sharded by key range). The N_w other ranks
are workers:

    worker: receive w (from every server) -> g = gradient(w, step) -> push g -> receive w ...
    server: take the next gradient from whichever worker pushed one -> w <- w - gamma g ->
            reply to that worker with the new w

A server applies each gradient the moment it arrives, so a worker that computed on the
weights of version v may see its gradient applied at version v + tau: tau, the staleness,
is recorded for every applied gradient (``ServerLog.staleness``; the worker learns its own
from the reply, ``WorkerLog.staleness``). Fast workers push more often; nobody waits for the
straggler; the price is tau (see ``theory.stability_threshold``).

Options. ``order="cyclic"`` serves the workers in turn instead of as they arrive: with N_w
workers every gradient then has tau = N_w - 1 after the first N_w (a forced delay, for the
stability experiment). ``bound=tau_max`` is bounded staleness (stale synchronous parallel):
a worker more than tau_max pushes ahead of the slowest active worker gets its reply only
when the slowest catches up.

Stopping. Server 0 counts its applied gradients; from ``updates`` on it answers each push
with the weights and "stop" (every push is applied, so up to N_w - 1 more than ``updates`` are:
those already on their way). A stopped worker tells the other servers it leaves; a server
ends when all its workers have left. Every message posted is received, so nothing is left
in flight for the next call.

Receiving "from any worker": a server posts one receive per worker and polls them
(``messages.Inbox``). Traffic per applied gradient: d elements up and d down (plus 2 or 3 counters), all of
it through the servers: a server moves 2 N_w d / len(servers) per round of N_w pushes, where a ring
all-reduce moves 2 (N - 1)/N d per rank whatever N is.
"""

import time
from collections import deque
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from parlab import p2p
from parlab._checks import real_number, whole_number
from parlab.async_sgd.messages import GRADIENT, LEAVE, Inbox, finish_sent, push, reply
from parlab.collectives import chunk_bounds
from parlab.runtime import emulation


@dataclass
class ServerLog:
    """What one server did: the staleness tau and the worker of each applied gradient, in
    the order applied, and its shard of the weights at the end; with ``record``, the
    perf_counter time and a copy of the shard after each applied gradient (``history``)."""

    weights: torch.Tensor
    staleness: list = field(default_factory=list)
    workers: list = field(default_factory=list)
    history: list = field(default_factory=list)

    def periods(self):
        """{worker: its mean seconds between two of its applied gradients}, its period from
        pull to push as the server saw it (needs ``record``, and two gradients per worker)."""
        if len(self.history) != len(self.workers):
            raise ValueError("periods need the time of every update: run the server with record=True.")
        times = {}
        for worker, (seconds, _) in zip(self.workers, self.history):
            times.setdefault(worker, []).append(seconds)
        return {w: (t[-1] - t[0]) / (len(t) - 1) for w, t in sorted(times.items()) if len(t) > 1}


@dataclass
class WorkerLog:
    """What one worker did: the staleness of each of its pushes (as server 0 applied it),
    and the weights of its last reply."""

    weights: torch.Tensor
    staleness: list = field(default_factory=list)

    @property
    def steps(self):
        return len(self.staleness)


def parameter_server(weights, gradient, lr, updates, servers=(0,), order="arrival", bound=None, seconds=0.0,
                     record=False):
    """Asynchronous SGD on every rank: ranks in ``servers`` serve, the others work.

    weights: the initial flat weights (d,), the same on every rank (servers take their shard).
    gradient(w, step) -> g (d,): a worker's gradient at w, its ``step``-th (0, 1, ...).
    seconds: declared compute time of one gradient (``emulation.compute``, scaled by the
    cluster's emulated devices). record: servers keep (time, weights) after every update.
    Returns a ``ServerLog`` on a server, a ``WorkerLog`` on a worker.
    """
    rank, N = dist.get_rank(), dist.get_world_size()
    servers = sorted(set(servers))
    if not servers or not all(isinstance(s, int) and 0 <= s < N for s in servers) or len(servers) >= N:
        raise ValueError(f"servers must name 1 to N - 1 = {N - 1} ranks (the others work), got {list(servers)}.")
    if order not in ("arrival", "cyclic"):
        raise ValueError(f'order must be "arrival" (as gradients come) or "cyclic" (workers in turn), got {order!r}.')
    if bound is not None:
        whole_number("bound (tau_max, pushes ahead of the slowest)", bound, "e.g. bound=2, or None.", minimum=0)
    real_number("lr (gamma)", lr, "e.g. lr=0.1.")
    whole_number("updates", updates, "e.g. updates=100 applied gradients.")
    flat = weights.detach().reshape(-1)
    workers = [r for r in range(N) if r not in servers]
    bounds = chunk_bounds(flat.numel(), len(servers))
    if rank in servers:
        s = servers.index(rank)
        lo, hi = bounds[s]
        return serve(flat[lo:hi].clone(), workers, lr, updates if s == 0 else None, order, bound, record)
    return work(gradient, servers, bounds, flat.dtype, seconds)


def serve(shard, workers, lr, updates=None, order="arrival", bound=None, record=False):
    """Serve ``shard`` to ``workers`` until all have left (see the module's docstring).
    ``updates``: this server decides when workers stop (server 0); None: another one does."""
    log = ServerLog(shard)
    version, clocks, held = 0, dict.fromkeys(workers, 0), []
    queue = deque(workers)  # who may push next: all of them, or (cyclic) the one in front
    sends = [p2p.isend(reply(shard, version, 0), w) for w in workers]
    inbox = Inbox(workers, shard.numel() + 2, shard.dtype)
    while queue or held:
        worker, message = inbox.take([queue[0]] if order == "cyclic" else list(queue))
        queue.remove(worker)
        if message[-1] == GRADIENT:  # apply at once: it was computed at version message[-2]
            tau = version - int(message[-2])
            log.staleness.append(tau)
            log.workers.append(worker)
            shard.add_(message[:-2], alpha=-lr)
            version += 1
            clocks[worker] += 1
            held.append((worker, tau))
            if record:
                log.history.append((time.perf_counter(), shard.clone()))
        stop = updates is not None and version >= updates
        for w, tau in list(held):
            slowest = min(clocks[a] for a in (*queue, *dict(held)))
            if stop or bound is None or clocks[w] - slowest <= bound:
                held.remove((w, tau))
                sends.append(p2p.isend(reply(shard, version, stop, tau), w))
                if not stop:
                    queue.append(w)
                    inbox.listen(w)
        sends = finish_sent(sends)
    p2p.wait_all(sends)
    return log


def work(gradient, servers, bounds, dtype, seconds=0.0):
    """A worker: pull, compute, push, until server ``servers[0]`` says stop."""
    weights = torch.empty(bounds[-1][1], dtype=dtype)
    replies = [torch.empty(hi - lo + 3, dtype=dtype) for lo, hi in bounds]
    versions = _receive_weights(weights, servers, bounds, replies)
    log = WorkerLog(weights)
    while True:
        g = gradient(weights.clone(), log.steps).reshape(-1).to(dtype)
        emulation.compute(seconds, log.steps)
        pushes = [p2p.isend(push(g[lo:hi], version, GRADIENT), s) for s, (lo, hi), version in
                  zip(servers, bounds, versions)]
        versions = _receive_weights(weights, servers, bounds, replies)
        p2p.wait_all(pushes)
        log.staleness.append(int(replies[0][-1]))
        if replies[0][-2] == 1:  # stop: the other servers learn that this worker leaves
            p2p.wait_all([p2p.isend(push(torch.zeros(hi - lo, dtype=dtype), 0, LEAVE), s)
                          for s, (lo, hi) in zip(servers[1:], bounds[1:])])
            return log


def _receive_weights(weights, servers, bounds, replies):
    """Receive each server's shard into ``weights``; returns the shards' versions."""
    for s, (lo, hi), message in zip(servers, bounds, replies):
        p2p.recv(message, s)
        weights[lo:hi] = message[:-3]
    return [int(message[-3]) for message in replies]
