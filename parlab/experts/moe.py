"""A mixture-of-experts MLP in one process: the reference that expert parallelism must equal.

    x (..., h) -> tokens (T, h) --router (h -> E)--> logits (T, E)
        in each group of T / groups tokens: route (top-k, capacity per group)
    dispatch: each group's kept rows in expert order, group 0's rows first
    run_experts: expert e on its rows of every group (an MLP h -> 4h -> h)
    combine: each group's rows back at their tokens, weighted by the gates -> (..., h)

The experts are ``parlab.gpt``'s MLP, so an MoE can take the place of a GPT layer's MLP (and
start from copies of its weights). The router is a linear layer without bias, as Switch
Transformer's and Mixtral's. Groups are GShard's: tokens are routed, and the capacity counted,
within a group, as each rank of expert parallelism routes its own tokens; groups = 1 routes
the whole batch at once. ``moe.aux_loss``, after a forward, is Switch Transformer's
load-balancing loss (the mean over groups); add it to the training loss.
"""

import torch
from torch import nn

from parlab._checks import real_number, whole_number
from parlab.experts.routing import (
    checked_k,
    combine_choices,
    dispatch_order,
    expert_capacity,
    load_balancing_loss,
    route,
)
from parlab.gpt import MLP, GPTConfig

__all__ = ["MoE", "run_experts"]


class MoE(nn.Module):
    """E experts (MLPs h -> 4h -> h), k per token, a router h -> E (module docstring).

    ``forward(x, groups=1)``: x (..., h) -> (..., h). Afterwards ``aux_loss`` holds the
    load-balancing loss (``load_balancing_loss`` with ``aux_loss_coefficient``, averaged over
    the groups) and ``routings`` each group's ``Routing``: its dropped pairs, its
    ``tokens_per_expert``."""

    def __init__(self, h, E, k=1, capacity_factor=1.25, aux_loss_coefficient=0.01):
        super().__init__()
        self.h = whole_number("h (hidden size)", h, "give the width of the tokens the layer reads.")
        self.E = whole_number("E (experts)", E, "build at least one expert.")
        self.k = checked_k(k, self.E)
        self.capacity_factor = real_number("capacity_factor", capacity_factor,
                                           "choose a slack above 0, e.g. 1.25 (Switch Transformer).", above=True)
        self.aux_loss_coefficient = real_number("aux_loss_coefficient", aux_loss_coefficient,
                                                "choose a small weight such as 0.01 (Switch Transformer), or 0.")
        self.router = nn.Linear(h, E, bias=False)
        # a = 1 head: the MLP reads only h, and any h is a valid one-head GPTConfig
        self.experts = nn.ModuleList(MLP(GPTConfig(h=h, a=1)) for _ in range(E))
        self.aux_loss, self.routings = None, []

    def forward(self, x, groups=1):
        # route: each group of T / groups tokens on its own, with a capacity counted on it
        tokens = flat_tokens(x, self.h)                                   # (T, h)
        T = tokens.shape[0]
        groups = whole_number("groups", groups, "route the tokens in 1 group or more.")
        if T % groups:
            raise ValueError(f"T = {T} tokens do not split into {groups} equal groups: choose a batch of a "
                             f"multiple of {groups} tokens.")
        logits = self.router(tokens)                                      # (T, E)
        capacity = expert_capacity(T // groups, self.E, self.k, self.capacity_factor)
        self.routings = [route(part, self.k, capacity) for part in logits.split(T // groups)]
        self.aux_loss = sum(load_balancing_loss(r.probs, r.expert, self.aux_loss_coefficient)
                            for r in self.routings) / groups
        # dispatch: the groups' rows one after another, as an all-to-all delivers the ranks' rows
        orders, counts = zip(*(dispatch_order(r) for r in self.routings))
        rows = [part[order // self.k] for part, order in zip(tokens.split(T // groups), orders)]
        outputs = run_experts(self.experts, torch.cat(rows), torch.stack(counts))   # (n, h)
        # combine: each group's outputs back at its tokens
        outputs = outputs.split([len(order) for order in orders])
        y = [combine_choices(out, r, order) for out, r, order in zip(outputs, self.routings, orders)]
        return torch.cat(y).view_as(x)


def run_experts(experts, rows, counts):
    """Each expert on its rows, all sources at once; the outputs in the order of ``rows``.

    rows (n, h): source-major, as an all-to-all delivers them: source 0's rows for expert 0,
    for expert 1, ..., then source 1's; counts (sources, experts): how many rows each source
    sent each expert (a source is a group of ``MoE``, a rank of expert parallelism). Expert e
    runs once, on its rows of source 0, then source 1, ..."""
    sources, held = counts.shape
    pieces = rows.split(counts.flatten().tolist())                  # pieces[source x held + e]
    outputs = [None] * len(pieces)
    for e, expert in enumerate(experts):
        mine = [source * held + e for source in range(sources)]
        out = expert(torch.cat([pieces[i] for i in mine]))          # (expert e's rows from every source, h)
        for i, piece in zip(mine, out.split(counts[:, e].tolist())):
            outputs[i] = piece
    return torch.cat(outputs)


def flat_tokens(x, h):
    """x (..., h) as (T, h), T the product of the leading dimensions; refuses another width."""
    if x.dim() < 1 or x.shape[-1] != h:
        raise ValueError(f"the layer was built for h = {h} features per token, but x has shape {tuple(x.shape)}: "
                         f"pass tokens of shape (..., {h}).")
    return x.reshape(-1, h)

