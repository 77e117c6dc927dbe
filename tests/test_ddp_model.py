"""parlab.ddp: the overlap model of a DDP step against hand-computed cases. Every bucket's
all-reduce is a ring over N_d ranks, 2 (N_d - 1) alpha + 2 (N_d - 1)/N_d B beta; no timing."""

import pytest
import torch
from torch import nn

from parlab.alpha_beta import cost_model
from parlab.ddp import assign_buckets, bucket_overlap, predict_overlap, predict_step
from parlab.units import MIB

ALPHA, BETA = 1e-3, 1e-6  # 1 ms per message, 1 ms per KB: round numbers to compute by hand


def three_layers():
    """Trainable parameters, registration order: 0.weight 4x4, 0.bias 4, 1.weight 2x4,
    1.bias 2 (64, 16, 32, 8 bytes), then a frozen layer that DDP leaves out."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2), nn.Linear(2, 2))
    model[2].requires_grad_(False)
    return model


def test_one_bucket_hides_nothing():
    # N_d = 2: a ring of 2 messages of 500 bytes, 2 alpha + 1000 beta = 3 ms.
    intervals, step_end, exposed = predict_overlap([1000], [0.05], 2, ALPHA, BETA)
    assert intervals == [(0.05, pytest.approx(0.053))]
    assert step_end == pytest.approx(0.053)
    assert exposed == pytest.approx(0.003)  # all of it


def test_each_all_reduce_is_a_ring_over_n_d_ranks():
    # N_d = 4: 6 messages of 250 bytes, 6 alpha + 1500 beta = 7.5 ms, lecture 01's cost_model.
    _, _, exposed = predict_overlap([1000], [0.0], 4, ALPHA, BETA)
    assert exposed == pytest.approx(0.0075) == pytest.approx(cost_model("ring", 1000, 4, ALPHA, BETA))
    assert predict_overlap([1000], [0.0], 1, ALPHA, BETA)[2] == 0  # one rank: nothing to average


def test_many_buckets_with_a_long_backward_expose_only_the_last():
    # Four 1000-byte buckets ready every 10 ms; each all-reduce takes 3 ms on 2 ranks.
    intervals, step_end, exposed = predict_overlap([1000] * 4, [0.01, 0.02, 0.03, 0.04], 2, ALPHA, BETA)
    assert intervals == [(pytest.approx(t), pytest.approx(t + 0.003)) for t in (0.01, 0.02, 0.03, 0.04)]
    assert step_end == pytest.approx(0.043)
    assert exposed == pytest.approx(0.003)  # the last bucket's all-reduce


def test_all_reduces_queue_one_at_a_time_when_communication_is_slower():
    # Ready at 1 and 2 ms, each all-reduce 2 + 10 = 12 ms: the second waits for the first.
    intervals, step_end, exposed = predict_overlap([10_000, 10_000], [0.001, 0.002], 2, ALPHA, BETA)
    assert intervals == [(0.001, pytest.approx(0.013)), (pytest.approx(0.013), pytest.approx(0.025))]
    assert step_end == pytest.approx(0.025)
    assert exposed == pytest.approx(0.023)


def test_bucket_overlap_uses_the_ddp_plan_in_reverse_order():
    model = three_layers()
    plan = bucket_overlap(model, 48 / MIB, 2, ALPHA, BETA, backward_seconds=0.12)
    assert plan["names"] == ["1.bias", "1.weight", "0.bias", "0.weight"]  # frozen 2.* left out
    assert plan["nbytes"] == [8, 32, 16, 64]
    # assign_buckets' [[3, 2], [1], [0]] in registration indices is [[0, 1], [2], [3]] in launch order
    assert assign_buckets([64, 16, 32, 8], 48) == [[3, 2], [1], [0]]
    assert plan["buckets"] == [[0, 1], [2], [3]]
    assert plan["bucket_bytes"] == [40, 16, 64]
    # Backward time proportional to bytes: 120 bytes in 120 ms, 1 ms per byte.
    assert plan["ready"] == pytest.approx([0.008, 0.040, 0.056, 0.120])
    assert [start for start, _ in plan["intervals"]] == pytest.approx([0.040, 0.056, 0.120])
    assert plan["exposed"] == pytest.approx(2 * ALPHA + 64 * BETA)


def test_bucket_overlap_takes_measured_ready_times():
    plan = bucket_overlap(three_layers(), 1, 2, ALPHA, BETA, parameter_ready=[0.5, 0.4, 0.3, 0.2])
    assert plan["buckets"] == [[0, 1, 2, 3]]
    assert plan["intervals"] == [(0.5, pytest.approx(0.5 + 2 * ALPHA + 120 * BETA))]


def test_variants_after_backward_launch_every_bucket_at_its_end():
    ready = [0.5, 0.4, 0.3, 0.2]
    naive = bucket_overlap(three_layers(), 1, 2, ALPHA, BETA, parameter_ready=ready, variant="naive")
    overlapped = bucket_overlap(three_layers(), 1, 2, ALPHA, BETA, parameter_ready=ready, variant="overlapped")
    flat = bucket_overlap(three_layers(), 1e-9, 2, ALPHA, BETA, parameter_ready=ready, variant="flat")
    per_parameter = [cost_model("ring", nbytes, 2, ALPHA, BETA) for nbytes in (8, 32, 16, 64)]
    assert naive["buckets"] == overlapped["buckets"] == [[0], [1], [2], [3]]  # the cap is the variant's own
    assert naive["intervals"][0][0] == 0.5 and naive["exposed"] == pytest.approx(sum(per_parameter))
    assert overlapped["intervals"][0][0] == 0.2 and overlapped["exposed"] < naive["exposed"]
    assert flat["buckets"] == [[0, 1, 2, 3]] and flat["exposed"] == pytest.approx(2 * ALPHA + 120 * BETA)


def test_predict_step_adds_forward_and_optimizer_to_the_end_of_backward_and_its_all_reduces():
    timing = dict(forward=0.01, backward=0.5, optimizer=0.002, parameter_ready=[0.5, 0.4, 0.3, 0.2])
    flat = predict_step(three_layers(), timing, 2, ALPHA, BETA, "flat")
    assert flat == pytest.approx(0.01 + 0.5 + 2 * ALPHA + 120 * BETA + 0.002)
    hidden = predict_step(three_layers(), dict(timing, backward=0.9), 2, ALPHA, BETA, "bucketed", 1)
    assert hidden == pytest.approx(0.01 + 0.9 + 0.002)  # backward measured longer than the all-reduce's end


@pytest.mark.parametrize("call, message", [
    (lambda: predict_overlap([1, 2], [0.1], 2, ALPHA, BETA), "one ready time per bucket"),
    (lambda: predict_overlap([100], [0.1], 2, -1, BETA), "alpha .seconds per message. must be at least 0"),
    (lambda: predict_overlap([100], [-0.1], 2, ALPHA, BETA), "every ready time must be at least 0 .*, got -0.1"),
    (lambda: predict_overlap([100], [0.1], 0, ALPHA, BETA), "N_d .the data-parallel degree. must be a whole number"),
    (lambda: bucket_overlap(three_layers(), 1, 2, ALPHA, BETA, backward_seconds=0),
     "backward_seconds must be above 0 .*, got 0"),
    (lambda: bucket_overlap(three_layers(), 1, 2, ALPHA, BETA), "give backward_seconds .* or parameter_ready"),
    (lambda: bucket_overlap(three_layers(), 1, 2, ALPHA, BETA, parameter_ready=[0.1]),
     "one time per trainable parameter of the model \\(4\\), got 1"),
    (lambda: bucket_overlap("model", 1, 2, ALPHA, BETA, 0.1), "model must be a torch.nn.Module, got 'model'"),
    (lambda: bucket_overlap(three_layers(), 1, 2, ALPHA, BETA, 0.1, variant="ring"), "variant must be one of"),
    (lambda: bucket_overlap(nn.Linear(2, 2).requires_grad_(False), 1, 2, ALPHA, BETA, 0.1),
     "no trainable parameters"),
    (lambda: predict_step(three_layers(), {"forward": 0.1}, 2, ALPHA, BETA), "pass what time_single_process_step"),
])
def test_bad_input_gets_a_sentence_saying_what_to_change(call, message):
    with pytest.raises(ValueError, match=message):
        call()
