"""Routing of a mixture of experts: which expert each token goes to, and how it comes back.

    logits (T, E) --softmax--> probs --top-k--> expert (T, k), gate (T, k)
        slots: every token's 1st choice before any 2nd choice, each in token order;
        a (token, choice) whose slot is >= capacity is dropped (gate 0, output 0)
    dispatch_order: the kept (token, choice) pairs sorted by expert, then slot
        -> the rows each expert runs on, expert 0's first
    combine_choices: each row's output back at its (token, choice); a token's output is the
        sum over its k choices of gate x the chosen expert's output

Symbols: T tokens routed together (b s of a GPT layer), E experts, h hidden size, k experts
per token (the glossary's k, the entries kept by top-k: here of a token's E probabilities).
GShard and the Switch Transformer write C for the expert capacity; here C(x) is a
compressor, so the capacity is spelled out. A dropped (token, choice) contributes nothing: a
token whose every choice is dropped leaves the layer as zeros, and the transformer's residual
connection (x + MoE(x)) carries it on unchanged, as in Switch.
"""

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

from parlab._checks import real_number, whole_number

__all__ = ["Routing", "combine_choices", "dispatch_order", "expert_capacity", "load_balancing_loss", "route"]


class Routing(NamedTuple):
    """Where the router sent T tokens (``route``): (T, k) tensors, a row per token and a
    column per choice, choice 0 the most probable,

    - ``expert``: the chosen expert (long);
    - ``slot``: the row's place among that expert's rows, 0, 1, ... (kept if < capacity);
    - ``gate``: its weight in the token's output, 0 where dropped;
    - ``dropped``: True where the expert was full;

    and ``tokens_per_expert`` (E,): the (token, choice) pairs that chose each expert, dropped
    ones included (for histograms of the router's balance); ``probs`` (T, E): the softmax."""

    expert: torch.Tensor
    slot: torch.Tensor
    gate: torch.Tensor
    dropped: torch.Tensor
    tokens_per_expert: torch.Tensor
    probs: torch.Tensor


def expert_capacity(T, E, k, capacity_factor):
    """Tokens one expert takes from T tokens: ceil(capacity_factor x T x k / E), the even
    share T k / E times the slack ``capacity_factor`` (Switch Transformer's capacity factor;
    GShard's capacity for k = 2). capacity_factor >= E / k keeps every token."""
    T = whole_number("T (tokens routed together)", T, "route at least one token.")
    k = checked_k(k, whole_number("E (experts)", E, "build at least one expert."))
    capacity_factor = real_number("capacity_factor", capacity_factor,
                                  "choose a slack above 0, e.g. 1.25 (Switch Transformer).", above=True)
    return math.ceil(capacity_factor * T * k / E)


def route(logits, k, capacity):
    """Top-k routing of T tokens to E experts with a capacity (the ``Routing`` fields).

    logits: (T, E), the router's scores. probs = softmax(logits); each token picks its k
    most probable experts. Gates: with k = 1 the chosen probability p itself (Switch
    Transformer: renormalised it would be 1, and the router would learn from the auxiliary
    loss alone); with k > 1 the k probabilities renormalised to sum to 1 (GShard's top-2;
    Mixtral's softmax over the top-k logits gives the same numbers). Slots, as GShard: the
    first choices of all tokens are served before any second choice, each in token order;
    (token, choice) pairs with slot >= capacity are dropped and their gate set to 0 (not
    renormalised over the choices kept)."""
    if not torch.is_tensor(logits) or logits.dim() != 2 or not logits.is_floating_point():
        raise ValueError(f"route takes the router's logits as a (T, E) float tensor, got "
                         f"{tuple(logits.shape) if torch.is_tensor(logits) else type(logits).__name__}: "
                         "flatten the tokens first, logits = router(x.reshape(-1, h)).")
    T, E = logits.shape
    k = checked_k(k, E)
    capacity = whole_number("capacity", capacity, "use expert_capacity(T, E, k, capacity_factor).")
    probs = logits.softmax(-1)                                      # (T, E)
    top, expert = probs.topk(k, dim=-1)                             # (T, k) each, best first
    gate = top if k == 1 else top / top.sum(-1, keepdim=True)
    chose = F.one_hot(expert.t().reshape(-1), E)                    # (k T, E): row choice x T + token
    # a row's slot: how many rows before it (choice-major) chose the same expert
    slot = ((chose.cumsum(0) - 1) * chose).sum(-1).view(k, T).t()   # (T, k)
    dropped = slot >= capacity
    return Routing(expert, slot, gate.masked_fill(dropped, 0), dropped, chose.sum(0), probs)


def load_balancing_loss(probs, expert, coefficient=0.01):
    """Switch Transformer's auxiliary loss (Fedus et al. 2021, Eq. 4), in their letters:

        coefficient x E x sum_i f_i P_i

    f_i: the fraction of the T k (token, choice) pairs that chose expert i, dropped ones
    included (no gradient); P_i: the mean over tokens of the router's probability for i.
    Both sum to 1; the loss is smallest, ``coefficient``, when both are uniform (1/E). With
    k = 1 it is Eq. 4 exactly (the paper writes alpha, here a latency, for the coefficient,
    and its f_i and P_i are not Megatron's f nor PowerSGD's P). probs: (T, E); expert: (T, k)."""
    E = probs.shape[1]
    f = torch.bincount(expert.flatten(), minlength=E).to(probs.dtype) / expert.numel()  # (E,)
    P = probs.mean(0)                                                                   # (E,)
    return coefficient * E * (f * P).sum()


def checked_k(k, E):
    """k, if it is a whole number of experts per token from 1 to E."""
    k = whole_number("k (experts per token)", k, "choose 1 (Switch) or 2 (GShard, Mixtral).")
    if k > E:
        raise ValueError(f"k = {k} experts per token, but there are only E = {E} experts: choose k <= {E}.")
    return k


def dispatch_order(routing):
    """(order, kept_per_expert): the kept (token, choice) pairs as flat indices token x k + choice,
    sorted by expert and, within one, by slot, so that expert 0's rows come first, then
    expert 1's; and how many rows each expert gets, (E,) with entries <= capacity. The rows
    to run are tokens[order // k]."""
    T, k = routing.expert.shape
    kept = ~routing.dropped
    pairs = kept.flatten().nonzero().squeeze(1)                           # (n,) token x k + choice
    by_expert_then_slot = (routing.expert * T * k + routing.slot).flatten()[pairs]
    order = pairs[by_expert_then_slot.argsort()]
    return order, torch.bincount(routing.expert[kept], minlength=len(routing.tokens_per_expert))


def combine_choices(outputs, routing, order):
    """The layer's output (T, h) from the experts' ``outputs`` (n, h), row i the output for
    pair ``order[i]`` (``dispatch_order``): a token's output is the sum over its k choices
    of gate x output, where a dropped pair's output is 0."""
    T, k = routing.expert.shape
    per_pair = outputs.new_zeros(T * k, outputs.shape[-1]).index_copy(0, order, outputs)  # (T k, h)
    return (routing.gate.unsqueeze(-1) * per_pair.view(T, k, -1)).sum(1)                 # (T, h)
