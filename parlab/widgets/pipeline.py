"""Widgets for the pipeline-parallelism lecture: a schedule's simulated timeline with its
bubble and activation memory, and the same schedule measured on real ranks.

    stage_times(name, v, tb_over_tf, tw_over_tf, t_f)         per-chunk t_f, t_b, t_w of a schedule
    schedule_figure(name, K, M, v, tb_over_tf, tw_over_tf)     simulated Gantt chart and its readouts
    measure_schedule(cluster, schedule, t_f, t_b, t_w)         a traced step of sleeping stages
    plot_measured(timeline, ax=None)                           the measured Gantt chart and bubble
    plot_bubble_measurement(measurement)                       a measured step below its simulation, one time axis
    plot_microbatch_tradeoff(sweep, real, alone, batch)        step time against M: emulated and real, each
                                                               beside its simulation
    schedule_widget(cluster=None)                              sliders and a "run on the cluster" button

Times are ratios to t_F, the forward of one micro-batch through one rank's share of the
model. t_B is the whole backward; ZB-H1 splits it into B (input gradient, t_B - t_W) and W
(weight gradient, t_W); the other schedules run it as one B. An interleaved rank's share is
v chunks, each taking t / v: the work per rank is the same for every schedule, so their
step times compare directly.
"""

import html
import textwrap

from parlab._checks import real_number, whole_number
from parlab.pipeline import (
    action_makespan,
    bubble_formula,
    bubble_fraction,
    bubble_ratio_playbook,
    make_schedule,
    simulate,
)
from parlab.pipeline.simulate import EVENT_NAMES
from parlab.trace import COMM, Timeline
from parlab.widgets._common import (
    FIT,
    Feedback,
    button,
    import_ipywidgets,
    in_range,
    png,
    running_cluster,
    show_static,
)

MEASURE_T_F = 0.02  # seconds a sleeping stage takes per forward when measured on a cluster


def stage_times(name, v=1, tb_over_tf=2.0, tw_over_tf=0.0, t_f=1.0):
    """``(t_f, t_b, t_w)`` per stage (chunk) of schedule ``name`` for a rank whose forward of
    one micro-batch takes ``t_f`` and whose backward takes ``tb_over_tf`` t_f, of which
    ``tw_over_tf`` t_f is the weight gradient: divided by v for interleaved chunks; for
    "zb_h1" B is t_b - t_w and W is t_w, for the others B is the whole t_b and t_w = 0."""
    whole_number("v (chunks per rank)", v, "give 1 for one stage per rank, 2 or more to interleave.")
    real_number("t_f", t_f, "give the time of one forward, above 0.", above=True)
    if not 0 <= tw_over_tf < tb_over_tf:
        raise ValueError(f"t_W / t_F = {tw_over_tf:g} must be at least 0 and below t_B / t_F = {tb_over_tf:g}: "
                         f"the weight gradient is a part of the backward.")
    chunk = t_f / v
    if name == "zb_h1":
        return chunk, (tb_over_tf - tw_over_tf) * chunk, tw_over_tf * chunk
    return chunk, tb_over_tf * chunk, 0.0


def schedule_figure(name, K, M, v=1, tb_over_tf=2.0, tw_over_tf=0.0, ax=None):
    """Simulate schedule ``name`` (``make_schedule``) with ``stage_times`` and draw its Gantt
    chart: one row per rank, a block per action labelled with its kind and micro-batch,
    time in units of t_F. Returns ``(ax, readouts)``; readouts: ``simulated_bubble``,
    ``formula_bubble`` (K - 1) / (v M + K - 1), ``playbook_ratio`` (K - 1) / (v M),
    ``step_time`` (in t_F), ``peak_activations`` per rank (in chunks, the schedule's unit)
    and ``peak_vs_gpipe`` (that memory over GPipe's M full micro-batches per rank). If the
    combination is impossible (M < K for 1F1B, ...), the figure's title is the ValueError's
    message and readouts is ``{"error": message}``."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=figure_size(K), layout="constrained")
    try:
        simulation = simulate(make_schedule(name, K, M, v), *stage_times(name, v, tb_over_tf, tw_over_tf))
    except ValueError as error:
        ax.set_axis_off()
        ax.set_title("\n".join(textwrap.wrap(str(error), 90)), fontsize=10, color="tab:red")
        return ax, {"error": str(error)}
    simulation.plot(ax=ax)
    ax.set_xlabel("time (units of t_F: one rank's forward of one micro-batch)")
    peaks = simulation.peak_activations
    return ax, dict(simulated_bubble=float(simulation.bubble_fraction), formula_bubble=bubble_formula(K, M, v),
                    playbook_ratio=bubble_ratio_playbook(K, M, v), step_time=float(simulation.step_time),
                    peak_activations=peaks, peak_vs_gpipe=[peak / (v * M) for peak in peaks])


def measure_schedule(cluster, schedule, t_f, t_b, t_w=0.0, timeout=60, on_step=None):
    """Run ``schedule`` once on ``cluster`` with stages that only sleep (t_f, t_b, t_w
    seconds per stage: ``parlab.pipeline.sleep_pipeline_step``) under ``cluster.trace``,
    after one untraced warm-up step: a cluster's first pipeline step also pays for imports
    and for opening the connections between ranks (seconds, not the schedule's bubble).
    Returns ``(timeline, bubble)`` with bubble = ``bubble_fraction(timeline)``, the same
    function the simulator's bubble is computed with. The cluster must have K ranks.
    ``on_step(label)``, if given, is called after each of the two steps (a progress bar)."""
    from parlab.pipeline import sleep_pipeline_step  # the executor needs torch; the figures do not

    for name, seconds in (("t_f", t_f), ("t_b", t_b), ("t_w", t_w)):
        real_number(name, seconds, "give the seconds a sleeping stage takes, from 0.")
    if cluster.world_size != schedule.num_ranks:
        raise ValueError(f"the cluster has {cluster.world_size} ranks and the schedule K = {schedule.num_ranks}: set "
                         f"K = {cluster.world_size} to run it here.")
    on_step = on_step or (lambda label: None)
    cluster.run(sleep_pipeline_step, schedule, t_f, t_b, t_w, timeout=timeout)
    on_step("the traced step")
    timeline = cluster.trace(sleep_pipeline_step, schedule, t_f, t_b, t_w, timeout=timeout)
    on_step("done")
    return timeline, bubble_fraction(timeline)


def plot_measured(timeline, ax=None):
    """The measured Gantt chart of a traced pipeline step (``parlab.viz.plot_timeline``: the
    schedule's actions above, transfers below, ms; other compute spans, such as a caller's
    "step", are left out), titled with its ``bubble_fraction`` and ``action_makespan``."""
    shown = Timeline([], timeline.world_size, timeline.results, regime=timeline.regime)
    shown.events = [ev for ev in timeline.events if ev.kind == COMM or ev.name in EVENT_NAMES.values()]
    title = f"measured on {timeline.world_size} ranks: bubble {bubble_fraction(timeline):.1%}, " \
            f"step {action_makespan(timeline) * 1e3:.0f} ms"
    return shown.plot(ax=ax, title=title)


def plot_bubble_measurement(measurement):
    """A ``parlab.pipeline.measure.BubbleMeasurement`` drawn as two Gantt charts on one time
    axis: the simulated step (with the link's time per message) above the measured one.
    Returns the figure."""
    import matplotlib.pyplot as plt

    K = measurement.schedule.num_ranks
    fig, (above, below) = plt.subplots(2, 1, figsize=figure_size(K, 2), layout="constrained")
    measurement.simulation.plot(ax=above)
    above.set_xlabel("time (s)")
    plot_measured(measurement.timeline, below)
    end = max(ax.get_xlim()[1] for ax in (above, below))  # both axes are in ms underneath: one scale for both
    for ax in (above, below):
        ax.set_xlim(0, end)
    return fig


def plot_microbatch_tradeoff(sweep, real, alone, batch):
    """Step time against the number of micro-batches M, GPipe. Left: ``sweep`` (the
    ``BubbleMeasurement``s of ``parlab.pipeline.measure.microbatch_sweep``, emulated stages of
    declared t(b)), measured and simulated. Right: ``real`` (the rows of
    ``gpipe_step_times``, real stages in real time) measured, beside the simulator fed with
    ``alone`` ({M: t(b)} of ``one_stage_costs``, split 1 : 2 into t_F and t_B) for a
    batch of ``batch`` samples. Returns the figure."""
    import matplotlib.pyplot as plt

    from parlab.pipeline import gpipe

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4), layout="constrained")
    Ms = [m.schedule.num_microbatches for m in sweep]
    left.plot(Ms, [m.simulated_step * 1e3 for m in sweep], "k--", label="simulated")
    left.plot(Ms, [m.measured_step * 1e3 for m in sweep], "o-", label="measured")
    left.set_title(f"emulated device and link, K = {sweep[0].schedule.num_ranks}", fontsize=10)
    K = real[0]["timeline"].world_size
    simulated = [float(simulate(gpipe(K, row["M"]), alone[row["M"]] / 3, 2 * alone[row["M"]] / 3).step_time)
                 for row in real]
    right.plot([row["M"] for row in real], [s * 1e3 for s in simulated], "k--", label="simulated from t(b) alone")
    right.plot([row["M"] for row in real], [row["step"] * 1e3 for row in real], "o-", label="measured")
    right.set_title(f"this machine, real time, K = {K}, B = {batch}", fontsize=10)
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_ylim(bottom=0)
        ax.set_xlabel("micro-batches M")
        ax.set_ylabel("step time (ms)")
        ax.legend(fontsize=8)
    return fig


def readout_html(readouts, measured_bubble=None):
    """One line of HTML with the numbers of ``schedule_figure`` (and a measured bubble)."""
    if "error" in readouts:
        return f"<span style='color:red'>{html.escape(readouts['error'])}</span>"
    peaks = ", ".join(map(str, readouts["peak_activations"]))
    relative = ", ".join(f"{share:.0%}" for share in readouts["peak_vs_gpipe"])
    measured = f"; measured bubble <b>{measured_bubble:.1%}</b>" if measured_bubble is not None else ""
    return (f"simulated bubble <b>{readouts['simulated_bubble']:.1%}</b>{measured}; closed form (K-1)/(vM+K-1) = "
            f"{readouts['formula_bubble']:.1%}, Playbook ratio (K-1)/(vM) = {readouts['playbook_ratio']:.1%}; "
            f"step {readouts['step_time']:.3g} t_F<br>peak activations per rank: {peaks} (of GPipe's: {relative})")


def applicable(name, K, M, v, tb_over_tf, tw_over_tf):
    """The widget's settings as schedule ``name`` reads them: "naive" runs M = 1, v is for
    interleaved 1F1B only and t_W for ZB-H1 only (1 and 0 elsewhere)."""
    return (name, K, 1 if name == "naive" else M, v if name == "interleaved_1f1b" else 1, tb_over_tf,
            tw_over_tf if name == "zb_h1" else 0.0)


def figure_size(K, rows=1):
    return 10, rows * (0.55 * K + 1.5)


def schedule_widget(cluster=None, name="1f1b", K=4, M=8, v=2, tb_over_tf=2.0, tw_over_tf=1.0):
    """``schedule_figure`` with a schedule dropdown and sliders K (1-8), M (1-32), v (1-4,
    interleaved only), t_B / t_F (0.5-4) and t_W / t_F (ZB-H1 only), and ``readout_html``.
    "naive" runs M = 1. With a ``cluster``, a button "run on the cluster" measures the
    current schedule (``measure_schedule``, t_F = 20 ms per rank, under a progress bar) when
    the cluster has K ranks and draws the measured timeline below the simulated one, with
    its bubble, while the settings stay; if an earlier cell closed the cluster, it starts a
    new one with as many ranks. Displays a static picture of the first state (kept by a
    saved notebook) and returns an ipywidgets VBox; without ipywidgets, warns and returns
    the static figure."""
    from parlab.pipeline import SCHEDULES

    if name not in SCHEDULES:
        raise ValueError(f"name is the schedule to draw: one of {', '.join(SCHEDULES)}, not {name!r}.")
    in_range("K (the number of ranks)", K, 1, 8, "the K slider goes from 1 to 8.", whole=True)
    in_range("M (the number of micro-batches)", M, 1, 32, "the M slider goes from 1 to 32.", whole=True)
    in_range("v (chunks per rank)", v, 1, 4, "the v slider goes from 1 to 4.", whole=True)
    in_range("tb_over_tf (t_B / t_F)", tb_over_tf, 0.5, 4, "the t_B / t_F slider goes from 0.5 to 4.")
    in_range("tw_over_tf (t_W / t_F)", tw_over_tf, 0, 2, "the t_W / t_F slider goes from 0 to 2.")
    widgets = import_ipywidgets()
    if widgets is None:
        return schedule_figure(*applicable(name, K, M, v, tb_over_tf, tw_over_tf))[0].figure

    schedule = widgets.Dropdown(options=list(SCHEDULES), value=name, description="schedule", style=FIT)
    ranks = widgets.IntSlider(K, min=1, max=8, description="K ranks", style=FIT)
    microbatches = widgets.IntSlider(M, min=1, max=32, description="M", style=FIT)
    chunks = widgets.IntSlider(v, min=1, max=4, description="v chunks", style=FIT)
    backward = widgets.FloatSlider(tb_over_tf, min=0.5, max=4, step=0.25, description="t_B / t_F", style=FIT)
    weight = widgets.FloatSlider(tw_over_tf, min=0, max=2, step=0.25, description="t_W / t_F", style=FIT)
    image, readout, feedback = widgets.Image(format="png"), widgets.HTML(), Feedback()
    measurement = {"cluster": cluster}  # and "settings": the settings it was measured at, "timeline", "bubble"

    def settings():
        return applicable(schedule.value, ranks.value, microbatches.value, chunks.value, backward.value, weight.value)

    def redraw(_=None):
        microbatches.disabled = schedule.value == "naive"
        chunks.disabled = schedule.value != "interleaved_1f1b"
        weight.disabled = schedule.value != "zb_h1"
        current = settings()
        measured = measurement if measurement.get("settings") == current else {}
        numbers = {}

        def draw(ax):
            if measured:  # two rows: the simulated step above the measured one
                figure = ax.figure
                ax.remove()
                ax, below = figure.subplots(2, 1)
                plot_measured(measured["timeline"], below)
            numbers.update(schedule_figure(*current, ax=ax)[1])

        image.value = png(draw, figure_size(current[1], 2 if measured else 1))
        readout.value = readout_html(numbers, measured.get("bubble"))

    def measure(_):
        current = settings()
        planned = make_schedule(*current[:4])
        times = stage_times(current[0], current[3], current[4], current[5], MEASURE_T_F)
        measurement["cluster"] = running_cluster(measurement["cluster"], feedback)
        with feedback.progress(2, f"{planned.name} on {current[1]} ranks: the warm-up step") as advance:
            timeline, bubble = measure_schedule(measurement["cluster"], planned, *times, on_step=advance)
        measurement.update(settings=current, timeline=timeline, bubble=bubble)
        redraw()

    for control in (schedule, ranks, microbatches, chunks, backward, weight):
        control.observe(feedback.guard(redraw, "Redrawing the schedule"), names="value")
    redraw()
    show_static(image.value, f"the {name} schedule on {K} ranks")
    rows = [schedule, widgets.HBox([ranks, microbatches, chunks]), widgets.HBox([backward, weight])]
    if cluster is not None:
        rows.append(button("run on the cluster", feedback.guard(measure, "Running on the cluster")))
    return widgets.VBox([*rows, feedback.box, readout, image])
