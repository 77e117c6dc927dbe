"""Lecture 06's widgets without a browser: the delayed-GD trajectory and stability region, the
gossip figure (values mixing, consensus against rho^2t), and both widgets answering their
controls."""

import math

import matplotlib
import pytest

from parlab.async_sgd import gossip, theory
from parlab.widgets.async_sgd import (
    gossip_run,
    gossip_widget,
    plot_gossip,
    plot_stability,
    stability_widget,
    verdict,
)

matplotlib.use("Agg")
pytestmark = pytest.mark.timeout(60)


def test_the_verdict_switches_at_the_cosine_threshold():
    for tau in range(5):
        threshold = theory.stability_threshold(tau)
        assert verdict(tau, 0.99 * threshold) == ("stable", threshold)
        assert verdict(tau, 1.01 * threshold)[0] == "unstable"


def test_plot_stability_draws_the_trajectory_and_marks_the_point():
    trajectory, region = plot_stability(2, 0.7, steps=40)
    (line,) = [line for line in trajectory.get_lines() if len(line.get_xdata()) == 41]
    assert list(line.get_ydata()) == theory.delayed_gd(0.7, 2, 40)
    assert trajectory.get_title() == ("tau = 2, gamma mu = 0.700: unstable (threshold 2 cos(tau pi / (2 tau + 1)) "
                                      "= 0.6180)")
    marker = region.get_lines()[-1]
    assert (list(marker.get_xdata()), list(marker.get_ydata())) == ([2], [0.7])


def test_gossip_run_keeps_the_mean_and_decays_no_slower_than_rho_squared():
    values, distances, rho = gossip_run("ring", 8, 12)
    assert rho == pytest.approx(0.8047, abs=5e-5)
    assert all(sum(row) / 8 == pytest.approx(3.5, abs=1e-12) for row in values)
    assert all(b <= a * rho**2 * (1 + 1e-9) for a, b in zip(distances, distances[1:]))
    values, distances, _ = gossip_run("one-peer exponential", 8, 3)  # log2 8 rounds: exact average
    assert values[-1] == [3.5] * 8 and distances[-1] == 0


def test_plot_gossip_draws_one_line_per_rank_and_the_rho_reference():
    left, right = plot_gossip("torus", 9, steps=10)
    assert len(left.get_lines()) == 9 + 1  # the ranks, and the mean
    reference = right.get_lines()[-1]
    assert reference.get_label() == f"Xi_0 rho^(2t), rho = {gossip.rho(gossip.torus(3, 3)):.4f}"
    assert reference.get_ydata()[1] / reference.get_ydata()[0] == pytest.approx(0.4**2)


def test_the_widgets_answer_their_controls_and_refuse_bad_values():
    widget = stability_widget(tau=1, gamma_mu=0.5)
    tau, gamma, readout, feedback, image = widget.children
    assert readout.value == "threshold 1.0000: <b>stable</b>"
    first = image.value
    gamma.value = 1.2
    assert readout.value == "threshold 1.0000: <b>unstable</b>" and image.value != first
    assert feedback.children[0].value == ""  # no error shown
    widget = gossip_widget("ring", 4)
    graph, ranks, readout, feedback, image = widget.children
    assert readout.value.startswith(f"rho = <b>{1 / 3:.4f}</b>; each rank sends 2 message(s)")
    graph.value = "one-peer exponential"
    assert "each rank sends 1 message(s)" in readout.value
    ranks.value = 16
    assert f"rho = <b>{math.cos(math.pi / 16):.4f}</b>" in readout.value  # round 0: (I + shift by 1) / 2
    with pytest.raises(ValueError, match="tau"):
        stability_widget(tau=20)
    with pytest.raises(ValueError, match="topology must be one of"):
        gossip_widget("star")
