"""parlab.experts in one process: routing keeps every expert within its capacity and serves
first choices before second ones (GShard), drops are counted, Switch Transformer's
load-balancing loss equals its formula worked by hand, a large capacity factor drops
nothing, the MoE computes each token's gated sum of its experts' outputs, the all-to-all bytes
formula, and the sentences that bad input gets."""

import math

import pytest
import torch

from parlab.experts import (
    MoE,
    all_to_all_bytes,
    balanced_all_to_all_bytes,
    dispatch_order,
    expert_capacity,
    experts_per_rank,
    load_balancing_loss,
    route,
)
from parlab.numerics import assert_equivalent

T, E, H = 32, 4, 8


def random_logits(seed=0):
    return torch.randn(T, E, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("k, capacity", [(1, 5), (2, 10), (2, 13), (3, 16)])
def test_no_expert_takes_more_than_its_capacity_and_drops_are_counted(k, capacity):
    routing = route(random_logits(k), k, capacity)
    kept = ~routing.dropped
    assert routing.tokens_per_expert.sum() == T * k
    for e in range(E):
        slots = routing.slot[kept & (routing.expert == e)]
        # each kept row has its own slot, 0, 1, ..., within the capacity
        assert sorted(slots.tolist()) == list(range(min(int(routing.tokens_per_expert[e]), capacity)))
    overflow = (routing.tokens_per_expert - capacity).clamp(min=0).sum()
    assert routing.dropped.sum() == overflow > 0
    assert torch.equal(routing.gate[routing.dropped], torch.zeros(int(overflow)))
    order, kept_per_expert = dispatch_order(routing)
    assert kept_per_expert.tolist() == routing.tokens_per_expert.clamp(max=capacity).tolist()
    assert routing.expert.flatten()[order].tolist() == sorted(routing.expert[kept].tolist())


def test_first_choices_are_served_before_second_choices():
    # tokens 0 and 1 prefer expert 0, token 2 expert 1; two slots per expert. In token order
    # token 0's and 1's second choices would fill expert 1 before token 2's first choice.
    logits = torch.tensor([[2.0, 0.0], [2.0, 0.0], [0.0, 2.0]])
    routing = route(logits, 2, 2)
    assert routing.expert.tolist() == [[0, 1], [0, 1], [1, 0]]
    assert routing.slot.tolist() == [[0, 1], [1, 2], [0, 2]]
    assert routing.dropped.tolist() == [[False, False], [False, True], [False, True]]
    assert routing.tokens_per_expert.tolist() == [3, 3]


def test_gates_are_the_probability_for_one_expert_and_renormalised_for_several():
    logits = random_logits()
    probs = logits.softmax(-1)
    top1 = route(logits, 1, T)
    assert torch.equal(top1.gate[:, 0], probs.max(-1).values)
    top2 = route(logits, 2, T)
    assert not top2.dropped.any()
    torch.testing.assert_close(top2.gate.sum(-1), torch.ones(T))
    chosen = probs.gather(1, top2.expert)
    torch.testing.assert_close(top2.gate, chosen / chosen.sum(-1, keepdim=True))


def test_the_load_balancing_loss_is_switch_transformer_s_formula_worked_by_hand():
    probs = torch.tensor([[0.7, 0.3], [0.6, 0.4], [0.2, 0.8], [0.9, 0.1]], dtype=torch.float64)
    routing = route(probs.log(), 1, 4)
    assert routing.expert[:, 0].tolist() == [0, 0, 1, 0]
    # f = (3/4, 1/4) of the tokens; P = (mean 0.7 0.6 0.2 0.9, mean 0.3 0.4 0.8 0.1) = (0.6, 0.4)
    by_hand = 0.01 * 2 * (3 / 4 * 0.6 + 1 / 4 * 0.4)
    assert math.isclose(load_balancing_loss(routing.probs, routing.expert).item(), by_hand, rel_tol=1e-12)
    # uniform probabilities and an even split give the coefficient itself, for any k
    uniform = torch.full((4, 2), 0.5, dtype=torch.float64)
    assert load_balancing_loss(uniform, torch.tensor([[0, 1], [1, 0], [0, 1], [1, 0]]), 0.1).item() == 0.1


def test_the_capacity_formula_and_a_large_capacity_factor_drops_nothing():
    assert expert_capacity(16, 8, 2, 1.25) == 5  # ceil(1.25 x 16 x 2 / 8)
    assert expert_capacity(16, 8, 1, 1.0) == 2
    torch.manual_seed(0)
    moe = MoE(H, E, k=2, capacity_factor=E / 2)
    moe(torch.randn(4, 8, H))
    assert expert_capacity(32, E, 2, E / 2) == 32 and not moe.routings[0].dropped.any()


def by_hand(moe, x):
    """Each token's sum over its kept choices of gate x the chosen expert's output, one by one."""
    routing = moe.routings[0]
    rows = []
    for i, token in enumerate(x.reshape(-1, moe.h)):
        total = torch.zeros(moe.h, dtype=x.dtype)
        for choice in range(moe.k):
            if not routing.dropped[i, choice]:
                total = total + routing.gate[i, choice] * moe.experts[int(routing.expert[i, choice])](token)
        rows.append(total)
    return torch.stack(rows).view_as(x)


@pytest.mark.parametrize("k, capacity_factor", [(1, 1.0), (2, 1.0), (2, 2.0)])
def test_the_moe_computes_each_token_s_gated_sum_and_a_dropped_token_leaves_as_zeros(k, capacity_factor):
    torch.manual_seed(1)
    moe = MoE(H, E, k=k, capacity_factor=capacity_factor).double()
    x = torch.randn(2, 16, H, dtype=torch.float64)
    y = moe(x)
    assert_equivalent(y, by_hand(moe, x), [], "MoE output")  # the same operations: the floor only
    routing = moe.routings[0]
    gone = routing.dropped.all(-1)
    if capacity_factor == 1.0:
        assert routing.dropped.any()
    assert torch.equal(y.reshape(-1, H)[gone], torch.zeros(int(gone.sum()), H, dtype=torch.float64))


def test_the_balanced_all_to_all_bytes_are_the_exact_count_of_a_balanced_router():
    logits = torch.nn.functional.one_hot(torch.arange(T) % E, E).float() * 5  # token t -> expert t mod E
    routing = route(logits, 1, T // E)
    assert not routing.dropped.any() and routing.tokens_per_expert.tolist() == [T // E] * E
    for ep in (1, 2, 4):
        for rank in range(ep):
            assert all_to_all_bytes(routing, rank, ep, H) == balanced_all_to_all_bytes(T, 1, H, ep) \
                == T * H * 4 * (ep - 1) / ep
    skewed = route(torch.tensor([[5.0, 0, 0, 0]] * T), 1, T)  # everything to expert 0 on rank 0
    assert all_to_all_bytes(skewed, 0, 2, H) == 0 and all_to_all_bytes(skewed, 1, 2, H) == T * H * 4


LEARNER_MISTAKES = {
    "k above E": (lambda: route(random_logits(), 5, 8), "k = 5 experts per token, but there are only E = 4"),
    "k of 0": (lambda: MoE(H, E, k=0), "k (experts per token) must be a whole number >= 1"),
    "capacity factor 0": (lambda: MoE(H, E, capacity_factor=0), "capacity_factor must be above 0"),
    "negative capacity factor": (lambda: expert_capacity(T, E, 1, -1.0), "capacity_factor must be above 0"),
    "experts do not split": (lambda: experts_per_rank(6, 4), "E = 6 experts do not split over ep = 4 ranks"),
    "wrong width": (lambda: MoE(H, E)(torch.randn(3, H + 1)), "built for h = 8 features per token"),
    "one-dimensional logits": (lambda: route(torch.randn(E), 1, 2), "(T, E) float tensor, got (4,)"),
    "groups do not split": (lambda: MoE(H, E)(torch.randn(10, H), groups=4), "T = 10 tokens do not split into 4"),
}


@pytest.mark.parametrize("mistake", LEARNER_MISTAKES)
def test_bad_input_says_what_to_change(mistake):
    attempt, sentence = LEARNER_MISTAKES[mistake]
    with pytest.raises(ValueError, match=r"choose|pass|route|build") as error:
        attempt()
    assert sentence in str(error.value)
