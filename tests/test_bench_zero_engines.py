"""parlab.bench.zero_engines: lecture 04's harness. Engines by name (parlab's and torch's behind
one interface) train like one process, within parlab.numerics' rounding band; the one-process
reference and the bytes it measures."""

import pytest
import torch

from parlab.bench.zero_engines import (
    LECTURE_LR,
    PARLAB_ENGINES,
    STAGE_ENGINES,
    TORCH_ENGINES,
    build_engine,
    lecture_batch,
    lecture_model,
    mlp,
    ring_arithmetic,
    start_from_different_weights,
    train_and_measure,
    train_one_process,
)
from parlab.memory import FP32_ADAM, model_state_bytes
from parlab.numerics import max_abs_difference, ring_orders, rounding_band

LECTURE_PSI = 64 * 256 + 256 + 2 * (256 * 256 + 256) + 256 * 8 + 8


def loss_band(losses, n_d, steps):
    """parlab.numerics' band for the losses of each step: one process summing n_d shards'
    gradients in each order of a ring, against ``losses`` (one process, the full batch)."""
    ring = [train_one_process(steps, shards=n_d, order=order)[1] for order in ring_orders(n_d)]
    return rounding_band(torch.tensor(losses), [torch.tensor(run) for run in ring])[0]


def test_the_lecture_model_and_batch_are_the_same_wherever_they_are_made():
    model = lecture_model()
    assert sum(p.numel() for p in model.parameters()) == LECTURE_PSI == 150_280
    assert [type(layer).__name__ for layer in model] == ["Linear", "ReLU"] * 3 + ["Linear"]
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), lecture_model().parameters()))
    inputs, targets = lecture_batch()
    assert inputs.shape == (32, 64) and targets.shape == (32, 8) and torch.equal(inputs, lecture_batch()[0])
    assert [layer.out_features for layer in mlp([3, 5, 2]) if hasattr(layer, "out_features")] == [5, 2]


def test_engine_names():
    assert set(STAGE_ENGINES.values()) <= set(PARLAB_ENGINES)
    assert {"FSDP FULL_SHARD", "FSDP SHARD_GRAD_OP", "FSDP NO_SHARD", "FSDP HYBRID_SHARD"} <= set(PARLAB_ENGINES)
    with pytest.raises(ValueError, match="engine must be one of 'ZeroDP stage 0', .*got 'stage 4'"):
        build_engine("stage 4", lecture_model())
    with pytest.raises(ValueError, match=r"options \['mixed_precision'\] are for parlab's engines"):
        build_engine("torch DDP", lecture_model(), mixed_precision=torch.bfloat16)


def test_one_process_records_the_loss_of_every_step_and_rounds_on_request():
    parameters, losses = train_one_process(steps=5)
    assert len(losses) == 5 and losses[-1] < losses[0] / 2
    # four shards' gradients averaged: the same losses (the mean of the shards' means) up to the
    # rounding of other summation orders, measured on the ring's orders
    band = loss_band(losses, 4, steps=5)
    _, sharded = train_one_process(steps=5, shards=4, order=[2, 0, 3, 1])
    assert max_abs_difference(torch.tensor(sharded), torch.tensor(losses)) <= band
    rounded, _ = train_one_process(steps=0, rounded_to=torch.bfloat16)
    assert all(torch.equal(p, p.to(torch.bfloat16).float()) for p in rounded.values())
    assert not all(torch.equal(p, p.to(torch.bfloat16).float()) for p in lecture_model().parameters())
    assert len(ring_arithmetic(4, steps=1)) == 4


@pytest.mark.timeout(180)
def test_every_engine_trains_like_one_process_and_holds_what_it_should(cluster2):
    reference, reference_losses = train_one_process()
    band = rounding_band(reference, ring_arithmetic(2))[0]
    losses_band = loss_band(reference_losses, 2, steps=3)
    names = ["ZeroDP stage 1", "FSDP FULL_SHARD", *TORCH_ENGINES]
    results = {name: cluster2.run(train_and_measure, name, timeout=120) for name in names}
    for name, per_rank in results.items():
        for result in per_rank:
            assert max_abs_difference(result["parameters"], reference) <= band, name
            assert max_abs_difference(torch.tensor(result["losses"]), torch.tensor(reference_losses)) <= losses_band
    for name in ("ZeroDP stage 1", "FSDP FULL_SHARD"):
        stage = 1 if name.startswith("ZeroDP") else 3
        for result in results[name]:  # plus Adam's step counters: one fp32 scalar per flat buffer
            assert 0 <= result["state"].total - model_state_bytes(LECTURE_PSI, stage, 2, *FP32_ADAM).total <= 16
            assert result["padded"] == LECTURE_PSI  # even, and every unit even: no padding at N_d = 2
        assert [result["held_after_forward"] for result in results[name]] == [4 * LECTURE_PSI * (stage < 3)] * 2
    # torch's DDP with gradient_as_bucket_view=True: its gradients are its buckets, counted once
    for name, stage in (("torch DDP", 0), ("torch fully_shard", 3)):
        formula = model_state_bytes(LECTURE_PSI, stage, 2, *FP32_ADAM)
        for result in results[name]:
            assert result["state"].params == formula.params and result["state"].grads == formula.grads
            assert "padded" not in result


@pytest.mark.timeout(120)
def test_fsdp_options_reach_the_engine(cluster2):
    [bf16, _] = cluster2.run(train_and_measure, "FSDP FULL_SHARD", steps=1, mixed_precision=torch.bfloat16)
    units = [64 * 256 + 256, 256 * 256 + 256, 256 * 256 + 256, 256 * 8 + 8]  # a unit per Linear, even numels
    assert bf16["gathered"] == [(torch.bfloat16, 2 * numel) for numel in units]  # the compute copy, while computing
    assert bf16["dtypes"] == {"shards": {"torch.float32"}, "gradients": {"torch.float32"},
                              "optimizer state": {"torch.float32"}}  # fp32 master weights and Adam
    fp32, _ = train_one_process(steps=1)
    # bf16 arithmetic changes the numbers; Adam's first step moves each parameter by at most lr
    # (g / |g|), so two first steps differ by at most 2 lr, whatever the precision
    assert 0 < max_abs_difference(bf16["parameters"], fp32) <= 2 * LECTURE_LR


@pytest.mark.timeout(120)
def test_who_broadcasts_the_initial_weights(cluster2):
    # every rank builds its model from its own seed; rank 0's own weights are also rank 0's
    rank_0, rank_1 = cluster2.run(start_from_different_weights)
    assert rank_1 == {
        "torch DistributedDataParallel(model)": ["rank 0's"],  # broadcast at construction
        "torch ZeroRedundancyOptimizer(params)": ["its own"],  # no broadcast at construction
        "torch fully_shard": ["chunk r of rank r's"],  # each rank keeps its chunk of its own weights
        "ZeroDP stage 1": ["rank 0's"],
        "FSDP FULL_SHARD": ["rank 0's"],
    }
    assert rank_0["torch ZeroRedundancyOptimizer(params)"] == ["rank 0's", "its own"]
    assert rank_0["torch fully_shard"] == ["chunk r of rank r's"]
