"""Widgets for lecture 09 (long sequences): ring attention step by step, and the causal work
each rank does under the contiguous and the zig-zag split.

    ring_plan(cp, split, causal)                    per step and rank: the K/V block held, its BlockTask
    plot_ring_steps(cp, split, causal, ax, step)    that plan as a grid of cells, step by rank
    plot_work_per_rank(cp, causal, split, ax)       block pairs per rank, contiguous beside zig-zag
    ring_figure(cp, split, causal, step)            both, side by side
    ring_readout(cp, split, causal, step)           the sentence under the widget's controls
    ring_attention_widget(cp=4, split="zigzag")     controls for cp, the split, causal and the step

Everything drawn is read from ``parlab.context_parallel``: which block rank r holds at step
i is ``ring_sources(r, cp)[i]``, what it computes with it ``block_task`` (None: skipped, the
block lies above the diagonal), its work ``block_pairs`` and the balance ``load_imbalance``.
A cell is the (s/cp) x (s/cp) pair of the rank's queries (rows, top to bottom) and the
block's keys (columns, left to right); its coloured part is what the rank computes.
"""

import html

from parlab.context_parallel import SPLITS, block_pairs, block_task, load_imbalance, ring_sources, sequence_indices
from parlab.widgets._common import FIT, Feedback, import_ipywidgets, in_range, png, show_static, toggle_buttons

DEGREES = (2, 4, 8)  # the widget's choices of cp
MAX_RANKS = 8  # up to 8 x 8 cells stay readable
SPLIT_LABELS = {"contiguous": "contiguous", "zigzag": "zig-zag"}
COLOURS = {"computed": "tab:blue", "masked": "tab:orange", "skipped": "white"}
LEGEND = {"computed": "computed (every key visible)", "masked": "computed with the causal mask (diagonal)",
          "skipped": "skipped (above the diagonal)"}
CELL = 0.62  # the side of a cell's square; cells are one unit apart


def ring_plan(cp, split="zigzag", causal=True):
    """What ring attention does at each step: a list over steps i = 0 .. cp - 1 of a list over
    ranks r of ``(src, task)``, src = ``ring_sources(r, cp)[i]`` the rank whose K/V block
    rank r holds and task = ``block_task(r, src, cp, split, causal)`` what it computes with
    it (None: skipped)."""
    _check(cp, split, causal)
    sources = [ring_sources(r, cp) for r in range(cp)]
    return [[(sources[r][i], block_task(r, sources[r][i], cp, split, causal)) for r in range(cp)]
            for i in range(cp)]


def plot_ring_steps(cp, split="zigzag", causal=True, ax=None, step=None):
    """``ring_plan(cp, split, causal)`` as a grid: one column per ring step, one row per rank
    (labelled with the chunks of s/(2 cp) positions its queries hold, ``sequence_indices``).
    Each cell is the block pair (queries down, keys across), labelled with the rank whose K/V
    block it is; the part computed is filled (``COLOURS``: blue without the mask, orange the
    diagonal block, computed whole with the mask, its upper triangle hatched: masked away),
    a skipped block is left empty. The filled patch of step i, rank r has the gid ``"i-r"``
    and the area ``task.area`` x CELL^2. With ``step``, steps after it are faded and its
    column is framed. Returns the axes."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch, Polygon, Rectangle

    plan = ring_plan(cp, split, causal)
    drawn = {_kind(task) for row in plan for _, task in row}
    if step is not None:
        in_range("step (of the ring)", step, 0, cp - 1, f"the ring of cp = {cp} ranks has steps 0 to {cp - 1}.",
                 whole=True)
    if ax is None:
        _, ax = plt.subplots(figsize=ring_steps_size(cp), layout="constrained")
    for i, tasks in enumerate(plan):
        alpha = 0.25 if step is not None and i > step else 1.0
        for r, (src, task) in enumerate(tasks):
            x, y = i, r  # the square's top-left corner; the y axis runs down
            ax.add_patch(Rectangle((x, y), CELL, CELL, fill=False, edgecolor="#999999", lw=0.8, alpha=alpha,
                                   linestyle="-" if task else ":"))
            if task is not None:
                rows, keys = task.query_rows(2), task.key_rows(2)  # halves of the square: 0, 1 or both
                ax.add_patch(Rectangle((x + keys.start * CELL / 2, y + rows.start * CELL / 2),
                                       (keys.stop - keys.start) * CELL / 2, (rows.stop - rows.start) * CELL / 2,
                                       facecolor=COLOURS[_kind(task)], edgecolor="none", alpha=alpha, gid=f"{i}-{r}"))
                if task.masked:  # what the mask throws away: keys after the query
                    ax.add_patch(Polygon([(x, y), (x + CELL, y), (x + CELL, y + CELL)], closed=True, fill=False,
                                         hatch="////", edgecolor="white", lw=0, alpha=alpha))
            ax.text(x + CELL / 2, y + CELL + 0.06, f"K/V of {src}", ha="center", va="top", fontsize=7,
                    alpha=alpha, color="black" if task else "gray")
    if step is not None:
        ax.add_patch(Rectangle((step - 0.12, -0.12), CELL + 0.24, cp - 1 + CELL + 0.42, fill=False,
                               edgecolor="black", lw=1.6))
    ax.set_xlim(-0.2, cp - 1 + CELL + 0.2)
    ax.set_ylim(cp + 0.05, -0.2)
    ax.set_aspect("equal")
    ax.set_xticks([i + CELL / 2 for i in range(cp)], [f"step {i}" for i in range(cp)], fontsize=8)
    ax.xaxis.tick_top()
    ax.set_yticks([r + CELL / 2 for r in range(cp)], [_rank_label(r, cp, split) for r in range(cp)], fontsize=8)
    ax.tick_params(length=0)
    ax.set_frame_on(False)
    ax.legend(handles=[Patch(facecolor=COLOURS[kind], edgecolor="#999999", label=LEGEND[kind])
                       for kind in COLOURS if kind in drawn],
              fontsize=7, loc="upper center", bbox_to_anchor=(0.5, 0), frameon=False)
    ax.set_title(f"ring attention, cp = {cp}, {SPLIT_LABELS[split]} split, {'causal' if causal else 'not causal'}\n"
                 f"at step i rank r holds the K/V of rank r - i (mod cp)", fontsize=9)
    return ax


def plot_work_per_rank(cp, causal=True, split=None, ax=None):
    """Bars of ``block_pairs(cp, split, causal)`` per rank for the contiguous and the zig-zag
    split side by side (``split``, if given, drawn solid, the other faded), the mean as a
    dashed line, and each split's slowest / mean (``load_imbalance``) in the legend, with
    2 cp / (cp + 1) beside it for the causal contiguous split. Returns the axes."""
    import matplotlib.pyplot as plt

    _check(cp, split or "zigzag", causal)
    if ax is None:
        _, ax = plt.subplots(figsize=(4.5, 3.2), layout="constrained")
    width = 0.4
    for offset, (name, colour) in zip((-width / 2, width / 2), (("contiguous", "tab:gray"), ("zigzag", "tab:green"))):
        work = block_pairs(cp, name, causal)
        label = f"{SPLIT_LABELS[name]}: slowest / mean {load_imbalance(work):.2f}"
        if causal and name == "contiguous":
            label += f" = 2cp/(cp+1) = {2 * cp}/{cp + 1}"
        ax.bar([r + offset for r in range(cp)], work, width, color=colour, label=label,
               alpha=1.0 if split in (None, name) else 0.35, gid=name)
    mean = sum(block_pairs(cp, "contiguous", causal)) / cp  # the same total work under either split
    ax.axhline(mean, color="black", lw=0.8, ls="--", label=f"mean {mean:g}")
    ax.set_xticks(range(cp), [str(r) for r in range(cp)])
    ax.set_xlabel("rank")
    ax.set_ylabel("block pairs of (s/cp) x (s/cp)")
    ax.set_ylim(0, cp * 1.35)
    ax.legend(fontsize=7, loc="upper left")
    ax.set_title("work per rank over all the steps", fontsize=9)
    return ax


def ring_figure(cp, split="zigzag", causal=True, step=None, figure=None):
    """``plot_ring_steps`` (left) beside ``plot_work_per_rank`` (right), in ``figure`` (a new
    one if None). Returns the figure."""
    import matplotlib.pyplot as plt

    _check(cp, split, causal)
    if figure is None:
        figure = plt.figure(figsize=figure_size(cp), layout="constrained")
    steps, work = figure.subplots(1, 2, width_ratios=[cp + 2.5, 4.5])
    plot_ring_steps(cp, split, causal, steps, step)
    plot_work_per_rank(cp, causal, split, work)
    return figure


def ring_readout(cp, split="zigzag", causal=True, step=0):
    """One sentence: what the ranks compute at ``step``, then each rank's block pairs over the
    whole ring (``block_pairs``) and the slowest over the mean (``load_imbalance``)."""
    plan = ring_plan(cp, split, causal)
    in_range("step (of the ring)", step, 0, cp - 1, f"the ring of cp = {cp} ranks has steps 0 to {cp - 1}.",
             whole=True)
    computing = sum(task is not None for _, task in plan[step])
    work = block_pairs(cp, split, causal)
    pairs = ", ".join(f"{w:g}" for w in work)
    balance = f"slowest / mean = {load_imbalance(work):.2f}"
    if causal and split == "contiguous":
        balance += f" (2cp/(cp+1) = {2 * cp / (cp + 1):.2f})"
    return (f"step {step}: {computing} of {cp} ranks compute with the block they hold. Over all {cp} steps the "
            f"ranks compute {pairs} block pairs of (s/cp) x (s/cp) (the diagonal block counts whole): {balance}.")


def ring_attention_widget(cp=4, split="zigzag", causal=True):
    """Step through ring attention: toggle buttons for cp (2, 4, 8), the split (contiguous,
    zig-zag) and causal on/off, and a slider for the step (0 to cp - 1) redraw ``ring_figure``
    and the sentence ``ring_readout``. Displays a static picture of step 0 (kept by a saved
    notebook) and returns an ipywidgets VBox; without ipywidgets, warns and returns
    ``ring_figure(cp, split, causal)``, every step drawn."""
    if cp not in DEGREES or isinstance(cp, bool):
        raise ValueError(f"cp must be one of {', '.join(map(str, DEGREES))} (the widget's choices), got {cp!r}: "
                         f"pick one of them.")
    _check(cp, split, causal)
    widgets = import_ipywidgets()
    if widgets is None:
        return ring_figure(cp, split, causal)

    degree = toggle_buttons(list(DEGREES), "cp", value=cp)
    splits = toggle_buttons([(SPLIT_LABELS[name], name) for name in SPLITS], "split", value=split)
    mask = toggle_buttons([("causal", True), ("not causal", False)], "attention", value=causal)
    step = widgets.IntSlider(0, min=0, max=cp - 1, description="step", style=FIT)
    image, readout, feedback = widgets.Image(format="png"), widgets.HTML(), Feedback()

    def redraw(_=None):
        settings = degree.value, splits.value, mask.value, step.value

        def draw(ax):
            figure = ax.figure
            ax.remove()
            ring_figure(*settings, figure=figure)

        image.value = png(draw, figure_size(degree.value))
        readout.value = html.escape(ring_readout(*settings))

    def change_degree(_):
        step.max = degree.value - 1  # may clamp step.value, which redraws too
        redraw()

    degree.observe(feedback.guard(change_degree, "Redrawing the ring"), names="value")
    for control in (splits, mask, step):
        control.observe(feedback.guard(redraw, "Redrawing the ring"), names="value")
    redraw()
    show_static(image.value, f"ring attention on cp = {cp} ranks, {SPLIT_LABELS[split]} split, step 0")
    return widgets.VBox([widgets.HBox([degree, splits]), widgets.HBox([mask, step]), feedback.box, readout, image])


def ring_steps_size(cp):
    return 1.8 + 0.95 * cp, 1.7 + 0.85 * cp


def figure_size(cp):
    width, height = ring_steps_size(cp)
    return width + 4.5, max(height, 3.6)


def _rank_label(r, cp, split):
    chunks = sequence_indices(2 * cp, cp, r, split).tolist()  # positions of a sequence of 2 cp chunks
    return f"rank {r}\nQ chunks {', '.join(map(str, chunks))}"


def _kind(task):
    return "skipped" if task is None else "masked" if task.masked else "computed"


def _check(cp, split, causal):
    in_range("cp (the context-parallel degree)", cp, 1, MAX_RANKS, "the step-through draws 1 to 8 ranks.", whole=True)
    if split not in SPLITS:
        raise ValueError(f"split must be 'contiguous' or 'zigzag', got {split!r}: pick one of them.")
    if not isinstance(causal, bool):
        raise ValueError(f"causal must be True or False, got {causal!r}: True masks keys after each query.")
