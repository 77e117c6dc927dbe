"""Widgets for lecture 05 (gradient compression): what a compressor saves on the wire and what
it costs, predicted and measured.

    lecture_compressor(kind, budget, rank)                    a compressor from the widget's controls
    step_prediction(compressor, N, link, ...)                 bytes and predicted step, beside dense
    plot_prediction(rows, ax=None)                            those as bars (and measured steps, if any)
    plot_curves(runs, axes=None, title="")                    loss against steps and against wall time
    drawn_rows(kind, N, link, ...), caption(...)              what the widget draws, and the line under it
    compression_widget(cluster, ...)                          controls over all of it, and a measured run

The prediction is ``parlab.bench.compression.predicted_step``: the declared compute plus the
alpha-beta time of the compressor's collectives; the measured runs are
``parlab.bench.compression.measure`` on the cluster, under the chosen link (emulated).
"""

from parlab._checks import real_number, whole_number
from parlab.bench.compression import measure, predicted_step
from parlab.compression import FP16, QSGD, ErrorFeedback, Identity, PowerSGD, RandK, ScaledSign, TopK
from parlab.runtime.emulation import Link
from parlab.widgets._common import Feedback, button, import_ipywidgets, log_slider, png, running_cluster, show_static

KINDS = ("fp16", "top-k + EF", "random-k", "QSGD q=4", "scaled sign + EF", "PowerSGD + EF")
ALWAYS_DRAWN = ("top-k + EF", "PowerSGD + EF")  # beside the chosen one, so every control shows its effect
FIGSIZE = (9, 3.2)
HIDDEN, DEPTH, COMPUTE_S, STEPS = 256, 2, 0.01, 6


def lecture_compressor(kind, budget=0.01, rank=2):
    """A fresh compressor: "dense", or one of ``KINDS``; ``budget`` is k/d for top-k and
    random-k (0 < budget <= 1), ``rank`` PowerSGD's R."""
    real_number("budget (k/d)", budget, "keep a fraction of the elements between 0 and 1, e.g. 0.01.", above=True)
    if budget > 1:
        raise ValueError(f"budget (k/d) is a fraction of the elements, at most 1; got {budget}.")
    whole_number("rank (R)", rank, "PowerSGD's rank: a whole number such as 2.")
    makers = {
        "dense": Identity, "fp16": FP16, "top-k + EF": lambda: ErrorFeedback(TopK(budget if budget < 1 else 1.0)),
        "random-k": lambda: RandK(budget if budget < 1 else 1.0), "QSGD q=4": lambda: QSGD(4),
        "scaled sign + EF": lambda: ErrorFeedback(ScaledSign()), "PowerSGD + EF": lambda: ErrorFeedback(PowerSGD(rank)),
    }
    if kind not in makers:
        raise ValueError(f"kind must be one of {', '.join(map(repr, makers))}; got {kind!r}.")
    return makers[kind]()


def step_prediction(kind, N, link, budget=0.01, rank=2, hidden=HIDDEN, depth=DEPTH, compute_s=COMPUTE_S):
    """Rows for "dense" and ``kind`` on the lecture's MLP at N ranks on ``link``: ``name``,
    ``sent`` (bytes each rank sends per step), ``bytes_ratio`` (over dense), ``predicted_s``
    (compute + alpha-beta, ``predicted_step``) and ``time_ratio`` (over dense's)."""
    whole_number("N (ranks)", N, "compression needs at least 2 ranks to talk: pick N >= 2.", minimum=2)
    if not isinstance(link, Link):
        raise ValueError(f"link must be a parlab.Link, got {link!r}: e.g. parlab.Link(latency=500e-6, bandwidth=10e6).")
    rows = []
    for name in ("dense", kind):
        sent, seconds = predicted_step(lecture_compressor(name, budget, rank), N, link, hidden, depth, compute_s)
        rows.append({"name": name, "sent": sent, "predicted_s": seconds})
    for row in rows:
        row["bytes_ratio"] = row["sent"] / rows[0]["sent"]
        row["time_ratio"] = row["predicted_s"] / rows[0]["predicted_s"]
    return rows


def plot_prediction(rows, compute_s=COMPUTE_S, ax=None, title=""):
    """Horizontal bars, one per row of ``step_prediction``: the declared compute and the
    predicted communication of a step (ms), and a dot at ``measured_s`` where a row has one.
    Returns the axes."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=FIGSIZE, layout="constrained")
    names = [row["name"] for row in rows]
    compute_ms = [compute_s * 1e3] * len(rows)
    communication_ms = [(row["predicted_s"] - compute_s) * 1e3 for row in rows]
    ax.barh(names, compute_ms, color="tab:gray", label="compute (declared)")
    ax.barh(names, communication_ms, left=compute_ms, color="tab:blue", label="communication (alpha-beta model)")
    measured = [(row["name"], row["measured_s"] * 1e3) for row in rows if row.get("measured_s") is not None]
    if measured:
        ax.plot([m for _, m in measured], [n for n, _ in measured], "o", color="tab:red", label="measured (median)")
    for y, row in enumerate(rows):
        ax.text(row["predicted_s"] * 1e3, y, f"  {row['sent']:,} B, x{row['time_ratio']:.2f}", va="center", fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("time per step (ms)")
    ax.set_xlim(0, max([row["predicted_s"] * 1e3 for row in rows] + [m for _, m in measured]) * 1.45)
    ax.set_title(title or "one step: bytes each rank sends and predicted time, beside dense", fontsize=10)
    ax.legend(fontsize=8, loc="lower right")
    return ax


def plot_curves(runs, axes=None, title=""):
    """Loss against steps (left) and against wall time (right), one line per run of
    ``parlab.bench.compression.measure``. Returns the two axes."""
    import matplotlib.pyplot as plt

    if axes is None:
        _, axes = plt.subplots(1, 2, figsize=(10, 3.4), layout="constrained", sharey=True)
    for number, run in enumerate(runs):
        steps = range(1, len(run["losses"]) + 1)
        axes[0].plot(steps, run["losses"], color=f"C{number}", label=run["name"])
        axes[1].plot(run["times"], run["losses"], color=f"C{number}", label=run["name"])
    axes[0].set_xlabel("step")
    axes[1].set_xlabel("wall time (s)")
    axes[0].set_ylabel("loss on a fixed batch")
    axes[1].legend(fontsize=8)
    if title:
        axes[0].figure.suptitle(title, fontsize=10)
    return axes


def compression_widget(cluster, kind="top-k + EF", N=4, bandwidth=10e6, latency=500e-6, budget=0.01, rank=2):
    """Controls: compressor, the budget k/d (top-k, random-k) and PowerSGD's rank, N (for the
    prediction), the link's bandwidth; the figure gives bytes and predicted step of dense, the
    chosen compressor, and top-k and PowerSGD at the chosen budget and rank; the readout the
    chosen one's beside dense. "measure" trains dense and the compressor on ``cluster`` under that link
    (emulated; its own N) for a few steps and adds the measured medians. Displays a static
    picture of the first state and returns an ipywidgets VBox; without ipywidgets, warns and
    returns the static figure."""
    step_prediction(kind, N, Link(latency, bandwidth), budget, rank)  # bad input: here, before any control
    widgets = import_ipywidgets()
    if widgets is None:
        return plot_prediction(drawn_rows(kind, N, Link(latency, bandwidth), budget, rank)).figure
    from parlab.widgets._common import FIT

    choice = widgets.Dropdown(options=KINDS, value=kind, description="compressor", style=FIT)
    fraction = log_slider(budget, -3, 0, "k/d (top-k, random-k)", readout_format=".3g")
    power_rank = widgets.IntSlider(rank, min=1, max=16, description="PowerSGD rank R", style=FIT)
    ranks = widgets.IntSlider(N, min=2, max=64, description="N (ranks, prediction)", style=FIT)
    speed = log_slider(bandwidth, 5, 10, "bandwidth (bytes/s)", readout_format=".3g")
    image, readout, feedback = widgets.Image(format="png"), widgets.HTML(), Feedback()
    state = {"cluster": cluster, "measured": {}}

    def rows():
        found = drawn_rows(choice.value, ranks.value, Link(latency, speed.value), fraction.value, power_rank.value)
        for row in found:
            row["measured_s"] = state["measured"].get((row["name"], ranks.value, speed.value))
        return found

    def redraw(_=None):
        found = rows()
        image.value = png(lambda ax: plot_prediction(found, ax=ax), FIGSIZE)
        chosen = found[1]
        readout.value = (f"{chosen['name']}: <b>{chosen['sent']:,} bytes</b> per rank and step "
                         f"(x{chosen['bytes_ratio']:.3f} of dense), predicted step <b>{chosen['predicted_s'] * 1e3:.1f}"
                         f" ms</b> (x{chosen['time_ratio']:.2f} of dense's {found[0]['predicted_s'] * 1e3:.1f} ms)")

    def run(_=None):
        state["cluster"] = running_cluster(state["cluster"], feedback)
        if state["cluster"].world_size != ranks.value:
            ranks.value = state["cluster"].world_size  # a measurement has the cluster's N
        names = {"dense": lambda: lecture_compressor("dense"),
                 choice.value: _maker(choice.value, fraction.value, power_rank.value)}
        feedback.say(f"measuring dense and {choice.value} for {STEPS} steps each on {ranks.value} ranks ...")
        with state["cluster"].emulate(link=Link(latency, speed.value)):
            measured = measure(state["cluster"], list(names), STEPS, HIDDEN, DEPTH, 16, COMPUTE_S,
                               compressors=names)
        for row in measured:
            state["measured"][(row["name"], ranks.value, speed.value)] = row["median_s"]
        feedback.say(f"measured under a link of {Link(latency, speed.value).describe()}: " + ", ".join(
            f"{row['name']} {row['median_s'] * 1e3:.1f} ms" for row in measured))
        redraw()

    for control in (choice, fraction, power_rank, ranks, speed):
        control.observe(feedback.guard(redraw, "Redrawing the prediction"), names="value")
    measure_button = button("measure on the cluster", feedback.guard(run, "Measuring"))
    redraw()
    show_static(image.value, caption(kind, N, bandwidth, budget, rank))
    return widgets.VBox([choice, fraction, power_rank, ranks, speed, measure_button, readout, feedback.box, image])


def drawn_rows(kind, N, link, budget=0.01, rank=2):
    """The rows the widget draws: dense, ``kind``, then each of ``ALWAYS_DRAWN`` not chosen
    (``step_prediction``'s rows, at the same budget and rank)."""
    kinds = dict.fromkeys([kind, *ALWAYS_DRAWN])
    return [step_prediction(kind, N, link, budget, rank)[0]] + [
        step_prediction(name, N, link, budget, rank)[1] for name in kinds]


def caption(kind, N, bandwidth, budget=0.01, rank=2):
    """The line under the widget's static picture: every compressor it draws, with its budget and rank."""
    names = [*dict.fromkeys([kind, *ALWAYS_DRAWN])]
    listed = ", ".join(names[:-1]) + " and " + names[-1]
    return f"{listed} (k/d = {budget:g}, PowerSGD's R = {rank}) against dense at N = {N}, {bandwidth / 1e6:g} MB/s"


def _maker(kind, budget, rank):
    return lambda: lecture_compressor(kind, budget, rank)
