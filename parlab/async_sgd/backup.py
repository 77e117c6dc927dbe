"""Synchronous SGD waits for its slowest worker; backup workers stop waiting for the last e.

    log = synchronous_sgd(weights, gradient, lr=0.1, steps=20, use=3)   # on every rank

Rank ``server`` holds the weights w; every other rank is a worker (N + e of them). Each step

    server: send w_k to every worker -> take the first N gradients computed at w_k
            -> w_{k+1} = w_k - gamma (1/N) sum of them (summed in worker order)
    worker: receive w_k -> compute g(w_k) -> push it, unless w_{k+1} arrived first

With ``use`` = N = every worker (e = 0) this is plain synchronous SGD, and a step takes as
long as its slowest worker: one straggler holds everyone. With e backups the step ends at
the N-th gradient; the e late ones are dropped (a late worker abandons its computation when
the next weights arrive, so every step starts together). With i.i.d. exponential compute
times of rate lambda (``exponential_seconds``) a step takes (Hn(N + e) - Hn(e)) / lambda on
average (``theory.expected_step_time``), plus the messages' time. ``SyncLog.used`` says
whose gradients each step used, so a one-process replay reproduces the weights exactly.
"""

import random
import time
from concurrent import futures
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from parlab import p2p
from parlab._checks import rank as check_rank
from parlab._checks import real_number, whole_number
from parlab.async_sgd.messages import GRADIENT, LEAVE, Inbox, arrival, finish_sent, push, reply
from parlab.runtime import emulation


@dataclass
class SyncLog:
    """The server's record: the weights at the end, each step's duration in seconds (from
    sending w_k to having w_{k+1}) and the workers whose gradients it used."""

    weights: torch.Tensor
    step_seconds: list = field(default_factory=list)
    used: list = field(default_factory=list)


@dataclass
class WorkerCounts:
    """A worker's record: gradients pushed, and computations abandoned because the next
    weights arrived first."""

    pushed: int = 0
    abandoned: int = 0


def synchronous_sgd(weights, gradient, lr, steps, use=None, seconds=0.0, server=0, workers=None):
    """Synchronous SGD through rank ``server``, using the first ``use`` gradients of each step
    (default: all workers). gradient(w, step) -> g (d,); ``seconds``: a worker's declared
    compute time per gradient, a number or a function of (step) (e.g. ``exponential_seconds``),
    scaled by the cluster's emulated devices. ``workers``: the ranks that work (default: all
    but the server); any other rank sits the run out and returns None, so one cluster can
    compare N = 2, e = 0 with N = 2, e = 1. Returns a ``SyncLog`` on the server and
    ``WorkerCounts`` on a worker."""
    N = dist.get_world_size()
    server = check_rank("server", server, N, "pick the rank that holds the weights, e.g. 0.")
    if workers is None:
        workers = [r for r in range(N) if r != server]
    workers = sorted({check_rank("a worker", w, N, "name ranks of this cluster.") for w in workers})
    if not workers or server in workers:
        raise ValueError(f"synchronous_sgd needs a server and at least one worker that is not the server (rank "
                         f"{server}): run it on 2 ranks or more, and leave the server out of workers.")
    use = len(workers) if use is None else whole_number(
        "use (N, gradients per step)", use, f"use at most the {len(workers)} workers; e = workers - use are backups.")
    if use > len(workers):
        raise ValueError(f"use = {use} gradients per step needs as many workers; there are {len(workers)}.")
    real_number("lr (gamma)", lr, "e.g. lr=0.1.")
    steps = whole_number("steps", steps, "e.g. steps=20.")
    flat = weights.detach().reshape(-1)
    seconds_of = seconds if callable(seconds) else (lambda step: seconds)
    if dist.get_rank() == server:
        return _serve(flat.clone(), workers, lr, steps, use)
    if dist.get_rank() not in workers:
        return None
    return _work(gradient, server, flat.numel(), flat.dtype, seconds_of)


def _serve(w, workers, lr, steps, use):
    log = SyncLog(w)
    inbox = Inbox(workers, w.numel() + 2, w.dtype)
    sends = []
    for k in range(steps):
        start = time.perf_counter()
        sends += [p2p.isend(reply(w, k, 0), worker) for worker in workers]
        got = {}
        while len(got) < use:  # the first N gradients computed at w_k; late ones are dropped
            worker, message = inbox.take(workers)
            inbox.listen(worker)
            if int(message[-2]) == k:
                got[worker] = message[:-2]
        used = sorted(got)
        w.sub_(_mean([got[worker] for worker in used]), alpha=lr)
        log.step_seconds.append(time.perf_counter() - start)
        log.used.append(used)
        sends = finish_sent(sends)
    sends += [p2p.isend(reply(w, steps, 1), worker) for worker in workers]
    # every worker's last message is LEAVE: receive all it sent before, so nothing stays posted
    staying = list(workers)
    while staying:
        worker, message = inbox.take(staying)
        if message[-1] == LEAVE:
            staying.remove(worker)
        else:
            inbox.listen(worker)
    p2p.wait_all(sends)
    return log


def _work(gradient, server, numel, dtype, seconds_of):
    counts = WorkerCounts()
    current, following = torch.empty(numel + 3, dtype=dtype), torch.empty(numel + 3, dtype=dtype)
    p2p.recv(current, server)
    while current[-2] != 1:
        step = int(current[-3])
        arriving = arrival(p2p.irecv(following, server))  # w_{k+1}: ends this step's computation if first
        g = gradient(current[:-3].clone(), step).reshape(-1).to(dtype)
        if _compute_unless(arriving, seconds_of(step), step):
            p2p.send(push(g, step, GRADIENT), server)
            counts.pushed += 1
        else:
            counts.abandoned += 1
        arriving.result()
        current, following = following, current
    p2p.send(push(torch.zeros(numel, dtype=dtype), 0, LEAVE), server)
    return counts


def _compute_unless(arriving, seconds, step):
    """Emulated compute of ``seconds`` (scaled by this rank's devices at ``step``), given up
    when the future ``arriving`` is done first. Returns whether it finished."""
    deadline = emulation.now() + seconds * emulation.compute_factor(step)
    futures.wait([arriving], timeout=max(deadline - emulation.now(), 0.0))
    if arriving.done():
        return False
    emulation.sleep_until(deadline)
    return True


def _mean(gradients):
    total = gradients[0].clone()
    for g in gradients[1:]:
        total += g
    return total / len(gradients)


def exponential_seconds(rate, seed=0, rank=None):
    """A compute time for ``synchronous_sgd``'s ``seconds``: exponential with ``rate`` lambda
    (mean 1/lambda), drawn i.i.d. per (seed, rank, step), so a run is reproducible. ``rank``:
    whose draws (default: the calling rank's), so the parent can recompute a run's draws."""
    rate = real_number("rate (lambda, per second)", rate, "e.g. rate=50 for a mean of 20 ms.", above=True)

    def seconds(step):
        return random.Random(f"{seed}/{dist.get_rank() if rank is None else rank}/{step}").expovariate(rate)

    return seconds


def drawn_step_seconds(draws, use, steps):
    """The compute part of each of ``steps`` steps that use the first ``use`` gradients of
    workers whose compute times are ``draws`` (one function of the step per worker, e.g.
    ``exponential_seconds(rate, seed, rank=r)``): the use-th smallest draw of each step. Its
    mean over many steps is (Hn(N + e) - Hn(e)) / lambda; over one run it is that run's own
    sample of the order statistic."""
    use = whole_number("use (N, gradients per step)", use, f"use 1 to {len(draws)} workers.")
    if use > len(draws):
        raise ValueError(f"use = {use} gradients per step needs as many workers; there are {len(draws)}.")
    return [sorted(draw(k) for draw in draws)[use - 1] for k in range(steps)]
