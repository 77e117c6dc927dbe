"""Pictures of what the ranks did: the contents of each rank's tensor before and after a
collective (``plot_collective``), and the Gantt chart of a measured or simulated timeline
(``plot_timeline``, drawn by ``parlab.trace`` beside the Timeline it draws, so that
``timeline.plot()`` works without the trace importing this module).

Plain matplotlib functions that return their axes, so notebooks, widgets and tests share them.
A chart they draw on a figure of their own from a script is shown or saved when the script
ends (``parlab.trace.show_from_script``).
"""

from parlab.trace import plot_timeline, show_from_script

__all__ = ["plot_collective", "plot_timeline"]


def plot_collective(before, after, title, axes=None):
    """Each rank's tensor before and after a collective, as rows of numbered cells.

    ``before``/``after``: one 1-D sequence (list or tensor) per rank, or None where a rank
    holds nothing meaningful (a gather's non-root ranks, say).
    """
    import matplotlib.pyplot as plt

    if len(before) != len(after):
        raise ValueError(f"before and after need one row per rank each, got {len(before)} and {len(after)} rows: "
                         "pass a row (or None) for every rank on both sides.")
    width = max(_longest(before), _longest(after))
    if axes is None:
        _, axes = plt.subplots(
            1, 2, figsize=(2.4 + 1.2 * width, 0.5 * len(before) + 1.3), layout="constrained"
        )
        show_from_script(axes[0].figure, "collective")
    vmax = max([abs(v) for row in before + after if row is not None for v in _values(row)] or [1])
    for ax, rows, name in ((axes[0], before, "before"), (axes[1], after, "after")):
        _draw_rows(ax, rows, vmax, width)
        ax.set_title(name, fontsize=10)
    axes[1].tick_params(labelleft=False)
    axes[0].figure.suptitle(title)
    return axes


def _draw_rows(ax, rows, vmax, width):
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    cmap = plt.get_cmap("Blues")
    for rank, row in enumerate(rows):
        for i, value in enumerate(_values(row) if row is not None else []):
            shade = 0.15 + 0.6 * abs(value) / vmax
            ax.add_patch(Rectangle((i, rank), 0.95, 0.9, color=cmap(shade)))
            ax.text(i + 0.47, rank + 0.45, _number(value), ha="center", va="center", fontsize=9)
        if row is None:
            ax.text(0.05, rank + 0.45, "—", va="center", color="gray")
    ax.set_xlim(0, width)
    ax.set_ylim(len(rows), 0)
    ax.set_yticks([r + 0.45 for r in range(len(rows))], [f"rank {r}" for r in range(len(rows))])
    ax.set_xticks([])
    ax.tick_params(left=False)
    for side in ("top", "right", "bottom", "left"):
        ax.spines[side].set_visible(False)


def _values(row):
    return [float(v) for v in (row.flatten().tolist() if hasattr(row, "flatten") else row)]


def _longest(rows):
    return max((len(_values(row)) for row in rows if row is not None), default=1)


def _number(value):
    return f"{value:g}" if abs(value) < 1e4 else f"{value:.1e}"
