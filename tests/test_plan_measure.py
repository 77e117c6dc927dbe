"""parlab.plan.measure: every plan it runs trains the small GPT like one process, holds the
model-state bytes the planner predicts (exactly for data parallelism at ZeRO 1-3; DDP exactly
4 Psi more, its buckets' gradient copies), and declares the planner's compute. Nothing is timed
here: the predicted-vs-measured step times are `parlab bench plan`'s and lecture 08's."""

import functools

import pytest
import torch
import torch.nn.functional as F

from parlab.emulated import ComputeTime
from parlab.gpt import GPT, CharDataset
from parlab.memory import FP32_ADAM, model_state_bytes
from parlab.numerics import assert_equivalent, backward_in_shards, ring_orders
from parlab.plan import Plan, emulated_cluster, measure, plan_time, run_plan, runs

STEPS = 1  # after the warm-up step: two losses, the second after one Adam step
pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def trained(cluster4):
    """Every layout of measure.LAYOUTS trained on 4 real ranks in real time (no declared
    compute, no emulated link): {layout: each rank's result}."""
    results = {}
    for plan in measure.predicted_plans():
        layout = (plan.N_d, plan.t, plan.K, plan.zero, plan.b, plan.M, plan.recompute)
        results[plan] = cluster4.run(runs.train_plan, layout, measure.BATCH.B, 0.0, STEPS)
    return results


@functools.cache
def one_process(shards=1, order=None):
    """The full batch's mean loss at each step of Adam in one process; with ``shards``, the
    gradient computed as that many ranks do (the yardstick's runs)."""
    torch.manual_seed(0)
    gpt = GPT(runs.CONFIG)
    optimizer = torch.optim.Adam(gpt.parameters(), lr=runs.LR)
    data, generator = CharDataset(), torch.Generator().manual_seed(0)
    losses = []
    for _ in range(STEPS + 1):
        tokens, targets = data.batch(measure.BATCH.B, runs.CONFIG.s, generator)
        with torch.no_grad():
            losses.append(_loss(gpt, tokens, targets))
        parts = list(zip(tokens.tensor_split(shards), targets.tensor_split(shards)))
        backward_in_shards(functools.partial(_loss, gpt), gpt.parameters(), parts, order)
        optimizer.step()
    return torch.stack(losses)


def _loss(gpt, tokens, targets):
    return F.cross_entropy(gpt(tokens).flatten(0, 1), targets.flatten())


def test_at_least_ten_plans_cover_every_engine_of_the_table():
    chosen = measure.predicted_plans()
    assert len(chosen) >= 10 and len(set(chosen)) == len(chosen)
    kinds = {(p.t > 1, p.K > 1, p.zero, p.M > 1, p.recompute) for p in chosen}
    for kind in [(False, False, zero, False, None) for zero in (0, 1, 3)] + [
            (False, False, 0, True, None), (False, False, 2, True, None), (False, False, 0, False, "full"),
            (True, False, 0, False, None), (True, False, 0, False, "full"), (False, True, 0, True, None)]:
        assert kind in kinds, kind
    assert all(measure.runnable(p) is None for p in chosen)
    assert not any(p.offload or p.shard_group for p in chosen)  # what the engines run, nothing else


def test_every_plan_trains_like_one_process(trained):
    reference = one_process()
    decomposed = [one_process(4, tuple(order)) for order in ring_orders(4)]
    for plan, results in trained.items():
        losses = [torch.tensor(r["losses"]) for r in results]  # float32, as the ranks computed each loss
        assert all(torch.equal(losses[0], other) for other in losses[1:])  # one all-reduced value on every rank
        assert_equivalent(losses[0], reference, decomposed, what=f"losses of {plan}")


def test_data_parallel_model_states_are_the_prediction_exactly(trained):
    psi = measure.model().psi
    for plan, results in trained.items():
        if plan.t == plan.K == 1:
            predicted = model_state_bytes(psi, plan.zero, plan.N_d, *FP32_ADAM).total
            extra = 4 * psi if plan.zero == 0 else 0  # DDP's buckets keep a copy of the gradients
            assert {r["state_bytes"] for r in results} == {predicted + extra}, plan


def test_tensor_and_pipeline_states_are_above_the_even_split_by_what_it_leaves_out(trained):
    """The planner spreads Psi evenly over t K ranks; a tensor-parallel rank also keeps the
    replicated parameters, a first or last stage the embeddings and the head (and at ZeRO 0,
    DDP's buckets a copy of the gradients, 4 Psi / (t K))."""
    for plan, results in trained.items():
        if plan.t > 1 or plan.K > 1:
            psi = measure.model().psi / (plan.t * plan.K)
            buckets = 4 * psi if plan.zero == 0 else 0
            predicted = model_state_bytes(psi, plan.zero, plan.N_d, *FP32_ADAM).total + buckets
            assert predicted < max(r["state_bytes"] for r in results) < 1.06 * predicted, plan


def test_the_declared_compute_adds_up_to_the_planner_s_compute():
    model, cluster = measure.model(), emulated_cluster()
    for plan in measure.predicted_plans():
        # forward, backward (twice the forward), and the forward again when recomputed
        per_layer = measure.declared_forward_seconds(plan, cluster) * (4 if plan.recompute else 3)
        declared = per_layer * (model.L // plan.K) * plan.M
        predicted = plan_time(model, measure.BATCH, cluster, plan, FP32_ADAM, efficiency=1.0).compute
        assert declared == pytest.approx(predicted, rel=1e-12)


def test_compute_time_is_an_identity_without_parameters():
    layer = ComputeTime(0.0, 0.0)
    x = torch.randn(3, 4, requires_grad=True)
    y = layer(x)
    y.sum().backward()
    assert list(layer.parameters()) == [] and torch.equal(y, x) and torch.equal(x.grad, torch.ones(3, 4))


@pytest.mark.parametrize("layout, match", [
    ((2, 2, 2, 0, 2, 2, None), "tensor and pipeline"),
    ((2, 2, 1, 1, 8, 1, None), "ZeRO 0 with one micro-batch"),
    ((1, 1, 4, 1, 2, 8, None), "pipeline plans run ZeRO 0"),
    ((4, 1, 1, 0, 4, 1, "selective"), "planned, not run"),
])
def test_a_plan_it_cannot_build_is_refused_with_the_reason(layout, match):
    plan = Plan(*layout)
    assert match in measure.runnable(plan)
    with pytest.raises(ValueError, match=match):
        run_plan(plan)


def test_bad_arguments_are_explained_before_any_rank_starts():
    with pytest.raises(ValueError, match="must be a parlab.plan.Plan"):
        run_plan((4, 1, 1, 0, 4, 1, None))
    with pytest.raises(ValueError, match="steps"):
        run_plan(measure.predicted_plans()[0], steps=0)
    with pytest.raises(ValueError, match="is not a plan of 4 ranks"):
        measure.check_plans(layouts=[(3, 1, 1, 0, 4, None)])


def test_each_plan_carries_the_prediction_the_run_is_costed_by():
    for plan in measure.predicted_plans():
        memory, seconds = measure.predict(plan)
        assert plan.memory == memory and plan.time == seconds
        assert memory.states == model_state_bytes(measure.model().psi / (plan.t * plan.K), plan.zero, plan.N_d,
                                                  *FP32_ADAM)
        hides = plan.t == plan.K == 1 and plan.zero == 0  # only DDP overlaps its all-reduce with backward
        exposed = plan_time(measure.model(), measure.BATCH, emulated_cluster(), plan, FP32_ADAM, efficiency=1.0,
                            activation_bytes=4, overlapped=()).data
        assert (seconds.data < exposed) if hides and plan.N_d > 1 else (seconds.data == exposed)
