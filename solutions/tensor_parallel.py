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
        # BEGIN SOLUTION: identity forward
        return x.view_as(x)
        # END SOLUTION

    @staticmethod
    def backward(ctx, grad):
        # BEGIN SOLUTION: all-reduce backward
        return all_reduce(grad)
        # END SOLUTION


class ReduceFromParallel(torch.autograd.Function):
    """g: ``forward(ctx, x)`` returns the sum of x over the ranks; ``backward(ctx, grad)``
    returns ``grad`` unchanged."""

    @staticmethod
    def forward(ctx, x):
        # BEGIN SOLUTION: all-reduce forward
        return all_reduce(x)
        # END SOLUTION

    @staticmethod
    def backward(ctx, grad):
        # BEGIN SOLUTION: identity backward
        return grad
        # END SOLUTION


class ColumnParallelLinear(nn.Module):
    """This rank's out/t output features of ``linear`` (module docstring). ``forward(x)``:
    x (..., in), the same on every rank; returns (..., out/t), Y_r = f(x) A_r^T + c_r."""

    def __init__(self, linear):
        super().__init__()
        self.weight = nn.Parameter(slice_of(linear.weight, 0))  # (out/t, in)
        self.bias = None if linear.bias is None else nn.Parameter(slice_of(linear.bias, 0))  # (out/t,)

    def forward(self, x):
        # BEGIN SOLUTION: f, then the local product
        return F.linear(CopyToParallel.apply(x), self.weight, self.bias)
        # END SOLUTION


class RowParallelLinear(nn.Module):
    """The sum over the ranks of ``linear`` on this rank's in/t input features (module
    docstring). ``forward(x)``: x (..., in/t), this rank's features; returns (..., out), the
    same on every rank, Y = g(x A_r^T) + c."""

    def __init__(self, linear):
        super().__init__()
        self.weight = nn.Parameter(slice_of(linear.weight, 1))  # (out, in/t)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone())  # (out,)

    def forward(self, x):
        # BEGIN SOLUTION: the local product, g, then the bias once
        y = ReduceFromParallel.apply(F.linear(x, self.weight))
        return y if self.bias is None else y + self.bias
        # END SOLUTION


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
        # BEGIN SOLUTION: multiply
        return loss * self.scale
        # END SOLUTION

    def unscale_(self, parameters):
        """Divide every gradient of ``parameters`` (those that have one) by sigma, in place.
        Returns True when any gradient holds an inf or a nan (found_inf)."""
        # BEGIN SOLUTION: divide, and look for inf/nan
        found_inf = False
        for p in parameters:
            if p.grad is not None:
                p.grad.div_(self.scale)
                found_inf = found_inf or not bool(torch.isfinite(p.grad).all())
        return found_inf
        # END SOLUTION

    def update(self, found_inf):
        """After a step: on an overflow, sigma <- sigma x backoff_factor and the count of good steps
        restarts at 0; otherwise one more good step, and at ``growth_interval`` of them
        sigma <- sigma x growth_factor and the count restarts at 0."""
        # BEGIN SOLUTION: back off or grow
        if found_inf:
            self.scale *= self.backoff_factor
            self.good_steps = 0
            return
        self.good_steps += 1
        if self.good_steps == self.growth_interval:
            self.scale *= self.growth_factor
            self.good_steps = 0
        # END SOLUTION

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

# BEGIN HINTS
HINTS = {
    "column_row_linear": (
        """
        Every rank reads the whole input of a column-parallel layer, so the input's gradient
        is a sum over the ranks; every rank holds a partial sum of a row-parallel layer's
        output. Which operator goes where, and which direction communicates?
        """,
        """
        CopyToParallel (f): forward returns x.view_as(x); backward returns all_reduce(grad).
        ReduceFromParallel (g): forward returns all_reduce(x); backward returns grad.
        ColumnParallelLinear.forward: F.linear of f(x) with this rank's weight and bias.
        RowParallelLinear.forward: F.linear of x with this rank's weight (no bias), through
        g, then add the bias once, after the sum.
        """,
        """
        def forward(self, x):                      # column
            return F.linear(CopyToParallel.apply(x), self.weight, self.bias)

        def forward(self, x):                      # row
            y = ReduceFromParallel.apply(F.linear(x, self.weight))
            return y + self.bias  (when there is one)

        Adding the bias before g adds it t times.
        """,
    ),
    "loss_scaler": (
        """
        GradScaler keeps the scale and a count of good steps in a row. An overflow resets
        the count; reaching growth_interval grows the scale and resets the count too.
        """,
        """
        scale_loss: loss * self.scale. unscale_: for each parameter with a gradient, divide
        it by self.scale in place and remember whether torch.isfinite(grad).all() failed.
        update(found_inf): overflow -> scale *= backoff_factor, good_steps = 0; otherwise
        good_steps += 1 and, when it reaches growth_interval, scale *= growth_factor and
        good_steps = 0.
        """,
        """
        def update(self, found_inf):
            if found_inf:
                self.scale *= self.backoff_factor; self.good_steps = 0; return
            self.good_steps += 1
            if self.good_steps == self.growth_interval:
                self.scale *= self.growth_factor; self.good_steps = 0
        """,
    ),
}
# END HINTS
