"""Widget for lecture 10 (DiLoCo over slow links): the wall time to a target loss of DDP and
of DiLoCo against the link's bandwidth, and the bandwidth below which DiLoCo wins.

    steps_to_target(curves, target)                         inner steps each measured curve needs
    crossover_sentence(steps, H, latency, ...)             where DiLoCo overtakes DDP, in words
    plot_wall_time_to_loss(curves, target, H, latency, ...) wall time to the target against 1/beta
    diloco_widget(curves, target, compute_s, ...)          H and alpha over the plot, the readout

Two halves make the prediction. The loss after S inner steps does not depend on the link, so
measured curves {"ddp": [(inner step, loss)], ("diloco", H): [...]} give S, the inner steps
each method needs to reach the target (``costs.steps_to_loss``). The link sets the seconds
per inner step (``costs.seconds_per_step``, the alpha-beta model of a ring all-reduce of P
bytes on N replicas): t_c + T(P) for DDP, t_c + T(P)/H for DiLoCo. Their product is the wall
time, S_ddp (t_c + T) against S_dil (t_c + T/H): DiLoCo takes more steps but pays the
all-reduce once per H of them, so it wins below the bandwidth ``costs.crossover`` gives.
"""

import math
import textwrap

from parlab._checks import whole_number
from parlab.diloco import costs
from parlab.runtime.emulation import Link
from parlab.widgets._common import Feedback, import_ipywidgets, in_range, log_slider, png, show_static, toggle_buttons

FIGSIZE = (7.5, 4.2)
BANDWIDTHS = [10 ** (6 + k / 8) for k in range(33)]  # the x axis: 1 MB/s to 10 GB/s, 8 points a decade
SAME_LATENCY = 1.25  # a measured point is drawn over lines whose latency is within this factor of its own
STYLES = {"ddp": {"color": "C0", "marker": "s"}, "diloco": {"color": "C3", "marker": "o"}}


def steps_to_target(curves, target):
    """{key: S}, the first inner step at which each curve of ``curves`` ({"ddp": points,
    ("diloco", H): points, ...}, points [(inner step, loss)]) is at or below ``target``;
    a ValueError naming the curve that never gets there, or keys that are not these."""
    if not curves:
        raise ValueError("curves is empty: give the measured loss against inner steps, {\"ddp\": [(step, loss), ...], "
                         "(\"diloco\", H): [...]}, e.g. from parlab.diloco.training.")
    for key in curves:
        if key != "ddp" and not (isinstance(key, tuple) and len(key) == 2 and key[0] == "diloco"
                                 and isinstance(key[1], int) and key[1] >= 1):
            raise ValueError(f"curves' keys are \"ddp\" and (\"diloco\", H) with H a whole number >= 1, got {key!r}: "
                             f"rename that curve or leave it out.")
    if "ddp" not in curves or len(curves) < 2:
        raise ValueError("curves needs DDP's curve under \"ddp\" and at least one (\"diloco\", H) curve: the widget "
                         f"compares the two; got {sorted(map(str, curves))}.")
    steps = {}
    for key, points in curves.items():
        steps[key] = costs.steps_to_loss(points, target)
        if steps[key] is None:
            lowest = min((loss for _, loss in points), default=None)
            raise ValueError(f"the curve {key!r} never reaches the target loss {target:g} (its lowest is "
                             f"{'none: it is empty' if lowest is None else f'{lowest:g}'}): raise the target above "
                             f"every curve's lowest loss, or measure that curve for more inner steps.")
    return steps


def crossover_sentence(steps, H, latency, compute_s, payload_bytes, N):
    """(bandwidth*, the sentence saying where DiLoCo at H reaches the target sooner than DDP):
    ``costs.crossover`` of the steps ``steps_to_target`` found."""
    S_ddp, S_dil = steps["ddp"], steps[("diloco", H)]
    bandwidth = costs.crossover(S_ddp, S_dil, H, payload_bytes, N, compute_s, latency)
    if bandwidth == math.inf:
        why = (f"it needs no more steps than DDP ({S_dil} against {S_ddp})" if S_dil <= S_ddp else
               f"at alpha = {latency * 1e3:.3g} ms the latency of DDP's all-reduces alone outweighs DiLoCo's "
               f"{S_dil - S_ddp} extra steps")
        return bandwidth, f"DiLoCo (H = {H}) is sooner at every bandwidth: {why}"
    if bandwidth == 0.0:
        return bandwidth, (f"DDP is sooner at every bandwidth: DiLoCo (H = {H}) needs {S_dil} steps, at least H times "
                           f"DDP's {S_ddp}, so it saves no all-reduce")
    return bandwidth, f"DiLoCo (H = {H}) is sooner below {_rate(bandwidth)}"


def plot_wall_time_to_loss(curves, target, H, latency, compute_s, payload_bytes, N, measured=None, ax=None):
    """Predicted wall time to reach ``target`` against the link's bandwidth 1/beta (log-log,
    ``BANDWIDTHS``) for DDP and for DiLoCo at ``H``: ``costs.wall_time_to_loss``, S (from
    the measured ``curves``) times ``costs.seconds_per_step`` on Link(``latency``, 1/beta),
    with t_c = ``compute_s``, P = ``payload_bytes`` and N replicas. The crossover bandwidth
    (``costs.crossover``) is a vertical line when finite. ``measured``: (method, H, latency,
    bandwidth, seconds) times to the target under emulated links, drawn as points where they
    belong to these lines: DDP's and DiLoCo's at this H, measured at a latency within
    ``SAME_LATENCY`` of ``latency``. Returns the axes."""
    import matplotlib.pyplot as plt

    steps = steps_to_target(curves, target)
    _check_H(curves, H)
    whole_number("N (replicas)", N, "DDP and DiLoCo average over replicas: give N >= 2.", minimum=2)
    if ax is None:
        _, ax = plt.subplots(figsize=FIGSIZE, layout="constrained")
    for method, key, label in (("ddp", "ddp", "DDP"), ("diloco", ("diloco", H), f"DiLoCo, H = {H}")):
        seconds = [costs.wall_time_to_loss(curves[key], target, method, Link(latency, bandwidth), compute_s,
                                           payload_bytes, N, H=1 if method == "ddp" else H) for bandwidth in BANDWIDTHS]
        ax.plot(BANDWIDTHS, seconds, color=STYLES[method]["color"], lw=2, label=f"model: {label}, S = {steps[key]}")
        points = [(b, s) for m, h, alpha, b, s in measured or () if m == method and (method == "ddp" or h == H)
                  and 1 / SAME_LATENCY <= alpha / latency <= SAME_LATENCY]
        if points:
            ax.plot(*zip(*points), STYLES[method]["marker"], color=STYLES[method]["color"], ms=6, ls="none",
                    label=f"measured: {label} (emulated link)")
    bandwidth, sentence = crossover_sentence(steps, H, latency, compute_s, payload_bytes, N)
    if 0 < bandwidth < math.inf:
        ax.axvline(bandwidth, color="black", ls="--", lw=1, label=f"crossover: {_rate(bandwidth)}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(BANDWIDTHS[0], BANDWIDTHS[-1])
    ax.set_xlabel("link bandwidth 1/beta (bytes/s)")
    ax.set_ylabel(f"wall time to loss {target:g} (s)")
    ax.set_title(f"model: alpha-beta, N = {N}, t_c = {compute_s * 1e3:.3g} ms, alpha = {latency * 1e3:.3g} ms, "
                 f"P = {payload_bytes / 1e6:.3g} MB\n" + textwrap.fill(sentence, 90), fontsize=9)
    ax.legend(fontsize=8, loc="upper right")
    return ax


def readout(curves, target, H, latency, compute_s, payload_bytes, N):
    """The widget's line: the crossover sentence and every curve's S, steps to the target."""
    steps = steps_to_target(curves, target)
    _, sentence = crossover_sentence(steps, H, latency, compute_s, payload_bytes, N)
    counts = ", ".join(f"{'DDP' if key == 'ddp' else f'DiLoCo H = {key[1]}'} <b>{S}</b>" for key, S in steps.items())
    return f"{sentence}; steps to loss {target:g}: {counts}"


def diloco_widget(curves, target, compute_s, payload_bytes, N, H=None, latency=0.03, measured=None):
    """Buttons for H (the H of the measured DiLoCo curves; ``H=None``: the smallest) and a
    latency slider (alpha, log scale, 1e-4 to 0.3 s) over ``plot_wall_time_to_loss``; the
    readout gives the crossover bandwidth and each curve's steps to ``target``. Displays a
    static picture of the first state and returns an ipywidgets VBox; without ipywidgets,
    warns and returns the static figure."""
    steps_to_target(curves, target)
    choices = _measured_H(curves)
    H = choices[0] if H is None else H
    _check_H(curves, H)
    in_range("latency (alpha, seconds)", latency, 1e-6, 1.0, "give the link's latency in seconds, e.g. 0.03 for 30 ms.")
    widgets = import_ipywidgets()
    if widgets is None:
        return plot_wall_time_to_loss(curves, target, H, latency, compute_s, payload_bytes, N, measured).figure
    period = toggle_buttons([(f"H = {h}", h) for h in choices], "DiLoCo's H", value=H)
    alpha = log_slider(latency, -4, math.log10(0.3), "latency alpha (s)", step=0.05, readout_format=".2e")
    image, line, feedback = widgets.Image(format="png"), widgets.HTML(), Feedback()

    def redraw(_=None):
        image.value = png(lambda ax: plot_wall_time_to_loss(curves, target, period.value, alpha.value, compute_s,
                                                            payload_bytes, N, measured, ax), FIGSIZE)
        line.value = readout(curves, target, period.value, alpha.value, compute_s, payload_bytes, N)

    for control in (period, alpha):
        control.observe(feedback.guard(redraw, "Redrawing the wall time to the target"), names="value")
    redraw()
    show_static(image.value, f"wall time to loss {target:g}, DDP against DiLoCo at H = {H}")
    return widgets.VBox([period, alpha, line, feedback.box, image])


def _measured_H(curves):
    return sorted(key[1] for key in curves if key != "ddp")


def _check_H(curves, H):
    if ("diloco", H) not in curves:
        raise ValueError(f"H = {H!r} has no measured DiLoCo curve: pick one of {_measured_H(curves)}, or measure "
                         "that H.")


def _rate(bytes_per_s):
    return f"{bytes_per_s / 1e9:.3g} GB/s" if bytes_per_s >= 1e9 else f"{bytes_per_s / 1e6:.3g} MB/s"
