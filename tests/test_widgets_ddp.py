"""Lecture 02's widgets without a browser: the buckets and overlap they draw (the DDP
wrapper's own plan, parlab.ddp's timing) and the widget answering its slider."""

import matplotlib
import pytest
from test_ddp_model import three_layers

from parlab.units import MIB
from parlab.widgets.ddp import bucket_widget, plot_bucket_sweep, plot_buckets

matplotlib.use("Agg")
N_D, ALPHA, BETA = 2, 1e-3, 1e-6  # 1 ms per message, 1 ms per KB: round numbers to compute by hand


# --- the figure and the widget ----------------------------------------------------------------


def bars(ax, row):
    """(x, width, colour) of the bars in the row "backward" (y 0.55) or "all-reduce" (y 1.05)."""
    y = {"backward": 0.55, "all-reduce": 1.05}[row]
    found = []
    for collection in ax.collections:
        colour = tuple(collection.get_facecolor()[0])
        for path in collection.get_paths():
            (x0, y0), (x1, _) = path.vertices.min(axis=0), path.vertices.max(axis=0)
            if abs(y0 - y) < 1e-9:
                found.append((x0, x1 - x0, colour))
    return sorted(found)


def test_plot_buckets_draws_one_bar_per_parameter_and_per_bucket_in_the_bucket_colours():
    ax = plot_buckets(three_layers(), 48 / MIB, N_D, ALPHA, BETA, backward_seconds=0.12)
    backward, all_reduce = bars(ax, "backward"), bars(ax, "all-reduce")
    assert [round(width, 6) for _, width, _ in backward] == [8, 32, 16, 64]  # ms, proportional to bytes
    assert [round(x, 6) for x, _, _ in all_reduce] == [40, 56, 120]
    colours = [colour for _, _, colour in backward]
    assert colours[0] == colours[1] != colours[2] != colours[3]
    assert [colour for _, _, colour in all_reduce] == [colours[0], colours[2], colours[3]]
    # The last bucket's ring on 2 ranks: 2 alpha + 64 beta = 2.06 ms after the end of backward.
    assert ax.get_title() == "bucket_cap_mb = 4.58e-05: 3 buckets, predicted end 122 ms, exposed communication 2.06 ms"
    [shaded] = ax.patches  # the exposed communication, from the end of backward to the end of the step
    assert shaded.get_path().transformed(shaded.get_patch_transform()).vertices[:, 0].min() == pytest.approx(120)


def test_bucket_widget_redraws_and_updates_its_readout_on_a_slider_move():
    widget = bucket_widget(three_layers(), N_D, ALPHA, BETA, backward_seconds=0.12, bucket_cap_mb=1)
    slider, readout, feedback, image = widget.children
    assert readout.value.startswith("<b>1</b> bucket;")
    assert "exposed communication <b>2.12 ms</b>" in readout.value  # 2 alpha + 120 bytes beta
    picture = image.value
    slider.value = 2**-20  # 1 byte: a bucket per parameter
    assert readout.value.startswith("<b>4</b> buckets")
    assert "exposed communication <b>2.06 ms</b>" in readout.value
    assert image.value != picture and image.value[:4] == b"\x89PNG"
    assert slider.description == "bucket_cap_mb (MiB)" and feedback.children[0].value == ""


def sweep_rows():
    return [dict(bucket_cap_mb=cap, buckets=buckets, median_s=seconds)
            for cap, buckets, seconds in ((0.5, 8, 0.3), (2, 2, 0.2), (8, 1, 0.4))]


def test_the_sweep_plot_puts_each_measured_cap_beside_the_model_with_its_buckets():
    ax = plot_bucket_sweep(sweep_rows(), [0.25, 0.2, 0.35])
    measured, model = ax.get_lines()
    assert list(measured.get_xdata()) == [0.5, 2, 8] and list(measured.get_ydata()) == pytest.approx([300, 200, 400])
    assert list(model.get_ydata()) == pytest.approx([250, 200, 350]) and model.get_linestyle() == "--"
    assert [text.get_text() for text in ax.texts] == ["8", "2", "1"]
    assert ax.get_xscale() == "log"


@pytest.mark.parametrize("call, message", [
    (lambda: plot_bucket_sweep(sweep_rows(), [0.1]), "one model time per row"),
    (lambda: plot_bucket_sweep([dict(bucket_cap_mb=None, buckets=1, median_s=0.1)], [0.1]),
     "a bucket_cap_mb in every row"),
    (lambda: bucket_widget(three_layers(), bucket_cap_mb=0),
     "bucket_cap_mb .* must be above 0 .*, got 0: the bucket slider has a log scale"),
    (lambda: bucket_widget(three_layers(), N_d=0), "N_d .the data-parallel degree. must be a whole number"),
    (lambda: plot_buckets(three_layers(), 1, N_D, ALPHA, BETA, backward_seconds=0), "backward_seconds must be above 0"),
    (lambda: plot_buckets("model", 1), "model must be a torch.nn.Module, got 'model'"),
])
def test_bad_input_gets_a_sentence_saying_what_to_change(call, message):
    with pytest.raises(ValueError, match=message):
        call()
