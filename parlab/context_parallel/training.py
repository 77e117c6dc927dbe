"""The small GPT trained with context parallelism on a ``parlab.Mesh`` of cp x dp ranks, and
tensor parallelism inside each cp rank: cp x tp or cp x tp x dp.

    mesh = parlab.Mesh(dp=2, cp=2)                              # 4 ranks; or Mesh(dp=2, cp=2, tp=2)
    trainer = ContextParallelTrainer(GPT(config), mesh, lr=1e-3)
    loss = trainer.step(tokens, targets)                        # the same batch on every rank

One step on the whole batch of B sequences of s tokens (every rank passes the same batch):

    cut      replica i_dp takes its B/dp sequences, and cp rank r its positions of them
             (``shard_sequence(..., split="zigzag", dim=1)``): (B/dp, s/cp) tokens and targets,
             the same on the t ranks of a tp group
    forward  ``ContextParallelGPT`` over ``mesh.group("cp")``: every layer on the rank's
             positions, the attention's K/V from the cp group (ring attention by default);
             with tp > 1 ``ParallelGPT(gpt, mesh.group("tp"), sequence_parallel,
             context_group=mesh.group("cp"))``: the same on the rank's a/t heads and h/t, 4h/t
             or V/t features, Megatron's collectives in the tp group
    loss     the sum of the rank's B s / (dp cp) cross-entropies over B s, all tokens of the step
    backward autograd; the attention's backward sends dK, dV to their owners; with sequence
             parallelism the replicated parameters' gradients are summed over the tp group
             (``reduce_sequence_parallel_gradients``)
    reduce   every gradient summed over ``mesh.group("dp", "cp")`` (one ring all-reduce of a
             flat buffer; each tp rank its own shard, with the dp x cp ranks of its tp
             coordinate): the ranks hold the same parameters and different tokens, and each
             loss already divides by all B s tokens, so the sum is the gradient of the batch's
             mean loss and there is nothing left to divide
    update   the optimizer (Adam by default), the same step on every rank

Bytes each rank sends per step, b = B/dp, n = s/cp: in the cp group, L attentions' forward
and backward, ``bytes_per_rank(method, b, s, h/t, cp)`` per layer (a rank's K/V carry its a/t
heads, h/t features); in the tp group (t > 1), per layer the ring all-reduces of the two g in
forward and the two f in backward, 2 (t - 1)/t x 4 b n h bytes each, plus the embedding's g,
the head's f and the cross-entropy's three all-reduces of b n numbers (with sequence
parallelism an all-gather and a reduce-scatter in place of each all-reduce of b n h, their
bytes together the same, and after backward one all-reduce of the replicated parameters'
gradients); over the N = dp cp ranks, the ring all-reduce's 2 (N - 1)/N x 4 Psi/t
bytes of fp32 gradients (Psi/t: the rank's shard; when N divides it). Spans "forward",
"backward", "gradient all-reduce" and "optimizer" mark the phases in a trace.
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
    ``mesh`` (a ``parlab.Mesh`` with dp, cp and tp axes only; module docstring). ``attention``:
    the context-parallel attention (``ring_attention``, ``all_gather_attention`` or
    ``ulysses_attention``); ``split``: "zigzag" (balanced causal work) or "contiguous";
    ``optimizer_class`` and ``**optimizer_kwargs``: the optimizer (Adam);
    ``sequence_parallel``: with tp > 1, Megatron's sequence parallelism in the tp group.

    Attributes: ``model`` (the ``ContextParallelGPT``, or with tp > 1 the ``ParallelGPT``),
    ``optimizer``, ``gradients`` (after a ``step(..., keep_gradients=True)``: the summed
    gradients by name, before the update)."""

    def __init__(self, gpt, mesh, attention=ring_attention, split="zigzag", optimizer_class=torch.optim.Adam,
                 sequence_parallel=False, **optimizer_kwargs):
        if not isinstance(mesh, Mesh):
            raise ValueError(f"mesh must be a parlab.Mesh, got {type(mesh).__name__}: build one on every rank, e.g. "
                             "parlab.Mesh(dp=2, cp=2).")
        others = {axis: mesh.size(axis) for axis in ("pp", "ep") if mesh.size(axis) > 1}
        if others:
            raise ValueError(f"ContextParallelTrainer trains on the dp, cp and tp axes; this mesh has "
                             f"{', '.join(f'{axis} = {size}' for axis, size in others.items())}: build it with "
                             "dp, cp and tp only.")
        self.mesh, self.split, self.gradients = mesh, split, None
        self.dp, self.cp, self.tp = mesh.size("dp"), mesh.size("cp"), mesh.size("tp")
        self.sequence_parallel = sequence_parallel and self.tp > 1
        if self.tp > 1:
            # imported here: parlab.tensor_parallel.model imports this package's attention, so
            # importing it at the top would make the two packages' imports wait on each other
            from parlab.tensor_parallel.model import ParallelGPT

            self.model = ParallelGPT(gpt, mesh.group("tp"), self.sequence_parallel, context_group=mesh.group("cp"),
                                     attention=attention, split=split)
        else:
            self.model = ContextParallelGPT(gpt, mesh.group("cp"), attention, split)
        self.optimizer = optimizer_class(self.model.parameters(), **optimizer_kwargs)
        self.data_group = mesh.group("dp", "cp")

    def step(self, tokens, targets, keep_gradients=False):
        """One training step on the batch (B, s): B a multiple of dp, s of 2 cp (zig-zag) or
        cp (and of cp t with sequence parallelism). Returns this rank's share of the batch's
        mean loss before the update (a float): summed over the dp x cp ranks it is the mean
        (the t ranks of a tp group hold the same share)."""
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
        if self.sequence_parallel:
            self.model.reduce_sequence_parallel_gradients()
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
        """Sum every parameter's gradient (with tp, this rank's shard) over the dp x cp ranks, in one flat buffer."""
        if self.dp * self.cp == 1:
            return
        params = list(self.model.parameters())  # every one has a gradient: every rank uses every parameter
        with torch.no_grad():
            flat = torch.cat([p.grad.flatten() for p in params])  # (Psi,)
            ring_all_reduce(flat, check=False, group=self.data_group)
            for p, summed in zip(params, flat.split([p.numel() for p in params])):
                p.grad.copy_(summed.view_as(p))
