"""What every widget shares: a figure drawn to PNG bytes, the static picture a saved notebook
keeps, controls whose labels fit, and the feedback line under the controls, where every
callback says what it is doing (with a progress bar for long work) and what went wrong.

Why a static picture: a widget's live view needs the kernel that made it. A notebook closed
and reopened (JupyterLab shows "Error displaying widget: model not found" in place of the
widget) or rendered on GitHub (which shows no widgets) shows only ordinary outputs, so each
widget function also displays a PNG of its first state as an output of its own.

Why a guard on every callback: an exception in a callback never reaches the notebook cell;
JupyterLab writes it only to its log console, and the widget seems to hang.
"""

import base64
import html
import io
import math
import numbers
import traceback
import warnings
from contextlib import contextmanager

from parlab._checks import refuse

# Every described control gets style=FIT: its label takes the width its text needs instead of
# ipywidgets' fixed 80 px, which cuts "bucket (MiB)" to "bucket (M...".
FIT = {"description_width": "initial"}
PX_PER_CHAR = 8  # at most what one character of JupyterLab's 13 px interface font takes
BUTTON_PADDING_PX = 32  # a button's padding and border around its text


def import_ipywidgets():
    """ipywidgets, or None (with a warning) where it is not installed: the widget functions
    then return their static figure."""
    try:
        import ipywidgets
    except ImportError:
        warnings.warn("ipywidgets is not installed: showing the static figure (pip install ipywidgets).", stacklevel=3)
        return None
    return ipywidgets


def png(draw, figsize):
    """PNG bytes of a figure drawn by ``draw(ax)``. A bare Figure, not pyplot: nothing is
    kept in pyplot's list of open figures or shown twice by the inline backend."""
    from matplotlib.figure import Figure

    figure = Figure(figsize=figsize, layout="constrained")
    draw(figure.subplots())
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=90)
    return buffer.getvalue()


def show_static(picture, what):
    """Display ``picture`` (PNG bytes of the widget's first state) as an output of its own,
    under a one-line caption, so the notebook keeps a picture of ``what`` where the live
    widget cannot be shown. Outside IPython there is no notebook to keep it: nothing."""
    from IPython import get_ipython
    from IPython.display import Markdown, display

    if get_ipython() is None:
        return
    display(Markdown(f"*{what}: a static picture of the first state, kept with the notebook; "
                     "the live widget below redraws it.*"))
    # Notebook JSON holds a PNG as base64 text: raw bytes would be saved as a list of numbers.
    display({"image/png": base64.b64encode(picture).decode("ascii"), "text/plain": f"<static picture: {what}>"},
            raw=True)


def button(description, on_click):
    """A button wide enough for its ``description``, calling ``on_click(button)``."""
    import ipywidgets as widgets

    width = len(description) * PX_PER_CHAR + BUTTON_PADDING_PX
    pressed = widgets.Button(description=description, layout=widgets.Layout(width=f"{width}px"))
    pressed.on_click(on_click)
    return pressed


def toggle_buttons(options, description, **kwargs):
    """ToggleButtons whose buttons are all wide enough for the longest option's label."""
    import ipywidgets as widgets

    labels = [str(option[0] if isinstance(option, tuple) else option) for option in options]
    width = max(len(label) for label in labels) * PX_PER_CHAR + BUTTON_PADDING_PX
    return widgets.ToggleButtons(options=options, description=description,
                                 style={**FIT, "button_width": f"{width}px"}, **kwargs)


class Feedback:
    """The widget's own output line, under its controls: a message (what it is doing, or what
    went wrong as a readable sentence) and a progress bar shown only during long work.
    ``box`` is the ipywidgets VBox to place in the widget."""

    def __init__(self):
        import ipywidgets as widgets

        self.message = widgets.HTML()
        self.bar = widgets.IntProgress(0, min=0, max=1, style=FIT, layout=widgets.Layout(display="none"))
        self.box = widgets.VBox([self.message, self.bar])
        self.failed = False

    def say(self, text):
        self.message.value = html.escape(text)
        self.failed = False

    def guard(self, callback, doing):
        """``callback`` wrapped for ``observe`` or ``on_click``: an error it shows before is
        cleared, and any exception it raises is shown here (``error_html``), never lost."""

        def guarded(*args):
            if self.failed:
                self.say("")
            try:
                callback(*args)
            except Exception as error:
                self.bar.layout.display = "none"
                self.message.value = error_html(error, doing)
                self.failed = True

        return guarded

    @contextmanager
    def progress(self, steps, first):
        """Show the progress bar over ``steps`` steps, labelled ``first``; yields
        ``advance(label)``, to call as each step ends. The bar goes when the block does."""

        def advance(label):
            self.bar.value += 1
            self.bar.description = label

        self.bar.max, self.bar.value, self.bar.description = steps, 0, first
        self.bar.layout.display = None
        try:
            yield advance
        finally:
            self.bar.layout.display = "none"


def error_html(error, doing):
    """``error`` as HTML a learner can read: a ValueError's own sentence (it says what to
    change); any other exception as "{doing} failed: {type}: {first line}", with the rest
    of its message (a rank's traceback) or the traceback folded under "details"."""
    first, _, rest = str(error).strip().partition("\n")
    if isinstance(error, ValueError):
        sentence = first
    else:
        sentence = f"{doing} failed: {type(error).__name__}: {first or 'no message'}"
        rest = rest or "".join(traceback.format_exception(error))
    details = f"<details><summary>details</summary><pre>{html.escape(rest)}</pre></details>" if rest else ""
    return f"<div class='parlab-error' style='color:#c62828'>{html.escape(sentence)}</div>{details}"


def running_cluster(cluster, feedback):
    """``cluster``, or, if an earlier cell closed it, a fresh ``parlab.Cluster`` with the same
    ranks, backend and device; ``feedback`` says which. The widget keeps the one returned."""
    from parlab.runtime import Cluster

    if not cluster.closed:
        return cluster
    feedback.say(f"the cluster given to this widget was closed by an earlier cell: starting a new one with "
                 f"{cluster.world_size} ranks (it stops with the kernel)...")
    fresh = Cluster(cluster.world_size, backend=cluster.backend, device=cluster.placement.device_type)
    feedback.say(f"started a new parlab.Cluster(world_size={cluster.world_size}) for this widget: the one it "
                 f"was given was closed.")
    return fresh


def in_range(name, value, low, high, fix, whole=False):
    """``value``, if a control from ``low`` to ``high`` can show it (a whole number if
    ``whole``); else parlab's ValueError, worded like every other refusal."""
    kind = numbers.Integral if whole else numbers.Real
    if isinstance(value, bool) or not isinstance(value, kind) or not low <= value <= high:  # nan is not
        refuse(name, f"a {'whole ' if whole else ''}number from {low:g} to {high:g}", value, fix)
    return value


def log_slider(value, low, high, description, base=10, **options):
    """A FloatLogSlider from base**low to base**high, widened to reach ``value`` if it lies
    outside (a measured alpha or beta may), labelled to fit."""
    import ipywidgets as widgets

    exponent = math.log(value, base)
    return widgets.FloatLogSlider(value, base=base, min=min(low, math.floor(exponent)),
                                  max=max(high, math.ceil(exponent)), description=description, style=FIT, **options)
