"""parlab.experts on real ranks: expert parallelism over ep = 2 (two groups of the 4-rank
cluster, each its own batch) and ep = 4 equals the one-process MoE with the same weights,
with and without drops: the very same routing (experts, slots, drop masks), and outputs,
loss and gradients (experts on their owners, the averaged router, the inputs) within the
rounding band; a token returned to the wrong place falls far outside that band; and the
trace's all-to-all bytes equal the formula with the router's actual counts.

The yardstick (parlab.numerics): the reference is the MoE in one process on the whole
batch routed in ep groups (``moe(x, groups=ep)``, one backward of the mean loss); the
yardstick is the same MoE run as the ranks run it, each rank's part of the batch on its own
(its own router product, its own experts' products), the parts' gradients summed in each
order of a ring of ep ranks (``backward_in_shards``, ``ring_orders``). What the ranks add to
it, one expert product over every rank's rows, is a reordering of the same sums."""

import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from parlab.numerics import assert_equivalent, backward_in_shards, ring_orders

H, E, K, T = 16, 8, 2, 16  # hidden size, experts, experts per token, tokens per rank
AUX = 0.1
PAIRS = [[0, 2], [1, 3]]  # the ep = 2 groups: group rank and global rank differ
NO_DROPS, DROPS = E / K, 1.0  # capacity T (nothing can drop), capacity ceil(T K / E) = 4


def build_moe(capacity_factor):
    from parlab.experts import MoE

    torch.manual_seed(0)
    return MoE(H, E, k=K, capacity_factor=capacity_factor, aux_loss_coefficient=AUX)


def ep_group(ep):
    """(this rank's group, its index among the groups): the world, or its pair of PAIRS
    (every rank makes every group, in one order)."""
    if ep == dist.get_world_size():
        return None, 0
    groups = [dist.new_group(ranks) for ranks in PAIRS]
    index = next(i for i, ranks in enumerate(PAIRS) if dist.get_rank() in ranks)
    return groups[index], index


def batch(ep, index):
    """Group ``index``'s whole batch: ep T tokens and their regression targets."""
    generator = torch.Generator().manual_seed(10 + index)
    return torch.randn(ep * T, H, generator=generator), torch.randn(ep * T, H, generator=generator)


def expert_parallel_step(ep, capacity_factor):
    """On every rank: this rank's (routing, results) of one forward and backward with expert
    parallelism, and the same from the one-process reference and its yardstick runs."""
    from parlab.experts import ExpertParallelMoE

    group, index = ep_group(ep)
    r = dist.get_rank(group)
    x, target = batch(ep, index)
    mine = slice(r * T, (r + 1) * T)
    layer = ExpertParallelMoE(build_moe(capacity_factor), group)
    tokens = x[mine].clone().requires_grad_()
    y = layer(tokens)
    loss = F.mse_loss(y, target[mine]) + layer.aux_loss
    loss.backward()
    layer.average_gradients()
    total = loss.detach().clone()
    dist.all_reduce(total, group=group)
    results = {"output": y.detach(), "loss": total / ep, "input gradient": tokens.grad / ep,
               **{full_name(n, layer.first_expert): p.grad for n, p in layer.named_parameters()}}
    routing = layer.routing
    expected = [reference(ep, capacity_factor, index, r, None)]
    expected += [reference(ep, capacity_factor, index, r, tuple(order)) for order in ring_orders(ep)]
    return (routing.expert, routing.slot, routing.dropped), results, expected


def full_name(name, first_expert):
    """``experts.i....`` of a rank's layer as the full MoE's ``experts.(first + i)....``."""
    if not name.startswith("experts."):
        return name
    _, i, rest = name.split(".", 2)
    return f"experts.{first_expert + int(i)}.{rest}"


@functools.cache
def reference(ep, capacity_factor, index, r, order):
    """One process, group ``index``'s batch, the results rank r holds: with order None the
    reference (the whole batch in ep routing groups, one backward), else the yardstick's run
    (each rank's part on its own, gradients summed in ``order``). Returns (routing of part r
    for the reference, results)."""
    moe = build_moe(capacity_factor)
    x, target = batch(ep, index)
    x.requires_grad_()
    mine = slice(r * T, (r + 1) * T)
    if order is None:
        y = moe(x, groups=ep)
        loss = F.mse_loss(y, target) + moe.aux_loss
        loss.backward()
        routing, output = moe.routings[r], y[mine]
    else:
        def loss_of(part):
            rows = slice(part * T, (part + 1) * T)
            return F.mse_loss(moe(x[rows]), target[rows]) + moe.aux_loss

        backward_in_shards(loss_of, [*moe.parameters(), x], [(part,) for part in range(ep)], order)
        loss = sum(loss_of(part) for part in order) / ep
        routing, output = None, moe(x[mine])
    experts = range(r * E // ep, (r + 1) * E // ep)
    grads = {n: p.grad for n, p in moe.named_parameters()
             if not n.startswith("experts.") or int(n.split(".")[1]) in experts}
    results = {"output": output.detach(), "loss": loss.detach(), "input gradient": x.grad[mine], **grads}
    return routing and (routing.expert, routing.slot, routing.dropped), results


@pytest.mark.timeout(180)
@pytest.mark.parametrize("ep", [2, 4])
@pytest.mark.parametrize("capacity_factor", [NO_DROPS, DROPS], ids=["no drops", "drops"])
def test_expert_parallelism_equals_the_moe_in_one_process(cluster4, ep, capacity_factor):
    dropped = 0
    for rank, (routing, results, expected) in enumerate(cluster4.run(expert_parallel_step, ep, capacity_factor,
                                                                      timeout=120)):
        (ref_routing, reference_results), decomposed = expected[0], [d[1] for d in expected[1:]]
        for name, ours, theirs in zip(("experts", "slots", "drop masks"), routing, ref_routing):
            assert torch.equal(ours, theirs), f"ep = {ep}, rank {rank}: {name} differ from one process's"
        for kind, names in parts(reference_results).items():  # each part in a band of its own magnitude
            assert_equivalent({n: results[n] for n in names}, {n: reference_results[n] for n in names},
                              [{n: d[n] for n in names} for d in decomposed], f"ep = {ep}, rank {rank}: {kind}")
        dropped += int(routing[2].sum())
    assert (dropped > 0) == (capacity_factor == DROPS)


def parts(results):
    """The results' names by kind: output, loss, input gradient, router gradient, expert gradients."""
    experts = [name for name in results if name.startswith("experts.")]
    return {**{name: [name] for name in results if name not in experts}, "expert gradients": experts}


def misplaced_step():
    """The ranks' output with combine right, and with every returned row one place off."""
    from parlab.experts import ExpertParallelMoE, combine, dispatch, expert_capacity, route, run_experts

    layer = ExpertParallelMoE(build_moe(DROPS))
    r, ep = dist.get_rank(), dist.get_world_size()
    x, _ = batch(ep, 0)
    tokens = x[r * T:(r + 1) * T]
    routing = route(layer.router(tokens), K, expert_capacity(T, E, K, DROPS))
    rows, plan = dispatch(tokens, routing, None)
    outputs = run_experts(layer.experts, rows, plan.counts)
    right = combine(outputs, routing, plan, None)
    wrong = combine(outputs, routing, plan._replace(order=plan.order.roll(1)), None)
    expected = [reference(ep, DROPS, 0, r, None)] + [reference(ep, DROPS, 0, r, tuple(o)) for o in ring_orders(ep)]
    return right.detach(), wrong.detach(), [e[1]["output"] for e in expected]


@pytest.mark.timeout(120)
def test_a_token_returned_to_the_wrong_place_is_far_outside_the_band(cluster4):
    for rank, (right, wrong, (reference_output, *decomposed)) in enumerate(cluster4.run(misplaced_step, timeout=60)):
        assert_equivalent(right, reference_output, decomposed, f"rank {rank}: combine")
        with pytest.raises(AssertionError, match="outside the band"):
            assert_equivalent(wrong, reference_output, decomposed, f"rank {rank}: misplaced combine")


def traced_step(ep):
    """One forward and backward, with each rank's bytes by the formula from its routing."""
    from parlab.experts import ExpertParallelMoE, all_to_all_bytes

    group, index = ep_group(ep)
    layer = ExpertParallelMoE(build_moe(DROPS), group)
    x, target = batch(ep, index)
    r = dist.get_rank(group)
    tokens = x[r * T:(r + 1) * T].requires_grad_()  # as inside a model: the dispatched rows need gradients too
    F.mse_loss(layer(tokens), target[r * T:(r + 1) * T]).backward()
    return all_to_all_bytes(layer.routing, r, ep, H, element_bytes=4), layer.routing.tokens_per_expert


@pytest.mark.timeout(120)
@pytest.mark.parametrize("ep", [2, 4])
def test_the_traced_all_to_all_bytes_equal_the_formula_with_the_router_s_counts(cluster4, ep):
    from parlab.experts import balanced_all_to_all_bytes, traced_all_to_all_bytes

    timeline = cluster4.trace(traced_step, ep, timeout=60)
    formula = [nbytes for nbytes, _ in timeline.results]
    counts_sent, counts_received = traced_all_to_all_bytes(timeline.window("dispatch counts", 0))
    assert counts_sent == counts_received == [(ep - 1) * (E // ep) * 8] * 4  # int64 rows per expert
    sent, received = traced_all_to_all_bytes(timeline.window("dispatch", 0))
    assert sent == formula
    returned_sent, returned = traced_all_to_all_bytes(timeline.window("combine", 0))
    assert returned == formula and returned_sent == received
    back_sent, back_received = traced_all_to_all_bytes(timeline.window("combine backward", 0))
    assert back_sent == formula and back_received == received
    back_sent, back_received = traced_all_to_all_bytes(timeline.window("dispatch backward", 0))
    assert back_received == formula and back_sent == received
    # the router is uneven, so the exact count is not the balanced formula's
    assert formula != [balanced_all_to_all_bytes(T, K, H, ep)] * 4
    assert any(len(set(counts.tolist())) > 1 for _, counts in timeline.results)


def learner_mistakes():
    from parlab.experts import ExpertParallelMoE, MoE

    messages = []
    for attempt in (lambda: ExpertParallelMoE(MoE(H, 6)), lambda: ExpertParallelMoE(torch.nn.Linear(H, H))):
        try:
            attempt()
        except ValueError as error:
            messages.append(str(error))
    return messages


@pytest.mark.timeout(120)
def test_experts_that_do_not_split_over_the_ranks_are_refused_with_a_sentence(cluster4):
    for uneven, not_a_moe in cluster4.run(learner_mistakes, timeout=60):
        assert "E = 6 experts do not split over ep = 4 ranks: choose E a multiple of 4" in uneven
        assert "ExpertParallelMoE splits a parlab.experts.MoE, got Linear" in not_a_moe
