"""Widgets for lecture 06 (asynchronous and decentralised SGD): how staleness limits the step
size, and how fast gossip on a graph reaches agreement.

    plot_delayed_gd(tau, gamma_mu, steps, ax=None)      the trajectory of delayed GD on f = mu x^2/2
    plot_stability_region(tau, gamma_mu, ax=None)       the stable gamma mu against tau, and the point
    stability_widget(tau, gamma_mu)                     sliders tau and gamma mu over both
    plot_gossip(topology, N, steps, axes=None)         values mixing, and the consensus distance against rho^2t
    gossip_widget(topology, N)                         a topology and N over plot_gossip, rho in the readout

The figures draw ``parlab.async_sgd.theory`` (the threshold 2 cos(tau pi / (2 tau + 1)) and the
recurrence x_{t+1} = x_t - gamma mu x_{t - tau}) and ``parlab.async_sgd.gossip`` (the mixing
matrices, rho, the consensus distance). The one-peer exponential graph changes W every round:
its rho is that of one period of ceil(log2 N) rounds, 0 (the exact average) only when N is a
power of 2.
"""

import torch

from parlab.async_sgd import gossip, theory
from parlab.widgets._common import FIT, Feedback, import_ipywidgets, in_range, png, show_static, toggle_buttons

FIGSIZE = (10, 3.4)
TAU_MAX, GAMMA_A_MAX = 8, 2.2


def verdict(tau, gamma_mu):
    """"stable" or "unstable", and the threshold, for delayed GD with staleness ``tau``."""
    threshold = theory.stability_threshold(tau)
    return ("stable" if 0 < gamma_mu < threshold else "unstable"), threshold


def plot_delayed_gd(tau, gamma_mu, steps=60, ax=None):
    """x_t of delayed gradient descent from x_0 = 1 (``theory.delayed_gd``), with the verdict
    and the threshold in the title. Returns the axes."""
    import matplotlib.pyplot as plt

    xs = theory.delayed_gd(gamma_mu, tau, steps)
    state, threshold = verdict(tau, gamma_mu)
    if ax is None:
        _, ax = plt.subplots(figsize=(6, 3.4), layout="constrained")
    ax.plot(range(len(xs)), xs, ".-", color="tab:green" if state == "stable" else "tab:red", lw=1, ms=3)
    ax.axhline(0, color="black", lw=0.6)
    bound = max(1.5, min(max(abs(x) for x in xs), 1e6) * 1.05)
    ax.set_ylim(-bound, bound)
    ax.set_xlabel("step t")
    ax.set_ylabel("x_t")
    ax.set_title(f"tau = {tau}, gamma mu = {gamma_mu:.3f}: {state} "
                 f"(threshold 2 cos(tau pi / (2 tau + 1)) = {threshold:.4f})", fontsize=10)
    return ax


def plot_stability_region(tau=None, gamma_mu=None, ax=None):
    """The largest stable gamma mu for tau = 0 .. TAU_MAX (shaded below: stable), with the
    point (tau, gamma mu) marked when given. Returns the axes."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(4, 3.4), layout="constrained")
    taus = list(range(TAU_MAX + 1))
    thresholds = [theory.stability_threshold(t) for t in taus]
    ax.fill_between(taus, 0, thresholds, color="tab:green", alpha=0.2, step=None, label="stable")
    ax.plot(taus, thresholds, "o-", color="tab:green", ms=4, label="2 cos(tau pi / (2 tau + 1))")
    if tau is not None:
        state, _ = verdict(tau, gamma_mu)
        ax.plot([tau], [gamma_mu], "X", ms=10, color="tab:green" if state == "stable" else "tab:red")
    ax.set_xlabel("staleness tau")
    ax.set_ylabel("gamma mu")
    ax.set_ylim(0, GAMMA_A_MAX)
    ax.legend(fontsize=8)
    ax.set_title("where delayed GD is stable", fontsize=10)
    return ax


def plot_stability(tau, gamma_mu, steps=60, axes=None):
    """The trajectory and the region side by side (``axes``: a pair, or None for a new figure)."""
    import matplotlib.pyplot as plt

    if axes is None:
        _, axes = plt.subplots(1, 2, figsize=FIGSIZE, layout="constrained", width_ratios=[2, 1])
    plot_delayed_gd(tau, gamma_mu, steps, axes[0])
    plot_stability_region(tau, gamma_mu, axes[1])
    return axes


def stability_widget(tau=2, gamma_mu=0.6):
    """Sliders for tau and gamma mu over ``plot_stability``; the readout gives the threshold and
    the verdict. Displays a static picture of the first state and returns an ipywidgets VBox;
    without ipywidgets, warns and returns the static figure."""
    in_range("tau (the staleness)", tau, 0, TAU_MAX, f"pick a staleness from 0 to {TAU_MAX}.", whole=True)
    in_range("gamma mu (step size times curvature)", gamma_mu, 0.01, GAMMA_A_MAX, f"pick from 0.01 to {GAMMA_A_MAX}.")
    widgets = import_ipywidgets()
    if widgets is None:
        return plot_stability(tau, gamma_mu)[0].figure
    tau_slider = widgets.IntSlider(tau, min=0, max=TAU_MAX, description="staleness tau", style=FIT)
    gamma_slider = widgets.FloatSlider(gamma_mu, min=0.01, max=GAMMA_A_MAX, step=0.01, description="gamma mu",
                                       style=FIT, readout_format=".2f")
    image, readout, feedback = widgets.Image(format="png"), widgets.HTML(), Feedback()

    def redraw(_=None):
        image.value = png(lambda ax: plot_stability(tau_slider.value, gamma_slider.value, axes=_pair(ax)), FIGSIZE)
        state, threshold = verdict(tau_slider.value, gamma_slider.value)
        readout.value = f"threshold {threshold:.4f}: <b>{state}</b>"

    for slider in (tau_slider, gamma_slider):
        slider.observe(feedback.guard(redraw, "Redrawing delayed gradient descent"), names="value")
    redraw()
    show_static(image.value, f"delayed gradient descent at tau = {tau}, gamma mu = {gamma_mu}")
    return widgets.VBox([tau_slider, gamma_slider, readout, feedback.box, image])


def gossip_run(topology, N, steps):
    """One-process gossip from x_r = r: (values [step][rank], consensus distances [step], rho,
    period). A static graph's rho bounds every step (period 1); the one-peer exponential
    graph changes W every round, so its rho is that of one period of p = ceil(log2 N) rounds
    (``gossip.one_peer_period``: 0 when N is a power of 2, the exact average)."""
    xs = [torch.tensor([float(r)], dtype=torch.float64) for r in range(N)]
    values, distances = [[x.item() for x in xs]], [gossip.consensus_distance(xs)]
    for t in range(steps):
        xs = gossip.gossip_all(gossip.mixing_matrix(topology, N, round=t), xs)
        values.append([x.item() for x in xs])
        distances.append(gossip.consensus_distance(xs))
    return (values, distances, *contraction(topology, N))


def contraction(topology, N):
    """(rho, period): a static graph's rho per step, or the one-peer exponential graph's rho
    of one period of p = ceil(log2 N) rounds, and p."""
    if topology == "one-peer exponential":
        return gossip.rho(gossip.one_peer_period(N)), gossip.one_peer_rounds(N)
    return gossip.rho(gossip.mixing_matrix(topology, N)), 1


def plot_gossip(topology, N, steps=20, axes=None):
    """Left: each rank's value over the steps of gossip from x_r = r, converging to the mean
    (N - 1)/2. Right: the consensus distance (log scale) against its bound Xi_0 rho^(2t)
    (per period for the one-peer graph; a line where one period averages exactly). Returns
    the axes."""
    import matplotlib.pyplot as plt

    values, distances, rho, period = gossip_run(topology, N, steps)
    if axes is None:
        _, axes = plt.subplots(1, 2, figsize=FIGSIZE, layout="constrained")
    left, right = axes
    left.plot(range(steps + 1), values, lw=1)
    left.axhline((N - 1) / 2, color="black", ls="--", lw=0.8, label="the mean, kept")
    left.set_xlabel("step t")
    left.set_ylabel("x_r")
    left.legend(fontsize=8)
    left.set_title(f"{topology}, N = {N}: every rank's value", fontsize=10)
    positive = [(t, d) for t, d in enumerate(distances) if d > 1e-30]
    right.semilogy([t for t, _ in positive], [d for _, d in positive], "o-", ms=3, label="measured")
    if rho == 0:
        right.axvline(period, color="black", ls="--", lw=1, label=f"exact average after {period} rounds")
    else:
        ts = range(0, steps + 1, period)
        per = "" if period == 1 else f" (one period of {period} rounds)"
        right.semilogy(ts, [distances[0] * rho ** (2 * t // period) for t in ts], "k--", lw=1,
                       label=f"Xi_0 rho^(2t{'' if period == 1 else f'/{period}'}), rho = {rho:.4f}{per}")
    right.set_ylim(bottom=max(min(d for _, d in positive) / 10, 1e-20))
    right.set_xlabel("step t")
    right.set_ylabel("consensus distance Xi")
    right.legend(fontsize=8)
    right.set_title("consensus distance", fontsize=10)
    return axes


def mixing_summary(topology, N):
    """The readout's sentence: rho (per period for the one-peer graph, saying whether it
    averages exactly) and the messages each rank sends per step."""
    W = gossip.mixing_matrix(topology, N)
    sends = int((W[:, 0] != 0).sum().item()) - 1
    rho, period = contraction(topology, N)
    summary = f"rho = <b>{rho:.4f}</b>"
    if period > 1:
        exact = "the exact average: N is a power of 2" if rho == 0 else "never exact: N is not a power of 2"
        summary = f"one period of {period} rounds: {summary} ({exact})"
    return f"{summary}; each rank sends {sends} message(s) per step"


def gossip_widget(topology="ring", N=8):
    """Topology buttons and an N slider over ``plot_gossip``; the readout gives rho and the
    messages per step. Displays a static picture of the first state and returns a VBox;
    without ipywidgets, warns and returns the static figure."""
    if topology not in gossip.TOPOLOGIES:
        raise ValueError(f"topology must be one of {', '.join(gossip.TOPOLOGIES)}; got {topology!r}.")
    in_range("N (the number of ranks)", N, 2, 32, "pick N from 2 to 32.", whole=True)
    widgets = import_ipywidgets()
    if widgets is None:
        return plot_gossip(topology, N)[0].figure
    graph = toggle_buttons(list(gossip.TOPOLOGIES), "graph", value=topology)
    ranks = widgets.IntSlider(N, min=2, max=32, description="N", style=FIT)
    image, readout, feedback = widgets.Image(format="png"), widgets.HTML(), Feedback()

    def redraw(_=None):
        image.value = png(lambda ax: plot_gossip(graph.value, ranks.value, axes=_pair(ax)), FIGSIZE)
        readout.value = mixing_summary(graph.value, ranks.value)

    for control in (graph, ranks):
        control.observe(feedback.guard(redraw, "Redrawing gossip"), names="value")
    redraw()
    show_static(image.value, f"gossip on the {topology} graph, N = {N}")
    return widgets.VBox([graph, ranks, readout, feedback.box, image])


def _pair(ax):
    """Split the single axes that ``png`` gives into two side by side."""
    grid = ax.figure.add_gridspec(1, 2)
    ax.set_subplotspec(grid[0])
    return ax, ax.figure.add_subplot(grid[1])
