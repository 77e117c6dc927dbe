"""Exercise: top-k routing with a capacity, and expert parallelism's dispatch and combine.

A mixture-of-experts layer sends each token to k of its E experts (MLPs). The router
scores every (token, expert) pair; ``route`` decides where each token goes and which
(token, choice) pairs an expert, full at its capacity, must drop.

Expert parallelism splits the E experts over the ep ranks of a group: rank p of the group
holds experts p E/ep .. (p + 1) E/ep - 1. Each rank routes its own tokens, sends each token
to the rank holding its expert, runs its own experts on the rows it received, and sends the
outputs back: ``dispatch_and_combine``, three all-to-alls (the counts, the rows, the outputs).

``all_to_all(x, output_splits, input_splits, group)`` (from ``parlab.experts``) computes what
torch's ``all_to_all_single`` does over ``group``, on parlab's point-to-point layer: the first
input_splits[0] rows of ``x`` go to group rank 0, the next input_splits[1] to rank 1, ...; it
returns the rows received, output_splits[p] of them from rank p, rank 0's first. Every rank
of the group must call it, with splits that agree: what rank p sends rank q is what rank q
expects from rank p. Use it for every exchange: the grader counts the bytes it sends.

Symbols: T tokens (rows of h features), E experts, k experts per token, ep the ranks of the
group.

Stuck? ``parlab.hint("experts.route")`` in a notebook (or ``parlab hint experts.route`` in a
terminal) opens a hint, one level at a time. Grade your work with ``parlab grade experts``
(or ``parlab.check("experts")``).
"""

from typing import NamedTuple

import torch
import torch.distributed as dist

from parlab.experts import all_to_all


class Routed(NamedTuple):
    """Where ``route`` sent T tokens: (T, k) tensors, a row per token and a column per choice
    (choice 0 the most probable expert), and one (E,) tensor:

    - ``expert`` (long): the chosen expert;
    - ``slot`` (long): the (token, choice) pair's place in its expert's queue, 0, 1, ...;
    - ``gate`` (float): its weight in the token's output, 0 where dropped;
    - ``dropped`` (bool): True where the slot is at or beyond the capacity;
    - ``tokens_per_expert`` (long, (E,)): the pairs that chose each expert, dropped ones included."""

    expert: torch.Tensor
    slot: torch.Tensor
    gate: torch.Tensor
    dropped: torch.Tensor
    tokens_per_expert: torch.Tensor


def route(logits, k, capacity):
    """Top-k routing of T tokens to E experts, each expert taking at most ``capacity``
    (token, choice) pairs. logits: (T, E), the router's scores. Returns a ``Routed``.

    - probs = softmax(logits) over the E experts; each token chooses its k most probable
      experts, most probable first (torch.topk's order).
    - Gates: with k = 1 the chosen probability itself (Switch Transformer); with k > 1 the k
      chosen probabilities divided by their sum (GShard's top-2).
    - Slots, as GShard: the first choices of all tokens are served before any second choice,
      each choice in token order: token 0's first choice, token 1's first choice, ..., then
      token 0's second choice, ... A pair's slot is the number of pairs served before it that
      chose the same expert.
    - A pair whose slot is >= capacity is dropped: its gate is set to 0 (the token's other
      gates are left as they are, not renormalised)."""
    # BEGIN SOLUTION: top-k, gates, then slots choice by choice, token by token
    T, E = logits.shape
    top, expert = logits.softmax(-1).topk(k, dim=-1)        # (T, k) each, best first
    gate = top if k == 1 else top / top.sum(-1, keepdim=True)
    slot = torch.empty_like(expert)
    served = torch.zeros(E, dtype=torch.long)                # pairs each expert has seen so far
    for choice in range(k):                                  # every first choice before any second
        for token in range(T):
            e = expert[token, choice]
            slot[token, choice] = served[e]
            served[e] += 1
    dropped = slot >= capacity
    return Routed(expert, slot, gate.masked_fill(dropped, 0.0), dropped, served)
    # END SOLUTION


def dispatch_and_combine(tokens, expert_of_token, E, run_experts, group=None):
    """Each of this rank's tokens through its expert, wherever that expert lives.

    tokens (T, h): this rank's rows (T may differ from rank to rank); expert_of_token (T,)
    long: the expert of each row, 0 .. E - 1 (one per token, nothing dropped); the E experts
    are split over the ep ranks of ``group`` (None: the world), E/ep each. Returns (T, h):
    row t the output of token t's expert on row t, in place of the token.

    The exchange, all through ``all_to_all``:

    1. the counts: a long tensor (ep, E/ep) whose row p says how many of my rows go to each
       of rank p's experts, one row to each rank; what comes back, ``counts`` (ep, E/ep), says
       how many rows each rank p will send each of my experts;
    2. the rows, sorted by expert (so that rank 0's experts' rows come first, then rank 1's:
       torch.argsort(..., stable=True) gives such an order);
    3. ``run_experts(rows, counts)`` (given): my experts on the rows received, as they came
       (rank 0's rows for my first expert, for my second, ..., then rank 1's); returns their
       outputs (n, h), in the same order;
    4. the outputs back, by the reverse all-to-all: each rank gets its rows in the order it
       sent them, and puts each back where its token was."""
    ep = dist.get_world_size(group)
    if E % ep:
        raise ValueError(f"E = {E} experts do not split over ep = {ep} ranks: choose E a multiple of {ep}.")
    held = E // ep  # experts per rank
    # BEGIN SOLUTION: counts, rows, experts, outputs back, each to its token
    order = torch.argsort(expert_of_token, stable=True)                   # (T,): rows by expert, hence by rank
    to_rank = torch.bincount(expert_of_token, minlength=E).view(ep, held)  # row p: my rows for rank p's experts
    counts = all_to_all(to_rank, [1] * ep, [1] * ep, group)               # row p: rank p's rows for my experts
    sent, received = to_rank.sum(1).tolist(), counts.sum(1).tolist()
    rows = all_to_all(tokens[order], received, sent, group)              # (n, h), rank 0's first
    returned = all_to_all(run_experts(rows, counts), sent, received, group)  # (T, h), in the order sent
    out = torch.empty_like(tokens)
    out[order] = returned  # row i went out as token order[i]
    return out
    # END SOLUTION


# BEGIN HINTS
HINTS = {
    "route": (
        """
        Three parts: which experts (softmax, then topk), how much each counts (the gates),
        and the queue at each expert (the slots). Only the slots need a loop, and the order
        of the loop is the whole point.
        """,
        """
        top, expert = logits.softmax(-1).topk(k, dim=-1) gives the k best, best first. Gates:
        top itself when k == 1, else top divided by its sum over the k. Slots: keep a counter
        per expert (a long tensor of E zeros) and walk the pairs choice-major: the outer loop
        over choices, the inner over tokens; each pair takes its expert's counter as its slot,
        then adds one. dropped = slot >= capacity; set those gates to 0. The counters, at the
        end, are tokens_per_expert.
        """,
        """
        served = torch.zeros(E, dtype=torch.long)
        for choice in range(k):
            for token in range(T):
                e = expert[token, choice]
                slot[token, choice] = served[e]; served[e] += 1
        dropped = slot >= capacity
        return Routed(expert, slot, gate.masked_fill(dropped, 0.0), dropped, served)
        """,
    ),
    "dispatch_and_combine": (
        """
        Nobody knows in advance how many rows will arrive from each rank: send that first.
        Then the rows, grouped by destination; then the way back is the same exchange with
        the splits swapped. Remember the permutation you sent the rows in.
        """,
        """
        order = torch.argsort(expert_of_token, stable=True). The counts per expert,
        torch.bincount(expert_of_token, minlength=E), viewed as (ep, E/ep), are what you
        send: one row per rank, all_to_all(to_rank, [1] * ep, [1] * ep, group). Row sums give
        the splits: sent (yours) and received (from the counts that came back). Rows out:
        all_to_all(tokens[order], received, sent, group). Outputs back: the same call with
        received and sent swapped. The i-th returned row belongs to token order[i].
        """,
        """
        counts = all_to_all(to_rank, [1] * ep, [1] * ep, group)
        sent, received = to_rank.sum(1).tolist(), counts.sum(1).tolist()
        rows = all_to_all(tokens[order], received, sent, group)
        returned = all_to_all(run_experts(rows, counts), sent, received, group)
        out = torch.empty_like(tokens); out[order] = returned

        out = returned (or returned[order]) leaves tokens at the wrong places: the inverse
        of "take rows in order" is "put row i at order[i]".
        """,
    ),
}
# END HINTS
