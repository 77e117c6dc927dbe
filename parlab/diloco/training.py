"""DDP, local SGD, DiLoCo and Streaming DiLoCo on one problem, under one regime: loss of
the global model against inner steps and wall time (lecture 10's curves and ``parlab bench
diloco``).

    problem = NoisyQuadratic(d=2**18, seconds=0.02)
    curve = curve_of(cluster.run(train, "diloco", problem, steps=32, H=8), problem)

The problem must carry enough bytes for a link's bandwidth to matter: lecture 06's least
squares has 32 weights, whose messages only pay latency, and computing its gradient for a
d of a million takes an m x d matrix per step. Here the gradient is cheap at any d: a noisy
quadratic with diagonal curvature c_j spread from 0.1 to 1 (a condition number of 10),

    f(w) = (1/2d) sum_j c_j (w_j - 1)^2,     g_r = c (w - 1) + noise xi_r,  xi_r ~ N(0, I)

with xi_r drawn from rank r's generator seeded by rank and step, and ``seconds`` of declared
compute per gradient (``emulation.compute``): what a model of d fp32 weights would take. Its
d weights are ``tensors`` tensors (a model's layers), which Streaming DiLoCo cuts into
fragments. Every method uses the inner optimizer SGD with gamma = ``lr``:

- ddp: the gradients averaged every step (parlab's ring all-reduce, ``local_sgd.average_gradients``);
- local: local SGD, the weights averaged every H steps (``local_sgd.average_parameters``);
- diloco: ``DiLoCo`` with Nesterov outer steps (eta, nu);
- streaming: ``DiLoCo`` with F fragments, delay tau, mixing omega and a compressor.

The loss is that of the global model, the one the method would hand over after each step:
DDP's w, local SGD's last average, DiLoCo's w. Rank 0 evaluates it; every rank records its
time, and a step's time is the last rank's.
"""

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from parlab import trace
from parlab._checks import whole_number
from parlab.async_sgd import local_sgd
from parlab.diloco.costs import METHODS
from parlab.diloco.outer import DiLoCo
from parlab.runtime import emulation


@dataclass(frozen=True)
class NoisyQuadratic:
    """d fp32 weights in ``tensors`` tensors, gradient noise of standard deviation ``noise``,
    ``seconds`` of declared compute per gradient, inner learning rate ``lr`` (gamma)."""

    d: int = 2**18
    tensors: int = 4
    noise: float = 0.3
    seconds: float = 0.02
    lr: float = 0.5

    def __post_init__(self):
        whole_number("d", self.d, "e.g. d=2**18 weights.")
        whole_number("tensors", self.tensors, "e.g. tensors=4.")
        if self.d % self.tensors:
            raise ValueError(f"d = {self.d} does not split into {self.tensors} tensors: pick d a multiple of tensors.")

    def parameters(self):
        """The starting weights, w = 0: ``tensors`` parameters of d / tensors elements each."""
        return [torch.nn.Parameter(torch.zeros(self.d // self.tensors)) for _ in range(self.tensors)]

    def curvature(self):
        return torch.linspace(0.1, 1.0, self.d)  # c, (d,)

    def set_gradients(self, parameters, rank, step):
        """Each parameter's .grad = its part of g_r at rank ``rank``'s batch ``step``; takes
        ``seconds`` of declared compute."""
        noise = torch.randn(self.d, generator=torch.Generator().manual_seed(10_000 * rank + step))
        with trace.span("gradient"):
            emulation.compute(self.seconds, step)
        w = torch.cat([p.detach() for p in parameters])  # (d,)
        g = self.curvature() * (w - 1) + self.noise * noise
        for p, part in zip(parameters, g.split(self.d // self.tensors)):
            p.grad = part.clone()

    def loss(self, parameters):
        """f at the weights ``parameters``."""
        w = torch.cat([p.detach().reshape(-1) for p in parameters])
        return (0.5 * (self.curvature() * (w - 1).pow(2)).mean()).item()


def train(method, problem, steps, H=8, outer_lr=0.7, outer_momentum=0.9, fragments=1, delay=0, mixing=0.0,
          compressor=None):
    """Run ``method`` (one of ``METHODS``) for ``steps`` inner steps on every rank; returns this
    rank's records [(perf_counter time, loss of the global model or None off rank 0)], the
    first at the start. H: local SGD's and DiLoCo's inner steps per synchronisation; the
    rest are DiLoCo's (``fragments``, ``delay``, ``mixing``, ``compressor``: streaming only)."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {', '.join(METHODS)}; got {method!r}.")
    steps = whole_number("steps", steps, "e.g. steps=32 inner steps.")
    rank = dist.get_rank()
    parameters = problem.parameters()
    inner = torch.optim.SGD(parameters, lr=problem.lr)
    diloco = None
    if method in ("diloco", "streaming"):
        streaming = dict(fragments=fragments, delay=delay, mixing=mixing, compressor=compressor)
        diloco = DiLoCo(inner, H, outer_lr, outer_momentum, **(streaming if method == "streaming" else {}))
    global_weights = diloco.global_parameters() if diloco else parameters
    if method == "local":  # between averagings the replicas differ: the global model is the last average
        global_weights = [p.detach().clone() for p in parameters]
    dist.barrier()  # a common start (not part of any method, not shaped)
    records = [(time.perf_counter(), problem.loss(global_weights) if rank == 0 else None)]
    for step in range(steps):
        with trace.span("step"):
            problem.set_gradients(parameters, rank, step)
            if method == "ddp":
                local_sgd.average_gradients(parameters)
            (diloco or inner).step()
            inner.zero_grad()
            if method == "local" and (step + 1) % H == 0:
                local_sgd.average_parameters(parameters)
                global_weights = [p.detach().clone() for p in parameters]
        records.append((time.perf_counter(), problem.loss(global_weights) if rank == 0 else None))
    if diloco:
        diloco.wait()
    return records


def curve_of(results):
    """From every rank's records: [(seconds since the start, inner step, loss of the global
    model)]; a step's time is the last rank's."""
    start = min(records[0][0] for records in results)
    return [(max(t for t, _ in row) - start, step, row[0][1]) for step, row in enumerate(zip(*results))]


def time_to_loss(curve, target):
    """(seconds from the start, inner step) where the curve's loss is first at or below
    ``target``; (None, None) if never."""
    return next(((seconds, step) for seconds, step, loss in curve if loss <= target), (None, None))


def communication_share(curve, compute_s):
    """The share of the wall time not spent in declared compute: 1 - steps t_c / total time."""
    seconds, steps, _ = curve[-1]
    return 1 - steps * compute_s / seconds
