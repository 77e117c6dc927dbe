"""Widget for lecture 07: the memory of activations per transformer layer, item by item, for
any (s, b, h, a, t, sequence parallelism, recompute: none, selective or full), beside
Korthikanti et al.'s formula and the bytes measured on real ranks.

    plot_activation_memory(s, b, h, a, t, ...)     the stacked items of one layer and the formula, one figure
    activation_widget(measured=None, ...)          sliders and toggles over plot_activation_memory

The items are ``parlab.tensor_parallel.activations.layer_saved_bytes`` (parlab's layer), the
formula ``korthikanti_bytes``; both in 16-bit values and 1-byte masks unless told otherwise.
"""

from parlab.tensor_parallel.activations import korthikanti_bytes, layer_saved_bytes, recompute_kind
from parlab.units import MIB
from parlab.widgets._common import FIT, Feedback, import_ipywidgets, in_range, png, show_static, toggle_buttons

FIGSIZE = (9, 3.6)


def plot_activation_memory(s, b, h, a, t=1, sequence_parallel=False, recompute=False, value_bytes=2, mask_bytes=1,
                           measured=None, ax=None):
    """Two horizontal bars in MiB: parlab's layer, its items stacked (``layer_saved_bytes``),
    and the paper's formula (``korthikanti_bytes``, always in 2-byte values and 1-byte masks,
    which the title says beside parlab's sizes). ``recompute``: False (none), "selective"
    or True ("full"). ``measured``: a list of dicts {"config": {s, b, h, a, t,
    sequence_parallel, recompute, value_bytes, mask_bytes}, "bytes": n, "label": text} from
    real runs; those whose config is the one drawn are marked on parlab's bar (black
    diamonds). Returns the axes."""
    import matplotlib.pyplot as plt

    recompute = recompute_kind(recompute)
    items = layer_saved_bytes(s, b, h, a, t, sequence_parallel, recompute, value_bytes, mask_bytes)
    formula = korthikanti_bytes(s, b, h, a, t, sequence_parallel, recompute)
    if ax is None:
        _, ax = plt.subplots(figsize=FIGSIZE, layout="constrained")
    left = 0.0
    for number, (name, nbytes) in enumerate(items.items()):
        ax.barh(1, nbytes / MIB, left=left, color=f"C{number % 10}", edgecolor="white", label=name)
        left += nbytes / MIB
    ax.barh(0, formula / MIB, color="0.6", edgecolor="white")
    config = dict(s=s, b=b, h=h, a=a, t=t, sequence_parallel=sequence_parallel, recompute=recompute,
                  value_bytes=value_bytes, mask_bytes=mask_bytes)
    for point in measured or []:
        if {**point["config"], "recompute": recompute_kind(point["config"].get("recompute"))} == config:
            ax.plot(point["bytes"] / MIB, 1, "kD", markersize=8)
            ax.annotate(point.get("label", "measured"), (point["bytes"] / MIB, 1), textcoords="offset points",
                        xytext=(0, 12), ha="center", fontsize=8)
    ax.set_yticks([0, 1], ["Korthikanti et al.", "parlab's layer"])
    ax.set_xlabel("activation memory of one layer (MiB)")
    mode = "TP + SP" if sequence_parallel else ("TP" if t > 1 else "no TP")
    mode += f", {recompute} recompute" if recompute else ""
    ax.set_title(f"s = {s}, b = {b}, h = {h}, a = {a}, t = {t}, {mode}\nparlab {left:.3g} MiB ({value_bytes}-byte "
                 f"values, {mask_bytes}-byte masks), the paper's formula {formula / MIB:.3g} MiB (2-byte values, "
                 "1-byte masks)", fontsize=10)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
    ax.set_xlim(0, max(left, formula / MIB) * 1.1)
    return ax


def activation_widget(measured=None, s=2048, b=1, h=4096, a=32, t=1, sequence_parallel=False, recompute=False,
                      value_bytes=2, mask_bytes=1):
    """``plot_activation_memory`` with sliders for s, b, h, a and t, a toggle for sequence
    parallelism and buttons for recompute (none, selective, full); the readout gives both
    totals and the formula's bytes without parallelism or recompute. Displays a static picture
    of the first state and returns an ipywidgets VBox; without ipywidgets, warns and returns
    the static figure."""
    for name, value, high in (("s", s, 2**16), ("b", b, 512), ("h", h, 2**16), ("a", a, 256), ("t", t, 64)):
        in_range(name, value, 1, high, f"pick {name} from 1 to {high}.", whole=True)
    layer_saved_bytes(s, b, h, a, t, recompute=recompute)  # sizes that do not split, an unknown recompute: refused
    widgets = import_ipywidgets()
    if widgets is None:
        return plot_activation_memory(s, b, h, a, t, sequence_parallel, recompute, value_bytes, mask_bytes,
                                      measured).figure
    sliders = {name: widgets.SelectionSlider(options=options, value=value, description=name, style=FIT)
               for name, options, value in (("s", _powers(16, 2**16, s), s), ("b", _powers(1, 512, b), b),
                                            ("h", _powers(16, 2**16, h), h), ("a", _powers(1, 256, a), a),
                                            ("t", _powers(1, 64, t), t))}
    sp = widgets.Checkbox(value=sequence_parallel, description="sequence parallel", style=FIT)
    recompute_buttons = toggle_buttons(["none", "selective", "full"], "recompute",
                                       value=recompute_kind(recompute) or "none")
    image, readout, feedback = widgets.Image(format="png"), widgets.HTML(), Feedback()

    def redraw(_=None):
        size = {name: slider.value for name, slider in sliders.items()}
        ours = sum(layer_saved_bytes(**size, sequence_parallel=sp.value, recompute=recompute_buttons.value,
                                     value_bytes=value_bytes, mask_bytes=mask_bytes).values())
        image.value = png(lambda ax: plot_activation_memory(**size, sequence_parallel=sp.value,
                                                            recompute=recompute_buttons.value,
                                                            value_bytes=value_bytes, mask_bytes=mask_bytes,
                                                            measured=measured, ax=ax), FIGSIZE)
        formula = korthikanti_bytes(**size, sequence_parallel=sp.value, recompute=recompute_buttons.value)
        alone = korthikanti_bytes(size["s"], size["b"], size["h"], size["a"])
        readout.value = (f"parlab's layer <b>{ours / MIB:.3g} MiB</b>, the formula {formula / MIB:.3g} MiB; "
                         f"without parallelism or recompute the formula gives {alone / MIB:.3g} MiB")

    guarded = feedback.guard(redraw, "Redrawing the activation memory")
    for control in (*sliders.values(), sp, recompute_buttons):
        control.observe(guarded, names="value")
    redraw()
    show_static(image.value, "the activation memory of one layer")
    controls = list(sliders.values())
    return widgets.VBox([widgets.HBox(controls[:3]), widgets.HBox([*controls[3:], sp]), recompute_buttons, readout,
                         feedback.box, image])


def _powers(low, high, value):
    """The powers of two from ``low`` to ``high``, with ``value`` among them."""
    options, p = [], low
    while p <= high:
        options.append(p)
        p *= 2
    return sorted(set(options) | {value})
