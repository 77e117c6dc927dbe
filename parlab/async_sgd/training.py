"""Sync, async, local and gossip SGD on one problem, under one regime: loss against steps
and wall time (lecture 06's training curves and ``parlab bench async``).

    problem = LeastSquares(d=32, seconds=0.02)
    curve = cluster.run(train, "gossip", problem, steps=24)    # then curve_of(...) in the parent

The problem: least squares, f(w) = (1/2m) ||A w - y||^2 on batches of m samples that each
rank draws from its own generator (seeded by rank and step), y = A w* + noise; every
gradient takes ``seconds`` of declared compute (``emulation.compute``, so the cluster's
emulated devices make some steps straggle). Each computing rank takes ``steps`` gradients:

- sync: all N ranks compute, then average their gradients (parlab's ring all-reduce), step;
- async: rank 0 is a parameter server, the N - 1 others push gradients as they finish
  (N - 1 workers, so (N - 1) x steps gradients: the report counts them);
- local: local steps, the replicas averaged every H steps (``PeriodicAverager``);
- gossip: one D-PSGD step on the ring per gradient (``gossip_step``), exchanges overlapping it.

Every rank returns its records (perf_counter time, weights) after each of its steps (the
async server after each update); ``curve_of`` turns them into (seconds from the start, loss
at the mean of the replicas) in the parent.
"""

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from parlab import collectives, trace
from parlab._checks import whole_number
from parlab.async_sgd import gossip, local_sgd, parameter_server
from parlab.runtime import emulation

METHODS = ("sync", "async", "local", "gossip")
HELD_OUT_SEED = 2**31 - 1  # no rank's batch: ranks draw seeds 10_000 rank + step


@dataclass(frozen=True)
class LeastSquares:
    """d weights, m samples per batch, noise of standard deviation ``noise``, ``seconds`` of
    declared compute per gradient, learning rate ``lr`` (gamma)."""

    d: int = 32
    m: int = 16
    noise: float = 0.1
    seconds: float = 0.02
    lr: float = 0.05

    def target(self):
        return torch.linspace(-1, 1, self.d, dtype=torch.float64)  # w*

    def batch(self, seed):
        generator = torch.Generator().manual_seed(seed)
        A = torch.randn(self.m, self.d, generator=generator, dtype=torch.float64)  # (m, d)
        return A, A @ self.target() + self.noise * torch.randn(self.m, generator=generator, dtype=torch.float64)

    def gradient(self, w, rank, step):
        """(1/m) A^T (A w - y) on rank ``rank``'s batch ``step``; takes ``seconds`` of declared compute."""
        A, y = self.batch(10_000 * rank + step)
        with trace.span("gradient"):
            emulation.compute(self.seconds, step)
        return A.T @ (A @ w - y) / self.m

    def loss(self, w):
        """f at w on a held-out batch of 1024 samples."""
        A, y = LeastSquares(self.d, 1024, self.noise).batch(HELD_OUT_SEED)
        return (0.5 * (A @ w - y).pow(2).mean()).item()


def train(method, problem, steps, period=4):
    """Run ``method`` (one of ``METHODS``) on every rank; returns this rank's records
    [(perf_counter time, weights)], the first at the start (``period`` = H for local SGD)."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {', '.join(METHODS)}; got {method!r}.")
    steps = whole_number("steps", steps, "e.g. steps=24 gradients per computing rank.")
    rank, N = dist.get_rank(), dist.get_world_size()
    w = torch.zeros(problem.d, dtype=torch.float64)
    dist.barrier()  # a common start (not part of any method, not shaped)
    records = [(time.perf_counter(), w.clone())]
    if method == "async":
        if N < 2:
            raise ValueError("async needs a server and a worker: run it on 2 ranks or more.")
        log = parameter_server.parameter_server(w, lambda v, step: problem.gradient(v, rank, step), problem.lr,
                                                (N - 1) * steps, record=True)
        return records + log.history if rank == 0 else []
    averager = local_sgd.PeriodicAverager(period, warmup_steps=period - 1)  # averages after steps H, 2H, ...
    ring = gossip.ring(N)
    for step in range(steps):
        with trace.span("step"):
            _step(method, problem, w, rank, step, ring, averager)
        records.append((time.perf_counter(), w.clone()))
    return records


def _step(method, problem, w, rank, step, ring, averager):
    if method == "gossip":
        gossip.gossip_step(w, ring, lambda v: problem.gradient(v, rank, step), problem.lr)
        return
    g = problem.gradient(w, rank, step)
    if method == "sync":
        collectives.ring_all_reduce(g, op="avg", check=False)
    w -= problem.lr * g
    if method == "local":
        averager.average_parameters([w])


def time_exchange(kind, numel, repeats):
    """Seconds per call on this rank, the mean of ``repeats`` after one warm-up, of one ring
    all-reduce (``kind`` "ring") or one gossip mixing step on the ring ("gossip", no
    gradient) of ``numel`` float32 values."""
    if kind not in ("ring", "gossip"):
        raise ValueError(f'kind must be "ring" or "gossip", got {kind!r}.')
    x, ring = torch.ones(numel), gossip.ring(dist.get_world_size())

    def once():
        if kind == "ring":
            collectives.ring_all_reduce(x, check=False)
        else:
            gossip.gossip_step(x, ring)

    once()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(repeats):
        once()
    return (time.perf_counter() - start) / repeats


def longest_waits(step):
    """Where each rank waited longest in ``step`` (a Timeline of one step, e.g.
    ``timeline.window("step")``): [(rank, op, k, peer, seconds)], k counting that rank's events
    of that op in the step from 1. An event's wait is the part of it after the rank's previous
    communication event ended: a ring step posts a send, receives, then waits for the send, so
    a send that completed during the receive does not count the receive's wait again."""
    waits = []
    for rank in range(step.world_size):
        events = step.select(rank=rank, kind=trace.COMM)
        waited = _waited(events)
        if waited:
            longest = max(events, key=waited.get)
            k = [ev for ev in events if ev.name == longest.name].index(longest) + 1
            waits.append((rank, longest.name, k, longest.peer, waited[longest]))
    return waits


def waited_before(step, moment):
    """Each rank's total wait (as ``longest_waits`` counts it) in the communication events of
    ``step`` that it started before ``moment`` (seconds on the timeline): a list by rank."""
    return [sum(seconds for ev, seconds in _waited(step.select(rank=rank, kind=trace.COMM)).items()
                if ev.start < moment) for rank in range(step.world_size)]


def _waited(events):
    """{event: the part of it after the rank's previous communication event ended}."""
    waited, previous_end = {}, float("-inf")
    for ev in sorted(events, key=lambda ev: ev.end):
        waited[ev] = ev.end - max(ev.start, previous_end)
        previous_end = ev.end
    return waited


def curve_of(results, problem):
    """From every rank's records: [(seconds since the start, step, loss at the mean of the
    replicas)]; a step's time is the last rank's (the async server's own records)."""
    per_rank = [records for records in results if records]
    start = min(records[0][0] for records in per_rank)
    curve = []
    for step, row in enumerate(zip(*per_rank)):
        mean = torch.stack([w for _, w in row]).mean(0)
        curve.append((max(t for t, _ in row) - start, step, problem.loss(mean)))
    return curve
