"""Pictures of what the ranks did: a Gantt chart of a measured timeline, and the contents
of each rank's tensor before and after a collective.

Plain matplotlib functions that return their axes, so notebooks, widgets and tests share them.
"""

from parlab.trace import COMM, COMPUTE

COMPUTE_COLOURS = {
    "forward": "tab:blue",
    "backward": "tab:green",
    "weight": "tab:olive",
    "optimizer": "tab:orange",
    # ZeRO and FSDP mark their collectives as spans ("all-gather", "reduce-scatter gradients",
    # ...: a span is coloured by its name's first word); their sends and receives draw in
    # the lower half of the row, in COMM_COLOURS.
    "all-gather": "tab:cyan",
    "reduce-scatter": "tab:pink",
    "all-reduce": "darkgoldenrod",
}
COMM_COLOURS = {"send": "tab:red", "isend": "tab:red", "recv": "tab:purple", "irecv": "tab:purple"}
OTHER_COMPUTE, OTHER_COMM = "tab:gray", "tab:brown"


def plot_timeline(timeline, ax=None, title=None):
    """Gantt chart of a ``parlab.trace.Timeline``: one row per rank (rank 0 on top), compute
    spans in the upper half of a row, communication in the lower half, time in ms."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    if ax is None:
        _, ax = plt.subplots(figsize=(10, 0.7 * timeline.world_size + 1.4))
    t0 = min((ev.start for ev in timeline.events), default=0.0)
    span_ms = max(timeline.duration * 1e3, 1e-6)
    legend = {}
    lanes = _comm_lanes(timeline.events)
    for ev in timeline.events:
        start, width = (ev.start - t0) * 1e3, max(ev.duration * 1e3, span_ms / 2000)
        if ev.kind == COMPUTE:
            colour = _compute_colour(ev.name)
            bottom, height, label = ev.rank - 0.42, 0.4, _compute_label(ev)
        else:
            # Transfers that overlap in time (an isend still pending during a recv) get
            # lanes of their own in the lower half of the row instead of drawing on top.
            lane, count = lanes[ev]
            colour = COMM_COLOURS.get(ev.name, OTHER_COMM)
            height = 0.4 / count
            bottom, label = ev.rank + 0.02 + lane * height, _comm_label(ev)
        ax.broken_barh([(start, width)], (bottom, height), facecolors=colour, edgecolor="white", linewidth=0.5)
        legend.setdefault(ev.name, colour)
        if width > span_ms * 0.03 and height >= 0.2:
            ax.text(start + width / 2, bottom + height / 2, label, ha="center", va="center", fontsize=7, color="white")
    ax.set_yticks(range(timeline.world_size), [f"rank {r}" for r in range(timeline.world_size)])
    ax.set_ylim(timeline.world_size - 0.5, -0.5)
    ax.set_xlim(0, span_ms * 1.01)
    ax.set_xlabel("time (ms)")
    ax.set_title(title or f"measured timeline ({timeline.duration * 1e3:.1f} ms)")
    if legend:
        handles = [Patch(color=colour, label=name) for name, colour in legend.items()]
        ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    return ax


def _comm_lanes(events):
    """Event -> (lane, lanes on its rank): greedy interval partitioning of each rank's
    communication events, so that events in one lane never overlap in time."""
    placed, lane_ends = {}, {}
    for ev in events:  # in start order
        if ev.kind != COMM:
            continue
        ends = lane_ends.setdefault(ev.rank, [])
        lane = next((i for i, end in enumerate(ends) if end <= ev.start), len(ends))
        if lane == len(ends):
            ends.append(ev.end)
        else:
            ends[lane] = ev.end
        placed[ev] = lane
    return {ev: (lane, len(lane_ends[ev.rank])) for ev, lane in placed.items()}


def _compute_colour(name):
    return COMPUTE_COLOURS.get(name) or COMPUTE_COLOURS.get(name.split(" ")[0], OTHER_COMPUTE)


def _compute_label(ev):
    """Pipeline spans read as the schedule notation, "{stage}{F|B|W}{micro-batch}" (an
    interleaved rank runs several stages); spans without a stage drop it ("B3")."""
    if ev.microbatch is not None:
        stage = "" if ev.stage is None else ev.stage
        return f"{stage}{ev.name[0].upper()}{ev.microbatch}"
    return ev.name


def _comm_label(ev):
    arrow = "→" if "send" in ev.name else "←"
    return f"{arrow}{ev.peer}" if ev.peer is not None else ev.name


def plot_collective(before, after, title, axes=None):
    """Each rank's tensor before and after a collective, as rows of numbered cells.

    ``before``/``after``: one 1-D sequence (list or tensor) per rank, or None where a rank
    holds nothing meaningful (a gather's non-root ranks, say).
    """
    import matplotlib.pyplot as plt

    width = max(_longest(before), _longest(after))
    if axes is None:
        _, axes = plt.subplots(
            1, 2, figsize=(2.4 + 1.2 * width, 0.5 * len(before) + 1.3), layout="constrained"
        )
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
