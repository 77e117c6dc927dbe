"""parlab.plan.measure: every plan it runs trains the small GPT like one process, holds the
model-state bytes the planner predicts (exactly for data parallelism at ZeRO 1-3; DDP exactly
4 Psi more, its buckets' gradient copies), and declares the planner's compute. Nothing is timed
here: the predicted-vs-measured step times are `parlab bench plan`'s and lecture 08's."""

import functools

import pytest
import torch

from parlab.emulated import ComputeTime
from parlab.gpt import batches, train_in_one_process
from parlab.memory import FP32_ADAM, model_state_bytes
from parlab.numerics import assert_equivalent, ring_orders
from parlab.plan import Plan, emulated_hardware, measure, plan_time, run_plan, runs

STEPS = 1  # after the warm-up step: two losses, the second after one Adam step
pytestmark = pytest.mark.timeout(240)


EIGHT = [(2, 2, 2, 1, 2, "full"), (2, 2, 2, 3, 2, "selective")]  # the 8-rank layouts trained here: ZeRO 1, 3


@pytest.fixture(scope="module")
def trained(cluster4, cluster8):
    """Every 4-rank layout of measure.LAYOUTS and the 8-rank ones of EIGHT trained on real ranks
    in real time (no declared compute, no emulated link): {layout: each rank's result}."""
    results = {}
    for plan in measure.predicted_plans():
        layout = (plan.N_d, plan.t, plan.K, plan.zero, plan.b, plan.M, plan.recompute)
        ranks = plan.ranks
        if ranks == 4 or layout[:5] + layout[6:] in EIGHT:
            hardware = cluster4 if ranks == 4 else cluster8
            results[plan] = hardware.run(runs.train_plan, layout, measure.BATCH.B, 0.0, STEPS)
    assert len(results) == sum(len(layout) and layout[0] * layout[1] * layout[2] == 4 for layout in measure.LAYOUTS) \
        + len(EIGHT)
    return results


@functools.cache
def one_process(shards=1, order=None):
    """The full batch's mean loss at each step of Adam in one process; with ``shards``, the
    gradient computed as that many ranks do (the yardstick's runs)."""
    data = batches(measure.BATCH.B, runs.CONFIG.s, STEPS + 1)
    return train_in_one_process(runs.CONFIG, data, runs.LR, shards, order)[0]


def test_the_plans_cover_every_engine_on_one_two_and_three_axes():
    chosen = measure.predicted_plans()
    assert len(chosen) >= 20 and len(set(chosen)) == len(chosen)
    kinds = {(p.t > 1, p.K > 1, p.zero, p.M > 1, p.recompute) for p in chosen}
    for kind in [(False, False, zero, False, None) for zero in (0, 1, 3)] + [
            (False, False, 0, True, None), (False, False, 2, True, None), (False, False, 0, False, "full"),
            (True, False, 0, False, None), (True, False, 0, False, "full"), (False, True, 0, True, None),
            (True, False, 3, False, "selective"), (True, True, 0, True, None), (False, True, 1, True, "full")]:
        assert kind in kinds, kind
    axes = [sum(degree > 1 for degree in (p.N_d, p.t, p.K)) for p in chosen]
    assert axes.count(3) >= 4 and axes.count(2) + axes.count(3) >= 6
    assert {p.zero for p in chosen if p.t > 1 and p.K > 1} == {0, 1, 2, 3}
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


def test_tensor_and_pipeline_states_are_the_formula_of_the_rank_s_own_parameters(trained):
    """The planner spreads Psi evenly over t K ranks; a tensor-parallel rank also keeps the
    replicated parameters, a first or last stage the embeddings and the head. With the rank's
    own count P (``numel``) the formula holds to the padding: DDP's buckets add a copy of the
    gradients (4 P) at ZeRO 0; at ZeRO 3 FSDP keeps the replicated ones whole (``kept_whole``,
    16 bytes each: parameter, gradient, Adam's two states) and pads each unit (a layer, the
    rest) to a multiple of N_d, at most N_d - 1 elements of 16 bytes per unit."""
    for plan, results in trained.items():
        if plan.t > 1 or plan.K > 1:
            psi = measure.model().psi / (plan.t * plan.K)
            for rank, r in enumerate(results):
                sharded = r["numel"] - r["kept_whole"]
                expected = model_state_bytes(sharded, plan.zero, plan.N_d, *FP32_ADAM).total + 16 * r["kept_whole"]
                expected += 4 * r["numel"] if plan.zero == 0 else 0
                units = measure.model().L // plan.K + 2
                padding = 16 * (plan.N_d - 1) * units
                assert expected - padding <= r["state_bytes"] <= expected + padding, (str(plan), rank)
            assert max(r["numel"] for r in results) > psi  # what Psi / (t K) leaves out


def test_the_declared_compute_adds_up_to_the_planner_s_compute():
    model = measure.model()
    for plan in measure.predicted_plans():
        hardware = emulated_hardware(plan.ranks)
        # forward, backward (twice the forward), and the forward again when recomputed
        forward, backward = measure.declared_seconds(plan, hardware)
        per_layer = forward * (2 if plan.recompute == "full" else 1) + backward
        declared = per_layer * (model.L // plan.K) * plan.M
        predicted = plan_time(model, measure.BATCH, hardware, plan, FP32_ADAM, efficiency=1.0).compute
        assert declared == pytest.approx(predicted, rel=1e-12)


def test_compute_time_is_an_identity_without_parameters():
    layer = ComputeTime(0.0, 0.0)
    x = torch.randn(3, 4, requires_grad=True)
    y = layer(x)
    y.sum().backward()
    assert list(layer.parameters()) == [] and torch.equal(y, x) and torch.equal(x.grad, torch.ones(3, 4))


def test_only_what_the_mesh_does_not_build_or_the_planner_rejects_is_refused():
    hybrid = Plan(4, 1, 1, 3, 4, 1, None, shard_group=2)
    too_few = Plan(1, 1, 4, 0, 8, 2, None, reasons=("M = 2 micro-batches cannot fill K = 4 stages.",))
    for plan, match in ((hybrid, "HYBRID_SHARD"), (too_few, "the planner rejects it: M = 2")):
        assert match in measure.runnable(plan)
        with pytest.raises(ValueError, match=match):
            run_plan(plan)
    assert measure.runnable(Plan(2, 2, 2, 3, 2, 4, "selective")) is None


def test_bad_arguments_are_explained_before_any_rank_starts():
    with pytest.raises(ValueError, match="must be a parlab.plan.Plan"):
        run_plan((4, 1, 1, 0, 4, 1, None))
    with pytest.raises(ValueError, match="steps"):
        run_plan(measure.predicted_plans()[0], steps=0)
    with pytest.raises(ValueError, match="is not a plan of 4 or 8 ranks"):
        measure.check_plans(layouts=[(3, 1, 1, 0, 4, None)])
    with pytest.raises(ValueError, match="runs on N_d t K = 8 ranks"):
        run_plan(measure.predicted_plans(layouts=[(2, 2, 2, 0, 2, None)])[0], hardware=emulated_hardware(4))


def test_each_plan_carries_the_prediction_the_run_is_costed_by():
    for plan in measure.predicted_plans():
        memory, seconds = measure.predict(plan)
        assert plan.memory == memory and plan.time == seconds
        assert memory.states == model_state_bytes(measure.model().psi / (plan.t * plan.K), plan.zero, plan.N_d,
                                                  *FP32_ADAM)
        hides = (plan.K == 1 and plan.zero == 0) or plan.zero in (2, 3)  # DDP without a pipeline, ZeRO-2, FSDP
        hardware = emulated_hardware(plan.ranks)
        exposed = plan_time(measure.model(), measure.BATCH, hardware, plan, FP32_ADAM, efficiency=1.0,
                            activation_bytes=4, overlapped=()).data
        assert (seconds.data < exposed) if hides and plan.N_d > 1 else (seconds.data == exposed)
