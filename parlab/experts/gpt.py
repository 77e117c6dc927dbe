"""The small GPT with mixture-of-experts MLPs: Switch Transformer's and GShard's model, at
the size of lectures 07 and 08.

    MoEGPT(config, E, k, capacity_factor, aux_loss_coefficient, every)
        blocks 0, every, 2 every, ...: the MLP replaced by a ``MoE`` of E MLP experts (k per token)
        the other blocks: ``parlab.gpt``'s dense MLP, as before
    loss(tokens, targets, groups=1) = cross-entropy + sum over the MoE layers of their aux_loss

Only the MLP module changes, so the names are the GPT's with the MoE's inside:
``blocks.0.mlp.router.weight``, ``blocks.0.mlp.experts.3.fc1.weight``. every = 2 (an MoE in
every other layer) is Switch Transformer's and GShard's choice; every = 1 Mixtral's.

Routing groups. Capacity is counted per group of tokens routed together (``MoE.forward(x,
groups)``): expert parallelism routes each rank's tokens on their own, so the one process
that computes what R ranks compute routes the batch of B sequences in R groups of B/R
sequences (group g the g-th B/R sequences: rank g's shard), ``model.loss(tokens, targets,
groups=R)``. The loss is then the ranks' L = (1/R) sum_r (loss_r + aux_r): the mean
cross-entropy over the batch plus each layer's auxiliary loss averaged over the groups.
"""

import torch.nn.functional as F

from parlab._checks import whole_number
from parlab.experts.moe import MoE
from parlab.experts.parallel import ExpertParallelMoE
from parlab.gpt import GPT

__all__ = ["GPTLayerMoE", "MoEGPT"]


class GPTLayerMoE(MoE):
    """A ``MoE`` in the place of a GPT block's MLP. ``Block`` calls ``mlp(n)``, so the routing
    groups are an attribute, ``groups``, which ``MoEGPT.forward`` sets before each call."""

    groups = 1

    def forward(self, x):
        return super().forward(x, groups=self.groups)


class MoEGPT(GPT):
    """``parlab.gpt.GPT`` whose MLP in blocks 0, every, 2 every, ... is a ``GPTLayerMoE`` of E
    experts, k per token, ``capacity_factor`` and ``aux_loss_coefficient`` as in ``MoE``.
    Built after the GPT's own layers (its dense MLPs in those blocks are dropped), so one
    seed gives one model on every rank."""

    def __init__(self, config, E=4, k=1, capacity_factor=1.25, aux_loss_coefficient=0.01, every=1):
        super().__init__(config)
        self.every = whole_number("every", every, "put an MoE in every layer (1), every other layer (2), ...")
        for block in self.blocks[::self.every]:
            block.mlp = GPTLayerMoE(config.h, E, k, capacity_factor, aux_loss_coefficient)

    def moe_layers(self):
        """The blocks' MoE layers, first block first: ``MoE``s, or ``ExpertParallelMoE``s once a
        trainer has split their experts over ranks."""
        return [block.mlp for block in self.blocks if isinstance(block.mlp, (MoE, ExpertParallelMoE))]

    def forward(self, tokens, groups=1):
        """(b, s) characters -> (b, s, V) logits, each MoE routing the b s tokens in ``groups``
        groups of b s / groups (module docstring). An ``ExpertParallelMoE`` routes its rank's
        tokens as one group: give it groups = 1."""
        groups = whole_number("groups", groups, "route the batch in 1 group or more (one per rank).")
        for layer in self.moe_layers():
            if not isinstance(layer, ExpertParallelMoE):
                layer.groups = groups
            elif groups != 1:
                raise ValueError(f"an expert-parallel layer routes its rank's tokens as one group, got groups = "
                                 f"{groups}: pass groups=1 on the ranks (the one-process model takes groups = R).")
        return super().forward(tokens)

    def loss(self, tokens, targets, groups=1):
        """Mean cross-entropy over the b s positions plus every MoE layer's ``aux_loss``
        (each one's mean over the routing groups)."""
        cross_entropy = F.cross_entropy(self(tokens, groups).flatten(0, 1), targets.flatten())
        return cross_entropy + sum(layer.aux_loss for layer in self.moe_layers())
