"""Lecture 05's widgets without a browser: the prediction they draw (bytes by the compressors'
formulas, time by the alpha-beta model), the curves, and the widget answering its controls and
its measure button."""

import matplotlib
import pytest

from parlab import Link
from parlab.widgets.compression import (
    KINDS,
    caption,
    compression_widget,
    drawn_rows,
    lecture_compressor,
    plot_curves,
    plot_prediction,
    step_prediction,
)

matplotlib.use("Agg")
D = 2 * (256 * 256 + 256)  # the lecture's MLP: 131,584 parameters
SLOW = Link(latency=500e-6, bandwidth=10e6)


def test_step_prediction_is_the_formulas_beside_dense():
    dense, topk = step_prediction("top-k + EF", 4, SLOW, budget=0.01)
    k = int(0.01 * D)
    assert dense["sent"] == 2 * 3 * 4 * D // 4 and topk["sent"] == 3 * k * (4 + 8)
    assert topk["bytes_ratio"] == topk["sent"] / dense["sent"]
    # compute + 2 (N - 1) ring steps of alpha + (d / N) 4 beta, and N - 1 all-gather steps of alpha + 12 k beta
    assert dense["predicted_s"] == pytest.approx(0.01 + 6 * (500e-6 + D / 4 * 4 / 10e6))
    assert topk["predicted_s"] == pytest.approx(0.01 + 3 * (500e-6 + 12 * k / 10e6))
    assert topk["time_ratio"] == pytest.approx(topk["predicted_s"] / dense["predicted_s"])
    _, power = step_prediction("PowerSGD + EF", 2, SLOW, rank=4)
    assert power["sent"] == 4 * (256 + 256 + (256 + 256) * 4 * 2)  # biases and P's, then Q's: N = 2 sends each once


def test_the_widget_draws_top_k_and_powersgd_beside_the_chosen_one_and_its_caption_says_so():
    assert [row["name"] for row in drawn_rows("fp16", 4, SLOW)] == ["dense", "fp16", "top-k + EF", "PowerSGD + EF"]
    assert [row["name"] for row in drawn_rows("PowerSGD + EF", 4, SLOW)] == ["dense", "PowerSGD + EF", "top-k + EF"]
    # the static picture's caption named only the chosen compressor, though PowerSGD is always drawn
    assert caption("top-k + EF", 4, 10e6, 0.01, 2) == (
        "top-k + EF and PowerSGD + EF (k/d = 0.01, PowerSGD's R = 2) against dense at N = 4, 10 MB/s")
    assert caption("fp16", 8, 1e9, 0.1, 4).startswith(
        "fp16, top-k + EF and PowerSGD + EF (k/d = 0.1, PowerSGD's R = 4)")
    # the glossary's letters: q for QSGD's levels (s is a sequence length)
    assert "QSGD q=4" in KINDS and lecture_compressor("QSGD q=4").levels == 4


def test_plot_prediction_draws_compute_and_communication_and_the_measured_dots():
    rows = step_prediction("fp16", 4, SLOW)
    rows[1]["measured_s"] = 0.06
    ax = plot_prediction(rows)
    widths = sorted(round(patch.get_width(), 6) for patch in ax.patches)
    expected = sorted([10.0, 10.0] + [round((row["predicted_s"] - 0.01) * 1e3, 6) for row in rows])
    assert widths == expected
    [dots] = ax.lines
    assert list(dots.get_xdata()) == [60.0]


def test_plot_curves_draws_loss_against_steps_and_wall_time():
    runs = [{"name": "dense", "losses": [3, 2, 1], "times": [0.1, 0.2, 0.3]},
            {"name": "fp16", "losses": [3, 2.5, 2], "times": [0.05, 0.1, 0.15]}]
    by_step, by_time = plot_curves(runs)
    assert [list(line.get_xdata()) for line in by_step.lines] == [[1, 2, 3]] * 2
    assert [list(line.get_xdata()) for line in by_time.lines] == [[0.1, 0.2, 0.3], [0.05, 0.1, 0.15]]


def test_the_widget_redraws_on_its_controls_and_measures_on_the_cluster(cluster2):
    widget = compression_widget(cluster2, kind="top-k + EF", N=4, bandwidth=10e6)
    choice, fraction, rank, ranks, speed, measure_button, readout, feedback, image = widget.children
    assert rank.description == "PowerSGD rank R"
    assert readout.value.startswith("top-k + EF: <b>47,340 bytes</b> per rank")
    picture = image.value
    for control, value in ((fraction, 0.1), (rank, 4), (ranks, 8), (speed, 1e9)):  # each control redraws
        control.value = value
        assert image.value != picture, control.description
        picture = image.value
    ranks.value, speed.value = 4, 10e6
    picture = image.value
    choice.value = "fp16"
    assert readout.value.startswith(f"fp16: <b>{3 * 2 * D // 2:,} bytes</b>") and image.value != picture
    measure_button.click()
    assert ranks.value == 2  # measured on the cluster's 2 ranks
    assert "measured under a link of 500 µs + bytes / (10 MB/s): dense" in feedback.children[0].value
    assert "parlab-error" not in feedback.children[0].value


@pytest.mark.parametrize("call, message", [
    (lambda: lecture_compressor("gzip"), "kind must be one of"),
    (lambda: lecture_compressor("top-k + EF", budget=2), "at most 1"),
    (lambda: step_prediction("fp16", 1, SLOW), "at least 2 ranks"),
    (lambda: step_prediction("fp16", 4, "10MB/s"), "link must be a parlab.Link"),
])
def test_bad_controls_are_refused_with_what_to_change(call, message):
    with pytest.raises(ValueError, match=message):
        call()
