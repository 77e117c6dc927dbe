"""The pipeline lecture's widgets without a browser: the figure's readouts against the
simulator and hand-computed values, impossible settings shown as messages, the widget
answering its controls, and a schedule measured on four real ranks."""

import html
import struct
import sys

import matplotlib
import pytest

from parlab.pipeline import Schedule, bubble_fraction, gpipe, make_schedule, one_f_one_b, simulate
from parlab.pipeline.measure import BubbleMeasurement
from parlab.widgets.pipeline import (
    measure_schedule,
    plot_bubble_measurement,
    plot_measured,
    plot_microbatch_tradeoff,
    readout_html,
    schedule_figure,
    schedule_widget,
    stage_times,
)

matplotlib.use("Agg")


# --- the plain functions -------------------------------------------------------------------------


def test_stage_times_divide_by_v_and_split_the_backward_only_for_zb_h1():
    assert stage_times("1f1b", 1, 2.0, 0.0) == (1.0, 2.0, 0.0)
    assert stage_times("interleaved_1f1b", 2, 3.0, 0.0, t_f=0.02) == pytest.approx((0.01, 0.03, 0.0))
    assert stage_times("zb_h1", 1, 2.0, 0.5) == (1.0, 1.5, 0.5)
    assert stage_times("gpipe", 1, 2.0, 0.5) == (1.0, 2.0, 0.0)  # one B: the whole backward
    with pytest.raises(ValueError, match="below t_B / t_F = 2"):
        stage_times("zb_h1", 1, 2.0, 2.0)


@pytest.mark.parametrize("call, message", [
    (lambda: stage_times("interleaved_1f1b", 0), "v .chunks per rank. must be a whole number >= 1, got 0"),
    (lambda: stage_times("1f1b", t_f=0), "t_f must be above 0 .*, got 0"),
    (lambda: schedule_widget(name="2f2b"), "one of naive, gpipe, .*, not '2f2b'"),
    (lambda: schedule_widget(K=9), "K .the number of ranks. must be a whole number from 1 to 8, got 9: the K slider"),
    (lambda: schedule_widget(M=0), "M .the number of micro-batches. must be a whole number from 1 to 32, got 0"),
    (lambda: schedule_widget(tb_over_tf=8), "tb_over_tf .t_B / t_F. must be a number from 0.5 to 4, got 8"),
    (lambda: measure_schedule(None, one_f_one_b(2, 2), -0.01, 0.02), "t_f must be at least 0 .*, got -0.01"),
])
def test_bad_input_gets_a_sentence_saying_what_to_change(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_1f1b_readouts_for_4_ranks_and_8_microbatches():
    _, readouts = schedule_figure("1f1b", 4, 8, tb_over_tf=2.0)
    assert readouts["simulated_bubble"] == pytest.approx(3 / 11, abs=1e-12)
    assert readouts["formula_bubble"] == pytest.approx(3 / 11, abs=1e-12)
    assert readouts["playbook_ratio"] == pytest.approx(3 / 8, abs=1e-12)
    assert readouts["step_time"] == pytest.approx((8 + 3) * 3)
    assert readouts["peak_activations"] == [4, 3, 2, 1]
    assert readouts["peak_vs_gpipe"] == pytest.approx([4 / 8, 3 / 8, 2 / 8, 1 / 8])


@pytest.mark.parametrize("name, K, M, v, tb, tw", [
    ("gpipe", 3, 5, 1, 1.5, 0.0), ("interleaved_1f1b", 4, 8, 2, 2.0, 0.0), ("interleaved_1f1b", 2, 6, 3, 1.0, 0.0),
    ("zb_h1", 3, 4, 1, 2.0, 1.0), ("naive", 4, 1, 1, 2.0, 0.0),
])
def test_readouts_are_the_simulators_numbers(name, K, M, v, tb, tw):
    _, readouts = schedule_figure(name, K, M, v, tb, tw)
    simulation = simulate(make_schedule(name, K, M, v), *stage_times(name, v, tb, tw))
    assert readouts["simulated_bubble"] == pytest.approx(float(simulation.bubble_fraction), abs=1e-12)
    assert readouts["step_time"] == pytest.approx(simulation.step_time, abs=1e-12)
    assert readouts["peak_activations"] == simulation.peak_activations
    assert readouts["formula_bubble"] == pytest.approx((K - 1) / (v * M + K - 1), abs=1e-12)
    assert readouts["playbook_ratio"] == pytest.approx((K - 1) / (v * M), abs=1e-12)


def test_interleaving_and_zero_bubble_shorten_the_same_work():
    # Every schedule does M (t_F + t_B) of work per rank: 4 x 3 = 12 t_F; K = 2 adds one bubble.
    flush = schedule_figure("1f1b", 2, 4, 1, 2.0)[1]["step_time"]
    interleaved = schedule_figure("interleaved_1f1b", 2, 4, 2, 2.0)[1]["step_time"]
    zero_bubble = schedule_figure("zb_h1", 2, 4, 1, 2.0, 1.0)[1]["step_time"]
    assert flush == pytest.approx(12 + 3)
    assert interleaved == pytest.approx(12 + 3 / 2)
    assert zero_bubble == pytest.approx(12 + (1 + 1 - 1))  # (K - 1)(t_F + t_B - t_W), B = W = 1


@pytest.mark.parametrize("name, K, M, v, message", [
    ("1f1b", 4, 2, 1, "M >= K"),
    ("interleaved_1f1b", 4, 6, 2, "M must be a multiple of K"),
    ("naive", 4, 8, 1, "set M = 1"),
])
def test_impossible_settings_show_the_message_instead_of_a_chart(name, K, M, v, message):
    ax, readouts = schedule_figure(name, K, M, v)
    assert set(readouts) == {"error"} and message in readouts["error"]
    assert message in ax.get_title().replace("\n", " ")
    assert not ax.axison
    assert html.escape(message) in readout_html(readouts)  # "M = 2 < K = 4" escaped in HTML


def test_the_chart_labels_blocks_and_measures_time_in_t_F():
    ax, _ = schedule_figure("gpipe", 2, 3, tb_over_tf=1.0)
    labels = sorted(text.get_text() for text in ax.texts)
    assert labels == sorted(f"{stage}{kind}{m}" for stage in range(2) for kind in "FB" for m in range(3))
    assert "t_F" in ax.get_xlabel() and "gpipe" in ax.get_title()


def test_readout_html_gives_the_numbers():
    _, readouts = schedule_figure("1f1b", 4, 8)
    html = readout_html(readouts, measured_bubble=0.3)
    for number in ("27.3%", "37.5%", "33 t_F", "4, 3, 2, 1", "50%, 38%, 25%, 12%", "measured bubble <b>30.0%"):
        assert number in html


# --- the widget ------------------------------------------------------------------------------------


def controls(box):
    """Every control under an ipywidgets box, by description."""
    found = {}
    for child in box.children:
        found.update(controls(child) if hasattr(child, "children") else {getattr(child, "description", ""): child})
    return found


def html_of(widget):
    """The widget's feedback message and its readout."""
    feedback, readout = widget.children[-3:-1]
    return [feedback.children[0].value, readout.value]


def png_height(data):
    return struct.unpack(">I", data[20:24])[0]


def test_the_widget_redraws_when_its_controls_change():
    widget = schedule_widget(name="1f1b", K=2, M=4, v=2, tb_over_tf=2.0)
    found = controls(widget)
    assert "run on the cluster" not in found  # no cluster, no button
    image = widget.children[-1]
    assert image.value[:8] == b"\x89PNG\r\n\x1a\n"
    assert "20.0%" in html_of(widget)[1]  # (K - 1) / (M + K - 1) = 1 / 5
    assert found["v chunks"].disabled and found["t_W / t_F"].disabled
    found["schedule"].value = "interleaved_1f1b"
    assert not found["v chunks"].disabled and "11.1%" in html_of(widget)[1]  # v = 2: 1 / 9
    found["schedule"].value = "1f1b"
    found["M"].value = 1
    assert "M &gt;= K" in html_of(widget)[1]
    found["schedule"].value = "naive"
    assert found["M"].disabled and "50.0%" in html_of(widget)[1]  # one micro-batch: (K - 1) / K


def test_without_ipywidgets_the_widget_is_the_static_figure(monkeypatch):
    from matplotlib.figure import Figure

    monkeypatch.setitem(sys.modules, "ipywidgets", None)
    with pytest.warns(UserWarning, match="ipywidgets is not installed"):
        figure = schedule_widget(name="gpipe", K=2, M=3)
    assert isinstance(figure, Figure) and "gpipe" in figure.axes[0].get_title()


def test_a_measurement_draws_its_simulation_above_it_on_one_time_axis():
    simulation = simulate(gpipe(2, 3), 0.01, 0.02)
    late = simulate(gpipe(2, 3), 0.01, 0.02, t_comm=0.005).timeline  # as if measured: a longer step
    figure = plot_bubble_measurement(BubbleMeasurement(gpipe(2, 3), late, simulation, 0.0, 0.001))
    above, below = figure.axes
    assert "(simulated)" in above.get_title() and below.get_title().startswith("measured on 2 ranks")
    assert above.get_xlim() == below.get_xlim() and above.get_xlim()[1] >= late.duration * 1e3


def test_the_measured_chart_leaves_out_a_callers_step_span():
    from parlab.trace import COMPUTE, Timeline

    s = 10**9
    events = [(0, COMPUTE, "forward", 1 * s, 2 * s, None, 0, 0, 0),
              (0, COMPUTE, "backward", 3 * s, 5 * s, None, 0, 0, 0),
              (0, COMPUTE, "step", 0, 6 * s, None, 0, None, None)]
    ax = plot_measured(Timeline(events, 1))
    assert "step" not in [text.get_text() for text in ax.get_legend().get_texts()]
    assert "step 4000 ms" in ax.get_title()  # the actions' makespan, 1 s to 5 s, not the step span's 6 s


def test_the_tradeoff_figure_puts_each_measurement_beside_its_simulation():
    sweep = [BubbleMeasurement(gpipe(2, M), simulate(gpipe(2, M), t, 2 * t).timeline, simulate(gpipe(2, M), t, 2 * t),
                               0.0, 0.001) for M, t in ((1, 0.03), (2, 0.02))]
    real = [{"M": M, "step": 0.1 * M, "timeline": simulate(gpipe(2, M), 1, 1).timeline} for M in (1, 2)]
    alone = {1: 0.009, 2: 0.006}
    left, right = plot_microbatch_tradeoff(sweep, real, alone, batch=8).axes
    (simulated, measured) = left.get_lines()
    assert list(simulated.get_ydata()) == pytest.approx([m.simulated_step * 1e3 for m in sweep])
    assert list(measured.get_ydata()) == pytest.approx([m.measured_step * 1e3 for m in sweep])
    (from_alone, real_measured) = right.get_lines()
    # GPipe, K = 2: (M + K - 1) (t_F + t_B) = (M + 1) t(b)
    assert list(from_alone.get_ydata()) == pytest.approx([2 * 9, 3 * 6])
    assert list(real_measured.get_ydata()) == pytest.approx([100, 200])
    assert "B = 8" in right.get_title() and "emulated" in left.get_title()


# --- measured on real ranks ------------------------------------------------------------------------


def test_a_measured_step_runs_each_ranks_actions_in_schedule_order(cluster4):
    schedule = one_f_one_b(4, 4)
    timeline, bubble = measure_schedule(cluster4, schedule, 0.004, 0.008)
    kinds = {"forward": "F", "backward": "B"}
    for rank, row in enumerate(schedule.actions):
        spans = timeline.select(rank=rank, name=None, kind="compute")
        assert [f"{ev.stage}{kinds[ev.name]}{ev.microbatch}" for ev in spans] == [str(a) for a in row]
    assert bubble == bubble_fraction(timeline) and 0 < bubble < 1
    assert "bubble" in plot_measured(timeline).get_title()


def test_measuring_needs_a_cluster_of_K_ranks(cluster4):
    with pytest.raises(ValueError, match="the cluster has 4 ranks and the schedule K = 2: set K = 4"):
        measure_schedule(cluster4, Schedule("two", 2, 1, 1, [["0F0", "0B0"], ["1F0", "1B0"]]), 0.001, 0.001)


def test_the_button_draws_the_measured_step_below_the_simulated_one(cluster4, monkeypatch):
    monkeypatch.setattr("parlab.widgets.pipeline.MEASURE_T_F", 0.002)  # a short step: 2 ms per forward
    widget = schedule_widget(cluster4, name="1f1b", K=4, M=4, tb_over_tf=1.0)
    found, image = controls(widget), widget.children[-1]
    simulated_only = png_height(image.value)
    found["run on the cluster"].click()
    assert "measured bubble" in html_of(widget)[1]
    assert png_height(image.value) > 1.5 * simulated_only
    found["t_B / t_F"].value = 2.0  # other settings: the measurement no longer applies
    assert "measured bubble" not in html_of(widget)[1] and png_height(image.value) == simulated_only
    found["K ranks"].value = 2
    found["run on the cluster"].click()
    assert "the cluster has 4 ranks" in html_of(widget)[0]
