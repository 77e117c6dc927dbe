"""Local SGD: every rank takes H optimizer steps on its own, then the replicas average.

    optimizer = PostLocalSGDOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                      PeriodicAverager(period=H, warmup_steps=2))
    for x, y in my_batches:                     # this rank's own data, no gradient all-reduce
        loss_fn(model(x), y).backward()
        optimizer.step()                        # a local step; every H-th one also averages
        optimizer.zero_grad()

Synchronous data parallelism all-reduces the gradient at every step; local SGD all-reduces
the weights once per H steps: H times fewer messages and bytes, paid for with replicas that
drift apart in between (their distance grows with H and with gamma). ``PeriodicAverager``
follows the schedule of torch's ``PeriodicModelAverager``: its counter starts at 0 and counts
calls (one per optimizer step); the call with counter c averages when c >= warmup_steps and
(c - warmup_steps) is a multiple of H. With H = 4 and 2 warm-up steps, optimizer steps 3, 7,
11, ... average (counting from 1). It is a drop-in averager for torch's
``PostLocalSGDOptimizer``, which calls ``average_parameters(params=param_groups)`` after
each optimizer step.

Post-local SGD (Lin et al. 2018) is synchronous during the warm-up: torch runs it as DDP with
``post_localSGD_hook``, which all-reduces the gradients of every step before
``start_localSGD_iter`` (= the averager's ``warmup_steps``). Without DDP, do the same with
``average_gradients`` while ``in_warmup``. After the warm-up torch's hook by default keeps
all-reducing gradients inside each node (``post_local_gradient_allreduce=True``, a subgroup per
node) and the averager averages the nodes' models every H steps; here a rank plays a node.

The average is parlab's ring all-reduce of all parameters flattened into one buffer, each
divided by N first, as torch's ``average_parameters`` does: 2 (N - 1) messages of d/N
elements per averaging, every H steps. On one axis of a ``parlab.Mesh`` pass its group
(``PeriodicAverager(H, group=mesh.group("dp"))``, as torch's averager takes a
``process_group``): the ring then goes round the group's ranks and N is the group's size.
"""

import torch

from parlab import collectives
from parlab._checks import place_in, whole_number


class PeriodicAverager:
    """Average the replicas' parameters over ``group`` (default: all ranks) at every
    ``period``-th call after ``warmup_steps`` calls (torch's ``PeriodicModelAverager``'s
    schedule and interface). ``step`` counts the calls so far."""

    def __init__(self, period, warmup_steps=0, group=None):
        self.period = whole_number("period (H, local steps between averagings)", period,
                                   "e.g. period=4; period=1 averages after every step.")
        self.warmup_steps = whole_number("warmup_steps", warmup_steps, "e.g. 0 or 2.", minimum=0)
        if group is not None:
            _group_size(group)  # a rank outside the group is told now, not at the first averaging
        self.group, self.step = group, 0

    def averages_now(self):
        """Whether the next call of ``average_parameters`` averages."""
        return self.step >= self.warmup_steps and (self.step - self.warmup_steps) % self.period == 0

    @property
    def in_warmup(self):
        """Whether the next optimizer step is a warm-up step (before any averaging): the steps
        whose gradients post-local SGD all-reduces."""
        return self.step < self.warmup_steps

    def average_parameters(self, params):
        """Average ``params`` (parameters, or an optimizer's parameter groups) over the
        group's ranks if the schedule says so, then count the call."""
        if self.averages_now():
            average_parameters(params, self.group)
        self.step += 1


def average_parameters(params, group=None):
    """Replace each parameter by its mean over the N ranks of ``group`` (default: all): one
    ring all-reduce of the parameters flattened and divided by N. ``params``: tensors or
    parameter groups."""
    _average([p.detach() for p in _parameters(params)], group)


def average_gradients(params, group=None):
    """Replace each parameter's gradient by its mean over the N ranks of ``group`` (default:
    all; one ring all-reduce, as DDP does every step): post-local SGD's warm-up. Call it
    between backward and the optimizer step. ``params``: tensors or parameter groups; those
    without a gradient are left out."""
    _average([p.grad for p in _parameters(params) if p.grad is not None], group)


def _average(tensors, group):
    """Each tensor replaced, in place, by its mean over the group's ranks: flattened into one
    buffer, divided by N, one ring all-reduce."""
    if not tensors:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])  # (d,)
    flat /= _group_size(group)
    collectives.ring_all_reduce(flat, check=False, group=group)
    offset = 0
    for t in tensors:
        t.copy_(flat[offset:offset + t.numel()].view_as(t))
        offset += t.numel()


def averaging_steps(steps, period, warmup_steps=0):
    """The optimizer steps (counted from 1) among the first ``steps`` after which
    ``PeriodicAverager(period, warmup_steps)`` averages: averaging_steps(8, 4, 2) == [3, 7]."""
    averager = PeriodicAverager(period, warmup_steps)
    chosen = []
    for step in range(1, whole_number("steps", steps, "e.g. 8.", minimum=0) + 1):
        if averager.averages_now():
            chosen.append(step)
        averager.step += 1
    return chosen


def _group_size(group):
    """N, the size of ``group``; a ValueError on a rank outside it."""
    return place_in(group, "pass each rank the group it belongs to (e.g. mesh.group(\"dp\")), and average only on "
                           "its members.")[1]


def _parameters(params):
    for item in params:
        if isinstance(item, dict):
            yield from item["params"]
        elif torch.is_tensor(item):
            yield item
        else:
            raise ValueError(f"average_parameters takes parameters or parameter groups, got {type(item).__name__}.")
