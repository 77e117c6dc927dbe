"""Widgets for lecture 02 (data parallelism): where a real model's buckets fall and how much of
their communication the backward pass hides.

    plot_buckets(model, bucket_cap_mb, N_d, alpha, beta, ...)   parameters, buckets and overlap, one figure
    bucket_widget(model, N_d, alpha, beta, backward_seconds)     a bucket-cap slider over plot_buckets
    plot_bucket_sweep(rows, model_s, ax=None)                     measured step time per bucket cap, and the model's

The figures draw ``parlab.ddp.bucket_overlap``: the buckets of ``parlab.ddp.assign_buckets``,
the plan the DDP wrapper uses, and each bucket's ring all-reduce over N_d ranks.
"""

from parlab._checks import real_number
from parlab.ddp import bucket_overlap
from parlab.units import MIB
from parlab.widgets._common import Feedback, import_ipywidgets, log_slider, png, show_static

# A cluster network, as in lecture 01: alpha = 10 µs per message, 1/beta = 25 GB/s, 8 ranks.
N_D, ALPHA, BETA = 8, 10e-6, 1 / 25e9
FIGSIZE = (10, 3.6)


def plot_buckets(model, bucket_cap_mb, N_d=N_D, alpha=ALPHA, beta=BETA, backward_seconds=0.01, parameter_ready=None,
                 ax=None):
    """The predicted backward pass of ``model`` with buckets of ``bucket_cap_mb`` MiB, on a
    time axis in ms (``bucket_overlap``). Top row, "backward": one bar per trainable
    parameter in the order backward produces its gradient (reverse registration order), its
    width the time its gradient takes (proportional to its bytes unless ``parameter_ready``
    is given), coloured by bucket. Bottom row, "all-reduce": each bucket's all-reduce in the
    bucket's colour, a ring over N_d ranks (2 (N_d - 1) alpha + 2 (N_d - 1)/N_d D_i beta long
    for D_i bytes), one at a time. The exposed communication, after the end of backward, is
    shaded. Returns the axes.
    """
    import matplotlib.pyplot as plt

    plan = bucket_overlap(model, bucket_cap_mb, N_d, alpha, beta, backward_seconds, parameter_ready)
    if ax is None:
        _, ax = plt.subplots(figsize=FIGSIZE, layout="constrained")
    colour_of = {}
    for number, bucket in enumerate(plan["buckets"]):
        for position in bucket:
            colour_of[position] = f"C{number % 10}"
    previous = 0.0
    for position, (name, ready) in enumerate(zip(plan["names"], plan["ready"])):
        width = max(ready - previous, 0.0)
        ax.broken_barh([(previous * 1e3, width * 1e3)], (0.55, 0.4), facecolors=colour_of[position],
                       edgecolor="white", linewidth=0.8)
        if width > 0.08 * plan["step_end"]:
            ax.text((previous + width / 2) * 1e3, 0.75, name, ha="center", va="center", fontsize=7, color="white")
        previous = max(previous, ready)
    for number, ((start, end), nbytes) in enumerate(zip(plan["intervals"], plan["bucket_bytes"])):
        ax.broken_barh([(start * 1e3, (end - start) * 1e3)], (1.05, 0.4), facecolors=f"C{number % 10}",
                       edgecolor="white", linewidth=0.8)
        if end - start > 0.08 * plan["step_end"]:
            ax.text((start + end) / 2 * 1e3, 1.25, _size(nbytes), ha="center", va="center", fontsize=7, color="white")
    if plan["exposed"] > 0:
        ax.axvspan(plan["backward"] * 1e3, plan["step_end"] * 1e3, color="tab:red", alpha=0.15, lw=0)
    ax.axvline(plan["backward"] * 1e3, color="black", lw=1, ls="--")
    ax.set_yticks([0.75, 1.25], ["backward", "all-reduce"])
    ax.set_ylim(1.55, 0.45)
    ax.set_xlim(0, plan["step_end"] * 1e3 * 1.02)
    ax.set_xlabel("time since the start of backward (ms)")
    ax.set_title(f"bucket_cap_mb = {bucket_cap_mb:.3g}: {_buckets(len(plan['buckets']))}, predicted end "
                 f"{plan['step_end'] * 1e3:.3g} ms, exposed communication {plan['exposed'] * 1e3:.3g} ms", fontsize=10)
    return ax


def bucket_widget(model, N_d=N_D, alpha=ALPHA, beta=BETA, backward_seconds=0.01, parameter_ready=None,
                  bucket_cap_mb=1.0):
    """``plot_buckets`` with a bucket-cap slider (MiB, log scale, 1 byte to 128 MiB, widened to
    reach ``bucket_cap_mb``); the readout gives the number of buckets, the predicted end of
    the step and the exposed communication. Displays a static picture of the first state
    (kept by a saved notebook) and returns an ipywidgets VBox; without ipywidgets, warns and
    returns the static figure."""
    real_number("bucket_cap_mb (the size of a bucket in MiB)", bucket_cap_mb,
                "the bucket slider has a log scale: give a cap above 0, e.g. 25.", above=True)
    bucket_overlap(model, bucket_cap_mb, N_d, alpha, beta, backward_seconds, parameter_ready)  # bad input: here
    widgets = import_ipywidgets()
    if widgets is None:
        return plot_buckets(model, bucket_cap_mb, N_d, alpha, beta, backward_seconds, parameter_ready).figure
    cap = log_slider(bucket_cap_mb, -20, 7, "bucket_cap_mb (MiB)", base=2, step=0.5, readout_format=".3g")
    image, readout, feedback = widgets.Image(format="png"), widgets.HTML(), Feedback()

    def redraw(_=None):
        image.value = png(lambda ax: plot_buckets(model, cap.value, N_d, alpha, beta, backward_seconds,
                                                  parameter_ready, ax), FIGSIZE)
        plan = bucket_overlap(model, cap.value, N_d, alpha, beta, backward_seconds, parameter_ready)
        readout.value = (f"{_buckets(len(plan['buckets']), bold=True)}; backward {plan['backward'] * 1e3:.3g} ms, "
                         f"step end {plan['step_end'] * 1e3:.3g} ms, exposed communication "
                         f"<b>{plan['exposed'] * 1e3:.3g} ms</b>")

    cap.observe(feedback.guard(redraw, "Redrawing the buckets"), names="value")
    redraw()
    show_static(image.value, f"the buckets of {bucket_cap_mb:.3g} MiB")
    return widgets.VBox([cap, readout, feedback.box, image])


def plot_bucket_sweep(rows, model_s, ax=None, label="measured"):
    """Step time (ms) against bucket cap (MiB, log scale): ``rows`` of
    ``parlab.bench.ddp_steps.measure_ddp_steps`` (one per cap) as measured points, each
    annotated with its number of buckets, and ``model_s`` (the model's seconds for the same
    rows, e.g. ``predicted_steps``) as a dashed line. Returns the axes."""
    import matplotlib.pyplot as plt

    if len(model_s) != len(rows) or not rows or any(row["bucket_cap_mb"] is None for row in rows):
        raise ValueError("plot_bucket_sweep needs one model time per row and a bucket_cap_mb in every row: pass the "
                         "rows of a sweep over ('bucketed', cap) and the model's times for the same rows.")
    if ax is None:
        _, ax = plt.subplots(figsize=(8, 3.6), layout="constrained")
    caps = [row["bucket_cap_mb"] for row in rows]
    ax.plot(caps, [row["median_s"] * 1e3 for row in rows], "o-", label=label)
    ax.plot(caps, [t * 1e3 for t in model_s], "k--", label="model: parlab.ddp.predict_step")
    for row in rows:
        ax.annotate(str(row["buckets"]), (row["bucket_cap_mb"], row["median_s"] * 1e3), textcoords="offset points",
                    xytext=(0, 6), ha="center", fontsize=7)
    ax.set_xscale("log", base=2)
    ax.set_ylim(bottom=0)
    ax.set_xlabel("bucket_cap_mb (MiB)")
    ax.set_ylabel("step time (ms)")
    ax.set_title("step time against bucket size (numbers: buckets per step)", fontsize=10)
    ax.legend(fontsize=8, loc="lower left")
    return ax


def _buckets(count, bold=False):
    number = f"<b>{count}</b>" if bold else str(count)
    return f"{number} bucket" + ("s" if count != 1 else "")


def _size(nbytes):
    return f"{nbytes / MIB:.3g} MiB" if nbytes >= MIB / 10 else f"{nbytes / 1024:.3g} KiB"
