"""Widget for lecture 10 (surviving failures): how often to checkpoint, as goodput against the
checkpoint interval I, the model beside runs with failures drawn at the MTBF.

    simulated_intervals(delta, restart, theta)           the I the figure simulates
    plot_goodput(delta, restart, theta, work, seed)      goodput against I, model and simulation
    interval_table(delta, restart, theta)                Young's, Daly's and the best I, and their goodput
    goodput_widget(delta, restart, theta)                sliders for delta, t_R and Theta over both

Everything is ``parlab.failures.young_daly``: the goodput model I / (Theta exp(t_R/Theta)
(exp((I + delta)/Theta) - 1)) (Daly 2006's complete cost function), Young's sqrt(2 delta
Theta), Daly's higher-order estimate, the exact optimum, and ``goodput_curve``'s seeded runs
with their standard errors and the band of I where the simulated best may fall. All times
are in seconds.

The simulation is kept to about ``EVENT_BUDGET`` random draws in all, so that a redraw stays
interactive: a segment of I + delta meets on average exp(t_R/Theta) (exp((I + delta)/Theta) - 1)
failures, so the work simulated at each I is what that budget allows, and the I drawn stop
where a segment would fail more than exp(``MAX_EXPONENT``) times (the goodput there is nil).
"""

import math

from parlab.failures import young_daly
from parlab.widgets._common import Feedback, import_ipywidgets, in_range, log_slider, png, show_static

FIGSIZE = (7.5, 4.2)
EVENT_BUDGET = 40_000  # random draws of all the runs together: about 0.1 s of simulation
MAX_EXPONENT = 5.0  # simulate I only while (I + delta + t_R)/Theta <= this: at most e^5 failures a segment
GRID = [2 ** (k / 2) for k in range(-8, 9)]  # the simulated I, as multiples of the optimum: 1/16 to 16


def simulated_intervals(delta, restart, theta):
    """(intervals, work): the I of ``GRID`` times the optimum I* whose segments are cheap to
    simulate ((I + delta + t_R)/Theta <= ``MAX_EXPONENT``), and the compute ``work`` each run
    gets: ``EVENT_BUDGET`` over the expected draws per unit of work, sum over I of
    (1 + exp(t_R/Theta) (exp((I + delta)/Theta) - 1)) / I."""
    best = young_daly.optimum_interval(delta, theta)
    young_daly.goodput(best, delta, restart, theta)  # refuses a t_R below 0 with parlab's sentence
    intervals = [best * g for g in GRID if (best * g + delta + restart) / theta <= MAX_EXPONENT]
    if len(intervals) < 2:
        raise ValueError(f"delta + t_R = {_duration(delta + restart)} is too long against Theta = {_duration(theta)}: "
                         f"every segment would fail about e^{(best + delta + restart) / theta:.0f} times before it "
                         f"ends. Shorten delta or t_R, or raise Theta.")
    draws_per_work = sum((1 + math.exp(restart / theta) * math.expm1((i + delta) / theta)) / i for i in intervals)
    return intervals, EVENT_BUDGET / draws_per_work


def plot_goodput(delta, restart, theta, work=None, seed=0, ax=None):
    """Goodput against the checkpoint interval I (log x) for checkpoints of ``delta`` seconds,
    restarts of ``restart`` (t_R) and an MTBF of ``theta`` (Theta): the model's curve, one
    seeded run per I of ``simulated_intervals`` (``goodput_curve``; ``work`` seconds of
    compute each, None: the budget's) with its standard error, the band where the simulated
    best may fall, and vertical lines at Young's, Daly's and the exact optimum. Returns the axes."""
    import matplotlib.pyplot as plt

    intervals, budget_work = simulated_intervals(delta, restart, theta)
    curve = young_daly.goodput_curve(delta, restart, theta, intervals, budget_work if work is None else work, seed)
    if ax is None:
        _, ax = plt.subplots(figsize=FIGSIZE, layout="constrained")
    fine = [intervals[0] * (intervals[-1] / intervals[0]) ** (k / 199) for k in range(200)]
    ax.plot(fine, [young_daly.goodput(i, delta, restart, theta) for i in fine], color="C0", lw=2,
            label="model: I / (Theta e^(t_R/Theta) (e^((I + delta)/Theta) - 1))")
    ax.errorbar(intervals, curve["measured"], yerr=curve["stderr"], fmt="o", color="C3", ms=4, capsize=2,
                label=f"simulated, one seeded run per I ({sum(curve['failures'])} failures), ± 1 standard error")
    ax.axvspan(min(curve["band"]), max(curve["band"]), color="C3", alpha=0.12,
               label="where the simulated best may fall (4 standard errors)")
    for key, style, name in (("young", {"color": "C1", "ls": "--"}, "Young sqrt(2 delta Theta)"),
                             ("daly", {"color": "C2", "ls": ":"}, "Daly"), ("optimum", {"color": "black", "ls": "-"},
                                                                             "optimum")):
        ax.axvline(curve[key], lw=1.2, **style, label=f"{name}: I = {_duration(curve[key])}")
    ax.set_xscale("log")
    ax.set_xlabel("checkpoint interval I (s)")
    ax.set_ylabel("goodput (compute / wall time)")
    ax.set_ylim(top=1)
    ax.set_title(f"goodput against I: delta = {_duration(delta)}, t_R = {_duration(restart)}, "
                 f"Theta = {_duration(theta)}", fontsize=10)
    ax.legend(fontsize=7, loc="lower center")
    return ax


def interval_table(delta, restart, theta):
    """HTML table: Young's, Daly's and the optimum I, and the model's goodput at each."""
    rows = [("Young sqrt(2 delta Theta)", young_daly.young_interval(delta, theta)),
            ("Daly", young_daly.daly_interval(delta, theta)), ("optimum", young_daly.optimum_interval(delta, theta))]
    cells = "".join(f"<tr><td>{name}</td><td>{_duration(i)}</td>"
                    f"<td>{young_daly.goodput(i, delta, restart, theta):.4f}</td></tr>" for name, i in rows)
    return f"<table><tr><th>interval</th><th>I</th><th>goodput</th></tr>{cells}</table>"


def goodput_widget(delta=60, restart=120, theta=3600 * 3):
    """Log sliders for delta, t_R and Theta, in seconds, over ``plot_goodput``; the readout is
    ``interval_table``. Displays a static picture of the first state and returns an
    ipywidgets VBox; without ipywidgets, warns and returns the static figure."""
    for name, value in (("delta (the checkpoint time)", delta), ("t_R (the restart time)", restart),
                        ("Theta (the MTBF)", theta)):
        in_range(name, value, 0.01, 1e7, "its slider has a log scale in seconds: give a time from 0.01 s to 1e7 s.")
    widgets = import_ipywidgets()
    if widgets is None:
        return plot_goodput(delta, restart, theta).figure
    write = log_slider(delta, 0, 4, "checkpoint time delta (s)", step=0.05, readout_format=".3g")
    recover = log_slider(restart, 0, 4, "restart time t_R (s)", step=0.05, readout_format=".3g")
    mtbf = log_slider(theta, 2, 6, "MTBF Theta (s)", step=0.05, readout_format=".3g")
    image, table, feedback = widgets.Image(format="png"), widgets.HTML(), Feedback()

    def redraw(_=None):
        image.value = png(lambda ax: plot_goodput(write.value, recover.value, mtbf.value, ax=ax), FIGSIZE)
        table.value = interval_table(write.value, recover.value, mtbf.value)

    for slider in (write, recover, mtbf):
        slider.observe(feedback.guard(redraw, "Redrawing the goodput"), names="value")
    redraw()
    show_static(image.value, f"goodput against I for delta = {delta} s, t_R = {restart} s, Theta = {theta} s")
    return widgets.VBox([write, recover, mtbf, table, feedback.box, image])


def _duration(seconds):
    for unit, scale in (("days", 86400), ("h", 3600), ("min", 60)):
        if seconds >= 2 * scale:
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds:.3g} s"
