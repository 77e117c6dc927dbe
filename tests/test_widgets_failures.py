"""Lecture 10's checkpoint-interval widget without a browser: the model curve is
``young_daly.goodput``, the simulated points are ``goodput_curve``'s, the vertical lines stand
at Young's, Daly's and the exact optimum, and impossible regimes are refused."""

import math

import matplotlib
import pytest

from parlab.failures import young_daly
from parlab.widgets.failures import GRID, goodput_widget, interval_table, plot_goodput, simulated_intervals

matplotlib.use("Agg")


def test_the_lines_stand_at_young_daly_and_the_optimum():
    ax = plot_goodput(60, 120, 3600 * 3, work=2e5, seed=3)
    lines = {line.get_label().split(":")[0]: line for line in ax.get_lines()}
    assert lines["Young sqrt(2 delta Theta)"].get_xdata()[0] == math.sqrt(2 * 60 * 3600 * 3)
    assert lines["Daly"].get_xdata()[0] == young_daly.daly_interval(60, 3600 * 3)
    assert lines["optimum"].get_xdata()[0] == young_daly.optimum_interval(60, 3600 * 3)
    assert ax.get_title() == "goodput against I: delta = 60 s, t_R = 2 min, Theta = 3 h"


def test_the_model_and_the_simulated_points_are_young_dalys():
    intervals, _ = simulated_intervals(60, 120, 3600)
    ax = plot_goodput(60, 120, 3600, work=2e5, seed=3)
    model = next(line for line in ax.get_lines() if line.get_label().startswith("model"))
    assert list(model.get_ydata()) == [young_daly.goodput(i, 60, 120, 3600) for i in model.get_xdata()]
    curve = young_daly.goodput_curve(60, 120, 3600, intervals, 2e5, seed=3)
    [points] = ax.containers  # the error bars
    assert list(points.lines[0].get_xdata()) == intervals
    assert list(points.lines[0].get_ydata()) == curve["measured"]
    assert points.get_label().startswith(f"simulated, one seeded run per I ({sum(curve['failures'])} failures)")


def test_the_simulated_intervals_stop_where_a_segment_would_fail_too_often():
    best = young_daly.optimum_interval(600, 1200)
    intervals, work = simulated_intervals(600, 600, 1200)
    assert intervals == [best * g for g in GRID if (best * g + 1200) / 1200 <= 5] and len(intervals) < len(GRID)
    assert work > 0
    assert len(simulated_intervals(60, 120, 3600 * 3)[0]) == len(GRID)


@pytest.mark.parametrize("args, match", [
    ((0, 120, 3600), "delta must be above 0"),
    ((60, -1, 3600), "t_R must be at least 0"),
    ((60, 120, -5), "Theta must be above 0"),
    ((3600, 3600, 600), r"delta \+ t_R = 2 h is too long against Theta = 10 min: .* Shorten delta or t_R"),
])
def test_bad_times_are_refused_with_what_to_change(args, match):
    with pytest.raises(ValueError, match=match):
        plot_goodput(*args)


def test_the_widget_reads_out_each_interval_and_its_goodput():
    widget = goodput_widget(delta=60, restart=120, theta=3600)
    write, recover, mtbf, table, feedback, image = widget.children
    assert table.value == interval_table(60, 120, 3600)
    optimum = young_daly.optimum_interval(60, 3600)
    assert f"<td>optimum</td><td>{optimum / 60:.3g} min</td><td>{young_daly.goodput(optimum, 60, 120, 3600):.4f}" \
        in table.value
    first = image.value
    mtbf.value = 3600 * 24
    assert table.value == interval_table(60, 120, 3600 * 24) and image.value != first
    assert feedback.children[0].value == ""
    write.value = 1e4
    mtbf.value = 100
    assert "too long against Theta" in feedback.children[0].value  # shown in the widget, not lost
    with pytest.raises(ValueError, match="t_R"):
        goodput_widget(restart=0)
