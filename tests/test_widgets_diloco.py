"""Lecture 10's DiLoCo widget without a browser: the model lines are the measured steps times
``costs.seconds_per_step``, the crossover line sits at ``costs.crossover``, measured points are
drawn, and bad curves or targets are refused with a sentence."""

import math

import matplotlib
import pytest

from parlab.diloco import costs
from parlab.runtime.emulation import Link
from parlab.widgets.diloco import BANDWIDTHS, diloco_widget, plot_wall_time_to_loss, readout, steps_to_target

matplotlib.use("Agg")

P, N, T_C = 4 * 2**18, 4, 0.02
# Loss falls as exp(-s / scale): to 0.02 (ln 50 = 3.91 scales) DDP takes 40 steps, DiLoCo 47 (H = 4) and 63 (H = 8).
CURVES = {"ddp": [(s, math.exp(-s / 10)) for s in range(101)],
          ("diloco", 4): [(s, math.exp(-s / 12)) for s in range(101)],
          ("diloco", 8): [(s, math.exp(-s / 16)) for s in range(101)]}


def test_steps_to_target_reads_each_curve():
    assert steps_to_target(CURVES, 0.02) == {"ddp": 40, ("diloco", 4): 47, ("diloco", 8): 63}


def test_the_lines_are_steps_times_seconds_per_step_and_the_crossover_is_costs():
    measured = [("ddp", 1, 0.001, 1e7, 5.0), ("diloco", 8, 0.001, 1e7, 3.0), ("diloco", 4, 0.001, 1e7, 9.0),
                ("ddp", 1, 0.03, 1e9, 7.0)]  # a point at another latency belongs to other lines
    ax = plot_wall_time_to_loss(CURVES, 0.02, 8, 0.001, T_C, P, N, measured=measured)
    lines = {line.get_label(): line for line in ax.get_lines()}
    ddp, diloco = lines["model: DDP, S = 40"], lines["model: DiLoCo, H = 8, S = 63"]
    assert list(ddp.get_xdata()) == BANDWIDTHS
    for line, method, S, H in ((ddp, "ddp", 40, 1), (diloco, "diloco", 63, 8)):
        expected = [S * costs.seconds_per_step(method, Link(0.001, b), T_C, P, N, H=H) for b in BANDWIDTHS]
        assert list(line.get_ydata()) == pytest.approx(expected, rel=1e-12)
    bandwidth = costs.crossover(40, 63, 8, P, N, T_C, 0.001)
    assert 1e6 < bandwidth < 1e10
    assert list(lines[f"crossover: {bandwidth / 1e6:.3g} MB/s"].get_xdata()) == [bandwidth, bandwidth]
    assert ax.get_title().startswith("model: alpha-beta, N = 4, t_c = 20 ms, alpha = 1 ms")
    # the model's lines cross where the crossover line stands
    assert (ddp.get_ydata() > diloco.get_ydata()).tolist() == [b < bandwidth for b in BANDWIDTHS]
    assert list(lines["measured: DDP (emulated link)"].get_ydata()) == [5.0]
    assert list(lines["measured: DiLoCo, H = 8 (emulated link)"].get_ydata()) == [3.0]  # H = 4's point left out


def test_no_crossover_line_when_latency_alone_decides():
    ax = plot_wall_time_to_loss(CURVES, 0.02, 8, 0.03, T_C, P, N)
    assert costs.crossover(40, 63, 8, P, N, T_C, 0.03) == math.inf
    assert not any(line.get_label().startswith("crossover") for line in ax.get_lines())
    assert "DiLoCo (H = 8) is sooner at every bandwidth" in ax.get_title()


@pytest.mark.parametrize("curves, target, match", [
    ({}, 0.02, "curves is empty"),
    ({"ddp": CURVES["ddp"]}, 0.02, "at least one"),
    ({"ddp": CURVES["ddp"], ("local", 4): CURVES["ddp"]}, 0.02, "rename that curve"),
    (CURVES, 1e-5, r"the curve 'ddp' never reaches the target loss 1e-05 \(its lowest is 4.53999e-05\): raise"),
    ({"ddp": CURVES["ddp"], ("diloco", 8): CURVES["diloco", 8][:50]}, 0.02,
     r"the curve \('diloco', 8\) never reaches the target loss 0.02 .*measure that curve for more inner steps"),
])
def test_bad_curves_and_targets_are_refused_with_what_to_change(curves, target, match):
    with pytest.raises(ValueError, match=match):
        plot_wall_time_to_loss(curves, target, 8, 0.001, T_C, P, N)


def test_one_replica_is_refused():
    with pytest.raises(ValueError, match="N >= 2"):
        plot_wall_time_to_loss(CURVES, 0.02, 8, 0.001, T_C, P, 1)


def test_the_widget_answers_h_and_latency_and_refuses_an_unmeasured_h():
    widget = diloco_widget(CURVES, 0.02, T_C, P, N, latency=0.001)
    period, alpha, line, feedback, image = widget.children
    assert line.value == readout(CURVES, 0.02, 4, 0.001, T_C, P, N)
    assert line.value.endswith("steps to loss 0.02: DDP <b>40</b>, DiLoCo H = 4 <b>47</b>, DiLoCo H = 8 <b>63</b>")
    first = image.value
    period.value = 8
    assert f"sooner below {costs.crossover(40, 63, 8, P, N, T_C, 0.001) / 1e6:.3g} MB/s" in line.value
    alpha.value = 0.1
    assert "sooner at every bandwidth" in line.value and image.value != first
    assert feedback.children[0].value == ""
    with pytest.raises(ValueError, match=r"H = 16 has no measured DiLoCo curve: pick one of \[4, 8\]"):
        diloco_widget(CURVES, 0.02, T_C, P, N, H=16)
