"""Expert and data parallelism together: an ``MoEGPT`` trained on the ep and dp axes of a mesh.

    mesh = parlab.Mesh(dp=2, ep=2)                              # 4 ranks
    trainer = ExpertDataParallel(MoEGPT(config, E=4, k=2), mesh, lr=1e-3)
    loss_r = trainer.step(tokens, targets)                      # the same batch on every rank

Who holds what. The R = dp x ep ranks all hold the dense parameters (embeddings, attention,
norms, dense MLPs, the routers) and read different tokens: rank r of
``mesh.group("dp", "ep")`` (r = i_dp ep + i_ep) reads the r-th of the batch's R shards of
B / R sequences. Each MoE layer is split over ``mesh.group("ep")`` (``ExpertParallelMoE``):
rank i_ep keeps experts i_ep E/ep .. (i_ep + 1) E/ep - 1 and the ep ranks of one replica
trade tokens by all-to-all; expert e lives on one rank per replica, ``mesh.group("dp")``.

Gradients. Rank r's loss is loss_r, its shard's mean cross-entropy plus its layers'
``aux_loss``; the step's loss is their mean, L = (1/R) sum_r loss_r, which is the one-process
model's ``loss(tokens, targets, groups=R)`` (``parlab.experts.gpt``). After every rank's
``loss_r.backward()``:

    dense theta (router included): rank r holds d loss_r / d theta, from its tokens only.
        The mean over group("dp", "ep") is (1/R) sum_r d loss_r / d theta = dL / d theta.
    expert theta_e on rank (i_dp, i_ep): the reverse all-to-all already brought it every
        token of replica i_dp's ep ranks: sum over those ranks of d loss_r / d theta_e.
        Divided by ep (as ``ExpertParallelMoE.average_gradients`` divides) it is replica
        i_dp's mean; the mean over group("dp") of the replicas' means is
        (1/dp) sum_i_dp (1/ep) sum_(r in replica i_dp) d loss_r / d theta_e = dL / d theta_e.

``ExpertParallelMoE.average_gradients`` averages the router over ep alone (one replica);
here it joins the dense parameters' one all-reduce over dp x ep. Every rank holding a
parameter then holds the same gradient, and the optimizer (Adam by default) keeps their
copies equal. With cp = 1 the expert group is dp; context parallelism would add its axis to
both groups (``parlab.Mesh``'s docstring), which this trainer does not do.
"""

import torch
import torch.distributed as dist

from parlab import trace
from parlab._checks import optimizer_class as checked_optimizer_class
from parlab.collectives import ring_all_reduce
from parlab.experts.gpt import MoEGPT
from parlab.experts.moe import MoE
from parlab.experts.parallel import ExpertParallelMoE
from parlab.runtime.mesh import Mesh

__all__ = ["ExpertDataParallel"]


class ExpertDataParallel:
    """This rank's part of ``model`` (an ``MoEGPT``, the same on every rank: one seed) trained
    on ``mesh``'s dp and ep axes (a ``parlab.Mesh`` with pp = tp = cp = 1; module docstring).
    Replaces each of the model's ``MoE`` layers by an ``ExpertParallelMoE`` over
    ``mesh.group("ep")`` holding this rank's E / ep experts (the others are dropped).

    Attributes: ``model``, ``optimizer`` (``optimizer_class`` over every parameter this rank
    holds, with ``**optimizer_kwargs``), ``shard`` and ``shards`` (this rank's place r and
    R = dp x ep), ``gradients`` (after a step with ``keep_gradients``)."""

    def __init__(self, model, mesh, optimizer_class=torch.optim.Adam, **optimizer_kwargs):
        if not isinstance(model, MoEGPT):
            raise ValueError(f"ExpertDataParallel trains a parlab.experts.MoEGPT, got {type(model).__name__}: build "
                             "MoEGPT(config, E, k) with one seed on every rank and pass it.")
        if not isinstance(mesh, Mesh):
            raise ValueError(f"mesh must be a parlab.Mesh, got {type(mesh).__name__}: build one on every rank, e.g. "
                             "parlab.Mesh(dp=2, ep=2).")
        others = {axis: mesh.size(axis) for axis in ("pp", "tp", "cp") if mesh.size(axis) > 1}
        if others:
            given = ", ".join(f"{axis} = {size}" for axis, size in others.items())
            raise ValueError(f"ExpertDataParallel trains on the dp and ep axes; this mesh has {given}: build it with "
                             "only dp and ep, e.g. parlab.Mesh(dp=2, ep=2).")
        self.model, self.mesh = model, mesh
        self.ep_group, self.dp_group, self.data_group = mesh.group("ep"), mesh.group("dp"), mesh.group("dp", "ep")
        self.ep, self.shards, self.shard = mesh.size("ep"), dist.get_world_size(self.data_group), \
            dist.get_rank(self.data_group)
        for block in model.blocks:
            if isinstance(block.mlp, MoE):
                block.mlp = ExpertParallelMoE(block.mlp, self.ep_group)
        held = {id(p) for layer in model.moe_layers() for p in layer.experts.parameters()}
        self.experts = [p for p in model.parameters() if id(p) in held]
        self.dense = [p for p in model.parameters() if id(p) not in held]
        self.optimizer = checked_optimizer_class(optimizer_class)(model.parameters(), **optimizer_kwargs)
        self.gradients = None

    def step(self, tokens, targets, keep_gradients=False):
        """One training step on the batch (B sequences, B a multiple of R, the same on every
        rank): forward and backward of this rank's B / R sequences, ``average_gradients``,
        the optimizer's step. Returns loss_r, this rank's loss (L is the ranks' mean). With
        ``keep_gradients``, ``gradients`` holds the averaged gradients by the one-process
        model's names (``full_gradients``), else None."""
        B = len(tokens)
        if B % self.shards:
            raise ValueError(f"a batch of {B} sequences does not split into dp x ep = {self.shards} shards: use a "
                             f"multiple of {self.shards}.")
        tokens, targets = tokens.tensor_split(self.shards)[self.shard], targets.tensor_split(self.shards)[self.shard]
        self.optimizer.zero_grad()
        with trace.span("forward"):
            loss = self.model.loss(tokens, targets)
        with trace.span("backward"):
            loss.backward()
        self.average_gradients()
        self.gradients = self.full_gradients() if keep_gradients else None
        with trace.span("optimizer"):
            self.optimizer.step()
        return loss.item()

    def average_gradients(self):
        """Experts: divided by ep, then averaged over group("dp"); dense parameters: averaged
        over group("dp", "ep") (module docstring)."""
        with torch.no_grad():
            for p in self.experts:
                if p.grad is not None:
                    p.grad /= self.ep
            average(self.experts, self.dp_group)
            average(self.dense, self.data_group)

    def full_gradients(self):
        """{name: a copy of the gradient} of every parameter this rank holds, by the names of
        the ``MoEGPT`` built in one process: this rank's experts i = 0 .. E/ep - 1 of a layer
        are that layer's experts first + i."""
        first = {f"blocks.{i}.mlp": block.mlp.first_expert for i, block in enumerate(self.model.blocks)
                 if isinstance(block.mlp, ExpertParallelMoE)}
        gradients = {}
        for name, p in self.model.named_parameters():
            layer, is_expert, rest = name.partition(".experts.")
            if is_expert:
                i, rest = rest.split(".", 1)
                name = f"{layer}.experts.{first[layer] + int(i)}.{rest}"
            gradients[name] = p.grad.clone()
        return gradients


def average(parameters, group):
    """Average the gradients of ``parameters`` over ``group`` in place: one ring all-reduce of
    them flattened end to end (a gradient that backward left as None counts as zeros)."""
    if dist.get_world_size(group) == 1 or not parameters:
        return
    for p in parameters:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    flat = torch.cat([p.grad.flatten() for p in parameters])
    with trace.span("all-reduce"):
        ring_all_reduce(flat, "avg", check=False, group=group)
    for p, g in zip(parameters, flat.split([p.numel() for p in parameters])):
        p.grad.copy_(g.view_as(p))
