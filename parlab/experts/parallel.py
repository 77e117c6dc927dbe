"""Expert parallelism: the E experts of an MoE split over the ep ranks of a process group.

    rank r: its tokens (T, h) --router (replicated)--> route: its own tokens, its own capacity
    dispatch:  kept rows per expert (ep, E/ep) --all-to-all--> rows each rank sends each of my experts
               rows tokens[order // k] --all-to-all (split sizes)--> rows from every rank, rank 0's first
    run_experts: each of my E/ep experts once, on its rows from every rank
    combine:   outputs --the reverse all-to-all--> my rows back, in the order I sent them
               combine_choices: each row at its (token, choice), weighted by its gate -> (T, h)
    backward:  an all-to-all's gradient goes back by the reverse all-to-all (``AllToAll``)

Rank r of the group holds experts r E/ep .. (r + 1) E/ep - 1, so the rows sorted by expert
are already sorted by the rank they go to. Built from the same ``MoE`` on every rank (one
seed), the ranks compute that MoE on the concatenation of their tokens with ``groups = ep``:
each rank is a GShard group, routing its own T tokens with a capacity of its own, as GShard,
DeepSpeed-MoE and Megatron-LM count it.

Gradients. The training loss is L = (1/ep) sum_r loss_r, loss_r rank r's mean loss plus its
``aux_loss``. After ``loss_r.backward()`` an expert's gradient already sums every rank's
contribution (the reverse all-to-all brought them to its owner): it is divided by ep. The
router's gradient covers rank r's tokens only: it is averaged over the group by an
all-reduce. ``average_gradients`` does both. Every collective takes ``group`` (later
``mesh.group("ep")``) and stays inside it; ``cluster.trace`` records each all-to-all.
"""

from typing import NamedTuple

import torch
from torch import nn

from parlab import collectives, trace
from parlab._checks import place_in
from parlab.collectives import ring_all_reduce
from parlab.experts.moe import MoE, flat_tokens, run_experts
from parlab.experts.routing import combine_choices, dispatch_order, expert_capacity, load_balancing_loss, route

__all__ = ["AllToAll", "Dispatch", "ExpertParallelMoE", "all_to_all", "all_to_all_bytes", "balanced_all_to_all_bytes",
           "combine", "dispatch", "experts_per_rank", "traced_all_to_all_bytes"]

# The names of the all-to-all's messages in the trace (send, receive): a step's all-to-all
# bytes count apart from the ring all-reduce's "isend"s (``traced_all_to_all_bytes``).
MESSAGES = ("all_to_all send", "all_to_all recv")


class Dispatch(NamedTuple):
    """What ``dispatch`` sent, for ``combine`` to bring it back: ``order`` (n,), the kept
    (token, choice) pairs token x k + choice in the order sent (``dispatch_order``); ``sent`` and
    ``received``, the rows sent to and received from each rank of the group; ``counts``
    (ep, E/ep), the rows received from each rank for each of this rank's experts."""

    order: torch.Tensor
    sent: list
    received: list
    counts: torch.Tensor


class ExpertParallelMoE(nn.Module):
    """``moe`` (a ``MoE``) with its experts split over ``group`` (default: every rank).

    Takes the router (replicated) and this rank's E/ep experts from ``moe``, the same
    modules, not copies. ``forward(x)``: x (..., h), this rank's tokens -> (..., h), as
    ``MoE.forward``; afterwards ``aux_loss`` and ``routing`` (this rank's) are set."""

    def __init__(self, moe, group=None):
        super().__init__()
        if not isinstance(moe, MoE):
            raise ValueError(f"ExpertParallelMoE splits a parlab.experts.MoE, got {type(moe).__name__}: build one "
                             "MoE with the same seed on every rank and pass it.")
        r, ep = place_in(group)
        held = experts_per_rank(moe.E, ep)
        self.group, self.ep, self.first_expert = group, ep, r * held
        self.h, self.E, self.k = moe.h, moe.E, moe.k
        self.capacity_factor, self.aux_loss_coefficient = moe.capacity_factor, moe.aux_loss_coefficient
        self.router = moe.router
        self.experts = nn.ModuleList(moe.experts[r * held:(r + 1) * held])
        self.aux_loss, self.routing = None, None

    def forward(self, x):
        # route: this rank's tokens, with a capacity counted on them
        tokens = flat_tokens(x, self.h)                                   # (T, h)
        logits = self.router(tokens)                                      # (T, E)
        self.routing = route(logits, self.k, expert_capacity(len(tokens), self.E, self.k, self.capacity_factor))
        self.aux_loss = load_balancing_loss(self.routing.probs, self.routing.expert, self.aux_loss_coefficient)
        # dispatch, compute, combine
        rows, plan = dispatch(tokens, self.routing, self.group)          # (rows from every rank, h)
        outputs = run_experts(self.experts, rows, plan.counts)           # (the same rows, h)
        return combine(outputs, self.routing, plan, self.group).view_as(x)

    def average_gradients(self):
        """After every rank's ``loss_r.backward()``: the gradients of L = (1/ep) sum_r loss_r
        (module docstring). Experts: divided by ep. Router (every other parameter): averaged
        over the group by one ring all-reduce of their flattened gradients."""
        for p in self.experts.parameters():
            if p.grad is not None:
                p.grad /= self.ep
        replicated = [p for name, p in self.named_parameters()
                      if not name.startswith("experts.") and p.grad is not None]
        if self.ep == 1 or not replicated:
            return
        flat = torch.cat([p.grad.flatten() for p in replicated])
        with trace.span("all-reduce"):
            ring_all_reduce(flat, "avg", check=False, group=self.group)
        for p, g in zip(replicated, flat.split([p.numel() for p in replicated])):
            p.grad.copy_(g.view_as(p))


def dispatch(tokens, routing, group=None):
    """Send every kept (token, choice) row to the rank holding its expert.

    tokens (T, h): this rank's; routing: ``route`` of their logits. First the counts (an
    all-to-all of the kept rows per expert, (ep, E/ep): row p is what rank p will get), then
    the rows, sorted by expert (``dispatch_order``), with ``all_to_all_single``'s split sizes.
    Returns (rows received (n, h): rank 0's rows for my first expert, for my second, ..., then
    rank 1's; a ``Dispatch``). Differentiable: the rows' gradient goes back by ``AllToAll``."""
    _, ep = place_in(group)
    held = experts_per_rank(len(routing.tokens_per_expert), ep)
    order, kept_per_expert = dispatch_order(routing)
    to_rank = kept_per_expert.view(ep, held)                              # (ep, E/ep): row p goes to rank p
    counts = all_to_all(to_rank, [1] * ep, [1] * ep, group, "dispatch counts")  # (ep, E/ep): row p from rank p
    sent, received = to_rank.sum(1).tolist(), counts.sum(1).tolist()
    k = routing.expert.shape[1]
    rows = AllToAll.apply(tokens[order // k], received, sent, group, "dispatch")
    return rows, Dispatch(order, sent, received, counts)


def combine(outputs, routing, plan, group=None):
    """The layer's output (T, h) on each rank: ``outputs`` (the experts' rows, in the order
    ``dispatch`` received them) go back by the reverse all-to-all, then each row to its
    (token, choice), weighted by its gate (``combine_choices``). Differentiable."""
    returned = AllToAll.apply(outputs, plan.sent, plan.received, group, "combine")  # (n sent, h), order sent
    return combine_choices(returned, routing, plan.order)


class AllToAll(torch.autograd.Function):
    """``all_to_all`` with autograd: rows split by ``input_splits`` out, ``output_splits``
    in; the gradient goes back by the reverse all-to-all (the two split lists swapped).
    ``AllToAll.apply(x, output_splits, input_splits, group, name)``."""

    @staticmethod
    def forward(ctx, x, output_splits, input_splits, group, name):
        ctx.splits, ctx.group, ctx.name = (input_splits, output_splits), group, name
        return all_to_all(x, output_splits, input_splits, group, name)

    @staticmethod
    def backward(ctx, grad):
        returned = all_to_all(grad.contiguous(), *ctx.splits, ctx.group, f"{ctx.name} backward")
        return returned, None, None, None, None


def all_to_all(x, output_splits, input_splits, group=None, name="all-to-all"):
    """``parlab.collectives.all_to_all`` over ``group`` (what torch's ``all_to_all_single``
    computes, on parlab's p2p layer: traced, and paying an emulated link): rows input_splits[p] of ``x``
    (in rank order) go to rank p; output_splits[p] rows come from rank p, in rank order.
    Returns the received (sum(output_splits), ...) tensor. Inside a span ``name``; each
    message is traced as an "all_to_all send" / "all_to_all recv" event (``MESSAGES``: global
    ranks; a rank's rows to itself never reach the wire), apart from the router's all-reduce."""
    with trace.span(name):
        return collectives.all_to_all(x, output_splits, input_splits, group, ops=MESSAGES)


def all_to_all_bytes(routing, rank, ep, h, element_bytes=4):
    """Bytes that ``rank`` (of the group) sends to other ranks in ``dispatch``, and gets back
    in ``combine`` (and again each way in backward): tokens_sent_elsewhere x h x
    element_bytes, tokens_sent_elsewhere the kept (token, choice) pairs of its ``routing``
    whose expert another rank holds. The exact count of what the router did; balanced, it is
    ``balanced_all_to_all_bytes``. The counts' all-to-all adds (ep - 1) E/ep x 8 bytes."""
    _, kept_per_expert = dispatch_order(routing)
    to_rank = kept_per_expert.view(ep, experts_per_rank(len(kept_per_expert), ep)).sum(1)  # (ep,)
    return (to_rank.sum() - to_rank[rank]).item() * h * element_bytes


def balanced_all_to_all_bytes(T, k, h, ep, element_bytes=4):
    """``all_to_all_bytes`` when the router is balanced and drops nothing: each rank's T k
    rows spread evenly, (ep - 1)/ep of them to other ranks: T k h element_bytes (ep - 1)/ep."""
    return T * k * h * element_bytes * (ep - 1) / ep


def traced_all_to_all_bytes(timeline):
    """(bytes sent, bytes received) by each rank in the all-to-alls of a traced call, two
    lists indexed by rank (exact: counted from the ``MESSAGES`` events). Narrow
    to one phase with ``timeline.window("dispatch", i)``: the i-th span named so on each rank."""
    return tuple([sum(ev.nbytes for ev in timeline.select(rank=r, kind=trace.COMM, name=message))
                  for r in range(timeline.world_size)] for message in MESSAGES)


def experts_per_rank(E, ep):
    """E / ep, if the ep ranks can hold the E experts in equal parts."""
    if E % ep:
        raise ValueError(f"E = {E} experts do not split over ep = {ep} ranks: choose E a multiple of {ep}, "
                         f"or a group of a number of ranks that divides {E}.")
    return E // ep
