"""Lecture 05's experiments beside ``parlab bench compression``: signs on a problem where the
ranks disagree, steps of each compressor measured against dense with this machine's noise
beside them, how far training got, where compression stops paying, and what torch's own
hooks do on gloo.

    sign_descent(steps, gamma, method)             signSGD's majority vote, averaged scaled signs, with EF
    compare(cluster, names, steps, ...)            step times over dense's, step by step, and the noise
    initial_loss(), steps_to_reach(row, loss)      where training started, and when a run got somewhere
    progress(rows, start)                          each run's loss drop, and who reached its loss first
    crossover(name, extra_s, N, latency, ...)      the bandwidth above which a compressor stops paying
    torch_hooks_on_gloo()                          torch's DDP comm hooks on CPU and gloo: which run

Symbols as in the glossary: N ranks, gamma the learning rate, d elements of a gradient.
"""

import statistics

import torch
import torch.distributed as dist
from torch import nn

from parlab.bench.compression import COMPRESSORS, EVALUATION_SEED, batches, measure, mlp, predicted_step
from parlab.collectives import ring_all_reduce
from parlab.compression import ErrorFeedback, Identity, ScaledSign, SignSGD
from parlab.runtime.emulation import Link

SIGN_METHODS = ("majority vote", "averaged scaled signs", "averaged scaled signs + EF")


def sign_descent(steps, gamma, method):
    """Minimise f(x) = (1/N) sum_r 1/2 ||x - a_r||^2 from x = 0 with sign messages: rank r
    holds a_r, three ranks agree on a_r = (0, 0), one disagrees, (12, -6); the minimum is
    their mean. ``method`` is one of ``SIGN_METHODS``:

    - "majority vote": every rank sends sign(g_r) (int8, summed by an all-reduce) and
      steps by gamma sign(sum_r sign(g_r)) (``SignSGD``);
    - "averaged scaled signs": every rank sends ||g_r||_1/d sign(g_r) (a 4-byte scale and
      int8 signs, by all-gather) and steps by gamma times their mean (``ScaledSign``);
    - "averaged scaled signs + EF": the same inside error feedback (``ErrorFeedback``).

    Returns the final x and, with EF, the largest norm of the ranks' mean residual over the
    last quarter of the steps (0.0 without EF)."""
    if method not in SIGN_METHODS:
        raise ValueError(f"method must be one of {', '.join(map(repr, SIGN_METHODS))}; got {method!r}.")
    if dist.get_world_size() != 4:
        raise ValueError(f"the sign-descent problem has one target per rank for 4 ranks: run it on 4, not "
                         f"{dist.get_world_size()}.")
    targets = torch.tensor([[0.0, 0.0]] * 3 + [[12.0, -6.0]])
    a = targets[dist.get_rank()]
    compressor = {"majority vote": SignSGD, "averaged scaled signs": ScaledSign,
                  "averaged scaled signs + EF": lambda: ErrorFeedback(ScaledSign())}[method]()
    x, worst = torch.zeros(2), 0.0
    for step in range(steps):
        g = x - a
        if isinstance(compressor, ErrorFeedback):
            delta, _ = compressor.aggregate(g, gamma=gamma)
            if step >= 3 * steps // 4:
                residual = compressor.residuals[0].clone()
                worst = max(worst, (ring_all_reduce(residual) / dist.get_world_size()).norm().item())
        else:
            delta = gamma * compressor.aggregate(g)[0]
        x = x - delta
    return x, worst


def torch_hooks_on_gloo():
    """On every rank: what each of torch's own DDP comm hooks does here (gloo, CPU): "ok" after
    4 steps, or the type of the exception it raised. On torch 2.13: fp16 and powerSGD work,
    bf16 refuses (it wants CUDA and NCCL), both quantization hooks fail in their callbacks,
    batched powerSGD fails once it starts compressing."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook, quantization_hooks

    def attempt(register, steps=4):
        torch.manual_seed(0)
        model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4)))
        try:
            register(model)
            for _ in range(steps):
                model(torch.randn(4, 16)).sum().backward()
            return "ok"
        except Exception as error:  # the finding is which error torch raises
            return type(error).__name__

    def powersgd(hook):
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2)
        return lambda model: model.register_comm_hook(state, hook)

    return {
        "fp16": attempt(lambda m: m.register_comm_hook(None, default_hooks.fp16_compress_hook)),
        "bf16": attempt(lambda m: m.register_comm_hook(None, default_hooks.bf16_compress_hook)),
        "quantization per tensor": attempt(
            lambda m: m.register_comm_hook(None, quantization_hooks.quantization_pertensor_hook)),
        "quantization per channel": attempt(
            lambda m: m.register_comm_hook(None, quantization_hooks.quantization_perchannel_hook)),
        "powerSGD": attempt(powersgd(powerSGD_hook.powerSGD_hook)),
        "batched powerSGD": attempt(powersgd(powerSGD_hook.batched_powerSGD_hook)),
    }


TWIN = "dense again"  # dense a second time, its steps in turns with the first: the noise yardstick


def compare(cluster, names, steps, hidden=256, depth=2, batch_size=16, compute_s=0.0):
    """``measure`` dense, ``names`` and ``TWIN`` in the cluster's current regime, their steps
    in turns, and give each row ``ratio``: the median over steps of its step's time over
    dense's step of the same turn (below 1: faster than dense). Returns (rows, noise): the
    rows of dense and ``names``, and the twin's row, whose ratio would be 1 without noise,
    with ``standard_error``: how far from the truth a median of that many ratios lies here
    and now (1.2533 sigma / sqrt(steps), sigma from the interquartile range of the twin's
    per-step ratios, IQR / 1.349, as for a normal distribution)."""
    compressors = {**COMPRESSORS, TWIN: Identity}
    rows = measure(cluster, ["dense", *(name for name in names if name != "dense"), TWIN], steps, hidden, depth,
                   batch_size, compute_s, compressors=compressors)
    for row in rows:
        row["step_ratios"] = [a / b for a, b in zip(row["seconds"], rows[0]["seconds"])]
        row["ratio"] = statistics.median(row["step_ratios"])
    noise = rows.pop()
    first, _, third = statistics.quantiles(noise["step_ratios"], n=4, method="inclusive")
    noise["standard_error"] = 1.2533 * (third - first) / 1.349 / len(noise["step_ratios"]) ** 0.5
    return rows, noise


def initial_loss(hidden=256, depth=2):
    """The loss on ``train``'s fixed batch before any step: every run starts from this MLP."""
    net, (inputs, targets) = mlp(hidden, depth), batches(hidden, 256, EVALUATION_SEED)
    with torch.no_grad():
        return (net(inputs) - targets).pow(2).mean().item()


def steps_to_reach(row, loss):
    """The steps after which ``row`` (of ``measure``) first has a loss at most ``loss``, or None."""
    return next((step for step, value in enumerate(row["losses"], start=1) if value <= loss), None)


def progress(rows, start):
    """How far each of ``rows`` (``compare``'s, dense first) got beside dense, from ``start``,
    the loss before any step (``initial_loss``): one dict per row after dense with ``share``
    (its loss drop over dense's), ``seconds`` (the time its steps took to its final loss),
    ``dense_steps`` and ``dense_seconds`` (when dense first had that loss; None if never)."""
    dense, found = rows[0], []
    for row in rows[1:]:
        final = row["losses"][-1]
        steps = steps_to_reach(dense, final)
        found.append({"name": row["name"], "loss": final, "share": (start - final) / (start - dense["losses"][-1]),
                      "seconds": row["times"][-1], "dense_steps": steps,
                      "dense_seconds": None if steps is None else dense["times"][steps - 1]})
    return found


def crossover(name, extra_s, N, latency, compute_s=0.0, hidden=256, depth=2, bandwidths=None):
    """The lowest of ``bandwidths`` (bytes/s; default 100 kB/s to 10 GB/s, 20 a decade) at
    which ``name``'s step, ``predicted_step`` plus ``extra_s`` (the seconds it costs this
    machine beyond dense's step, which the model leaves out), is no shorter than dense's:
    where compression stops paying on a link of ``latency``. None if it pays at all of them."""
    def step(compressor, bandwidth):
        return predicted_step(COMPRESSORS[compressor](), N, Link(latency, bandwidth), hidden, depth, compute_s)[1]

    grid = bandwidths or [10 ** (5 + i / 20) for i in range(101)]
    return next((b for b in grid if step(name, b) + extra_s >= step("dense", b)), None)
