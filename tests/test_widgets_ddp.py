"""Lecture 02's widgets without a browser: the overlap model against hand-computed cases,
the buckets it draws (the DDP wrapper's own plan), the widget answering its slider, and the
bucket-size sweep on two real ranks."""

import matplotlib
import pytest
import torch
from torch import nn

import parlab
from parlab.ddp import MB, assign_buckets
from parlab.widgets.ddp import (
    bucket_overlap,
    bucket_widget,
    measure_bucket_sweep,
    plot_buckets,
    predict_overlap,
    time_single_process_step,
)

matplotlib.use("Agg")
ALPHA, BETA = 1e-3, 1e-6  # 1 ms per message, 1 ms per KB: round numbers to compute by hand


@pytest.fixture(autouse=True)
def close_figures():
    import matplotlib.pyplot as plt

    yield
    plt.close("all")


def three_layers():
    """Trainable parameters, registration order: 0.weight 4x4, 0.bias 4, 1.weight 2x4,
    1.bias 2 (64, 16, 32, 8 bytes), then a frozen layer that DDP leaves out."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2), nn.Linear(2, 2))
    model[2].requires_grad_(False)
    return model


# --- the analytic model ----------------------------------------------------------------------


@pytest.mark.timeout(10)
def test_one_bucket_hides_nothing():
    intervals, step_end, exposed = predict_overlap([1000], [0.05], ALPHA, BETA)
    assert intervals == [(0.05, pytest.approx(0.05 + 0.001 + 0.001))]
    assert step_end == pytest.approx(0.052)
    assert exposed == pytest.approx(0.002)  # all of alpha + B beta


@pytest.mark.timeout(10)
def test_many_buckets_with_a_long_backward_expose_only_the_last():
    # Four 1000-byte buckets ready every 10 ms; each all-reduce takes 2 ms.
    intervals, step_end, exposed = predict_overlap([1000] * 4, [0.01, 0.02, 0.03, 0.04], ALPHA, BETA)
    assert intervals == [(pytest.approx(t), pytest.approx(t + 0.002)) for t in (0.01, 0.02, 0.03, 0.04)]
    assert step_end == pytest.approx(0.042)
    assert exposed == pytest.approx(0.002)  # the last bucket's alpha + B beta


@pytest.mark.timeout(10)
def test_all_reduces_queue_on_one_link_when_communication_is_slower():
    # Ready at 1 and 2 ms, each all-reduce 11 ms: the second waits for the first.
    intervals, step_end, exposed = predict_overlap([10_000, 10_000], [0.001, 0.002], ALPHA, BETA)
    assert intervals == [(0.001, pytest.approx(0.012)), (pytest.approx(0.012), pytest.approx(0.023))]
    assert step_end == pytest.approx(0.023)
    assert exposed == pytest.approx(0.021)


@pytest.mark.timeout(10)
def test_predict_overlap_needs_one_ready_time_per_bucket():
    with pytest.raises(ValueError, match="one ready time per bucket"):
        predict_overlap([1, 2], [0.1], ALPHA, BETA)


@pytest.mark.timeout(10)
def test_bucket_overlap_uses_the_ddp_plan_in_reverse_order():
    model = three_layers()
    plan = bucket_overlap(model, 48 / MB, ALPHA, BETA, backward_seconds=0.12)
    assert plan["names"] == ["1.bias", "1.weight", "0.bias", "0.weight"]  # frozen 2.* left out
    assert plan["nbytes"] == [8, 32, 16, 64]
    # assign_buckets' [[3, 2], [1], [0]] in registration indices is [[0, 1], [2], [3]] in launch order
    assert assign_buckets([p for p in model.parameters() if p.requires_grad], 48 / MB) == [[3, 2], [1], [0]]
    assert plan["buckets"] == [[0, 1], [2], [3]]
    assert plan["bucket_bytes"] == [40, 16, 64]
    # Backward time proportional to bytes: 120 bytes in 120 ms, 1 ms per byte.
    assert plan["ready"] == pytest.approx([0.008, 0.040, 0.056, 0.120])
    assert [start for start, _ in plan["intervals"]] == pytest.approx([0.040, 0.056, 0.120])
    assert plan["exposed"] == pytest.approx(ALPHA + 64 * BETA)


@pytest.mark.timeout(10)
def test_bucket_overlap_takes_measured_ready_times():
    plan = bucket_overlap(three_layers(), 1, ALPHA, BETA, parameter_ready=[0.5, 0.4, 0.3, 0.2])
    assert plan["buckets"] == [[0, 1, 2, 3]]
    assert plan["intervals"] == [(0.5, pytest.approx(0.5 + ALPHA + 120 * BETA))]


# --- the figure and the widget ----------------------------------------------------------------


def bars(ax, row):
    """(x, width, colour) of the bars in the row "backward" (y 0.55) or "all-reduce" (y 1.05)."""
    y = {"backward": 0.55, "all-reduce": 1.05}[row]
    found = []
    for collection in ax.collections:
        colour = tuple(collection.get_facecolor()[0])
        for path in collection.get_paths():
            (x0, y0), (x1, _) = path.vertices.min(axis=0), path.vertices.max(axis=0)
            if abs(y0 - y) < 1e-9:
                found.append((x0, x1 - x0, colour))
    return sorted(found)


@pytest.mark.timeout(30)
def test_plot_buckets_draws_one_bar_per_parameter_and_per_bucket_in_the_bucket_colours():
    ax = plot_buckets(three_layers(), 48 / MB, ALPHA, BETA, backward_seconds=0.12)
    backward, all_reduce = bars(ax, "backward"), bars(ax, "all-reduce")
    assert [round(width, 6) for _, width, _ in backward] == [8, 32, 16, 64]  # ms, proportional to bytes
    assert [round(x, 6) for x, _, _ in all_reduce] == [40, 56, 120]
    colours = [colour for _, _, colour in backward]
    assert colours[0] == colours[1] != colours[2] != colours[3]
    assert [colour for _, _, colour in all_reduce] == [colours[0], colours[2], colours[3]]
    assert ax.get_title() == "bucket_cap_mb = 4.58e-05: 3 buckets, predicted end 121 ms, exposed communication 1.06 ms"
    [shaded] = ax.patches  # the exposed communication, from the end of backward to the end of the step
    assert shaded.get_path().transformed(shaded.get_patch_transform()).vertices[:, 0].min() == pytest.approx(120)


@pytest.mark.timeout(30)
def test_bucket_widget_redraws_and_updates_its_readout_on_a_slider_move():
    widget = bucket_widget(three_layers(), ALPHA, BETA, backward_seconds=0.12, bucket_cap_mb=1)
    slider, readout, feedback, image = widget.children
    assert readout.value.startswith("<b>1</b> bucket;")
    assert "exposed communication <b>1.12 ms</b>" in readout.value  # alpha + 120 bytes beta
    picture = image.value
    slider.value = 2**-20  # 1 byte: a bucket per parameter
    assert readout.value.startswith("<b>4</b> buckets")
    assert "exposed communication <b>1.06 ms</b>" in readout.value
    assert image.value != picture and image.value[:4] == b"\x89PNG"
    assert slider.description == "bucket_cap_mb (MiB)" and feedback.children[0].value == ""


@pytest.mark.parametrize("call, message", [
    (lambda: predict_overlap([100], [0.1], -1, BETA), "alpha .seconds per all-reduce. must be at least 0 .*, got -1"),
    (lambda: predict_overlap([100], [-0.1], ALPHA, BETA), "every ready time must be at least 0 .*, got -0.1"),
    (lambda: bucket_overlap(three_layers(), 1, ALPHA, BETA, backward_seconds=0),
     "backward_seconds must be above 0 .*, got 0"),
    (lambda: bucket_overlap(three_layers(), 1, ALPHA, BETA, parameter_ready=[0.1]),
     "one time per trainable parameter of the model \\(4\\), got 1"),
    (lambda: bucket_overlap("model", 1, ALPHA, BETA, 0.1), "model must be a torch.nn.Module, got 'model'"),
    (lambda: bucket_widget(three_layers(), bucket_cap_mb=0),
     "bucket_cap_mb .* must be above 0 .*, got 0: the bucket slider has a log scale"),
    (lambda: time_single_process_step(build_small_model, small_batch, repeats=0),
     "repeats must be a whole number >= 1, got 0"),
    (lambda: measure_bucket_sweep(None, build_small_model, small_batch, []), "give at least one"),
    (lambda: measure_bucket_sweep(None, build_small_model, small_batch, [1], steps=0),
     "steps must be a whole number >= 1, got 0"),
])
def test_bad_input_gets_a_sentence_saying_what_to_change(call, message):
    with pytest.raises(ValueError, match=message):
        call()


# --- measurements -----------------------------------------------------------------------------


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


@pytest.mark.timeout(120)
def test_bucket_sweep_on_two_ranks_reports_the_number_of_buckets_of_each_cap():
    with parlab.Cluster(world_size=2, timeout=90) as cluster:
        rows = measure_bucket_sweep(cluster, build_small_model, small_batch, [1e-6, 1], steps=2)
    assert [(row["bucket_cap_mb"], row["buckets"]) for row in rows] == [(1e-6, 4), (1, 1)]
    assert all(row["step_seconds"] > 0 for row in rows)
