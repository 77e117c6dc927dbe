"""parlab.bench.ddp_steps: what the measurements return (shapes, bucket counts, the traced
step of each config), never how fast; the emulated model's parameters and declared times."""

import functools
import statistics

import pytest
import torch
from torch import nn

from parlab.bench.ddp_steps import (
    EMULATED_BATCH,
    emulated_batch,
    emulated_mlp,
    measure_compute,
    measure_ddp_steps,
    predicted_steps,
    time_single_process_step,
)
from parlab.ddp import predict_step, trainable_parameters
from parlab.runtime.emulation import Link


def build_small_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def small_batch(rank):
    generator = torch.Generator().manual_seed(rank)
    return torch.randn(6, 8, generator=generator), torch.randn(6, 4, generator=generator)


@pytest.mark.timeout(30)
def test_single_process_timing_gives_a_ready_time_per_parameter_last_layer_first():
    timing = time_single_process_step(build_small_model, small_batch, repeats=3)
    assert min(timing["forward"], timing["backward"], timing["optimizer"]) > 0
    ready = timing["parameter_ready"]
    assert len(ready) == 4 and all(0 < t <= timing["backward"] for t in ready)
    assert max(ready[2:]) <= min(ready[:2])  # the output layer's gradients come first


@pytest.mark.timeout(60)
def test_compute_is_measured_on_every_rank_and_the_slowest_kept(cluster2):
    timing = measure_compute(cluster2, build_small_model, small_batch, repeats=2)
    assert set(timing) == {"forward", "backward", "optimizer", "parameter_ready"}
    assert len(timing["parameter_ready"]) == 4 and min(timing["parameter_ready"]) > 0


@pytest.mark.timeout(120)
def test_each_config_reports_its_buckets_step_times_and_the_traced_last_step(cluster2):
    steps = 2
    rows = measure_ddp_steps(cluster2, build_small_model, small_batch, ["flat", ("bucketed", 1e-6)], steps=steps)
    assert [(row["variant"], row["bucket_cap_mb"], row["buckets"]) for row in rows] == [
        ("flat", None, 1), ("bucketed", 1e-6, 4)]
    for row in rows:
        assert len(row["seconds"]) == steps and row["median_s"] == statistics.median(row["seconds"])
        window = row["timeline"]
        for rank in range(2):  # one step: one "step" span per rank, holding its all-reduces
            assert len(window.select(rank=rank, name="step")) == 1
            assert len(window.select(rank=rank, name="all_reduce")) == row["buckets"]


def test_the_emulated_model_averages_only_its_linear_weights():
    model = emulated_mlp(width=4, depth=3, backward_s=0.02)
    assert [name for name, _ in trainable_parameters(model)] == ["0.weight", "2.weight", "4.weight"]
    assert [(layer.forward_s, layer.backward_s) for layer in model[1::2]] == [(0.01, 0.02)] * 3
    assert emulated_mlp(4, 1, 0.02, forward_s=0)[1].forward_s == 0
    inputs, targets = emulated_batch(4, rank=1)
    assert inputs.shape == targets.shape == (EMULATED_BATCH, 4)
    assert not torch.equal(inputs, emulated_batch(4, rank=0)[0])  # each rank its own shard


@pytest.mark.timeout(30)
def test_the_emulated_model_s_gradients_are_ready_after_the_declared_backward_times():
    timing = time_single_process_step(functools.partial(emulated_mlp, 4, 3, 0.02, 0), functools.partial(
        emulated_batch, 4), repeats=1)
    # Lower bounds only (a sleep lasts at least its time): the last layer after one sleep, the first after three.
    ready = timing["parameter_ready"]
    assert ready[2] >= 0.02 and ready[1] >= 0.04 and ready[0] >= 0.06
    assert ready[2] < ready[1] < ready[0]


def test_each_row_gets_the_overlap_model_of_its_variant_and_cap_on_the_link():
    model, link = emulated_mlp(4, 3, 0.02), Link(latency=1e-3, bandwidth=1e6)
    timing = dict(forward=0.001, backward=0.06, optimizer=0.001, parameter_ready=[0.06, 0.04, 0.02])
    rows = [dict(variant="flat", bucket_cap_mb=None), dict(variant="bucketed", bucket_cap_mb=64 / 2**20),
            dict(variant="bucketed", bucket_cap_mb=None)]
    assert predicted_steps(rows, model, timing, 2, link) == [
        predict_step(model, timing, 2, 1e-3, 1e-6, "flat"), predict_step(model, timing, 2, 1e-3, 1e-6, "bucketed",
                                                                         64 / 2**20),
        predict_step(model, timing, 2, 1e-3, 1e-6, "bucketed", 25)]  # None: DDP's default cap, 25 MiB


@pytest.mark.parametrize("call, message", [
    (lambda: time_single_process_step(build_small_model, small_batch, repeats=0),
     "repeats must be a whole number >= 1, got 0"),
    (lambda: measure_ddp_steps(None, build_small_model, small_batch, []), "give at least one"),
    (lambda: measure_ddp_steps(None, build_small_model, small_batch, ["fast"]), "variant must be one of"),
    (lambda: measure_ddp_steps(None, build_small_model, small_batch, [("bucketed", 0)]),
     "bucket_cap_mb must be above 0"),
    (lambda: measure_ddp_steps(None, build_small_model, small_batch, ["flat"], steps=0),
     "steps must be a whole number >= 1, got 0"),
])
def test_bad_input_gets_a_sentence_saying_what_to_change(call, message):
    with pytest.raises(ValueError, match=message):
        call()
