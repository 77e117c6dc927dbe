"""The planner's widget (lecture 08): the fastest plans for a model on a cluster, as a chart of
memory per GPU against step time and as a table; and plans run on emulated ranks beside their
prediction.

    plot_plans(every, hardware, n)       the n fastest accepted plans, the GPU's memory as a line
    plan_widget(model, nodes, ...)       model, batch, nodes, GPU memory and link speeds as controls,
                                         and "run this plan" for the small GPT on emulated ranks
    plot_predicted_vs_measured(rows)     measured against predicted step time, a band of +-15%
    format_measured(rows)                the same rows as text, model-state bytes too

The numbers are ``parlab.plan``'s; this module only draws them. The cluster is built from the
controls with ``Hardware.dgx_a100``'s peak FLOP/s and latencies; memory and bandwidths move.
"""

import html

from parlab.plan import Batch, Hardware, Model, format_table, measure, plan_label, plan_table, plans
from parlab.runtime import Link
from parlab.units import GIB
from parlab.widgets._common import FIT, Feedback, button, import_ipywidgets, in_range, log_slider, png, show_static

MODELS = {"small GPT": Model.small_gpt, "7B": Model.llama2_7b, "70B": Model.llama2_70b}
NODES = (1, 2, 4, 8, 16, 32, 64)
FIGSIZE = (7, 4)
A100 = Hardware.dgx_a100()
RUNS = "small GPT"  # the model "run this plan" runs (lecture 07's GPT, measure.CONFIG's size)
TOLERANCE = 0.15  # the planner's acceptance criterion: a measured step within 15% of the prediction


def plot_plans(every, hardware, n=10, ax=None):
    """The ``n`` fastest accepted plans of ``every`` (``parlab.plan.plans``' list) as points:
    step time (s) across, memory per GPU up, each labelled N_d x t x K, its ZeRO stage and its
    shard group, recompute and offload where it has them, the fastest as a star; a line at the
    GPU's memory. Plans that all need under a twentieth of it (a small model) are drawn in MiB
    without the line, which would flatten them against the axis; the legend still gives the
    GPU's memory. With no accepted plan, says how many were rejected and the first reason.
    Returns the axes."""
    import matplotlib.pyplot as plt

    ax = ax or plt.figure(figsize=FIGSIZE).subplots()
    accepted = [p for p in every if not p.rejected][:n]
    small = bool(accepted) and max(p.memory.total for p in accepted) < hardware.memory / 20
    unit, scale = ("MiB", 2**20) if small else ("GiB", GIB)
    limit = f"GPU memory, {hardware.memory / GIB:g} GiB"
    if small:
        ax.plot([], [], color="grey", linestyle="--", label=f"{limit}: far above these plans")
    else:
        ax.axhline(hardware.memory / GIB, color="grey", linestyle="--", label=limit)
    for rank, plan in enumerate(accepted):
        point = (plan.time.total, plan.memory.total / scale)
        ax.plot(*point, "*" if rank == 0 else "o", color="C1" if rank == 0 else "C0", markersize=14 if rank == 0 else 6,
                gid=f"plan-{rank}")
        ax.annotate(plan_label(plan), point, fontsize=7, xytext=(4, 4), textcoords="offset points")
    if not accepted:
        first = next((p for p in every if p.memory is not None), every[0])
        ax.text(0.5, 0.5, f"no plan accepted ({len(every)} rejected);\ne.g. {' '.join(first.reasons)}",
                transform=ax.transAxes, ha="center", va="center", fontsize=9)
    ax.margins(x=0.12)  # room for the labels of the slowest points
    ax.set(xlabel="step time (s)", ylabel=f"memory per GPU ({unit})", ylim=(0, None),
           title=f"{len(accepted)} fastest plans on {hardware.name}\n(N_d x t x K, ZeRO stage; S=: HYBRID_SHARD, "
                 "rc: full recompute, sel: selective, off: offload)")
    ax.legend(loc="lower right", fontsize=8)
    return ax


def hardware_of(gpus_per_node, nodes, memory_gib, intra_gbs, inter_gbs):
    """A ``Hardware`` of A100-like GPUs (``Hardware.dgx_a100``'s peak and latencies) with these
    sizes, memory (GiB) and bandwidths (GB/s)."""
    return Hardware(gpus_per_node, nodes, memory_gib * GIB, A100.peak_flops,
                    intra=Link(A100.intra.latency, intra_gbs * 1e9), inter=Link(A100.inter.latency, inter_gbs * 1e9),
                    name=f"{nodes} x {gpus_per_node} GPUs of {memory_gib:g} GiB")


def plan_widget(model="70B", B=1536, nodes=64, memory_gib=80, n=8):
    """``plot_plans`` and ``format_table`` of the ``n`` fastest plans with controls: the model
    (small GPT, 7B, 70B), the global batch B, nodes of 1 to 8 GPUs, each GPU's memory, and
    the intra- and inter-node bandwidths. Under them, for the small GPT only, a plan of
    ``parlab.plan.measure``'s (the GPT of lecture 07 on 4 or 8 ranks with an emulated link and
    declared compute) and "run this plan": ``run_plan`` trains it for two steps and the
    widget shows ``format_measured`` of the run, measured beside predicted. Displays a static
    picture of the first state (kept by a saved notebook) and returns an ipywidgets VBox;
    without ipywidgets, warns and returns the static figure."""
    if model not in MODELS:
        raise ValueError(f"model must be one of {', '.join(MODELS)}, got {model!r}: pick one of them.")
    in_range("B (the global batch)", B, 1, 1 << 20, "give B from 1 to 1,048,576 samples.", whole=True)
    if nodes not in NODES:
        raise ValueError(f"nodes must be one of {NODES}, got {nodes!r}: pick one of them.")
    in_range("memory_gib", memory_gib, 1, 1024, "give each GPU's memory from 1 to 1024 GiB.")
    widgets = import_ipywidgets()
    first = hardware_of(8, nodes, memory_gib, A100.intra.bandwidth / 1e9, A100.inter.bandwidth / 1e9)
    if widgets is None:
        return plot_plans(plans(MODELS[model](), Batch(B), first), first, n).figure

    chosen = widgets.Dropdown(options=list(MODELS), value=model, description="model", style=FIT)
    batch = widgets.BoundedIntText(B, min=1, max=1 << 20, description="global batch B", style=FIT)
    machines = widgets.Dropdown(options=NODES, value=nodes, description="nodes", style=FIT)
    per_node = widgets.Dropdown(options=(1, 2, 4, 8), value=8, description="GPUs per node", style=FIT)
    memory = widgets.IntSlider(memory_gib, min=8, max=192, description="GiB per GPU", continuous_update=False,
                               style=FIT)
    intra = log_slider(A100.intra.bandwidth / 1e9, 0, 3, "intra-node GB/s", continuous_update=False)
    inter = log_slider(A100.inter.bandwidth / 1e9, -1, 3, "inter-node GB/s", continuous_update=False)
    image, table, feedback = widgets.Image(format="png"), widgets.HTML(), Feedback()
    runnable = sorted(measure.predicted_plans(), key=lambda p: p.time.total)  # fastest predicted first
    to_run = widgets.Dropdown(options=[(plan_label(p, long=True), i) for i, p in enumerate(runnable)],
                              description="plan on emulated ranks", style=FIT)
    measured = widgets.HTML()

    def redraw(_=None):
        hardware = hardware_of(per_node.value, machines.value, memory.value, intra.value, inter.value)
        every = plans(MODELS[chosen.value](), Batch(batch.value), hardware)
        image.value = png(lambda ax: plot_plans(every, hardware, n, ax), FIGSIZE)
        table.value = f"<pre>{format_table(plan_table(every, n, rejected=3 if every[0].rejected else 0))}</pre>"
        # The cluster in words: a control that changes no plan (the network of one node) still shows it moved.
        feedback.say(f"{sum(not p.rejected for p in every)} of {len(every)} plans accepted on {hardware.name}, "
                     f"{intra.value:.3g} GB/s inside a node, {inter.value:.3g} GB/s between nodes.")

    def offer(_=None):
        to_run.disabled = run.disabled = chosen.value != RUNS
        if run.disabled:
            measured.value = html.escape(f"Only the {RUNS} runs here (on 4 or 8 emulated ranks of this machine): the "
                                         f"{chosen.value} would need a real cluster. Pick the {RUNS} to run a plan.")
            return
        plan = runnable[to_run.value]
        measured.value = html.escape(f"{plan_label(plan, long=True)}: the planner predicts {plan.time.total:.3g} s per "
                                     f"step; \"run this plan\" starts {plan.ranks} ranks and measures it.")

    def run_selected(_=None):
        if chosen.value != RUNS:
            raise ValueError(f"only the {RUNS} runs on this machine, not the {chosen.value}: pick the {RUNS}.")
        plan = runnable[to_run.value]
        feedback.say(f"running {plan_label(plan, long=True)} on {plan.ranks} emulated ranks...")
        result = measure.run_plan(plan, steps=1)  # one warm-up step and one measured: the emulated time barely varies
        measured.value = f"<pre>{html.escape(format_measured([result]))}</pre>"
        feedback.say(f"ran {plan_label(plan, long=True)}: its step took {result.time_ratio:.2f} x the prediction.")

    run = button("run this plan", feedback.guard(run_selected, "Running the plan"))
    for control in (chosen, batch, machines, per_node, memory, intra, inter):
        control.observe(feedback.guard(redraw, "Planning"), names="value")
    for control in (chosen, to_run):
        control.observe(feedback.guard(offer, "Choosing a plan to run"), names="value")
    redraw()
    offer()
    show_static(image.value, f"the fastest plans for the {model} on {nodes} nodes")
    rows = [widgets.HBox([chosen, batch]), widgets.HBox([machines, per_node, memory]), widgets.HBox([intra, inter])]
    return widgets.VBox([*rows, feedback.box, image, table, widgets.HBox([to_run, run]), measured])


def plot_predicted_vs_measured(rows, ax=None, tolerance=TOLERANCE):
    """Each run of ``rows`` (``parlab.plan.Measured``, e.g. ``check_plans()``) as a point:
    predicted step time across, measured up, numbered as ``format_measured`` numbers its
    lines; the diagonal (measured = predicted) and the band within ``tolerance`` of it;
    points outside the band in red. Returns the axes."""
    import matplotlib.pyplot as plt

    if not rows:
        raise ValueError("rows is empty: pass the Measured runs of check_plans() or run_plan(...).")
    ax = ax or plt.figure(figsize=FIGSIZE).subplots()
    times = [t for r in rows for t in (r.predicted_time.total, r.step_seconds)]
    ends = [min(times) * 0.8, max(times) * 1.2]
    ax.plot(ends, ends, color="grey", linewidth=1, label="measured = predicted")
    ax.fill_between(ends, [e * (1 - tolerance) for e in ends], [e * (1 + tolerance) for e in ends], color="grey",
                    alpha=0.2, label=f"within {tolerance:.0%}")
    for i, row in enumerate(rows, 1):
        inside = abs(row.time_ratio - 1) <= tolerance
        ax.plot(row.predicted_time.total, row.step_seconds, "o", color="C0" if inside else "C3", gid=f"measured-{i}")
        ax.annotate(str(i), (row.predicted_time.total, row.step_seconds), fontsize=8, xytext=(4, 4),
                    textcoords="offset points")
    ax.set(xlim=ends, ylim=ends, xlabel="predicted step time (s)", ylabel="measured step time (s)",
           title=f"step time of {len(rows)} plans (numbered as in the table)")
    ax.legend(loc="upper left", fontsize=8)
    return ax


def format_measured(rows):
    """``rows`` (``parlab.plan.Measured``) as text: one numbered line per plan with its
    predicted and measured step time and model-state bytes, and measured / predicted for each."""
    lines = [f"{'#':>2} {'plan':24} {'predicted s':>11} {'measured s':>10} {'ratio':>5}  {'predicted states':>16} "
             f"{'measured states':>15} {'ratio':>5}"]
    for i, r in enumerate(rows, 1):
        lines.append(f"{i:2} {plan_label(r.plan, long=True):24} {r.predicted_time.total:11.3f} {r.step_seconds:10.3f} "
                     f"{r.time_ratio:5.2f}  {r.predicted_memory.states.total:16,.0f} {r.state_bytes:15,} "
                     f"{r.state_ratio:5.2f}")
    return "\n".join(lines)
