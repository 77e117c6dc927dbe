"""The small GPT trained with context parallelism on a ``parlab.Mesh`` of cp x dp ranks.

    mesh = parlab.Mesh(dp=2, cp=2)                              # 4 ranks
    trainer = ContextParallelTrainer(GPT(config), mesh, lr=1e-3)
    loss = trainer.step(tokens, targets)                        # the same batch on every rank

One step on the whole batch of B sequences of s tokens (every rank passes the same batch):

    cut      replica i_dp takes its B/dp sequences, and cp rank r its positions of them
             (``shard_sequence(..., split="zigzag", dim=1)``): (B/dp, s/cp) tokens and targets
    forward  ``ContextParallelGPT`` over ``mesh.group("cp")``: every layer on the rank's
             positions, the attention's K/V from the cp group (ring attention by default)
    loss     the sum of the rank's B s / (dp cp) cross-entropies over B s, all tokens of the step
    backward autograd; the attention's backward sends dK, dV to their owners
    reduce   every gradient summed over ``mesh.group("dp", "cp")`` (one ring all-reduce of a
             flat buffer): the ranks hold the same parameters and different tokens, and each
             loss already divides by all B s tokens, so the sum is the gradient of the batch's
             mean loss and there is nothing left to divide
    update   the optimizer (Adam by default), the same step on every rank

Bytes each rank sends per step: in the cp group, L attentions' forward and backward
(``bytes_per_rank`` with b = B/dp, per layer); over the N = dp cp ranks, the ring
all-reduce's 2 (N - 1)/N x 4 Psi bytes of fp32 gradients (when N divides Psi). Spans "forward", "backward", "gradient
all-reduce" and "optimizer" mark the phases in a trace.
"""

import torch

from parlab import trace
from parlab.collectives import ring_all_reduce
from parlab.context_parallel.gpt import ContextParallelGPT
from parlab.context_parallel.ring import ring_attention
from parlab.context_parallel.splits import shard_sequence
from parlab.runtime.mesh import Mesh

__all__ = ["ContextParallelTrainer"]


class ContextParallelTrainer:
    """This rank's part of training ``gpt`` (a ``parlab.gpt.GPT``, the same on every rank) on
    ``mesh`` (a ``parlab.Mesh`` with dp and cp axes only; module docstring). ``attention``:
    the context-parallel attention (``ring_attention``, ``all_gather_attention`` or
    ``ulysses_attention``); ``split``: "zigzag" (balanced causal work) or "contiguous";
    ``optimizer_class`` and ``**optimizer_kwargs``: the optimizer (Adam).

    Attributes: ``model`` (the ``ContextParallelGPT``), ``optimizer``, ``gradients`` (after
    a ``step(..., keep_gradients=True)``: the summed gradients by name, before the update)."""

    def __init__(self, gpt, mesh, attention=ring_attention, split="zigzag", optimizer_class=torch.optim.Adam,
                 **optimizer_kwargs):
        if not isinstance(mesh, Mesh):
            raise ValueError(f"mesh must be a parlab.Mesh, got {type(mesh).__name__}: build one on every rank, e.g. "
                             "parlab.Mesh(dp=2, cp=2).")
        others = {axis: mesh.size(axis) for axis in ("tp", "pp", "ep") if mesh.size(axis) > 1}
        if others:
            raise ValueError(f"ContextParallelTrainer trains on the dp and cp axes; this mesh has "
                             f"{', '.join(f'{axis} = {size}' for axis, size in others.items())}: build it with "
                             "dp and cp only.")
        self.mesh, self.split, self.gradients = mesh, split, None
        self.dp, self.cp = mesh.size("dp"), mesh.size("cp")
        self.model = ContextParallelGPT(gpt, mesh.group("cp"), attention, split)
        self.optimizer = optimizer_class(self.model.parameters(), **optimizer_kwargs)
        self.data_group = mesh.group("dp", "cp")

    def step(self, tokens, targets, keep_gradients=False):
        """One training step on the batch (B, s): B a multiple of dp, s of 2 cp (zig-zag) or
        cp. Returns this rank's share of the batch's mean loss before the update (a float):
        summed over all ranks it is the mean."""
        B, s = tokens.shape
        if B % self.dp:
            raise ValueError(f"a batch of {B} sequences does not split over dp = {self.dp} replicas: use a multiple "
                             f"of {self.dp}.")
        tokens, targets = (self.my_part(x) for x in (tokens, targets))  # (B/dp, s/cp)
        self.optimizer.zero_grad()
        with trace.span("forward"):
            loss = self.model.loss(tokens, targets, tokens_in_batch=B * s)
        with trace.span("backward"):
            loss.backward()
        with trace.span("gradient all-reduce"):
            self.sum_gradients()
        self.gradients = {name: p.grad.clone() for name, p in self.model.named_parameters()} \
            if keep_gradients else None
        with trace.span("optimizer"):
            self.optimizer.step()
        return loss.item()

    def my_part(self, x):
        """This rank's part of a (B, s) batch: its replica's B/dp sequences, its cp positions of them."""
        sequences = x.tensor_split(self.dp)[self.mesh.coordinate("dp")]
        return shard_sequence(sequences, self.cp, self.mesh.coordinate("cp"), self.split, dim=1)  # (B/dp, s/cp)

    def sum_gradients(self):
        """Sum every parameter's gradient over the dp x cp ranks, in one flat buffer."""
        if self.dp * self.cp == 1:
            return
        params = list(self.model.parameters())  # every one has a gradient: every rank uses every parameter
        with torch.no_grad():
            flat = torch.cat([p.grad.flatten() for p in params])  # (Psi,)
            ring_all_reduce(flat, check=False, group=self.data_group)
            for p, summed in zip(params, flat.split([p.numel() for p in params])):
                p.grad.copy_(summed.view_as(p))
