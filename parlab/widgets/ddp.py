"""Widgets for lecture 02 (data parallelism): where a real model's buckets fall, how much of
their communication the backward pass hides, and the bucket-size sweep on real ranks.

    predict_overlap(bucket_bytes, ready_times, alpha, beta)   the analytic overlap model
    bucket_overlap(model, bucket_cap_mb, alpha, beta, ...)    the model for a module's real buckets
    plot_buckets(model, bucket_cap_mb, ax=None, ...)          parameters, buckets and overlap, one figure
    bucket_widget(model, alpha, beta, backward_seconds)       a bucket-cap slider over plot_buckets
    time_single_process_step(build_model, make_batch)         forward, backward per parameter, optimizer
    measure_bucket_sweep(cluster, build_model, make_batch, caps_mb)   DDP step time per bucket cap

The bucket plan is ``parlab.ddp.assign_buckets``, the one the DDP wrapper uses: the figures
show the buckets that training will all-reduce.
"""

import statistics
import time

import torch
import torch.distributed as dist

from parlab._checks import module, real_number, whole_number
from parlab.ddp import DDP, MB, assign_buckets
from parlab.widgets._common import Feedback, import_ipywidgets, log_slider, png, show_static

# A cluster network, as in lecture 01: alpha = 10 µs per message, 1/beta = 25 GB/s.
ALPHA, BETA = 10e-6, 1 / 25e9
FIGSIZE = (10, 3.6)


def predict_overlap(bucket_bytes, ready_times, alpha, beta):
    """The analytic model of one backward pass with bucketed, overlapped all-reduces.

    ``bucket_bytes``: B_b, the bytes of each bucket in launch order (b = 1..n);
    ``ready_times``: r_b, the seconds after the start of backward at which bucket b's last
    gradient is ready. The all-reduces share one link, so they run one at a time, in order:

        start_b = max(r_b, end_{b-1})          (end_0 = 0)
        end_b   = start_b + alpha + B_b beta
        T_bwd   = max_b r_b                    (backward ends with its last gradient)
        T_step  = max(T_bwd, end_n)
        exposed = T_step - T_bwd               (communication that backward does not hide)

    One bucket (ready at T_bwd) hides nothing: exposed = alpha + B beta, all of it. Many
    small buckets, with a backward long enough, hide all but the last one:
    exposed = alpha + B_n beta. Returns ``(intervals, T_step, exposed)`` with ``intervals``
    the list of (start_b, end_b).
    """
    if len(bucket_bytes) != len(ready_times) or not bucket_bytes:
        raise ValueError(
            f"predict_overlap needs one ready time per bucket and at least one bucket; got "
            f"{len(bucket_bytes)} buckets and {len(ready_times)} ready times."
        )
    real_number("alpha (seconds per all-reduce)", alpha, "give the latency in seconds, e.g. alpha = 1e-5.")
    real_number("beta (seconds per byte)", beta, "give the inverse bandwidth, e.g. beta = 1e-9 for 1 GB/s.")
    for nbytes, ready in zip(bucket_bytes, ready_times):
        real_number("every bucket's bytes", nbytes, "give the size of each bucket in bytes.")
        real_number("every ready time", ready, "give the seconds after the start of backward, from 0.")
    intervals, end = [], 0.0
    for nbytes, ready in zip(bucket_bytes, ready_times):
        start = max(ready, end)
        end = start + alpha + nbytes * beta
        intervals.append((start, end))
    backward = max(ready_times)
    step_end = max(backward, end)
    return intervals, step_end, step_end - backward


def trainable_parameters(model):
    """``[(name, parameter)]`` of the parameters DDP averages, in registration order (a tied
    parameter once, frozen ones left out), as ``parlab.ddp.DDP`` selects them."""
    module("model", model, "pass the torch.nn.Module that DDP wraps.")
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    if not named:
        raise ValueError("the model has no trainable parameters: there is nothing to bucket.")
    return named


def bucket_overlap(model, bucket_cap_mb, alpha, beta, backward_seconds=None, parameter_ready=None):
    """``predict_overlap`` for the real buckets of ``model`` at ``bucket_cap_mb`` MiB.

    Gradient readiness: ``parameter_ready`` (seconds after the start of backward at which
    each trainable parameter's gradient is ready, in registration order, e.g. measured by
    ``time_single_process_step``) or, if not given, backward time proportional to size: the
    gradients arrive in reverse registration order and parameter i takes
    ``backward_seconds`` x (its bytes / all bytes). A bucket is ready with its last gradient.

    Returns a dict: ``names`` and ``nbytes`` of the parameters and ``ready`` (their ready
    times) in launch order (reverse registration order), ``buckets`` (lists of positions in
    that order), ``bucket_bytes``, ``intervals``, ``backward`` (T_bwd), ``step_end`` and
    ``exposed``.
    """
    named = trainable_parameters(model)
    parameters = [p for _, p in named]
    sizes = [p.numel() * p.element_size() for p in parameters]
    if parameter_ready is None:
        if backward_seconds is None:
            raise ValueError("give backward_seconds (time proportional to size) or parameter_ready (measured).")
        real_number("backward_seconds", backward_seconds, "give the seconds of one backward pass, e.g. 0.01.",
                    above=True)
        elapsed, parameter_ready = 0.0, [0.0] * len(sizes)
        for index in reversed(range(len(sizes))):
            elapsed += backward_seconds * sizes[index] / sum(sizes)
            parameter_ready[index] = elapsed
    if len(parameter_ready) != len(parameters):
        raise ValueError(f"parameter_ready needs one time per trainable parameter of the model ({len(parameters)}), "
                         f"got {len(parameter_ready)}.")
    last = len(parameters) - 1
    buckets = [[last - index for index in bucket] for bucket in assign_buckets(parameters, bucket_cap_mb)]
    order = list(reversed(range(len(parameters))))
    ready = [parameter_ready[index] for index in order]
    bucket_bytes = [sum(sizes[order[i]] for i in bucket) for bucket in buckets]
    bucket_ready = [max(ready[i] for i in bucket) for bucket in buckets]
    intervals, step_end, exposed = predict_overlap(bucket_bytes, bucket_ready, alpha, beta)
    return dict(names=[named[index][0] for index in order], nbytes=[sizes[index] for index in order], ready=ready,
                buckets=buckets, bucket_bytes=bucket_bytes, intervals=intervals, backward=max(ready),
                step_end=step_end, exposed=exposed)


def plot_buckets(model, bucket_cap_mb, alpha=ALPHA, beta=BETA, backward_seconds=0.01, parameter_ready=None, ax=None):
    """The predicted backward pass of ``model`` with buckets of ``bucket_cap_mb`` MiB, on a
    time axis in ms (``bucket_overlap``). Top row, "backward": one bar per trainable
    parameter in the order backward produces its gradient (reverse registration order), its
    width the time its gradient takes (proportional to its bytes unless ``parameter_ready``
    is given), coloured by bucket. Bottom row, "all-reduce": each bucket's all-reduce in the
    bucket's colour, alpha + B beta long, one at a time. The exposed communication, after
    the end of backward, is shaded. Returns the axes.
    """
    import matplotlib.pyplot as plt

    plan = bucket_overlap(model, bucket_cap_mb, alpha, beta, backward_seconds, parameter_ready)
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


def bucket_widget(model, alpha=ALPHA, beta=BETA, backward_seconds=0.01, parameter_ready=None, bucket_cap_mb=1.0):
    """``plot_buckets`` with a bucket-cap slider (MiB, log scale, 1 byte to 128 MiB, widened to
    reach ``bucket_cap_mb``); the readout gives the number of buckets, the predicted end of
    the step and the exposed communication. Displays a static picture of the first state
    (kept by a saved notebook) and returns an ipywidgets VBox; without ipywidgets, warns and
    returns the static figure."""
    real_number("bucket_cap_mb (the size of a bucket in MiB)", bucket_cap_mb,
                "the bucket slider has a log scale: give a cap above 0, e.g. 25.", above=True)
    bucket_overlap(model, bucket_cap_mb, alpha, beta, backward_seconds, parameter_ready)  # bad input: ValueError here
    widgets = import_ipywidgets()
    if widgets is None:
        return plot_buckets(model, bucket_cap_mb, alpha, beta, backward_seconds, parameter_ready).figure
    cap = log_slider(bucket_cap_mb, -20, 7, "bucket_cap_mb (MiB)", base=2, step=0.5, readout_format=".3g")
    image, readout, feedback = widgets.Image(format="png"), widgets.HTML(), Feedback()

    def redraw(_=None):
        image.value = png(lambda ax: plot_buckets(model, cap.value, alpha, beta, backward_seconds, parameter_ready,
                                                  ax), FIGSIZE)
        plan = bucket_overlap(model, cap.value, alpha, beta, backward_seconds, parameter_ready)
        readout.value = (f"{_buckets(len(plan['buckets']), bold=True)}; backward {plan['backward'] * 1e3:.3g} ms, "
                         f"step end {plan['step_end'] * 1e3:.3g} ms, exposed communication "
                         f"<b>{plan['exposed'] * 1e3:.3g} ms</b>")

    cap.observe(feedback.guard(redraw, "Redrawing the buckets"), names="value")
    redraw()
    show_static(image.value, f"the buckets of {bucket_cap_mb:.3g} MiB")
    return widgets.VBox([cap, readout, feedback.box, image])


def time_single_process_step(build_model, make_batch, loss_fn=torch.nn.functional.mse_loss, lr=0.01, repeats=5):
    """Time one SGD step of ``build_model()`` on ``make_batch(0)`` in this process, without
    any communication: the median over ``repeats`` (after one warm-up step) of the forward,
    backward and optimizer seconds, and of each trainable parameter's gradient-ready time
    (seconds after the start of backward, registration order, from post-accumulate-grad
    hooks). Returns a dict with ``forward``, ``backward``, ``optimizer``, ``parameter_ready``."""
    whole_number("repeats", repeats, "time at least one step, e.g. repeats=5.")
    model = build_model()
    inputs, targets = make_batch(0)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    parameters = [p for _, p in trainable_parameters(model)]
    ready = [0.0] * len(parameters)
    for index, p in enumerate(parameters):
        p.register_post_accumulate_grad_hook(lambda _, index=index: ready.__setitem__(index, time.perf_counter()))
    samples = []
    for _ in range(repeats + 1):
        optimizer.zero_grad()
        t0 = time.perf_counter()
        loss = loss_fn(model(inputs), targets)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        optimizer.step()
        t3 = time.perf_counter()
        samples.append((t1 - t0, t2 - t1, t3 - t2, [t - t1 for t in ready]))
    samples = samples[1:]
    median = statistics.median
    return dict(forward=median(s[0] for s in samples), backward=median(s[1] for s in samples),
                optimizer=median(s[2] for s in samples),
                parameter_ready=[median(s[3][i] for s in samples) for i in range(len(parameters))])


def measure_bucket_sweep(cluster, build_model, make_batch, caps_mb, steps=5, loss_fn=torch.nn.functional.mse_loss,
                         lr=0.01):
    """Measured DDP ("bucketed") step time for each bucket cap in ``caps_mb`` on ``cluster``.

    For each cap every rank wraps a fresh ``build_model()``, takes one warm-up step and then
    ``steps`` timed SGD steps on its batch ``make_batch(rank)`` (forward, backward,
    ``finish_gradient_synchronization``, optimizer). A step lasts as long as its slowest
    rank. Returns rows: dicts with ``bucket_cap_mb``, ``buckets`` (their number) and
    ``step_seconds`` (the median over steps of the slowest rank's time)."""
    caps_mb = list(caps_mb)
    if not caps_mb:
        raise ValueError("caps_mb lists the bucket caps to measure, in MiB: give at least one.")
    whole_number("steps", steps, "time at least one step per cap, e.g. steps=5.")
    per_rank = cluster.run(_time_bucketed_steps, build_model, make_batch, caps_mb, steps, loss_fn, lr)
    rows = []
    for index, cap in enumerate(caps_mb):
        slowest = [max(rank[index][1][step] for rank in per_rank) for step in range(steps)]
        rows.append(dict(bucket_cap_mb=cap, buckets=per_rank[0][index][0], step_seconds=statistics.median(slowest)))
    return rows


def _time_bucketed_steps(build_model, make_batch, caps_mb, steps, loss_fn, lr):
    inputs, targets = make_batch(dist.get_rank())
    results = []
    for cap in caps_mb:
        model = build_model()
        ddp = DDP(model, "bucketed", bucket_cap_mb=cap)
        optimizer = torch.optim.SGD(model.parameters(), lr=lr)
        times = []
        for _ in range(steps + 1):
            dist.barrier()  # every rank starts the step together
            start = time.perf_counter()
            optimizer.zero_grad()
            loss_fn(ddp(inputs), targets).backward()
            ddp.finish_gradient_synchronization()
            optimizer.step()
            times.append(time.perf_counter() - start)
        results.append((len(ddp.buckets), times[1:]))
    return results


def _buckets(count, bold=False):
    number = f"<b>{count}</b>" if bold else str(count)
    return f"{number} bucket" + ("s" if count != 1 else "")


def _size(nbytes):
    return f"{nbytes / MB:.3g} MiB" if nbytes >= MB / 10 else f"{nbytes / 1024:.3g} KiB"
