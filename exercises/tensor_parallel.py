# Generated from solutions/tensor_parallel.py by `python -m parlab.course.exercises build`.
# Write your code where it raises NotImplementedError, then run `parlab grade tensor_parallel`.
# parlab-generated sha256=97d268e8a2a78424cc31993a77cbed0a16de956348d2e49c5d674136a5f621bd
"""Exercise: Megatron's column- and row-parallel linear layers with the operators f and g,
and a dynamic loss scaler.

Tensor parallelism over t ranks (the default process group) splits one linear layer
Y = X A^T + c, A of shape (out, in):

- ``ColumnParallelLinear``: rank r holds rows r out/t .. (r + 1) out/t - 1 of A and c and
  computes its out/t output features Y_r = f(X) A_r^T + c_r from the whole input X;
- ``RowParallelLinear``: rank r holds columns r in/t .. (r + 1) in/t - 1 of A (and the whole
  bias c), reads its in/t input features X_r and computes Y = g(X_r A_r^T) + c, the sum of
  the t partial products, with c added once.

The two conjugate operators, as autograd functions:

    operator                    forward                  backward
    f  ``CopyToParallel``       identity                 all-reduce (sum) of the gradient
    g  ``ReduceFromParallel``   all-reduce (sum)         identity

An MLP ``RowParallelLinear(gelu(ColumnParallelLinear(X)))`` then computes on every rank the
one-process output, and every rank's parameters get the one-process gradients of their
slices: one all-reduce of the output (b, s, h) forward, one of the input's gradient backward.
The constructors (provided) copy this rank's slice of a full ``nn.Linear``. Communicate only
with ``all_reduce`` below (parlab's ring, traced: the grader counts your all-reduces).

Mixed precision: ``DynamicLossScaler`` multiplies the loss by a scale sigma before backward, so
that small fp16 gradients do not underflow, and divides the gradients by sigma before the
optimizer step. When a gradient holds an inf or a nan the step is skipped and sigma is
multiplied by ``backoff_factor``; after ``growth_interval`` good steps in a row it is
multiplied by ``growth_factor``. Given the same overflows it follows the scale sequence of
``torch.amp.GradScaler`` (its ``get_scale()`` after each ``update()``): exactly with
power-of-two factors such as the defaults (GradScaler rounds its scale to fp32, a Python
float does not; ``parlab.mixed_precision.LossScaler`` rounds as GradScaler does).

Stuck? ``parlab.hint("tensor_parallel.column_row_linear")`` (in a terminal, ``parlab hint
tensor_parallel.column_row_linear``) opens a hint, one level at a time. Grade your work with
``parlab grade tensor_parallel`` (or ``parlab.check("tensor_parallel")`` in a notebook).
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from parlab import trace
from parlab.collectives import ring_all_reduce


class CopyToParallel(torch.autograd.Function):
    """f: ``forward(ctx, x)`` returns x unchanged (a view); ``backward(ctx, grad)`` returns the
    sum of ``grad`` over the ranks."""

    @staticmethod
    def forward(ctx, x):
        raise NotImplementedError("forward is not implemented yet: identity forward")

    @staticmethod
    def backward(ctx, grad):
        raise NotImplementedError("backward is not implemented yet: all-reduce backward")


class ReduceFromParallel(torch.autograd.Function):
    """g: ``forward(ctx, x)`` returns the sum of x over the ranks; ``backward(ctx, grad)``
    returns ``grad`` unchanged."""

    @staticmethod
    def forward(ctx, x):
        raise NotImplementedError("forward is not implemented yet: all-reduce forward")

    @staticmethod
    def backward(ctx, grad):
        raise NotImplementedError("backward is not implemented yet: identity backward")


class ColumnParallelLinear(nn.Module):
    """This rank's out/t output features of ``linear`` (module docstring). ``forward(x)``:
    x (..., in), the same on every rank; returns (..., out/t), Y_r = f(x) A_r^T + c_r."""

    def __init__(self, linear):
        super().__init__()
        self.weight = nn.Parameter(slice_of(linear.weight, 0))  # (out/t, in)
        self.bias = None if linear.bias is None else nn.Parameter(slice_of(linear.bias, 0))  # (out/t,)

    def forward(self, x):
        raise NotImplementedError("forward is not implemented yet: f, then the local product")


class RowParallelLinear(nn.Module):
    """The sum over the ranks of ``linear`` on this rank's in/t input features (module
    docstring). ``forward(x)``: x (..., in/t), this rank's features; returns (..., out), the
    same on every rank, Y = g(x A_r^T) + c."""

    def __init__(self, linear):
        super().__init__()
        self.weight = nn.Parameter(slice_of(linear.weight, 1))  # (out, in/t)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone())  # (out,)

    def forward(self, x):
        raise NotImplementedError("forward is not implemented yet: the local product, g, then the bias once")


class DynamicLossScaler:
    """Loss scaling with a dynamic scale (module docstring).

        scaler = DynamicLossScaler()
        scaler.scale_loss(loss).backward()
        scaler.step(optimizer, parameters)   # provided: unscale_, step unless inf/nan, update

    Attributes: ``scale`` (sigma, a Python float, starts at ``init_scale``) and ``good_steps``
    (steps since the last overflow or growth, GradScaler's growth tracker)."""

    def __init__(self, init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000):
        if not (init_scale > 0 and growth_factor > 1 and 0 < backoff_factor < 1 and growth_interval >= 1):
            raise ValueError("need init_scale > 0, growth_factor > 1, 0 < backoff_factor < 1 and growth_interval "
                             ">= 1 (torch.amp.GradScaler's defaults: 2**16, 2.0, 0.5, 2000).")
        self.scale, self.good_steps = float(init_scale), 0
        self.growth_factor, self.backoff_factor, self.growth_interval = growth_factor, backoff_factor, growth_interval

    def scale_loss(self, loss):
        """loss x sigma."""
        raise NotImplementedError("scale_loss is not implemented yet: multiply")

    def unscale_(self, parameters):
        """Divide every gradient of ``parameters`` (those that have one) by sigma, in place.
        Returns True when any gradient holds an inf or a nan (found_inf)."""
        raise NotImplementedError("unscale_ is not implemented yet: divide, and look for inf/nan")

    def update(self, found_inf):
        """After a step: on an overflow, sigma <- sigma x backoff_factor and the count of good steps
        restarts at 0; otherwise one more good step, and at ``growth_interval`` of them
        sigma <- sigma x growth_factor and the count restarts at 0."""
        raise NotImplementedError("update is not implemented yet: back off or grow")

    def step(self, optimizer, parameters):
        """Provided: unscale, take the optimizer's step unless a gradient overflowed, update
        sigma. Returns True when the step was taken."""
        found_inf = self.unscale_(list(parameters))
        if not found_inf:
            optimizer.step()
        self.update(found_inf)
        return not found_inf


# --- Provided ------------------------------------------------------------------------------


def all_reduce(tensor):
    """The sum of ``tensor`` over all ranks, as a new tensor (parlab's ring all-reduce),
    traced as one span named "all-reduce"."""
    if dist.get_world_size() == 1:
        return tensor
    reduced = tensor.contiguous().clone()
    with trace.span("all-reduce"):
        ring_all_reduce(reduced, check=False)
    return reduced


def slice_of(tensor, dim):
    """This rank's 1/t of ``tensor`` along ``dim`` (a copy): rank r gets part r of t."""
    t = dist.get_world_size()
    if tensor.shape[dim] % t:
        raise ValueError(f"{tensor.shape[dim]} rows along dimension {dim} do not split over t = {t} ranks: choose "
                         f"a size that is a multiple of {t}.")
    return tensor.detach().chunk(t, dim)[dist.get_rank()].clone()
