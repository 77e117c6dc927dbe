"""What every widget shares (parlab.widgets._common), checked on every widget: a static
picture for saved notebooks, labels that fit, errors shown in the widget's own output line,
a closed cluster replaced, and widget modules that share helpers through _common only."""

import ast
import base64
import pathlib
import re

import matplotlib
import nbformat
import nbformat.validator
import pytest
import torch
from IPython.core.interactiveshell import InteractiveShell
from IPython.utils.capture import capture_output

import parlab
import parlab.widgets
from parlab.runtime import RankError
from parlab.widgets._common import BUTTON_PADDING_PX, PX_PER_CHAR, Feedback
from parlab.widgets.collectives import alpha_beta_widget, ring_widget
from parlab.widgets.context_parallel import ring_attention_widget
from parlab.widgets.ddp import bucket_widget
from parlab.widgets.diloco import diloco_widget
from parlab.widgets.experts import router_widget
from parlab.widgets.failures import goodput_widget
from parlab.widgets.memory import memory_widget
from parlab.widgets.pipeline import schedule_widget
from parlab.widgets.zero_steps import zero_step_widget

matplotlib.use("Agg")


class FakeCluster:
    """Stands in for a running parlab.Cluster whose every call fails with ``error``."""

    closed = False

    def __init__(self, world_size, error):
        self.world_size, self.error = world_size, error

    def run(self, *args, **kwargs):
        raise self.error

    trace = run


def small_model():
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))


EVERY_WIDGET = {
    "ring_widget": lambda: ring_widget(N=3),
    "alpha_beta_widget": lambda: alpha_beta_widget(N=4),
    "bucket_widget": lambda: bucket_widget(small_model(), backward_seconds=0.01),
    "memory_widget": lambda: memory_widget(FakeCluster(2, RuntimeError("unused"))),
    "schedule_widget": lambda: schedule_widget(FakeCluster(2, RuntimeError("unused")), K=2, M=4),
    "zero_step_widget": lambda: zero_step_widget(n_d=2),
    "ring_attention_widget": lambda: ring_attention_widget(cp=4),
    "router_widget": lambda: router_widget(E=8, k=2, ep=4),
    "diloco_widget": lambda: diloco_widget({"ddp": [(0, 1.0), (4, 0.1)], ("diloco", 8): [(0, 1.0), (6, 0.1)]}, 0.1,
                                           compute_s=0.02, payload_bytes=1e6, N=4),
    "goodput_widget": lambda: goodput_widget(delta=60, restart=120, theta=3600),
}


def leaves(box):
    """Every control under an ipywidgets box, depth first."""
    for child in box.children:
        yield from leaves(child) if hasattr(child, "children") else [child]


def first_picture(box):
    return next(leaf for leaf in leaves(box) if type(leaf).__name__ == "Image").value


def feedback_of(box):
    """The widget's feedback line: (message, progress bar)."""
    [message, bar] = next(child for child in box.children if type(child).__name__ == "VBox").children
    return message, bar


def button_named(box, description):
    return next(leaf for leaf in leaves(box) if type(leaf).__name__ == "Button" and leaf.description == description)


@pytest.fixture
def shell():
    """An IPython shell, as in a notebook, whose display outputs a test can capture."""
    yield InteractiveShell.instance()
    InteractiveShell.clear_instance()


@pytest.mark.parametrize("name", EVERY_WIDGET)
def test_every_widget_leaves_a_static_picture_of_its_first_state(name, shell):
    with capture_output() as captured:
        widget = EVERY_WIDGET[name]()
    pictures = [output.data["image/png"] for output in captured.outputs if "image/png" in output.data]
    assert [base64.b64decode(text) for text in pictures] == [first_picture(widget)], "one PNG, the first picture"
    nbformat.validator.validate(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(outputs=[
        nbformat.v4.new_output("display_data", output.data) for output in captured.outputs])]))  # saved as is
    assert any("static picture" in output.data.get("text/markdown", "") for output in captured.outputs)


def test_outside_ipython_nothing_is_displayed(capsys):
    ring_widget(N=3)
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize("name", EVERY_WIDGET)
def test_every_label_fits_its_text(name):
    widget = EVERY_WIDGET[name]()
    for leaf in leaves(widget):
        kind, description = type(leaf).__name__, getattr(leaf, "description", "")
        if kind == "Button":
            assert int(leaf.layout.width.removesuffix("px")) >= len(description) * PX_PER_CHAR + BUTTON_PADDING_PX
        elif description:  # ipywidgets' default label is 80 px: "bucket_cap_mb (MiB)" needs about 150
            assert leaf.style.description_width == "initial", f"{kind} {description!r}"
        if kind == "ToggleButtons":
            longest = max(len(label) for label in leaf._options_labels)
            assert int(leaf.style.button_width.removesuffix("px")) >= longest * PX_PER_CHAR + BUTTON_PADDING_PX


def test_a_callback_error_of_any_kind_becomes_a_sentence_in_the_widget():
    feedback = Feedback()

    def broken(_):
        raise KeyError("stage")

    feedback.guard(broken, "Redrawing the bars")(None)
    assert feedback.failed and "parlab-error" in feedback.message.value
    assert "Redrawing the bars failed: KeyError: &#x27;stage&#x27;" in feedback.message.value
    assert "<details><summary>details</summary><pre>Traceback" in feedback.message.value  # ours, folded
    feedback.guard(lambda _: None, "Redrawing the bars")(None)
    assert feedback.message.value == "" and not feedback.failed  # the next good call clears it


def test_a_value_error_shows_its_own_sentence():
    feedback = Feedback()

    def refuse(_):
        raise ValueError("set M = 1 for the naive schedule <one micro-batch>.")

    feedback.guard(refuse, "Redrawing")(None)
    assert "set M = 1 for the naive schedule &lt;one micro-batch&gt;.</div>" in feedback.message.value
    assert "failed" not in feedback.message.value and "details" not in feedback.message.value


def test_a_redraw_that_raises_is_shown_in_the_widget_not_lost(monkeypatch):
    widget = zero_step_widget(n_d=2)
    stage, phase = widget.children[0].children
    monkeypatch.setattr("parlab.widgets.zero_steps.plot_zero_step", lambda *args: 1 / 0)
    phase.value = 2
    message, _ = feedback_of(widget)
    assert "Redrawing the step failed: ZeroDivisionError: division by zero" in message.value


@pytest.mark.parametrize("make", [
    lambda cluster: memory_widget(cluster),
    lambda cluster: schedule_widget(cluster, K=2, M=4),
], ids=["memory_widget", "schedule_widget"])
def test_a_rank_error_on_the_cluster_is_shown_with_its_traceback(make):
    remote = "Traceback (most recent call last):\n  File \"<cell>\", line 3\nZeroDivisionError: division by zero"
    widget = make(FakeCluster(2, RankError({1: remote})))
    [pressed] = [leaf for leaf in leaves(widget) if type(leaf).__name__ == "Button"]
    pressed.click()  # before: the RankError reached only JupyterLab's log console
    message, bar = feedback_of(widget)
    assert "on the cluster failed: RankError: rank 1 failed: ZeroDivisionError: division by zero" in message.value
    assert "File &quot;&lt;cell&gt;&quot;, line 3" in message.value and bar.layout.display == "none"


def test_a_cluster_closed_by_an_earlier_cell_is_replaced_by_one_of_the_same_size(monkeypatch):
    started = []

    def start(*args, **kwargs):
        started.append(parlab.Cluster(*args, **kwargs))
        return started[-1]

    monkeypatch.setattr("parlab.runtime.Cluster", start)
    monkeypatch.setattr("parlab.widgets.pipeline.MEASURE_T_F", 0.002)
    with parlab.Cluster(world_size=2, timeout=60) as given:
        pass  # closed, as a notebook's last cell leaves it
    try:
        widget = schedule_widget(given, name="gpipe", K=2, M=2)
        message, bar = feedback_of(widget)
        progress = []
        bar.observe(lambda change: progress.append(change["new"]), names="value")
        button_named(widget, "run on the cluster").click()
        assert [cluster.world_size for cluster in started] == [2]
        assert "started a new parlab.Cluster(world_size=2) for this widget" in message.value
        assert "measured bubble" in widget.children[-2].value
        assert progress == [1, 2] and bar.layout.display == "none"  # the warm-up step, then the traced one
        button_named(widget, "run on the cluster").click()
        assert len(started) == 1, "the new cluster is kept for the next press"
    finally:
        for cluster in started:
            cluster.close()


def test_widget_modules_share_helpers_through_the_private_module_only():
    folder = pathlib.Path(parlab.widgets.__file__).parent
    for path in folder.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("parlab.widgets."):
                private = [alias.name for alias in node.names if alias.name.startswith("_")]
                assert node.module == "parlab.widgets._common" or not private, f"{path.name}: {private}"
    assert not re.search(r"def _png\b", (folder / "collectives.py").read_text())
