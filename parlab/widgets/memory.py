"""Widgets for the ZeRO lecture: the model-state memory of one device at each ZeRO stage, as
the paper predicts it and as the ranks of a cluster really hold it.

    parse_psi("7.5B")                                    Psi from "7.5B", "125M", "1e9"
    memory_bars(psi, n_d, kappa, param_bytes, grad_bytes)   stacked bars per stage, static figure
    memory_readout(psi, n_d, kappa, ...)                    the same numbers as an HTML table
    measure_stages(cluster, model_fn, stages, ...)          ModelState measured on real ranks
    memory_widget(cluster=None)                             Psi, kappa, N_d, dtype controls over it all

kappa is the optimizer state's bytes per parameter (the ZeRO paper's K; K counts pipeline
stages in this course).

The predictions are ``parlab.memory.model_state_bytes``; the measurements are the ZeRO and
FSDP engines' ``model_state_bytes()`` (``parlab.zero``), taken at rest after a step.
"""

import math

import torch
import torch.distributed as dist

from parlab import zero
from parlab._checks import real_number
from parlab.memory import FP32_ADAM, MIXED_ADAM, STAGES, fits, model_state_bytes
from parlab.units import GB
from parlab.widgets._common import (
    FIT,
    Feedback,
    button,
    import_ipywidgets,
    in_range,
    png,
    running_cluster,
    show_static,
    toggle_buttons,
)

PSI_PRESETS = {"1.5B": 1.5e9, "7.5B": 7.5e9, "70B": 70e9}
# The widget's dtype choice: (param_bytes, grad_bytes) and the kappa of Adam in that recipe.
DTYPES = {"fp16/bf16 mixed": MIXED_ADAM, "fp32": FP32_ADAM}
PARTS = ("params", "grads", "optimizer")
PART_LABELS = {"params": "parameters", "grads": "gradients", "optimizer": "optimizer state"}
STAGE_LABELS = {0: "0: DDP", 1: "1: P_os", 2: "2: P_os+g", 3: "3: P_os+g+p"}
UNITS = ((1e9, "GB"), (1e6, "MB"), (1e3, "KB"), (1, "B"))
FIGSIZE = (8, 4.2)


def parse_psi(text):
    """The number of parameters written as ``"7.5B"``, ``"125M"``, ``"20k"`` or ``"1e9"``."""
    cleaned = str(text).strip().replace(",", "").replace("_", "")
    scale = {"k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12}.get(cleaned[-1:].lower(), 1)
    try:
        psi = float(cleaned[:-1] if scale != 1 else cleaned) * scale
    except ValueError:
        raise ValueError(f"write the number of parameters like 7.5B, 125M or 1e9, not {text!r}.") from None
    if not 0 <= psi < math.inf:
        raise ValueError(f"the number of parameters must be a finite number of at least 0, not {text!r}.")
    return psi


def memory_bars(psi, n_d, kappa=12, param_bytes=2, grad_bytes=2, device_gb=80, ax=None, measured=None, highlight=None):
    """Model-state bytes of ONE device at ZeRO stages 0 to 3 (``model_state_bytes``), one
    stacked bar per stage: parameters, gradients, optimizer state, in GB (1e9 bytes; MB or
    KB for small models), the total written above. A dashed line marks ``device_gb``, the
    memory of one device (drawn when it is within view). ``measured``: a dict stage ->
    ``ModelState`` (e.g. from ``measure_stages``), drawn hatched beside the predicted bar of
    the stage. ``highlight``: a stage outlined in black. Each bar rectangle carries a gid
    ``"predicted-{stage}-{part}"`` or ``"measured-{stage}-{part}"``. Returns the axes.
    """
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    _check_device(device_gb)
    if ax is None:
        _, ax = plt.subplots(figsize=FIGSIZE, layout="constrained")
    predicted = {stage: model_state_bytes(psi, stage, n_d, kappa, param_bytes, grad_bytes) for stage in STAGES}
    measured = {stage: state for stage, state in (measured or {}).items() if stage in STAGES}
    tallest = max(state.total for state in [*predicted.values(), *measured.values()]) or 1
    scale, unit = next((scale, unit) for scale, unit in UNITS if tallest >= scale or scale == 1)
    width = 0.38 if measured else 0.6
    for stage, state in predicted.items():
        offset = -0.2 if measured else 0.0
        _stacked_bar(ax, stage + offset, width, state, scale, "predicted", stage, highlight == stage)
        if stage in measured:
            _stacked_bar(ax, stage + 0.2, width, measured[stage], scale, "measured", stage, False)
    device = device_gb * GB
    if device <= 1.5 * tallest:
        ax.axhline(device / scale, color="black", ls="--", lw=1)
        ax.text(3.45, device / scale, f" {device_gb:g} GB device", va="bottom", ha="right", fontsize=8)
    handles = [Patch(facecolor=f"C{i}", label=PART_LABELS[part]) for i, part in enumerate(PARTS)]
    if measured:
        handles.append(Patch(facecolor="white", edgecolor="gray", hatch="///", label="measured"))
    ax.legend(handles=handles, fontsize=8, loc="upper right")
    ax.set_xticks(list(STAGES), [STAGE_LABELS[stage] for stage in STAGES])
    ax.set_xlim(-0.6, 3.6)
    ax.set_ylim(0, max(tallest, device if device <= 1.5 * tallest else 0) / scale * 1.18)
    ax.set_xlabel("ZeRO stage")
    ax.set_ylabel(f"model states per device ({unit})")
    ax.set_title(f"Psi = {_count(psi)}, N_d = {n_d}, kappa = {kappa:g}, {param_bytes:g}+{grad_bytes:g} bytes per "
                 f"parameter and gradient: {_first_fit(predicted, device, device_gb)}", fontsize=9)
    return ax


def memory_readout(psi, n_d, kappa=12, param_bytes=2, grad_bytes=2, device_gb=80, highlight=None):
    """An HTML table of ``model_state_bytes`` per stage (GB per device, each part and the
    total) with whether it fits in ``device_gb``; the ``highlight`` row in bold."""
    _check_device(device_gb)
    rows = []
    for stage in STAGES:
        state = model_state_bytes(psi, stage, n_d, kappa, param_bytes, grad_bytes)
        cells = [STAGE_LABELS[stage], *(f"{value / GB:.3g}" for value in state), f"{state.total / GB:.3g}",
                 "yes" if fits(state, device_gb * GB) else "no"]
        if stage == highlight:
            cells = [f"<b>{cell}</b>" for cell in cells]
        rows.append("<tr>" + "".join(f"<td>{cell}</td>" for cell in cells) + "</tr>")
    header = ("<tr><th>stage</th><th>params</th><th>grads</th><th>optimizer</th><th>total (GB)</th>"
              f"<th>fits {device_gb:g} GB?</th></tr>")
    return f"<table>{header}{''.join(rows)}</table>"


def small_model():
    """The model the widget measures: a 3-layer MLP, 32 -> 64 -> 64 -> 8, Psi = 6,792."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(),
                               torch.nn.Linear(64, 8))


def small_batch(rank):
    """Rank ``rank``'s batch for ``small_model``: 16 inputs of 32 features, 16 targets of 8."""
    generator = torch.Generator().manual_seed(rank)
    return torch.randn(16, 32, generator=generator), torch.randn(16, 8, generator=generator)


def measure_stages(cluster, model_fn=small_model, stages=STAGES, make_batch=small_batch,
                   optimizer_class=torch.optim.Adam, loss_fn=torch.nn.functional.mse_loss, **optimizer_kwargs):
    """Measured model states of one device at each ZeRO stage in ``stages`` on ``cluster``.

    For each stage every rank wraps a fresh ``model_fn()`` in its engine (stages 0 to 2:
    ``parlab.zero.ZeroDP``; stage 3: ``parlab.zero.FSDP`` with ``strategy="FULL_SHARD"``),
    takes one step of ``optimizer_class(**optimizer_kwargs)`` on ``make_batch(rank)`` and
    measures ``engine.model_state_bytes()`` at rest. Returns a dict stage -> ``ModelState``
    of the rank holding the most (the one that has to fit). Compare with
    ``model_state_bytes(Psi, stage, N_d, *FP32_ADAM)`` for fp32 Adam on CPU ranks.
    """
    for stage in stages:
        if stage not in STAGES:
            raise ValueError(f"stages must be ZeRO stages 0 to 3, got {stage!r}.")
    per_rank = cluster.run(_measure_on_rank, model_fn, list(stages), make_batch, optimizer_class, loss_fn,
                           optimizer_kwargs)
    return {stage: max((states[index] for states in per_rank), key=lambda state: state.total)
            for index, stage in enumerate(stages)}


def _measure_on_rank(model_fn, stages, make_batch, optimizer_class, loss_fn, optimizer_kwargs):
    inputs, targets = make_batch(dist.get_rank())
    states = []
    for stage in stages:
        if stage == 3:
            engine = zero.FSDP(model_fn(), optimizer_class, strategy="FULL_SHARD", **optimizer_kwargs)
        else:
            engine = zero.ZeroDP(model_fn(), optimizer_class, stage=stage, **optimizer_kwargs)
        engine.zero_grad()
        loss_fn(engine(inputs), targets).backward()
        engine.step()
        states.append(engine.model_state_bytes())
    return states


def memory_widget(cluster=None, psi="7.5B", n_d=64, device_gb=80):
    """``memory_bars`` with controls: a Psi preset and a free Psi text ("7.5B", "125M"), the
    dtype (fp16/bf16 mixed: 2 + 2 bytes, kappa = 12; fp32: 4 + 4 bytes, kappa = 8, Adam's
    presets), kappa, N_d, the device's GB and a stage to highlight, over the figure and ``memory_readout``.
    With a ``cluster``, a button "measure on the cluster" runs ``measure_stages`` (fp32 Adam
    on ``small_model``) stage by stage under a progress bar, sets the controls to that model
    (its Psi, N_d = world size, fp32) and lays the measured bars beside the predicted ones
    while the controls stay there; if an earlier cell closed the cluster, it starts a new
    one with as many ranks. Displays a static picture of the first state (kept by a saved
    notebook) and returns an ipywidgets VBox; without ipywidgets, warns and returns the
    static figure.
    """
    psi_value = parse_psi(psi)
    in_range("n_d (N_d, the data-parallel degree)", n_d, 1, 1024, "the N_d slider goes from 1 to 1024.", whole=True)
    in_range("device_gb", device_gb, 1, 10_000, "the device box takes 1 to 10,000 GB.")
    widgets = import_ipywidgets()
    if widgets is None:
        return memory_bars(psi_value, n_d, device_gb=device_gb).figure

    preset = widgets.Dropdown(options=["custom", *PSI_PRESETS], value=psi if psi in PSI_PRESETS else "custom",
                              description="Psi preset", style=FIT)
    psi_text = widgets.Text(str(psi), description="Psi", continuous_update=False, style=FIT)
    dtype = toggle_buttons(list(DTYPES), "dtype")
    kappa = widgets.FloatSlider(MIXED_ADAM.kappa, min=0, max=24, step=1, description="kappa", style=FIT)
    ranks = widgets.IntSlider(n_d, min=1, max=1024, description="N_d", continuous_update=False, style=FIT)
    device = widgets.BoundedFloatText(device_gb, min=1, max=10_000, description="device GB", style=FIT)
    highlight = toggle_buttons(list(STAGES), "stage", value=3)
    image, readout, feedback = widgets.Image(format="png"), widgets.HTML(), Feedback()
    measurement = {"cluster": cluster}  # and "config": the controls it was measured at, "states"

    def controls():
        precision = DTYPES[dtype.value]
        return parse_psi(psi_text.value), ranks.value, kappa.value, precision.param_bytes, precision.grad_bytes

    def redraw(_=None):
        config = controls()
        measured = measurement["states"] if measurement.get("config") == config else None
        image.value = png(lambda ax: memory_bars(*config, device.value, ax, measured, highlight.value), FIGSIZE)
        readout.value = memory_readout(*config, device.value, highlight.value)

    def choose_preset(_):
        if preset.value in PSI_PRESETS:
            psi_text.value = preset.value

    def choose_dtype(_):
        kappa.value = DTYPES[dtype.value].kappa

    def measure(_):
        measurement["cluster"] = running_cluster(measurement["cluster"], feedback)
        ranks_there = measurement["cluster"].world_size
        states = {}
        with feedback.progress(len(STAGES), f"stage 0 on {ranks_there} ranks") as advance:
            for stage in STAGES:
                states.update(measure_stages(measurement["cluster"], stages=(stage,)))
                advance(f"stage {stage + 1} on {ranks_there} ranks" if stage + 1 in STAGES else "done")
        psi_small = sum(p.numel() for p in small_model().parameters())
        measurement.update(states=states, config=(float(psi_small), ranks_there, FP32_ADAM.kappa, FP32_ADAM.param_bytes,
                                                  FP32_ADAM.grad_bytes))
        preset.value, psi_text.value, ranks.value, dtype.value = "custom", str(psi_small), ranks_there, "fp32"
        redraw()

    preset.observe(feedback.guard(choose_preset, "Choosing the preset"), names="value")
    dtype.observe(feedback.guard(choose_dtype, "Choosing the dtype"), names="value")
    for control in (psi_text, dtype, kappa, ranks, device, highlight):
        control.observe(feedback.guard(redraw, "Redrawing the memory bars"), names="value")
    redraw()
    show_static(image.value, f"ZeRO memory for Psi = {psi}")
    rows = [widgets.HBox([preset, psi_text]), widgets.HBox([dtype, device]), widgets.HBox([kappa, ranks]), highlight]
    if cluster is not None:
        rows.append(button("measure on the cluster", feedback.guard(measure, "Measuring on the cluster")))
    return widgets.VBox([*rows, feedback.box, image, readout])


def _check_device(device_gb):
    # Psi, N_d, kappa and the bytes are model_state_bytes' to check; the device is the figure's.
    real_number("device_gb", device_gb, "give the memory of one device in GB, e.g. 80.", above=True)


def _stacked_bar(ax, x, width, state, scale, kind, stage, outlined):
    bottom = 0.0
    for index, part in enumerate(PARTS):
        height = getattr(state, part) / scale
        ax.bar(x, height, width, bottom=bottom, color=f"C{index}", hatch="///" if kind == "measured" else None,
               edgecolor="black" if outlined else "white", linewidth=1.5 if outlined else 0.5,
               gid=f"{kind}-{stage}-{part}")
        bottom += height
    ax.text(x, bottom, f"{bottom:.3g}", ha="center", va="bottom", fontsize=7)


def _first_fit(predicted, device, device_gb):
    fitting = [stage for stage, state in predicted.items() if fits(state, device)]
    number = f"{device_gb:g}"
    target = f"{_article(number)} {number} GB device"
    return f"fits {target} from stage {fitting[0]}" if fitting else f"no stage fits {target}"


def _article(number):
    """The article said before ``number`` (digits): "an" where it is read starting with a
    vowel, eight... or an eleven or eighteen leading a group of thousands (8, 80, 11, 18,
    11000, 18.5; not 110 or 180), "a" otherwise."""
    whole = number.split(".")[0]
    eleven = len(whole) % 3 == 2 and whole[:2] in ("11", "18")
    return "an" if whole.startswith("8") or eleven else "a"


def _count(psi):
    scale, suffix = next(((s, x) for s, x in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k")) if psi >= s),
                         (1, ""))
    return f"{psi / scale:.3g}{suffix}"
