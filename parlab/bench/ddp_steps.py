"""Measuring DDP steps: what lecture 02 and ``parlab bench ddp`` time, and how.

    time_single_process_step(build_model, make_batch)            compute alone: forward, backward, optimizer
    measure_compute(cluster, build_model, make_batch)            the same on every rank at once, the slowest
    measure_ddp_steps(cluster, build_model, make_batch, configs)  DDP step time per variant and bucket cap
    predicted_steps(rows, model, timing, N_d, link)              the overlap model's, for the same configs
    emulated_mlp(width, depth, backward_s)                       a model of emulated devices (declared times)

A step is forward + backward + gradient synchronisation + ``optimizer.step()`` (``timed_step``);
the ranks start each step together (a barrier, not timed) and a step lasts as long as its
slowest rank. ``time_single_process_step`` gives the compute that
``parlab.ddp.predict_step`` puts beside the communication.
"""

import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

from parlab import runtime, trace
from parlab._checks import real_number, whole_number
from parlab.bench import synchronise
from parlab.ddp import DDP, VARIANTS, predict_step, trainable_parameters
from parlab.emulated import SleepLayer

SEED = 0
EMULATED_BATCH = 4  # samples per rank: the declared times are the compute, the real part stays small


def timed_step(wrapped, optimizer, inputs, targets, loss_fn=nn.functional.mse_loss):
    """One SGD step of ``wrapped`` (parlab's DDP or torch's) and its seconds on this rank. The
    ranks start it together (a barrier, not timed); traced, it is a "step" span holding
    "forward" (parlab's DDP marks it), "backward" and "optimizer"."""
    synchronise(inputs.device)
    dist.barrier()
    start = time.perf_counter()
    with trace.span("step"):
        optimizer.zero_grad()
        loss = loss_fn(wrapped(inputs), targets)
        with trace.span("backward"):
            loss.backward()
        if isinstance(wrapped, DDP):
            wrapped.finish_gradient_synchronization()
        with trace.span("optimizer"):
            optimizer.step()
        synchronise(inputs.device)
    return time.perf_counter() - start


def slowest_rank(seconds):
    """Lists of step times on this rank -> the same lists with each step the slowest rank's."""
    per_step = torch.tensor(seconds, dtype=torch.float64)
    dist.all_reduce(per_step, op=dist.ReduceOp.MAX)
    return per_step.tolist()


def time_single_process_step(build_model, make_batch, loss_fn=nn.functional.mse_loss, lr=0.01, repeats=5):
    """Time one SGD step of ``build_model()`` on ``make_batch(rank)`` (rank 0 outside a process
    group) in this process, without any communication: the median over ``repeats`` (after
    one warm-up step) of the forward, backward and optimizer seconds, and of each trainable
    parameter's gradient-ready time (seconds after the start of backward, registration
    order, from post-accumulate-grad hooks). Returns a dict with ``forward``, ``backward``,
    ``optimizer``, ``parameter_ready``: the ``timing`` of ``parlab.ddp.predict_step``."""
    whole_number("repeats", repeats, "time at least one step, e.g. repeats=5.")
    model = build_model()
    inputs, targets = make_batch(dist.get_rank() if dist.is_initialized() else 0)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    parameters = [p for _, p in trainable_parameters(model)]
    ready = [0.0] * len(parameters)
    for index, p in enumerate(parameters):
        p.register_post_accumulate_grad_hook(lambda _, index=index: ready.__setitem__(index, time.perf_counter()))
    samples = []
    for _ in range(repeats + 1):
        optimizer.zero_grad()
        t0 = time.perf_counter()
        loss = loss_fn(model(inputs), targets)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        optimizer.step()
        t3 = time.perf_counter()
        samples.append((t1 - t0, t2 - t1, t3 - t2, [t - t1 for t in ready]))
    samples = samples[1:]
    median = statistics.median
    return dict(forward=median(s[0] for s in samples), backward=median(s[1] for s in samples),
                optimizer=median(s[2] for s in samples),
                parameter_ready=[median(s[3][i] for s in samples) for i in range(len(parameters))])


def measure_compute(cluster, build_model, make_batch, repeats=5):
    """``time_single_process_step`` on every rank of ``cluster`` at once (the ranks share the
    machine as in training), the slowest rank's: each time the maximum over ranks."""
    per_rank = cluster.run(time_single_process_step, build_model, make_batch, repeats=repeats)
    slowest = {key: max(rank[key] for rank in per_rank) for key in ("forward", "backward", "optimizer")}
    slowest["parameter_ready"] = [max(times) for times in zip(*(rank["parameter_ready"] for rank in per_rank))]
    return slowest


def measure_ddp_steps(cluster, build_model, make_batch, configs, steps=5):
    """Measured DDP step time of each config on ``cluster``: a config is a variant name
    ("flat") or ``(variant, bucket_cap_mb)`` (("bucketed", 1.0)).

    For each config every rank wraps a fresh ``build_model()``, takes one warm-up step and
    then ``steps`` timed SGD steps on its batch ``make_batch(rank)`` (``timed_step``); a
    step lasts as long as its slowest rank. Returns one row per config: a dict with
    ``variant``, ``bucket_cap_mb`` (None: the variant's own), ``buckets`` (their number),
    ``median_s`` (the median step), ``seconds`` (every step) and ``timeline`` (the traced
    events of the last step, ``Timeline.window``)."""
    configs = [(config, None) if isinstance(config, str) else tuple(config) for config in configs]
    if not configs:
        raise ValueError("configs lists the DDP variants to measure, e.g. ['flat', ('bucketed', 1.0)]: give at "
                         "least one.")
    for variant, cap in configs:
        if variant not in VARIANTS:
            raise ValueError(f"each config's variant must be one of {', '.join(map(repr, VARIANTS))}, got "
                             f"{variant!r}: e.g. ('bucketed', 1.0).")
        if cap is not None:
            real_number("bucket_cap_mb", cap, "give a bucket size in MiB, e.g. ('bucketed', 1.0).", above=True)
    whole_number("steps", steps, "time at least one step per config, e.g. steps=5.")
    timeline = cluster.trace(time_ddp_steps, build_model, make_batch, configs, steps)
    rows = []
    for index, ((variant, cap), (buckets, seconds)) in enumerate(zip(configs, timeline.results[0])):
        rows.append(dict(variant=variant, bucket_cap_mb=cap, buckets=buckets, median_s=statistics.median(seconds),
                         seconds=seconds, timeline=timeline.window("step", (index + 1) * (steps + 1) - 1)))
    return rows


def predicted_steps(rows, model, timing, N_d, link):
    """The overlap model's step time (``parlab.ddp.predict_step``) for each row of
    ``measure_ddp_steps`` (its variant and cap), on N_d ranks joined by ``link`` (a
    ``parlab.Link``: alpha = its latency, beta = 1 / its bandwidth), with ``timing`` from
    ``measure_compute``."""
    # A cap of None is DDP's default, 25 MiB (naive, flat and overlapped have caps of their own).
    return [predict_step(model, timing, N_d, link.latency, 1 / link.bandwidth, row["variant"],
                         25 if row["bucket_cap_mb"] is None else row["bucket_cap_mb"]) for row in rows]


def time_ddp_steps(build_model, make_batch, configs, steps, lr=0.01):
    """On every rank: for each ``(variant, bucket_cap_mb)`` (None: DDP's default cap), one
    warm-up and ``steps`` timed steps of a fresh ``DDP(build_model(), variant, ...)``.
    Returns ``[(buckets, [seconds of each step, the slowest rank's])]``, the same on every rank."""
    device = runtime.device()
    inputs, targets = (tensor.to(device) for tensor in make_batch(dist.get_rank()))
    buckets, seconds = [], []
    for variant, cap in configs:
        model = build_model().to(device)
        ddp = DDP(model, variant) if cap is None else DDP(model, variant, bucket_cap_mb=cap)
        optimizer = torch.optim.SGD(model.parameters(), lr=lr)
        times = [timed_step(ddp, optimizer, inputs, targets) for _ in range(1 + steps)]
        buckets.append(len(ddp.buckets))
        seconds.append(times[1:])
    return list(zip(buckets, slowest_rank(seconds)))


def emulated_mlp(width, depth, backward_s, forward_s=None):
    """An MLP of emulated devices: ``depth`` times a bias-free ``Linear(width, width)``
    followed by ``SleepLayer(forward_s, backward_s)`` (``forward_s`` defaults to half of
    ``backward_s``: a backward costs about two forwards). Each layer's gradient (4 width^2
    bytes) is ready once its sleep layer has slept ``backward_s``; the sleep layers' scalar
    weights are frozen, so DDP averages the Linear weights only. The same on every rank."""
    torch.manual_seed(SEED)
    layers = []
    for _ in range(depth):
        sleep = SleepLayer(backward_s / 2 if forward_s is None else forward_s, backward_s)
        sleep.weight.requires_grad_(False)
        layers += [nn.Linear(width, width, bias=False), sleep]
    return nn.Sequential(*layers)


def emulated_batch(width, rank):
    """Rank ``rank``'s (inputs, targets) for ``emulated_mlp``: ``EMULATED_BATCH`` samples."""
    generator = torch.Generator().manual_seed(SEED + rank)
    return torch.randn(EMULATED_BATCH, width, generator=generator), torch.randn(EMULATED_BATCH, width,
                                                                                 generator=generator)
