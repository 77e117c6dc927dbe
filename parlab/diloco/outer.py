"""DiLoCo and Streaming DiLoCo: H inner steps on each replica, then an outer step on the
averaged change of the weights.

    inner = torch.optim.AdamW(model.parameters(), lr=4e-4)
    diloco = DiLoCo(inner, inner_steps=H)       # outer: Nesterov momentum, eta = 0.7, nu = 0.9
    for x, y in my_batches:                     # this rank's own data, no gradient all-reduce
        loss_fn(model(x), y).backward()
        diloco.step()                           # an inner step; every H-th one ends an outer step
        diloco.zero_grad()

Symbols: N replicas (the ranks of ``group``), H inner steps per outer step, gamma the inner
learning rate, eta the outer learning rate, nu the outer momentum, w the global weights
(every rank keeps the same copy), w_r replica r's weights. DiLoCo (Douillard et al. 2023,
"DiLoCo: Distributed Low-Communication Training of Language Models", arXiv 2311.08105,
Algorithm 1) repeats:

    w_r <- w; H steps of the inner optimizer on w_r          # no communication
    Delta = (1/N) sum_r (w - w_r)                            # the pseudo-gradient: one ring all-reduce
    buf <- nu buf + Delta;  w <- w - eta (Delta + nu buf)    # the outer optimizer: SGD with Nesterov

The paper's inner optimizer is AdamW and its outer one Nesterov momentum; eta = 0.7 and nu = 0.9
(the defaults here) are the outer SGD of pytorch/torchft's DiLoCo test
(torchft/local_sgd_integ_test.py), and the abstract reports 500 times less communication than
synchronous training. The outer step is torch's ``SGD(nesterov=True)`` on the copy w, whose
"gradient" is Delta. With H = 1, inner SGD, eta = 1 and nu = 0 it is synchronous data
parallelism: Delta = gamma g_bar, w <- w - gamma g_bar. The inner optimizer's state (Adam's
moments) carries on across outer steps. Bytes: 2 (N - 1)/N 4 Psi per rank every H steps (fp32),
against DDP's 2 (N - 1)/N 4 Psi every step.

Streaming DiLoCo (Douillard et al. 2025, "Streaming DiLoCo with overlapping communication",
arXiv 2501.18512) changes three things, each an argument here:

- ``fragments`` F: the parameters cut into F strided fragments, synchronised on a staggered
  schedule (``parlab.diloco.schedule``): 1/F of the bytes every H/F steps instead of all of
  them every H steps, so the link's peak load drops F times;
- ``delay`` tau and ``mixing`` omega: a fragment's all-reduce runs on the rank's
  communication thread (``parlab.background``) while the next tau inner steps compute; then
  its outer step is applied to w and merged into the replica, which has moved on meanwhile:
  w_r <- omega w_r + (1 - omega) w on the fragment (omega = 0: take w, as DiLoCo does);
- ``compressor``: what travels is a compressed pseudo-gradient, e.g. ``FP16()`` or ``BF16()``
  from ``parlab.compression.compressors`` (the paper sends 4-bit floats; torch has no 4-bit
  dtype to sum in, so 16 bits is the nearest lecture 05 offers). Its ``aggregate`` averages
  over the group; the outer step and w stay in the parameters' dtype.

With F = 1, tau = 0, omega = 0 and no compressor, Streaming DiLoCo is DiLoCo.
"""

import torch

from parlab import background
from parlab._checks import place_in, real_number, whole_number
from parlab.compression.compressors import Identity
from parlab.diloco import schedule


class DiLoCo:
    """DiLoCo on the parameters of ``inner_optimizer`` (any torch optimizer), averaging over
    ``group`` (default: all ranks; e.g. ``mesh.group("dp")`` on one axis of a mesh). ``step()``
    takes an inner step and, when the schedule says so, starts or applies outer steps;
    ``fragments``, ``delay``, ``mixing`` and ``compressor`` make it Streaming DiLoCo."""

    def __init__(self, inner_optimizer, inner_steps, outer_lr=0.7, outer_momentum=0.9, group=None,
                 fragments=1, delay=0, mixing=0.0, compressor=None):
        if not isinstance(inner_optimizer, torch.optim.Optimizer):
            raise ValueError(f"inner_optimizer must be a torch optimizer over the model's parameters, e.g. "
                             f"torch.optim.AdamW(model.parameters()); got {type(inner_optimizer).__name__}.")
        self.H = whole_number("inner_steps (H)", inner_steps, "e.g. inner_steps=500 as in the paper, or 1.")
        self.delay = whole_number("delay (tau)", delay, "e.g. delay=0, or a few inner steps.", minimum=0)
        if self.delay >= self.H:
            raise ValueError(f"delay (tau) = {self.delay} must be below inner_steps (H) = {self.H}: a fragment's "
                             "outer step is applied before its next all-reduce starts.")
        self.mixing = real_number("mixing (omega)", mixing, "pass a number from 0 (take w) to below 1.")
        if self.mixing >= 1:
            raise ValueError(f"mixing (omega) = {mixing} would ignore the outer step: pass a number below 1, "
                             "e.g. 0 (DiLoCo) or 0.5.")
        real_number("outer_lr (eta)", outer_lr, "e.g. outer_lr=0.7 as in the paper.", above=True)
        real_number("outer_momentum (nu)", outer_momentum, "e.g. 0.9 as in the paper, or 0 for plain SGD.")
        if group is not None:  # a rank outside the group is told now, not at the first outer step
            place_in(group, "pass each rank the group it belongs to (e.g. mesh.group(\"dp\")), and run DiLoCo only "
                            "on its members.")
        parameters = [p for g in inner_optimizer.param_groups for p in g["params"] if p.requires_grad]
        self.inner_optimizer, self.group, self.compressor = inner_optimizer, group, compressor or Identity()
        self.fragments = schedule.strided_fragments(parameters, fragments)
        schedule.sync_offsets(self.H, len(self.fragments))  # F <= H, refused now rather than at step 1
        # w, one copy per fragment; each fragment has its own outer optimizer (its momentum buffer, buf)
        self.global_weights = [[p.detach().clone() for p in fragment] for fragment in self.fragments]
        self.outer_optimizers = [torch.optim.SGD(w, lr=outer_lr, momentum=outer_momentum,
                                                 nesterov=outer_momentum > 0) for w in self.global_weights]
        self.steps, self.in_flight = 0, {}

    def step(self):
        """One inner step; then start the all-reduces and apply the outer steps now due."""
        self.inner_optimizer.step()
        self.steps += 1
        F = len(self.fragments)
        for i in schedule.due(self.steps, self.H, F):
            self._start(i)
        for i in schedule.due(self.steps, self.H, F, self.delay):
            self._apply(i)

    def zero_grad(self, set_to_none=True):
        self.inner_optimizer.zero_grad(set_to_none=set_to_none)

    def global_parameters(self):
        """w, the global weights, as tensors in the order of the inner optimizer's parameters."""
        F = len(self.fragments)
        return [self.global_weights[j % F][j // F] for j in range(sum(map(len, self.fragments)))]

    def wait(self):
        """Wait for the all-reduces still in flight (at the end of training: every rank's
        communication thread is then idle); their outer steps are not applied."""
        for pending in self.in_flight.values():
            if isinstance(pending, background.Handle):
                pending.wait()
        self.in_flight.clear()

    def _start(self, i):
        # Delta = w - w_r on fragment i, one flat buffer: (Psi_i,)
        delta = torch.cat([(w - p.detach()).reshape(-1) for w, p in zip(self.global_weights[i], self.fragments[i])])
        if self.delay:  # overlapped with the next tau inner steps
            self.in_flight[i] = background.start(self._average, delta)
        else:
            self.in_flight[i] = self._average(delta)

    def _average(self, delta):
        return self.compressor.aggregate(delta, group=self.group)[0]  # (1/N) sum_r C(Delta_r)

    def _apply(self, i):
        pending = self.in_flight.pop(i)
        mean = pending.wait() if isinstance(pending, background.Handle) else pending
        offset = 0
        for w in self.global_weights[i]:
            w.grad = mean[offset:offset + w.numel()].view_as(w).to(w.dtype)
            offset += w.numel()
        self.outer_optimizers[i].step()  # buf <- nu buf + Delta; w <- w - eta (Delta + nu buf)
        with torch.no_grad():
            for p, w in zip(self.fragments[i], self.global_weights[i]):
                p.lerp_(w, 1 - self.mixing)  # w_r <- omega w_r + (1 - omega) w; exactly w at omega = 0
                w.grad = None
