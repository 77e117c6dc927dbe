"""Widgets for lecture 01 (collectives): a step-through of ring all-reduce, and the
alpha-beta model of every all-reduce algorithm with measured times laid over it.

    plot_ring_step(N, step)                       one step of the ring, as a static figure
    ring_widget(N=4)                              sliders for N and the step
    plot_alpha_beta(N, alpha, beta, sizes)        predicted time against message size
    alpha_beta_widget(measured, N, alpha, beta)   sliders for N, alpha, beta and a size
"""

from parlab._checks import real_number, whole_number
from parlab.alpha_beta import ALL_REDUCE_ALGORITHMS, cost_model
from parlab.collectives import ring_contributions, ring_steps
from parlab.widgets._common import FIT, Feedback, import_ipywidgets, in_range, log_slider, png, show_static

# Ring and butterfly share their bandwidth term: the butterfly is dotted so the ring shows through.
ALGORITHM_STYLES = {
    "naive": {"color": "C3", "linestyle": "--"},
    "ring": {"color": "C0", "linestyle": "-"},
    "butterfly": {"color": "C2", "linestyle": ":"},
    "tree": {"color": "C1", "linestyle": "-."},
}
ALGORITHM_LABELS = {"naive": "naive (one root)", "ring": "ring", "butterfly": "butterfly",
                    "tree": "tree (reduce + broadcast)"}
ACTION_COLOURS = {"reduce": "tab:red", "copy": "tab:green"}
MAX_RANKS = 8  # the ring step-through stays readable up to 8 rows of 8 chunks
SIZES = [2.0**k for k in range(6, 31)]  # the message sizes D of the alpha-beta widget: 64 B to 1 GiB


def plot_ring_step(N, step, ax=None):
    """Rank r's tensor after the first ``step`` steps of ring all-reduce on N ranks, one row
    per rank and one column per chunk; a cell's colour is the number of ranks summed in that
    chunk (``ring_contributions``) and its text lists them. For step >= 1 the transfers of
    that step are drawn: an arrow from the chunk rank r sent to the same chunk of rank
    r + 1 (the ring wraps from the bottom row to the top), the received chunk outlined in red
    ("reduce": added in) or green ("copy": written over), and each row says what it sent
    and received. Returns the axes.
    """
    import matplotlib.pyplot as plt
    from matplotlib.colors import BoundaryNorm

    steps = ring_steps(N)
    held = ring_contributions(N, step)
    if ax is None:
        _, ax = plt.subplots(figsize=_ring_figsize(N), layout="constrained")
    counts = [[len(ranks) for ranks in row] for row in held]
    levels = BoundaryNorm([k + 0.5 for k in range(N + 1)], 256)  # one colour per count 1..N
    image = ax.imshow(counts, cmap="Blues", norm=levels, aspect="auto")
    for r, row in enumerate(held):
        for c, ranks in enumerate(row):
            text = "all" if len(ranks) == N > 1 else "+".join(map(str, sorted(ranks)))
            ax.text(c, r, text, ha="center", va="center", fontsize=9 if N <= 5 else 7,
                    color="white" if len(ranks) > N / 2 else "black")
    ax.set_xticks(range(N), [f"chunk {c}" for c in range(N)], fontsize=8)
    ax.set_yticks(range(N), [f"rank {r}" for r in range(N)])
    ax.tick_params(length=0)
    ax.spines[:].set_visible(False)
    ax.set_ylim(N - 0.5 + 0.45, -0.5 - 0.45)  # room for the ring's wrap-around arrows
    colourbar = ax.figure.colorbar(image, ax=ax, ticks=range(1, N + 1), fraction=0.05, pad=0.02)
    colourbar.set_label("ranks summed in the chunk", fontsize=8)
    if step == 0:
        ax.set_title("before the all-reduce: every rank holds only its own data", fontsize=10, pad=10)
        return ax
    current = steps[step - 1]
    _draw_transfers(ax, current, N)
    verb = {"reduce": "adds the chunk it receives into its own", "copy": "writes the chunk it receives over its own"}
    title = f"{current.phase} step {current.j + 1} of {N - 1}: each rank {verb[current.action]}"
    ax.set_title(title, fontsize=10, pad=10)
    return ax


def _draw_transfers(ax, ring_step, N):
    from matplotlib.patches import Rectangle

    colour = ACTION_COLOURS[ring_step.action]
    arrow = dict(arrowstyle="-|>", color="black", lw=1.3, shrinkA=0, shrinkB=0)
    for r in range(N):
        sent, received, right = ring_step.send[r], ring_step.receive[r], (r + 1) % N
        ax.add_patch(Rectangle((received - 0.5, r - 0.5), 1, 1, fill=False, edgecolor=colour, lw=2.5))
        if right > r:
            ax.annotate("", xy=(sent + 0.35, right - 0.15), xytext=(sent + 0.35, r + 0.15), arrowprops=arrow)
        else:  # the wrap-around: out of the bottom row, into the top one
            ax.annotate("", xy=(sent + 0.35, N - 0.5 + 0.4), xytext=(sent + 0.35, r + 0.15), arrowprops=arrow)
            ax.annotate("", xy=(sent + 0.35, -0.15), xytext=(sent + 0.35, -0.5 - 0.4), arrowprops=arrow)
        moves = f"sends chunk {sent} → rank {right}\nreceives chunk {received} ← rank {(r - 1) % N}"
        ax.text(N - 0.4, r, moves, va="center", fontsize=7, clip_on=False)


def _ring_figsize(N):
    return 5.6 + 0.9 * N, 1.2 + 0.55 * N  # the width leaves room for the labels and the colour bar


def ring_widget(N=4):
    """Step through ring all-reduce: sliders for the number of ranks N (2..8) and the step
    (0..2 (N - 1)) redraw ``plot_ring_step``. Displays a static picture of step 0 (kept by a
    saved notebook) and returns an ipywidgets VBox; without ipywidgets, warns and returns the
    static figure."""
    in_range("N (the number of ranks in the ring)", N, 2, MAX_RANKS, "the step-through draws 2 to 8 ranks.", whole=True)
    widgets = import_ipywidgets()
    if widgets is None:
        return plot_ring_step(N, 0).figure
    ranks = widgets.IntSlider(N, min=2, max=MAX_RANKS, description="N ranks", style=FIT)
    step = widgets.IntSlider(0, min=0, max=2 * (N - 1), description="step", style=FIT)
    image, feedback = widgets.Image(format="png"), Feedback()

    def redraw(_=None):
        image.value = png(lambda ax: plot_ring_step(ranks.value, step.value, ax), _ring_figsize(ranks.value))

    def change_ranks(_):
        step.max = 2 * (ranks.value - 1)  # may clamp step.value, which redraws too
        redraw()

    ranks.observe(feedback.guard(change_ranks, "Redrawing the ring"), names="value")
    step.observe(feedback.guard(redraw, "Redrawing the ring"), names="value")
    redraw()
    show_static(image.value, f"ring all-reduce on {N} ranks")
    return widgets.VBox([widgets.HBox([ranks, step]), feedback.box, image])


def plot_alpha_beta(N, alpha, beta, sizes, measured=None, ax=None):
    """Predicted all-reduce time against message size D (bytes in ``sizes``) on N ranks, one
    line per algorithm of ``ALL_REDUCE_ALGORITHMS`` (``cost_model``), on log-log axes.
    ``measured``: rows with world_size, bytes, algorithm and seconds (the rows of
    ``parlab.bench.collectives.bench_collectives``); those at this N are drawn as points in
    their algorithm's colour, torch's ``dist.all_reduce`` in black. Returns the axes.
    """
    import matplotlib.pyplot as plt

    _check_model(N, alpha, beta)
    if not sizes or not all(size > 0 for size in sizes):
        raise ValueError(f"sizes are the message sizes D to draw, in bytes: give at least one, each above 0, "
                         f"not {sizes!r}.")
    if ax is None:
        _, ax = plt.subplots(figsize=(7.5, 4.2), layout="constrained")
    for algorithm in ALL_REDUCE_ALGORITHMS:
        ax.plot(sizes, [cost_model(algorithm, D, N, alpha, beta) for D in sizes], lw=2,
                **ALGORITHM_STYLES[algorithm], label=f"model: {ALGORITHM_LABELS[algorithm]}")
    points = {"torch": ("x", "black", "torch dist.all_reduce")}
    points.update({algorithm: ("o", style["color"], algorithm) for algorithm, style in ALGORITHM_STYLES.items()})
    for algorithm, (marker, colour, name) in points.items():
        rows = [row for row in measured or () if row["world_size"] == N and row["algorithm"] == algorithm]
        if rows:
            ax.plot([row["bytes"] for row in rows], [row["seconds"] for row in rows], marker, color=colour,
                    markersize=5, label=f"measured: {name}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("message size D (bytes)")
    ax.set_ylabel("all-reduce time (s)")
    ax.set_title(f"alpha-beta model, N = {N}: alpha = {alpha * 1e6:.3g} µs, 1/beta = {1 / beta / 1e9:.3g} GB/s",
                 fontsize=10)
    ax.legend(fontsize=7, loc="upper left", ncol=2 if measured else 1)
    return ax


def prediction_table(N, alpha, beta, D):
    """HTML table of each algorithm's predicted time for D bytes on N ranks, split into its
    latency term (the alpha part) and bandwidth term (the beta part); the fastest in bold."""
    times = {a: cost_model(a, D, N, alpha, beta) for a in ALL_REDUCE_ALGORITHMS}
    fastest = min(times, key=times.get)
    rows = []
    for algorithm, seconds in times.items():
        cells = [ALGORITHM_LABELS[algorithm], _ms(seconds), _ms(cost_model(algorithm, D, N, alpha, 0)),
                 _ms(cost_model(algorithm, D, N, 0, beta))]
        if algorithm == fastest:
            cells = [f"<b>{cell}</b>" for cell in cells]
        rows.append("<tr>" + "".join(f"<td>{cell}</td>" for cell in cells) + "</tr>")
    header = "<tr><th>algorithm</th><th>predicted</th><th>latency term</th><th>bandwidth term</th></tr>"
    caption = f"all-reduce of D = {D:,.0f} bytes on N = {N} ranks"
    return f"<table><caption>{caption}</caption>{header}{''.join(rows)}</table>"


def alpha_beta_widget(measured=None, N=4, alpha=1e-5, beta=1e-10):
    """The alpha-beta model with sliders: N (2..64), alpha (seconds, log scale), beta
    (seconds per byte, log scale) redraw ``plot_alpha_beta`` (with ``measured`` rows laid
    over it); a message-size slider marks a size D on the plot and fills the table of
    ``prediction_table``. The alpha and beta sliders widen to reach the values given.
    Displays a static picture of the first state (kept by a saved notebook) and returns an
    ipywidgets VBox; without ipywidgets, warns and returns the static figure."""
    _check_model(N, alpha, beta)
    real_number("alpha (seconds per message)", alpha, "the alpha slider has a log scale: give a latency above 0.",
                above=True)
    widgets = import_ipywidgets()
    if widgets is None:
        return plot_alpha_beta(N, alpha, beta, SIZES, measured).figure
    ranks = widgets.IntSlider(N, min=2, max=max(64, N), description="N ranks", style=FIT)
    latency = log_slider(alpha, -7, -2, "alpha (s)", step=0.1, readout_format=".2e")
    per_byte = log_slider(beta, -12, -7, "beta (s/B)", step=0.1, readout_format=".2e")
    size = log_slider(2**20, 6, 30, "D (bytes)", base=2, step=1, readout_format=".3s")
    image, table, feedback = widgets.Image(format="png"), widgets.HTML(), Feedback()

    def redraw(_=None):
        def draw(ax):
            plot_alpha_beta(ranks.value, latency.value, per_byte.value, SIZES, measured, ax)
            ax.axvline(size.value, color="gray", lw=0.8, ls=":")

        image.value = png(draw, (7.5, 4.2))
        table.value = prediction_table(ranks.value, latency.value, per_byte.value, size.value)

    for slider in (ranks, latency, per_byte, size):
        slider.observe(feedback.guard(redraw, "Redrawing the model"), names="value")
    redraw()
    show_static(image.value, f"the alpha-beta model on {N} ranks")
    return widgets.VBox([widgets.HBox([ranks, size]), widgets.HBox([latency, per_byte]), feedback.box, image, table])


def _check_model(N, alpha, beta):
    whole_number("N (the number of ranks)", N, "the model compares all-reduce algorithms on 2 ranks or more.", 2)
    real_number("alpha (seconds per message)", alpha, "give the latency in seconds, e.g. alpha = 1e-5.")
    real_number("beta (seconds per byte)", beta, "give the inverse bandwidth, above 0: e.g. beta = 1e-9 for 1 GB/s.",
                above=True)


def _ms(seconds):
    return f"{seconds * 1e3:.3g} ms"

