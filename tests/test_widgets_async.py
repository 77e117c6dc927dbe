"""Lecture 06's widgets without a browser: the delayed-GD trajectory and stability region, the
gossip figure (values mixing, consensus against rho^2t), and both widgets answering their
controls."""

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
    values, distances, rho, period = gossip_run("ring", 8, 12)
    assert (round(rho, 4), period) == (0.8047, 1)
    assert all(sum(row) / 8 == pytest.approx(3.5, abs=1e-12) for row in values)
    assert all(b <= a * rho**2 * (1 + 1e-9) for a, b in zip(distances, distances[1:]))
    values, distances, rho, period = gossip_run("one-peer exponential", 8, 3)  # log2 8 rounds: exact average
    assert values[-1] == [3.5] * 8 and distances[-1] == 0 and (rho, period) == (0, 3)


def test_the_one_peer_graph_is_bounded_per_period_and_exact_only_at_powers_of_two():
    values, distances, rho, period = gossip_run("one-peer exponential", 6, 9)  # N = 6: 3 rounds a period
    assert period == 3 and rho == pytest.approx(gossip.rho(gossip.one_peer_period(6))) and rho > 0.2
    assert all(d > 0 for d in distances)  # never the exact average
    assert all(distances[t + 3] <= distances[t] * rho**2 * (1 + 1e-9) for t in range(0, 7, 3))
    _, right = plot_gossip("one-peer exponential", 6, steps=9)
    reference = right.get_lines()[-1]
    assert reference.get_label() == f"Xi_0 rho^(2t/3), rho = {rho:.4f} (one period of 3 rounds)"
    assert list(reference.get_xdata()) == [0, 3, 6, 9]
    _, right = plot_gossip("one-peer exponential", 8, steps=9)
    assert right.get_lines()[-1].get_label() == "exact average after 3 rounds"


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
    assert readout.value == ("one period of 2 rounds: rho = <b>0.0000</b> (the exact average: N is a power of 2); "
                             "each rank sends 1 message(s) per step")
    ranks.value = 6
    assert readout.value.startswith(f"one period of 3 rounds: rho = <b>{gossip.rho(gossip.one_peer_period(6)):.4f}</b> "
                                    "(never exact: N is not a power of 2)")
    with pytest.raises(ValueError, match="tau"):
        stability_widget(tau=20)
    with pytest.raises(ValueError, match="topology must be one of"):
        gossip_widget("star")
