"""Emulated devices: a layer that only takes time.

    SleepLayer(t_f, t_b, t_w)    identity on values; forward takes t_f, backward t_b (+ t_w)
    ComputeTime(t_f, t_b)        the same without a parameter, to put in front of a real layer

A timeline made of these reproduces a schedule on any machine: the layer sleeps instead of
computing, which releases the CPU, so K ranks on 2 cores take the same time as on K cores,
and a measured bubble or overlap can be put beside the model's. On a cluster with emulated
devices (``parlab.Devices``) the declared times are scaled by the rank's slowdown and its
straggling steps (``parlab.runtime.emulation.compute``); otherwise they are taken as given.
Each time is in seconds, at most ``emulation.MAX_COMPUTE_S`` seconds per call: the layer sleeps
it for real, so a time in milliseconds given as seconds is refused rather than waited out.
"""

import torch
from torch import nn

from parlab.runtime import emulation


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
            emulation.declared_seconds(name, seconds)
        self.forward_s, self.backward_s, self.weight_s = forward_s, backward_s, weight_s
        self.weight = nn.Parameter(torch.zeros(()))
        self.steps = -1

    def extra_repr(self):
        return f"forward_s={self.forward_s}, backward_s={self.backward_s}, weight_s={self.weight_s}"

    def forward(self, x):
        # A forward and the backward that follows it are one step of an emulated device
        # (a straggling step is slow in both); steps are counted per layer.
        self.steps += 1
        return _SleepThrough.apply(x, self.forward_s, self.backward_s, self.steps) + _SleepWeight.apply(
            self.weight, self.weight_s, self.steps)


class ComputeTime(nn.Module):
    """y = x, declaring a compute time without a parameter: the forward sleeps ``forward_s``
    and the backward ``backward_s`` (scaled as ``SleepLayer``'s). In front of a real layer,
    ``nn.Sequential(ComputeTime(f, 2 * f), layer)`` gives that layer a declared time on top
    of its own (small) arithmetic, and leaves the model's parameters, its flat buffers and
    shards exactly as they were (a ``SleepLayer`` would add its ``weight``)."""

    def __init__(self, forward_s, backward_s):
        super().__init__()
        for name, seconds in (("forward_s", forward_s), ("backward_s", backward_s)):
            emulation.declared_seconds(name, seconds)
        self.forward_s, self.backward_s = forward_s, backward_s
        self.steps = -1

    def extra_repr(self):
        return f"forward_s={self.forward_s}, backward_s={self.backward_s}"

    def forward(self, x):
        self.steps += 1
        return _SleepThrough.apply(x, self.forward_s, self.backward_s, self.steps)


class _SleepThrough(torch.autograd.Function):
    """Identity on x; sleeps in forward, and in backward (the gradient of x)."""

    @staticmethod
    def forward(ctx, x, forward_s, backward_s, step):
        _sleep(forward_s, step)
        ctx.backward_s, ctx.step = backward_s, step
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        _sleep(ctx.backward_s, ctx.step)
        return grad, None, None, None


class _SleepWeight(torch.autograd.Function):
    """0 * weight; its backward (the weight's gradient, 0) sleeps."""

    @staticmethod
    def forward(ctx, weight, weight_s, step):
        ctx.weight_s, ctx.step = weight_s, step
        return torch.zeros_like(weight)

    @staticmethod
    def backward(ctx, grad):
        _sleep(ctx.weight_s, ctx.step)
        return torch.zeros_like(grad), None, None


def _sleep(seconds, step):
    # time.sleep(0) still yields the CPU, which costs milliseconds on a busy machine
    if seconds > 0:
        emulation.compute(seconds, step)
