"""Cutting a model into pipeline stages, and a layer that only takes time.

    partition(model, S)          contiguous nn.Sequential stages, balanced by parameter count
    SleepLayer(t_f, t_b, t_w)    identity on values; forward sleeps t_f, backward t_b (+ t_w)

A pipeline stage is a contiguous slice of an ``nn.Sequential``. ``partition`` returns views
of the model's own layers (no copies), so the gradients that a pipeline accumulates in the
stages are the model's gradients.

``SleepLayer`` makes a timeline reproduce a schedule on any machine: ``time.sleep`` releases
the CPU, so K ranks sleeping on 2 cores take the same time as on K cores, and a measured
bubble can be put beside the simulated one.
"""

import numbers
import time

import torch
from torch import nn

from parlab._checks import real_number


def partition(model, num_stages, split=None):
    """Cut ``model`` (an ``nn.Sequential`` of L layers) into ``num_stages`` = S contiguous,
    non-empty ``nn.Sequential`` stages sharing the model's layers.

    split: layer counts per stage (S whole numbers >= 1 adding up to L). Without it, the
    stages are balanced by parameter count: with P_j the parameters of layers 0..j, the
    cut i (i = 1..S-1) follows the layer whose P_j is closest to i P_L / S, the later
    layer on ties (so a parameter-free activation stays with the layer before it), and
    every stage keeps at least one layer. A model without parameters is balanced by
    layer count.
    """
    if not isinstance(model, nn.Sequential):
        raise ValueError(f"partition cuts an nn.Sequential into slices of layers; got {type(model).__name__}: "
                         f"write the model as nn.Sequential(layer, layer, ...).")
    layers, S = list(model), num_stages
    if isinstance(S, bool) or not isinstance(S, numbers.Integral) or not 1 <= S <= len(layers):
        raise ValueError(f"a model of {len(layers)} layers cannot be cut into {S!r} non-empty stages: use "
                         f"between 1 and {len(layers)} stages, or a deeper model.")
    if split is None:
        split = _balanced_split([sum(p.numel() for p in layer.parameters()) for layer in layers], S)
    elif (not isinstance(split, (list, tuple)) or len(split) != S
          or any(isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 1 for n in split)
          or sum(split) != len(layers)):
        raise ValueError(f"split={split!r} must give {S} layer counts, each at least 1, adding up to the "
                         f"model's {len(layers)} layers: list how many layers each stage takes.")
    bounds = [sum(split[:i]) for i in range(S + 1)]
    return [nn.Sequential(*layers[bounds[i]:bounds[i + 1]]) for i in range(S)]


def _balanced_split(sizes, S):
    if sum(sizes) == 0:
        sizes = [1] * len(sizes)
    cumulative = [sum(sizes[:j + 1]) for j in range(len(sizes))]
    cuts, previous = [], -1  # cut after layer j: stage i ends with layer cuts[i]
    for i in range(1, S):
        target = i * cumulative[-1] / S
        # keep a layer for each stage still to come
        candidates = range(previous + 1, len(sizes) - (S - i))
        previous = min(candidates, key=lambda j: (abs(cumulative[j] - target), -j))
        cuts.append(previous)
    ends = cuts + [len(sizes) - 1]
    return [ends[0] + 1] + [ends[i] - ends[i - 1] for i in range(1, S)]


class SleepLayer(nn.Module):
    """y = x, but the forward sleeps ``forward_s`` seconds and the backward ``backward_s``
    computing the gradient of x and ``weight_s`` computing the gradient of the layer's one
    parameter, ``weight`` (a scalar 0 that never changes: its gradient is 0).

    The two backward parts are separate autograd nodes, so a pipeline that splits its
    backward pays ``backward_s`` in B (gradient w.r.t. the stage input) and ``weight_s`` in
    W (gradient w.r.t. the parameters); one ordinary backward pays both. The gradient of x
    is computed (and the time spent) only when x requires grad, as for any layer: give the
    first stage an input with ``requires_grad=True`` to charge its backward too.
    """

    def __init__(self, forward_s, backward_s, weight_s=0.0):
        super().__init__()
        for name, seconds in (("forward_s", forward_s), ("backward_s", backward_s), ("weight_s", weight_s)):
            real_number(name, seconds, "sleep times cannot be negative: give each in seconds, e.g. 0.01.")
        self.forward_s, self.backward_s, self.weight_s = forward_s, backward_s, weight_s
        self.weight = nn.Parameter(torch.zeros(()))

    def extra_repr(self):
        return f"forward_s={self.forward_s}, backward_s={self.backward_s}, weight_s={self.weight_s}"

    def forward(self, x):
        return _SleepThrough.apply(x, self.forward_s, self.backward_s) + _SleepWeight.apply(self.weight, self.weight_s)


class _SleepThrough(torch.autograd.Function):
    """Identity on x; sleeps in forward, and in backward (the gradient of x)."""

    @staticmethod
    def forward(ctx, x, forward_s, backward_s):
        _sleep(forward_s)
        ctx.backward_s = backward_s
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        _sleep(ctx.backward_s)
        return grad, None, None


class _SleepWeight(torch.autograd.Function):
    """0 * weight; its backward (the weight's gradient, 0) sleeps."""

    @staticmethod
    def forward(ctx, weight, weight_s):
        ctx.weight_s = weight_s
        return torch.zeros_like(weight)

    @staticmethod
    def backward(ctx, grad):
        _sleep(ctx.weight_s)
        return torch.zeros_like(grad), None


def _sleep(seconds):
    # time.sleep(0) still yields the CPU, which costs milliseconds on a busy machine
    if seconds > 0:
        time.sleep(seconds)
