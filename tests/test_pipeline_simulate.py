"""The schedule simulator against the known results: GPipe's and 1F1B's bubble of
(K - 1) / (M + K - 1), their activation peaks, interleaving dividing the bubble by v, ZB-H1
filling part of it with weight gradients; the bubble of a timeline; communication delays;
the plot."""

from fractions import Fraction

import matplotlib
import pytest

from parlab.pipeline import (
    action_makespan,
    bubble_formula,
    bubble_fraction,
    bubble_ratio_playbook,
    gpipe,
    interleaved_1f1b,
    naive,
    one_f_one_b,
    simulate,
    zero_bubble_h1,
)
from parlab.trace import COMM, COMPUTE, Timeline

matplotlib.use("Agg")
pytestmark = pytest.mark.timeout(30)
ONE = Fraction(1)


# --- the golden results --------------------------------------------------------------------------


@pytest.mark.parametrize("t_b", [ONE, 2 * ONE])
@pytest.mark.parametrize("build", [gpipe, one_f_one_b])
def test_gpipe_and_1f1b_idle_3_of_11_for_4_ranks_and_8_microbatches(build, t_b):
    simulation = simulate(build(4, 8), t_f=ONE, t_b=t_b)
    assert simulation.bubble_fraction == Fraction(3, 11)  # exact: Fraction times stay Fractions
    assert simulation.step_time == (8 + 4 - 1) * (1 + t_b)
    assert simulation.busy == [8 * (1 + t_b)] * 4
    assert bubble_formula(4, 8) == pytest.approx(3 / 11, abs=1e-12)


def test_gpipe_holds_every_microbatch_and_1f1b_at_most_K_minus_r():
    assert simulate(gpipe(4, 8)).peak_activations == [8, 8, 8, 8]
    assert simulate(one_f_one_b(4, 8)).peak_activations == [4, 3, 2, 1]
    assert simulate(one_f_one_b(8, 32)).peak_activations == [8 - r for r in range(8)]


def test_naive_model_parallelism_keeps_one_rank_busy_at_a_time():
    simulation = simulate(naive(4), t_f=ONE, t_b=2 * ONE)
    assert simulation.bubble_fraction == Fraction(3, 4)
    assert simulation.step_time == 4 * 3


@pytest.mark.parametrize("K, M, v", [(4, 8, 2), (4, 8, 4), (2, 4, 2), (3, 6, 3), (8, 16, 2), (4, 4, 2)])
@pytest.mark.parametrize("t_b", [ONE, 2 * ONE])
def test_interleaving_with_chunk_times_t_over_v_gives_the_closed_form(K, M, v, t_b):
    simulation = simulate(interleaved_1f1b(K, M, v), t_f=ONE / v, t_b=t_b / v)
    assert simulation.bubble_fraction == Fraction(K - 1, v * M + K - 1)
    assert float(simulation.bubble_fraction) == pytest.approx(bubble_formula(K, M, v), abs=1e-12)
    assert simulation.step_time == (M + Fraction(K - 1, v)) * (1 + t_b)


def test_interleaving_two_chunks_halves_the_playbook_ratio():
    def ratio(simulation):  # idle time over ideal time
        return simulation.bubble_fraction / (1 - simulation.bubble_fraction)

    flush = simulate(one_f_one_b(4, 8), t_f=ONE, t_b=2 * ONE)
    interleaved = simulate(interleaved_1f1b(4, 8, 2), t_f=ONE / 2, t_b=ONE)
    assert ratio(flush) == Fraction(3, 8) == Fraction(bubble_ratio_playbook(4, 8)).limit_denominator(100)
    assert ratio(interleaved) == ratio(flush) / 2
    assert float(ratio(interleaved)) == pytest.approx(bubble_ratio_playbook(4, 8, v=2), abs=1e-12)


@pytest.mark.parametrize("K, M", [(2, 2), (4, 8), (8, 16), (3, 7)])
@pytest.mark.parametrize("t_b, t_w", [(ONE, ONE), (2 * ONE, ONE), (ONE, ONE / 2)])
def test_zero_bubble_h1_fills_the_bubble_with_weight_gradients(K, M, t_b, t_w):
    zero_bubble = simulate(zero_bubble_h1(K, M), t_f=ONE, t_b=t_b, t_w=t_w)
    flush = simulate(one_f_one_b(K, M), t_f=ONE, t_b=t_b + t_w)  # the same backward, unsplit
    # Qi et al.: each rank idles (K - 1)(t_f + t_b - t_w) instead of (K - 1)(t_f + t_b + t_w).
    assert zero_bubble.step_time == M * (1 + t_b + t_w) + (K - 1) * (1 + t_b - t_w)
    assert flush.step_time == M * (1 + t_b + t_w) + (K - 1) * (1 + t_b + t_w)
    assert zero_bubble.bubble_fraction < flush.bubble_fraction
    # A micro-batch is held until its W (Qi et al. count it in flight until then): rank r defers r W's, so
    # every rank holds K, 1F1B's rank 0's peak; no rank holds more than 1F1B's most.
    assert flush.peak_activations == [K - r for r in range(K)]
    assert zero_bubble.peak_activations == [K] * K


def test_the_lecture_form_and_the_playbook_ratio_are_one_bubble():
    for K, M, v in [(1, 1, 1), (2, 1, 1), (4, 8, 1), (4, 8, 2), (8, 3, 4), (16, 64, 1)]:
        f, r = bubble_formula(K, M, v), bubble_ratio_playbook(K, M, v)
        assert f == pytest.approx(r / (1 + r), abs=1e-12)


# --- times, communication and the timeline --------------------------------------------------------


def test_a_transfer_between_ranks_costs_t_comm():
    simulation = simulate(naive(2), t_f=1, t_b=2, t_comm=Fraction(1, 4))
    times = {str(action): interval for action, interval in simulation.times.items()}
    assert times == {"0F0": (0, 1), "1F0": (Fraction(5, 4), Fraction(9, 4)),
                     "1B0": (Fraction(9, 4), Fraction(17, 4)), "0B0": (Fraction(18, 4), Fraction(26, 4))}
    assert simulation.step_time == Fraction(13, 2)


def test_chunks_on_one_rank_pass_results_without_communication():
    simulation = simulate(interleaved_1f1b(1, 3, 2), t_f=1, t_b=2, t_comm=5)
    assert simulation.step_time == 3 * 2 * (1 + 2)
    assert simulation.bubble_fraction == 0


def test_the_timeline_has_one_compute_event_per_action_in_seconds():
    schedule = zero_bubble_h1(2, 3)
    simulation = simulate(schedule, t_f=0.5, t_b=1.0, t_w=0.25)
    events = simulation.timeline.select(kind=COMPUTE)
    assert len(events) == sum(len(row) for row in schedule.actions) == 2 * 3 * 3
    names = {"F": "forward", "B": "backward", "W": "weight"}
    for action, (start, end) in simulation.times.items():
        (event,) = [ev for ev in events if (ev.stage, ev.microbatch, ev.name) == (action.stage, action.microbatch,
                                                                                   names[action.kind])]
        assert event.rank == schedule.rank_of(action.stage)
        assert (event.start, event.end) == pytest.approx((start, end), abs=1e-9)
    assert simulation.timeline.duration == pytest.approx(simulation.step_time, abs=1e-9)
    assert bubble_fraction(simulation.timeline) == pytest.approx(simulation.bubble_fraction, abs=1e-9)


S = 10**9  # nanoseconds per second: a Timeline's raw events are in ns
# Two ranks, makespan 1 s to 5 s (4 s): rank 0 computes 2 s, rank 1 3 s. Bubble = 1 - 5 / (2 x 4).
ACTIONS = [(0, COMPUTE, "forward", 1 * S, 2 * S, None, 0, 0, 0), (0, COMPUTE, "backward", 4 * S, 5 * S, None, 0, 0, 0),
           (1, COMPUTE, "forward", 2 * S, 3 * S, None, 0, 1, 0), (1, COMPUTE, "backward", 3 * S, 5 * S, None, 0, 1, 0)]


def test_bubble_fraction_of_a_measured_timeline_counts_compute_only():
    events = ACTIONS + [(0, COMM, "send", 0, 6 * S, 1, 64, None, None)]  # a transfer is not work
    assert bubble_fraction(Timeline(events, 2)) == pytest.approx(1 - 5 / 8, abs=1e-12)
    assert action_makespan(Timeline(events, 2)) == pytest.approx(4, abs=1e-12)
    with pytest.raises(ValueError, match="no forward, backward or weight spans"):
        bubble_fraction(Timeline(events[-1:], 2))


def test_a_step_span_around_the_actions_is_not_work():
    # A caller marks its steps with trace.span("step") (for Timeline.window); the span
    # covers the actions and the idle time between them, so counted as work it would make
    # every rank busy all the time.
    steps = [(rank, COMPUTE, "step", 0, 6 * S, None, 0, None, None) for rank in range(2)]
    timeline = Timeline(ACTIONS + steps, 2)
    assert bubble_fraction(timeline) == pytest.approx(1 - 5 / 8, abs=1e-12)
    assert action_makespan(timeline) == pytest.approx(4, abs=1e-12)
    assert bubble_fraction(timeline.window()) == pytest.approx(1 - 5 / 8, abs=1e-12)


@pytest.mark.parametrize("kwargs, message", [
    (dict(t_w=1), "has no W actions, so its B is the whole backward"),
    (dict(t_f=0), r"t_f \(the time of a forward\) must be above 0"),
    (dict(t_comm=-1), r"t_comm .* must be at least 0"),
])
def test_simulate_rejects_impossible_times(kwargs, message):
    with pytest.raises(ValueError, match=message):
        simulate(one_f_one_b(2, 2), **kwargs)


def test_plot_labels_each_block_with_its_action_in_simulator_units():
    ax = simulate(gpipe(2, 3), t_f=1, t_b=1).plot()
    labels = sorted(text.get_text() for text in ax.texts)
    assert labels == sorted(f"{stage}{kind}{m}" for stage in range(2) for kind in "FB" for m in range(3))
    assert "simulator units" in ax.get_xlabel()
    assert ax.get_xlim()[1] == pytest.approx(8 * 1e3 * 1.01)  # 8 units, drawn as 8000 "ms"
    assert ax.xaxis.get_major_formatter()(4000, 0) == "4"
    assert "gpipe" in ax.get_title() and "bubble 25.0%" in ax.get_title()
