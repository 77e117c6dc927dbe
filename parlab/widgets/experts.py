"""Widgets for lecture 09 (many experts): where a router sends its tokens, what a capacity
drops, and the bytes the all-to-all of expert parallelism moves between the ep ranks.

    router_logits(T, E, skew, seed)               one rank's logits: random, the skewed experts favoured
    routing_numbers(E, k, ep, capacity_factor, skew, T, h, seed)
                                                  each rank's routing, the rows per expert, the bytes matrix
    plot_expert_load(numbers, ax=None)            rows per expert (kept, by rank; dropped) and the capacity
    plot_all_to_all(numbers, ax=None)             bytes from each rank to each rank, a heatmap
    plot_routing(E, k, ep, capacity_factor, skew) both, side by side
    router_readout(numbers)                       the sentence under the widget's controls
    router_widget(E=8, k=2, ep=4, ...)            controls for k, the capacity factor, the skew and ep

Everything is ``parlab.experts``'s: each of the ep ranks routes its own T tokens
(``route``, with the capacity ``expert_capacity(T, E, k, capacity_factor)`` counted on them,
as GShard groups), and ``dispatch`` sends each kept (token, choice) row to the rank holding
its expert, ranks holding E/ep experts each in order (``experts_per_rank``): from rank r to
rank p go the kept rows of r's routing for experts p E/ep .. (p + 1) E/ep - 1
(``dispatch_order``), h x element_bytes bytes a row. ``combine`` sends the same rows back.
"""

import html

from parlab._checks import real_number, whole_number
from parlab.experts import all_to_all_bytes, dispatch_order, expert_capacity, experts_per_rank, route
from parlab.gpt import GPTConfig
from parlab.units import KB
from parlab.widgets._common import FIT, Feedback, import_ipywidgets, in_range, png, show_static, toggle_buttons

HIDDEN = GPTConfig().h  # the lecture's small GPT: a row is h values
T_PER_RANK = 64  # tokens each rank routes: b s of its micro-batch
MAX_RANKS, MAX_EXPERTS = 8, 32  # what the heatmap and the bars keep readable
SKEW_MAX = 4.0  # the skew slider's end: e^4 ~ 55 times the odds for a skewed expert
FIGSIZE = (11, 4.6)


def skewed_experts(E):
    """The experts ``skew`` favours: the first quarter, 0 .. max(1, E/4) - 1. They sit on the
    first ranks, so the skew shows in one column of the all-to-all."""
    return range(max(1, E // 4))


def router_logits(T, E, skew=0.0, seed=0):
    """(T, E) router logits of a random, untrained router: standard normal (a
    ``torch.Generator`` seeded ``seed``), plus ``skew`` on the ``skewed_experts``."""
    import torch

    logits = torch.randn(T, E, generator=torch.Generator().manual_seed(seed))  # (T, E)
    logits[:, list(skewed_experts(E))] += skew
    return logits


def routing_numbers(E=8, k=2, ep=4, capacity_factor=1.25, skew=0.0, T=T_PER_RANK, h=HIDDEN, element_bytes=4,
                    seed=0):
    """Route T tokens on each of the ep ranks (rank r's logits ``router_logits(T, E, skew,
    seed + r)``) with top-k and capacity ``expert_capacity(T, E, k, capacity_factor)``.
    Returns a dict: ``capacity`` (rows an expert takes from one rank), ``routings`` (a
    ``Routing`` per rank), ``chose`` and ``kept`` ((ep, E) lists: the (token, choice) pairs of
    rank r that chose expert e, and those kept, ``dispatch_order``), ``bytes`` ((ep, ep):
    bytes rank r's dispatch sends to rank p, the diagonal the rows that stay), ``sent``
    (bytes each rank sends to the others, ``all_to_all_bytes``), ``pairs`` (T k ep),
    ``dropped`` (pairs dropped), ``tokens_lost`` (tokens with every choice dropped) and the
    settings."""
    E = whole_number("E (experts)", E, "build at least one expert.")
    ep = whole_number("ep (the expert-parallel degree)", ep, "count the ranks that split the experts.")
    held = experts_per_rank(E, ep)
    capacity = expert_capacity(T, E, k, capacity_factor)
    real_number("skew", skew, "give the bias added to the skewed experts' logits: 0 for an even router, up to 4.")
    whole_number("seed", seed, "give a whole number such as 0.", minimum=0)
    whole_number("h (hidden size)", h, "give the width of a token, e.g. 128.")
    routings = [route(router_logits(T, E, skew, seed + r), k, capacity) for r in range(ep)]
    kept = [dispatch_order(routing)[1] for routing in routings]  # (E,) a rank: its kept rows per expert
    row_bytes = h * element_bytes
    return dict(
        E=E, k=k, ep=ep, T=T, h=h, capacity_factor=capacity_factor, skew=skew, capacity=capacity, routings=routings,
        chose=[routing.tokens_per_expert.tolist() for routing in routings], kept=[rows.tolist() for rows in kept],
        bytes=[(rows.view(ep, held).sum(1) * row_bytes).tolist() for rows in kept],  # (ep, ep): [from r][to p]
        sent=[all_to_all_bytes(routing, r, ep, h, element_bytes) for r, routing in enumerate(routings)],
        pairs=T * k * ep, dropped=sum(int(routing.dropped.sum()) for routing in routings),
        tokens_lost=sum(int(routing.dropped.all(1).sum()) for routing in routings))


def plot_expert_load(numbers, ax=None):
    """Rows each expert gets from the ep ranks (``routing_numbers``): the kept rows stacked by
    the rank they come from (gid ``"kept-{e}-{r}"``), the dropped ones on top, hatched red
    (gid ``"dropped-{e}"``, the count written above); the expert's capacity, ep x capacity
    (each rank gives it at most ``capacity`` rows), as a red line and the even share
    T k ep / E as a dotted one. Returns the axes."""
    import matplotlib.pyplot as plt

    E, ep, capacity = numbers["E"], numbers["ep"], numbers["capacity"]
    if ax is None:
        _, ax = plt.subplots(figsize=(6, 4), layout="constrained")
    colours = plt.get_cmap("Blues")([0.35 + 0.6 * r / max(ep - 1, 1) for r in range(ep)])
    bottom = [0] * E
    for r in range(ep):
        for e, rows in enumerate(numbers["kept"][r]):
            ax.bar(e, rows, bottom=bottom[e], color=colours[r], edgecolor="white", lw=0.4, gid=f"kept-{e}-{r}",
                   label=("kept" + (f", shaded by the sending rank (0 light .. {ep - 1} dark)" if ep > 1 else ""))
                   if e == r == 0 else None)
            bottom[e] += rows
    dropped = [sum(numbers["chose"][r][e] - numbers["kept"][r][e] for r in range(ep)) for e in range(E)]
    full = [e for e in range(E) if dropped[e]]
    for e in full:
        ax.bar(e, dropped[e], bottom=bottom[e], color="white", edgecolor="tab:red", hatch="///", lw=0.8,
               gid=f"dropped-{e}", label="dropped (the expert was full)" if e == full[0] else None)
        ax.text(e, bottom[e] + dropped[e], f"-{dropped[e]}", ha="center", va="bottom", fontsize=7, color="tab:red")
    ax.axhline(ep * capacity, color="tab:red", lw=1.2,
               label=f"capacity: ep x ⌈cf T k / E⌉ = {ep} x {capacity} = {ep * capacity}")
    ax.axhline(numbers["T"] * numbers["k"] * ep / E, color="black", lw=0.8, ls=":", label="even share T k ep / E")
    ax.set_xticks(range(E), [str(e) for e in range(E)], fontsize=8 if E <= 16 else 6)
    hot = list(skewed_experts(E))
    for e in hot if numbers["skew"] else ():
        ax.get_xticklabels()[e].set_color("tab:red")
    ax.set_xlabel("expert" + (f" (skewed: {hot[0]}..{hot[-1]} in red)" if numbers["skew"] else ""))
    ax.set_ylabel("(token, choice) rows")
    ax.set_ylim(0, max(ep * capacity, max(b + d for b, d in zip(bottom, dropped))) * 1.12)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2, frameon=False)
    ax.set_title(f"rows per expert: T = {numbers['T']} tokens on each of ep = {ep} ranks, top-{numbers['k']}, "
                 f"capacity factor {numbers['capacity_factor']:g}, skew {numbers['skew']:g}", fontsize=9)
    return ax


def plot_all_to_all(numbers, ax=None):
    """``numbers["bytes"]`` as an ep x ep heatmap in kB (rows: the sending rank, columns: the
    receiving one), each cell's number written in it; the diagonal, rows that stay on their
    rank and never reach the wire, in gray. Row labels give each rank's total sent. Returns
    the axes."""
    import matplotlib.pyplot as plt
    import numpy as np

    ep, matrix = numbers["ep"], np.array(numbers["bytes"], dtype=float) / KB
    if ax is None:
        _, ax = plt.subplots(figsize=(4.8, 4), layout="constrained")
    wire = np.ma.masked_array(matrix, mask=np.eye(ep, dtype=bool))
    colours = plt.get_cmap("Oranges").with_extremes(bad="#dddddd")  # the masked diagonal
    top = float(wire.max()) if ep > 1 else 0.0  # one rank: every cell stays, nothing on the wire
    image = ax.imshow(wire, cmap=colours, vmin=0, vmax=top or 1.0)
    for r in range(ep):
        for p in range(ep):
            local = "\n(stays)" if r == p else ""
            dark = r != p and matrix[r, p] > 0.6 * top
            ax.text(p, r, f"{matrix[r, p]:.1f}{local}", ha="center", va="center", fontsize=8 if ep <= 4 else 6,
                    color="white" if dark else "black")
    ax.set_xticks(range(ep), [f"to {p}" for p in range(ep)], fontsize=8)
    ax.set_yticks(range(ep), [f"rank {r}\nsends {numbers['sent'][r] / KB:.1f}" for r in range(ep)], fontsize=7)
    ax.figure.colorbar(image, ax=ax, fraction=0.05, pad=0.02).set_label("kB on the wire", fontsize=8)
    ax.set_title(f"dispatch all-to-all, kB (h = {numbers['h']}, fp32 rows);\ncombine sends the same back", fontsize=9)
    return ax


def plot_routing(E=8, k=2, ep=4, capacity_factor=1.25, skew=0.0, T=T_PER_RANK, seed=0, figure=None):
    """``plot_expert_load`` (left) beside ``plot_all_to_all`` (right) of ``routing_numbers``
    with these settings, in ``figure`` (a new one if None). Returns the figure."""
    import matplotlib.pyplot as plt

    numbers = drawable(E, k, ep, capacity_factor, skew, T, seed)
    if figure is None:
        figure = plt.figure(figsize=FIGSIZE, layout="constrained")
    load, traffic = figure.subplots(1, 2, width_ratios=[6, 4.5])
    plot_expert_load(numbers, load)
    plot_all_to_all(numbers, traffic)
    return figure


def router_readout(numbers):
    """One sentence of ``routing_numbers``: the pairs dropped (and tokens that lost every
    choice), the busiest expert's load (pairs that chose it, over its ep x capacity), and the
    bytes each rank sends in dispatch."""
    E, ep, capacity = numbers["E"], numbers["ep"], numbers["capacity"]
    load = [sum(chose[e] for chose in numbers["chose"]) for e in range(E)]
    busiest = max(range(E), key=load.__getitem__)
    sent = ", ".join(f"{b / KB:.1f}" for b in numbers["sent"])
    return (f"dropped {numbers['dropped']} of {numbers['pairs']} (token, choice) pairs "
            f"({numbers['dropped'] / numbers['pairs']:.1%}); {numbers['tokens_lost']} tokens lost every choice. "
            f"Busiest expert {busiest}: {load[busiest]} pairs chose it, capacity {ep} x {capacity} = {ep * capacity}: "
            f"load / capacity = {load[busiest] / (ep * capacity):.2f}. Each rank sends {sent} kB in dispatch "
            f"(and as much in combine).")


def router_widget(E=8, k=2, ep=4, capacity_factor=1.25, skew=0.0, T=T_PER_RANK, seed=0):
    """``plot_routing`` with controls: k (1 to min(E, 4)), the capacity factor (0.25 to 4),
    the skew (0 to 4) and ep (the divisors of E up to 8); the sentence ``router_readout``.
    E, T and the seed are fixed. Displays a static picture of the first state (kept by a
    saved notebook) and returns an ipywidgets VBox; without ipywidgets, warns and returns the
    static figure."""
    drawable(E, k, ep, capacity_factor, skew, T, seed)  # bad input: here, before any control
    in_range("k (experts per token)", k, 1, min(E, 4), f"the k slider goes from 1 to {min(E, 4)}.", whole=True)
    in_range("capacity_factor", capacity_factor, 0.25, 4, "the capacity factor slider goes from 0.25 to 4.")
    in_range("skew", skew, 0, SKEW_MAX, f"the skew slider goes from 0 to {SKEW_MAX:g}.")
    widgets = import_ipywidgets()
    if widgets is None:
        return plot_routing(E, k, ep, capacity_factor, skew, T, seed)

    choices = widgets.IntSlider(k, min=1, max=min(E, 4), description="k (experts per token)", style=FIT)
    slack = widgets.FloatSlider(capacity_factor, min=0.25, max=4, step=0.05, description="capacity factor", style=FIT)
    bias = widgets.FloatSlider(skew, min=0, max=SKEW_MAX, step=0.25, description="skew", style=FIT)
    ranks = toggle_buttons([d for d in range(1, min(E, MAX_RANKS) + 1) if E % d == 0], "ep", value=ep)
    image, readout, feedback = widgets.Image(format="png"), widgets.HTML(), Feedback()

    def redraw(_=None):
        settings = E, choices.value, ranks.value, slack.value, bias.value, T, seed

        def draw(ax):
            figure = ax.figure
            ax.remove()
            plot_routing(*settings, figure=figure)

        image.value = png(draw, FIGSIZE)
        readout.value = html.escape(router_readout(drawable(*settings)))

    for control in (choices, slack, bias, ranks):
        control.observe(feedback.guard(redraw, "Redrawing the routing"), names="value")
    redraw()
    show_static(image.value, f"top-{k} routing to E = {E} experts on ep = {ep} ranks, capacity factor "
                             f"{capacity_factor:g}, skew {skew:g}")
    return widgets.VBox([widgets.HBox([choices, slack]), widgets.HBox([bias, ranks]), feedback.box, readout, image])


def drawable(E, k, ep, capacity_factor, skew, T, seed):
    """``routing_numbers`` of these settings, if the figure can draw them (ep <= 8, E <= 32)."""
    in_range("ep (the expert-parallel degree)", ep, 1, MAX_RANKS, "the heatmap draws 1 to 8 ranks.", whole=True)
    in_range("E (experts)", E, 1, MAX_EXPERTS, "the bars draw 1 to 32 experts.", whole=True)
    return routing_numbers(E, k, ep, capacity_factor, skew, T, seed=seed)
