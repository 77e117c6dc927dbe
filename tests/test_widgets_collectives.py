"""Lecture 01's widgets without a browser: the plain figures they draw, and the widgets
themselves answering slider moves with a new picture and a new table."""

import subprocess
import sys

import matplotlib
import pytest
from matplotlib.image import AxesImage
from matplotlib.patches import Rectangle
from matplotlib.text import Annotation

from parlab.alpha_beta import ALL_REDUCE_ALGORITHMS, cost_model
from parlab.collectives import ring_contributions
from parlab.widgets.collectives import (
    ACTION_COLOURS,
    alpha_beta_widget,
    plot_alpha_beta,
    plot_ring_step,
    prediction_table,
    ring_widget,
)

matplotlib.use("Agg")


def texts(ax):
    return [text.get_text() for text in ax.texts if not isinstance(text, Annotation)]


def outlines(ax):
    return [patch for patch in ax.patches if isinstance(patch, Rectangle) and not patch.get_fill()]


# --- the ring step-through --------------------------------------------------------------------


@pytest.mark.parametrize("N, step", [(4, 0), (4, 2), (4, 3), (4, 5), (3, 4)])
def test_ring_step_colours_each_cell_by_its_number_of_contributions(N, step):
    ax = plot_ring_step(N, step)
    [image] = [artist for artist in ax.get_images() if isinstance(artist, AxesImage)]
    expected = [[len(ranks) for ranks in row] for row in ring_contributions(N, step)]
    assert image.get_array().tolist() == expected
    assert [label.get_text() for label in ax.get_yticklabels()] == [f"rank {r}" for r in range(N)]
    assert [label.get_text() for label in ax.get_xticklabels()] == [f"chunk {c}" for c in range(N)]


def test_ring_step_draws_the_transfers_of_the_step():
    ax = plot_ring_step(4, 2)  # reduce-scatter step j = 1: rank r sends chunk r - 2, receives r - 3
    assert ax.get_title() == "reduce-scatter step 2 of 3: each rank adds the chunk it receives into its own"
    assert "sends chunk 2 → rank 1\nreceives chunk 1 ← rank 3" in texts(ax)  # rank 0
    assert "0+2+3" in texts(ax) and "all" not in texts(ax)
    boxes = outlines(ax)
    centres = sorted((round(box.get_x() + 0.5), round(box.get_y() + 0.5)) for box in boxes)  # (chunk, rank)
    assert centres == [(0, 3), (1, 0), (2, 1), (3, 2)]
    assert {box.get_edgecolor() for box in boxes} == {matplotlib.colors.to_rgba(ACTION_COLOURS["reduce"])}
    arrows = [text for text in ax.texts if isinstance(text, Annotation)]
    assert len(arrows) == 3 + 2  # three between neighbours; the wrap from rank 3 to 0 in two halves


def test_ring_step_0_and_the_last_step_have_no_transfers_left_to_guess():
    start, end = plot_ring_step(4, 0), plot_ring_step(4, 6)
    assert start.get_title() == "before the all-reduce: every rank holds only its own data"
    assert outlines(start) == []
    assert end.get_title() == "all-gather step 3 of 3: each rank writes the chunk it receives over its own"
    assert texts(end).count("all") == 16


# --- the alpha-beta model ---------------------------------------------------------------------


def test_alpha_beta_plot_draws_the_model_of_every_algorithm_on_log_axes():
    sizes = [2.0**k for k in range(10, 25)]
    ax = plot_alpha_beta(4, 2e-5, 1e-9, sizes)
    lines = {line.get_label(): line for line in ax.get_lines()}
    assert len(lines) == len(ALL_REDUCE_ALGORITHMS)
    for algorithm in ALL_REDUCE_ALGORITHMS:
        [line] = [line for label, line in lines.items() if label.startswith(f"model: {algorithm}")]
        assert list(line.get_ydata()) == pytest.approx([cost_model(algorithm, D, 4, 2e-5, 1e-9) for D in sizes])
    assert (ax.get_xscale(), ax.get_yscale()) == ("log", "log")
    assert ax.get_title() == "alpha-beta model, N = 4: alpha = 20 µs, 1/beta = 1 GB/s"


def test_alpha_beta_plot_overlays_the_measured_rows_of_its_world_size():
    measured = [
        {"world_size": N, "bytes": D, "algorithm": algorithm, "seconds": 1e-3 * N}
        for N in (2, 4) for D in (1024, 4096) for algorithm in ("torch", "naive", "ring", "butterfly")
    ]
    ax = plot_alpha_beta(2, 2e-5, 1e-9, [1024.0, 4096.0], measured)
    points = {line.get_label(): line for line in ax.get_lines() if line.get_label().startswith("measured")}
    assert sorted(points) == [
        "measured: butterfly", "measured: naive", "measured: ring", "measured: torch dist.all_reduce",
    ]
    assert all(list(line.get_ydata()) == [2e-3, 2e-3] for line in points.values())


def test_prediction_table_splits_each_time_into_latency_and_bandwidth_terms():
    html = prediction_table(4, 1e-5, 1e-9, 1e6)  # ring: 6 alpha + 1.5 D beta = 0.06 + 1.5 ms
    assert "<td>ring</td><td>1.56 ms</td><td>0.06 ms</td><td>1.5 ms</td>" in html
    assert "<td><b>butterfly</b></td><td><b>1.54 ms</b></td>" in html  # the fastest, in bold
    assert "D = 1,000,000 bytes on N = 4 ranks" in html
    small = prediction_table(8, 1e-5, 1e-9, 1024)  # latency-bound: the ring's 2 (N - 1) messages lose
    assert "<td>ring</td><td>0.142 ms</td><td>0.14 ms</td>" in small
    assert "<td><b>butterfly</b></td><td><b>0.0618 ms</b></td>" in small


# --- the widgets, driven without a browser ----------------------------------------------------


def sliders(box):
    """The widget's sliders by description (they sit in the HBoxes at the top of the box)."""
    return {w.description: w for row in box.children if hasattr(row, "children") for w in row.children}


def test_ring_widget_redraws_when_the_step_or_the_number_of_ranks_changes():
    box = ring_widget(N=4)
    image = box.children[-1]
    controls = sliders(box)
    ranks, step = controls["N ranks"], controls["step"]
    assert (step.min, step.max) == (0, 6)
    first = bytes(image.value)
    assert first.startswith(b"\x89PNG")
    step.value = 3
    after_step = bytes(image.value)
    assert after_step != first
    step.value = 6
    ranks.value = 3
    assert step.max == 4 and step.value == 4
    assert bytes(image.value) not in (first, after_step)


def test_alpha_beta_widget_updates_the_table_and_the_figure():
    box = alpha_beta_widget(N=4, alpha=1e-5, beta=1e-9)
    controls = sliders(box)
    image, table = box.children[-2], box.children[-1]
    assert table.value == prediction_table(4, controls["alpha (s)"].value, controls["beta (s/B)"].value, 2**20)
    picture = bytes(image.value)
    controls["D (bytes)"].value = 2**12
    assert "D = 4,096 bytes on N = 4 ranks" in table.value
    assert bytes(image.value) != picture
    controls["N ranks"].value = 16
    assert "on N = 16 ranks" in table.value


def test_a_measured_alpha_or_beta_outside_the_sliders_widens_them():
    controls = sliders(alpha_beta_widget(N=100, alpha=0.5, beta=1e-13))  # once clamped to 64, 1e-2 and 1e-12
    assert (controls["N ranks"].value, controls["alpha (s)"].value, controls["beta (s/B)"].value) == (100, 0.5, 1e-13)


@pytest.mark.parametrize("call, message", [
    (lambda: ring_widget(N=9),
     "N .the number of ranks in the ring. must be a whole number from 2 to 8, got 9: the step-through draws"),
    (lambda: ring_widget(N=2.5), "whole number from 2 to 8, got 2.5"),
    (lambda: plot_alpha_beta(4, 1e-5, 0, [1024]),
     "beta .seconds per byte. must be above 0 .*, got 0: give the inverse bandwidth"),
    (lambda: plot_alpha_beta(4, -1e-5, 1e-9, [1024]), "alpha .seconds per message. must be at least 0 .*, got -1e-05"),
    (lambda: plot_alpha_beta(4, 1e-5, 1e-9, []), "give at least one, each above 0"),
    (lambda: plot_alpha_beta(1, 1e-5, 1e-9, [1024]),
     "N .the number of ranks. must be a whole number >= 2, got 1: the model compares"),
    (lambda: prediction_table(4, 1e-5, 1e-9, -1), "D .bytes in the tensor. must be at least 0 .*, got -1"),
    (lambda: prediction_table(4, 1e-5, float("nan"), 1024), "got nan"),
    (lambda: alpha_beta_widget(alpha=0), "must be above 0 .*, got 0: the alpha slider has a log scale"),
])
def test_bad_input_gets_a_sentence_saying_what_to_change(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_the_widgets_module_imports_without_ipywidgets():
    code = "import sys, parlab.widgets.collectives; print('ipywidgets' in sys.modules)"
    finished = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=50)
    assert finished.stdout.strip() == "False", finished.stderr
