"""Mixed precision from scratch: compute in 16 bits, keep the weights in 32, scale the loss.

A 16-bit float has few bits. fp16 keeps 10 bits of mantissa and 5 of exponent: the largest
finite value is 65504, the smallest normal 2^-14 (6.1e-5), the smallest subnormal 2^-24
(6.0e-8), and below half of that everything rounds to 0; next to 1 its spacing is 2^-10, so
1 + 1e-4 rounds back to 1. bf16 keeps fp32's 8 exponent bits (range up to 3.4e38, smallest
normal 1.2e-38, as fp32) and only 7 of mantissa (spacing 2^-7 next to 1). ``edge_values``
returns these for any floating dtype.

Two things follow, and each has its remedy here:

    problem                                          remedy
    a small update to a 16-bit weight rounds away    ``MasterWeights``: the optimizer steps fp32
                                                     master weights; the 16-bit model is a copy
    a small fp16 gradient underflows to 0            ``LossScaler``: backward on loss x scale,
                                                     unscale the fp32 gradients before the step

    model = MasterWeights(model, torch.float16)          # the model now computes in fp16
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)   # over the fp32 master weights
    scaler = LossScaler()
    for x, y in batches:
        loss = loss_fn(model(x).float(), y)              # forward in fp16, the loss in fp32
        scaler.scale(loss).backward()                    # fp16 gradients of loss x scale
        model.step(optimizer, scaler)                    # to fp32, unscale, skip on inf/nan, step, copy
        scaler.update()                                  # back off after an overflow, grow after a while
        model.zero_grad()

The scale is dynamic, as ``torch.amp.GradScaler``'s, and follows the same sequence given the
same overflows: a step whose gradients hold an inf or a nan is skipped and the scale is
multiplied by ``backoff_factor``; after ``growth_interval`` steps in a row without one it is
multiplied by ``growth_factor``. The scale is an fp32 number, rounded as GradScaler rounds it.
bf16 rarely needs a scaler (its range is fp32's), fp16 does.

Where this differs from ``torch.autocast``: autocast keeps fp32 weights and casts per
operation, running some operations (softmax, losses, norms' statistics) in fp32; here the
whole model, its buffers included, is one 16-bit copy (as Megatron and apex's O2 do), and the
caller computes the loss in fp32 by casting the output, as above.
"""

import math
import numbers
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_map

from parlab import _checks

LOW_PRECISION = (torch.float16, torch.bfloat16)


class EdgeValues(NamedTuple):
    """The edges of a floating dtype (all as Python floats)."""

    largest: float  # the largest finite value; twice it is inf
    smallest_normal: float  # below it, values lose mantissa bits (subnormals)
    smallest_subnormal: float  # the smallest value above 0; half of it rounds to 0
    eps: float  # the spacing next to 1: 1 + eps / 2 rounds to 1


def edge_values(dtype):
    """``EdgeValues`` of a floating ``dtype``: e.g. torch.float16 gives largest 65504,
    smallest_normal 2^-14, smallest_subnormal 2^-24, eps 2^-10; torch.bfloat16 gives
    3.39e38, 2^-126, 2^-133 and 2^-7. The smallest subnormal is smallest_normal x eps (the
    exponent of the smallest normal, the last mantissa bit)."""
    if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        _checks.refuse("dtype", "a floating torch dtype", dtype,
                       "pass e.g. torch.float16, torch.bfloat16 or torch.float32.")
    info = torch.finfo(dtype)
    return EdgeValues(float(info.max), float(info.smallest_normal), float(info.smallest_normal * info.eps),
                      float(info.eps))


class LossScaler:
    """Dynamic loss scaling, following ``torch.amp.GradScaler``'s scale sequence.

    ``scale(loss)``: loss x sigma, the scale (backward on it gives gradients x sigma, above
    fp16's underflow; the glossary's sigma). ``unscale_(optimizer)``: divide the gradients of
    the optimizer's parameters by sigma (in their dtype: fp32 master gradients, ``MasterWeights``) and note whether
    any is inf or nan. ``step(optimizer)``: unscale if not done yet, then the optimizer's step
    unless an inf or nan was found; True if it stepped. ``update()``: once per step, after the
    steps: the new scale (table in the module docstring).

    ``scale_value`` is the current scale; ``scale_history[i]`` the scale step i used and
    ``skipped[i]`` whether step i was skipped (for plots). ``group``: None where each rank
    holds whole gradients (one process, DDP); where gradients are sharded over ranks (ZeRO-2,
    FSDP, tensor parallelism) the process group they are sharded over (e.g. ``dist.group.WORLD``),
    so that an overflow on one rank skips the step on all of them (one all-reduce of a flag).
    """

    def __init__(self, init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000, group=None):
        _checks.real_number("init_scale", init_scale, "pass a positive scale such as 2.0**16, GradScaler's default.",
                            above=True)
        _checks.real_number("growth_factor", growth_factor, "the scale grows after a run of good steps: pass a "
                            "number above 1, such as 2.0.", minimum=1, above=True)
        if not (isinstance(backoff_factor, numbers.Real) and 0 < backoff_factor < 1):
            _checks.refuse("backoff_factor", "a number between 0 and 1", backoff_factor,
                           "the scale shrinks after an overflow: pass e.g. 0.5.")
        self.growth_factor, self.backoff_factor, self.group = float(growth_factor), float(backoff_factor), group
        self.growth_interval = _checks.whole_number("growth_interval", growth_interval,
                                                    "give the number of good steps before the scale grows, e.g. 2000.")
        self.scale_value = _fp32(init_scale)
        self.good_steps = 0  # steps in a row without inf/nan since the last change of scale
        self.scale_history, self.skipped = [], []
        self.found_inf = {}  # id(optimizer) -> inf/nan found in its gradients, for this step

    def scale(self, loss):
        """``loss`` x the current scale, in the loss's dtype."""
        return loss * self.scale_value

    def unscale_(self, optimizer):
        """Divide the gradients of ``optimizer``'s parameters by the scale in place (multiplied
        by 1 / scale, rounded to fp32 as GradScaler does) and note whether any was inf or nan.
        Once per optimizer and step."""
        if id(optimizer) in self.found_inf:
            raise ValueError("unscale_ was called for this optimizer already in this step: call it once, "
                             "then step(optimizer) and update().")
        inverse = _fp32(1.0 / self.scale_value)
        found = torch.zeros((), dtype=torch.bool)
        with torch.no_grad():
            for group in optimizer.param_groups:
                for p in group["params"]:
                    if p.grad is None:
                        continue
                    if p.grad.dtype == torch.float16:
                        raise ValueError("unscaling fp16 gradients in fp16 makes the small ones underflow again: "
                                         "step fp32 master weights (MasterWeights) and unscale their gradients.")
                    found |= ~torch.isfinite(p.grad).all().cpu()  # checked before the division, as GradScaler
                    p.grad.mul_(inverse)
        if self.group is not None:
            flag = found.to(torch.float32)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)  # one rank's overflow is every rank's
            found = flag > 0
        self.found_inf[id(optimizer)] = bool(found)

    def step(self, optimizer):
        """``optimizer.step()`` on the unscaled gradients, unless one of them is inf or nan.
        Returns True if the optimizer stepped, False if the step was skipped."""
        if id(optimizer) not in self.found_inf:
            self.unscale_(optimizer)
        if self.found_inf[id(optimizer)]:
            return False
        optimizer.step()
        return True

    def update(self):
        """The scale for the next step: x backoff_factor if this step found an inf or nan (and
        the run of good steps starts again), x growth_factor after growth_interval good steps
        in a row (kept if that would overflow fp32). Call once per step, after step()."""
        if not self.found_inf:
            raise ValueError("update() comes after step(optimizer) (or unscale_) in each step: "
                             "call scaler.step(optimizer) first.")
        overflow = any(self.found_inf.values())
        self.scale_history.append(self.scale_value)
        self.skipped.append(overflow)
        self.found_inf = {}
        if overflow:
            self.scale_value, self.good_steps = _fp32(self.scale_value * self.backoff_factor), 0
            return
        self.good_steps += 1
        if self.good_steps == self.growth_interval:
            grown = _fp32(self.scale_value * self.growth_factor)
            if math.isfinite(grown):
                self.scale_value = grown
            self.good_steps = 0


class MasterWeights:
    """A model computing in ``dtype`` (fp16 or bf16) whose optimizer steps fp32 master weights.

    Construction copies the model's trainable fp32 parameters into fp32 master Parameters
    (``parameters()``: give these to the optimizer), then converts the model, parameters and
    buffers, to ``dtype`` in place: forward and backward run in 16 bits, and their gradients
    are 16-bit. ``step(optimizer, scaler=None)`` copies those gradients into the masters'
    ``.grad`` as fp32, steps (through ``scaler.step`` if given: unscale in fp32, skip on
    inf/nan), and if it stepped rounds the new master values into the model. An update below
    half the 16-bit spacing of a weight (1e-4 on a weight of 1 in fp16) rounds away in the
    model but adds up in the master, and reaches the model once the sum is large enough.
    Calling the object runs the model on its inputs, floating ones cast to ``dtype``.
    """

    def __init__(self, model, dtype=torch.float16):
        _checks.module("model", model, "pass the fp32 model to train in mixed precision.")
        if dtype not in LOW_PRECISION:
            _checks.refuse("dtype", "torch.float16 or torch.bfloat16", dtype,
                           "pass the 16-bit dtype to compute in; the master weights are fp32.")
        self.module, self.dtype = model, dtype
        self.trainable = [p for p in model.parameters() if p.requires_grad]
        if not self.trainable or any(p.dtype != torch.float32 for p in self.trainable):
            raise ValueError("MasterWeights needs a model with trainable fp32 parameters (they become the master "
                             "weights): build it in fp32, or call model.float() first.")
        self.master = [torch.nn.Parameter(p.detach().clone()) for p in self.trainable]
        model.to(dtype)

    def __call__(self, *args, **kwargs):
        args, kwargs = tree_map(self._cast_input, (args, kwargs))
        return self.module(*args, **kwargs)

    def _cast_input(self, value):
        if torch.is_tensor(value) and value.is_floating_point():
            return value.to(self.dtype)
        return value

    def parameters(self):
        """The fp32 master Parameters, in the order of the model's trainable parameters."""
        return list(self.master)

    def step(self, optimizer, scaler=None):
        """16-bit gradients -> fp32 master gradients, the optimizer's step (``scaler.step``
        if a ``LossScaler`` is given: call ``scaler.update()`` after), new master values ->
        the 16-bit model. Returns False if the scaler skipped the step (the model is unchanged)."""
        for master, p in zip(self.master, self.trainable):
            master.grad = None if p.grad is None else p.grad.float()
        if scaler is None:
            optimizer.step()
            stepped = True
        else:
            stepped = scaler.step(optimizer)
        if stepped:
            with torch.no_grad():
                for master, p in zip(self.master, self.trainable):
                    p.copy_(master)  # rounds to the model's dtype
        return stepped

    def zero_grad(self):
        """Drop the gradients of the model and of the master weights."""
        for tensor in (*self.trainable, *self.master):
            tensor.grad = None


def _fp32(value):
    """``value`` rounded to the nearest fp32 number (GradScaler keeps its scale in fp32 and
    computes each new scale in double before rounding it)."""
    return torch.tensor(value, dtype=torch.float64).to(torch.float32).item()
