"""One ZeRO training step, shard by shard: which rank holds which shard of the parameters, the
gradients and the optimizer state after each phase of the step, at stages 0 to 3, as the
engines of ``parlab.zero`` do it (``ZeroDP`` for stages 0 to 2, ``FSDP`` FULL_SHARD for 3).

    STEP_PHASES[stage]                       the phases of one step at that stage, in order
    zero_step_holdings(stage, phase, n_d)    what each rank holds after that phase (data)
    plot_zero_step(stage, phase, n_d)        the same as a figure: one cell per rank x state x shard
    plot_zero_steps(stage, n_d)              every phase of one step, one panel each
    zero_step_widget(n_d=4)                  a stage dropdown and a phase slider over plot_zero_step

Each model state is one flat buffer cut into N_d shards (``parlab.flat.FlatLayout``);
rank r owns shard r, the chunk the ring reduce-scatter leaves fully reduced on it (as
``torch.distributed.reduce_scatter`` does). A holding is one label per shard, None where the
rank does not hold that shard:

    w, w'          the parameters before and after the optimizer step
    g_r            the rank's own gradient (of its shard of the batch), not yet averaged
    g_avg          the gradient averaged over the N_d ranks
    partial        what the ring reduce-scatter leaves in the shards a rank does not own
    opt, opt'      the optimizer state before and after the step

The phases, each drawn as the holdings right after it:

    stage 0   backward; reduce-scatter of the gradients; all-gather of the gradients (the two
              halves of the all-reduce); the optimizer step on every shard, on every rank
    stage 1   backward; reduce-scatter of the gradients; the optimizer step on the own shard;
              all-gather of the parameters. The full gradient buffer stays, partial sums
              outside the own shard, and ``zero_grad`` zeroes it in place for the next step
    stage 2   backward, each bucket of gradients reduce-scattered as soon as backward has
              produced it (``parlab.zero.buckets``), its own part added into the rank's
              gradient shard and the bucket freed: no full gradient is ever held, and after
              backward a rank holds its averaged gradient shard only; then the optimizer step
              on the own shard and the all-gather of the parameters, as stage 1
    stage 3   one FSDP unit (the model's other units go through the same phases in turn, one
              unsharded at a time): unshard (all-gather) before forward; forward done, reshard
              (full parameters freed); unshard again before backward and the unit's backward
              (its full gradient exists only here); reduce-scatter of the gradient, reshard
              (full buffers freed); the optimizer step on the own shard. The next forward
              unshards w'

Stages 0 to 2 send the same bytes: ZeRO moves the optimizer step of stage 0 from after the
all-reduce to between its two halves, where each rank has the averaged gradient of one shard.
"""

from parlab._checks import whole_number
from parlab.memory import check_stage
from parlab.widgets._common import FIT, Feedback, import_ipywidgets, in_range, png, show_static
from parlab.widgets.memory import PART_LABELS, PARTS, STAGE_LABELS

STEP_PHASES = {
    0: ("backward", "reduce-scatter of the gradients", "all-gather of the gradients (the all-reduce is done)",
        "optimizer step on every shard"),
    1: ("backward", "reduce-scatter of the gradients (the full buffer is kept)", "optimizer step on the own shard",
        "all-gather of the parameters"),
    2: ("backward, each bucket reduce-scattered as backward produces it", "optimizer step on the own shard",
        "all-gather of the parameters"),
    3: ("unshard: all-gather before forward", "forward done: reshard (the full parameters freed)",
        "unshard again before backward, then the unit's backward",
        "reduce-scatter of the gradient, reshard (full buffers freed)", "optimizer step on the own shard"),
}
OPTIMIZER_PHASE = {0: 3, 1: 2, 2: 1, 3: 4}  # the index of the optimizer step in STEP_PHASES
COLOURS = {  # light before, dark after; each state in the colour memory_bars gives it
    "w": "#aec7e8", "w'": "#1f77b4",
    "g_r": "#ffbb78", "g_avg": "#ff7f0e", "partial": "#e6e6e6",
    "opt": "#98df8a", "opt'": "#2ca02c",
}
LABELS = {"w": "$w$", "w'": "$w'$", "g_r": "$g_r$", "g_avg": r"$\bar g$", "partial": "partial",
          "opt": r"$\mathrm{opt}$", "opt'": r"$\mathrm{opt}'$"}
DARK = {"w'", "g_avg", "opt'"}  # written in white
MAX_RANKS = 8  # up to 8 rows of 3 x 8 cells stay readable


def zero_step_holdings(stage, phase, n_d=4):
    """What each of the N_d ranks holds right after phase ``phase`` (an index into
    ``STEP_PHASES[stage]``) of one training step at ZeRO stage ``stage``: a list, rank r at
    index r, of {"params": labels, "grads": labels, "optimizer": labels}, each a tuple of N_d
    labels, one per shard (module docstring), None where the rank does not hold the shard."""
    check_stage(stage)
    if not 0 <= phase < len(STEP_PHASES[stage]):
        raise ValueError(f"stage {stage} has phases 0 to {len(STEP_PHASES[stage]) - 1} (STEP_PHASES[{stage}]), "
                         f"got phase={phase!r}.")
    whole_number("n_d (N_d, the data-parallel degree)", n_d, "give the number of data-parallel ranks, e.g. 4.")
    return [_rank_holdings(stage, phase, rank, n_d) for rank in range(n_d)]


def _rank_holdings(stage, phase, own, n_d):
    def everywhere(label):
        return (label,) * n_d

    def own_shard(label, elsewhere=None):
        return tuple(label if shard == own else elsewhere for shard in range(n_d))

    stepped = phase >= OPTIMIZER_PHASE[stage]
    state = "opt'" if stepped else "opt"
    if stage == 3:
        params = everywhere("w") if phase in (0, 2) else own_shard("w'" if stepped else "w")
        grads = everywhere(None) if phase < 2 else everywhere("g_r") if phase == 2 else own_shard("g_avg")
        return {"params": params, "grads": grads, "optimizer": own_shard(state)}
    if stage == 0:
        params = everywhere("w'" if stepped else "w")
        if phase < 2:
            grads = everywhere("g_r") if phase == 0 else own_shard("g_avg", "partial")
        else:
            grads = everywhere("g_avg")  # the all-gather completed the all-reduce
        return {"params": params, "grads": grads, "optimizer": everywhere(state)}
    if stage == 2:
        phase += 1  # its backward ends where stage 1's reduce-scatter does, with the own shard only
    params = everywhere("w") if phase < 2 else own_shard("w'", "w") if phase == 2 else everywhere("w'")
    grads = everywhere("g_r") if phase == 0 else own_shard("g_avg", "partial" if stage == 1 else None)
    return {"params": params, "grads": grads, "optimizer": own_shard(state)}


def plot_zero_step(stage, phase, n_d=4, ax=None):
    """``zero_step_holdings(stage, phase, n_d)`` as a figure: one row per rank (labelled with
    the shard it owns), three blocks of N_d cells (parameters, gradients, optimizer state),
    one cell per shard, coloured and labelled by what the rank holds there (``COLOURS``,
    ``LABELS``), white and empty where it holds nothing; the owned shard outlined in black.
    Each cell carries the gid ``"{rank}-{part}-{shard}"``. Returns the axes."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    holdings = zero_step_holdings(stage, phase, n_d)
    _check_drawable(n_d)
    if ax is None:
        _, ax = plt.subplots(figsize=_figsize(n_d), layout="constrained")
    for rank, held in enumerate(holdings):
        for block, part in enumerate(PARTS):
            for shard, label in enumerate(held[part]):
                x, owned = block * (n_d + 1) + shard, shard == rank  # rank r owns shard r
                ax.add_patch(Rectangle((x, rank), 0.92, 0.86, facecolor=COLOURS.get(label, "white"),
                                       edgecolor="black" if owned else "#bbbbbb",
                                       linewidth=1.2 if owned else 0.8, gid=f"{rank}-{part}-{shard}"))
                if label is not None:
                    ax.text(x + 0.46, rank + 0.43, LABELS[label], ha="center", va="center", fontsize=8,
                            color="white" if label in DARK else "black")
    for x in range(3 * (n_d + 1)):
        if x % (n_d + 1) < n_d:
            ax.text(x + 0.46, -0.05, f"shard {x % (n_d + 1)}", ha="center", va="bottom", fontsize=6, color="gray")
    ax.set_xlim(-0.1, 3 * (n_d + 1) - 1)
    ax.set_ylim(n_d, -0.4)
    ax.set_xticks([block * (n_d + 1) + n_d / 2 - 0.04 for block in range(3)], [PART_LABELS[p] for p in PARTS])
    ax.set_yticks([rank + 0.43 for rank in range(n_d)],
                  [f"rank {rank} (owns {rank})" for rank in range(n_d)], fontsize=8)
    ax.tick_params(length=0)
    ax.set_frame_on(False)
    phases = STEP_PHASES[stage]
    ax.set_title(f"ZeRO stage {stage}, phase {phase + 1}/{len(phases)}: {phases[phase]}", fontsize=9)
    return ax


def plot_zero_steps(stage, n_d=4):
    """Every phase of one step at ``stage``: ``plot_zero_step`` for each of
    ``STEP_PHASES[stage]``, two panels a row. Returns the figure."""
    import matplotlib.pyplot as plt

    check_stage(stage)
    _check_drawable(n_d)
    count = len(STEP_PHASES[stage])
    width, height = _figsize(n_d)
    figure, axes = plt.subplots((count + 1) // 2, 2, figsize=(2 * width, (count + 1) // 2 * height),
                                layout="constrained", squeeze=False)
    for phase, ax in enumerate(axes.flat):
        if phase < count:
            plot_zero_step(stage, phase, n_d, ax)
        else:
            ax.set_axis_off()
    return figure


def zero_step_widget(n_d=4, stage=2):
    """Step through one training step: a dropdown for the ZeRO stage (0 to 3) and a slider for
    the phase (1 to the stage's number of phases) redraw ``plot_zero_step``. Displays a static
    picture of the first phase (kept by a saved notebook) and returns an ipywidgets VBox;
    without ipywidgets, warns and returns ``plot_zero_steps(stage, n_d)``."""
    check_stage(stage)
    _check_drawable(n_d)
    widgets = import_ipywidgets()
    if widgets is None:
        return plot_zero_steps(stage, n_d)

    stages = widgets.Dropdown(options=[(STAGE_LABELS[s], s) for s in STEP_PHASES], value=stage,
                              description="ZeRO stage", style=FIT)
    phase = widgets.IntSlider(1, min=1, max=len(STEP_PHASES[stage]), description="phase", style=FIT)
    image, feedback = widgets.Image(format="png"), Feedback()

    def redraw(_=None):
        image.value = png(lambda ax: plot_zero_step(stages.value, phase.value - 1, n_d, ax), _figsize(n_d))

    def change_stage(_):
        phase.max = len(STEP_PHASES[stages.value])  # may clamp phase.value, which redraws too
        redraw()

    stages.observe(feedback.guard(change_stage, "Redrawing the step"), names="value")
    phase.observe(feedback.guard(redraw, "Redrawing the step"), names="value")
    redraw()
    show_static(image.value, f"ZeRO stage {stage}, phase 1, on {n_d} ranks")
    return widgets.VBox([widgets.HBox([stages, phase]), feedback.box, image])


def _check_drawable(n_d):
    in_range("n_d (N_d, the data-parallel degree)", n_d, 1, MAX_RANKS, "the step-through draws 1 to 8 ranks.",
             whole=True)


def _figsize(n_d):
    return 1.6 + 0.45 * (3 * n_d + 2), 1.0 + 0.45 * n_d
