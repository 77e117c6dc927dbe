"""Lecture 07's widget without a browser: the bars are parlab's accounting and the paper's
formula, measured bytes are marked only on their own configuration, the widget answers its
controls (selective recompute among them), and a size that does not split is told in the
feedback line."""

import matplotlib
import pytest

from parlab.tensor_parallel.activations import korthikanti_bytes, layer_saved_bytes
from parlab.widgets.activations import MIB, activation_widget, plot_activation_memory

matplotlib.use("Agg")


def bar_widths(ax, y):
    return [patch.get_width() for patch in ax.patches if abs(patch.get_y() + patch.get_height() / 2 - y) < 1e-9]


def test_the_bars_are_the_accounting_stacked_and_the_formula():
    ax = plot_activation_memory(2048, 1, 4096, 32, t=4, sequence_parallel=True)
    items = layer_saved_bytes(2048, 1, 4096, 32, 4, True, value_bytes=2, mask_bytes=1)
    assert bar_widths(ax, 1) == pytest.approx([nbytes / MIB for nbytes in items.values()])
    assert bar_widths(ax, 0) == pytest.approx([korthikanti_bytes(2048, 1, 4096, 32, 4, True) / MIB])
    assert "t = 4, TP + SP" in ax.get_title()


def test_selective_recompute_drops_the_attention_s_s_by_s_items_from_both_bars():
    ax = plot_activation_memory(2048, 1, 4096, 32, t=4, sequence_parallel=True, recompute="selective")
    items = layer_saved_bytes(2048, 1, 4096, 32, 4, True, "selective", value_bytes=2, mask_bytes=1)
    assert not {"softmax output", "attention dropout output", "attention dropout mask"} & set(items)
    assert bar_widths(ax, 1) == pytest.approx([nbytes / MIB for nbytes in items.values()])
    assert bar_widths(ax, 0) == pytest.approx([2048 * 4096 * 34 / 4 / MIB])  # sbh 34/t
    assert "TP + SP, selective recompute" in ax.get_title()
    fp32 = plot_activation_memory(64, 8, 128, 4, value_bytes=4, mask_bytes=4).get_title()
    assert "(4-byte values, 4-byte masks), the paper's formula" in fp32 and "(2-byte values, 1-byte masks)" in fp32


def test_measured_bytes_are_marked_on_their_own_configuration_only():
    config = dict(s=16, b=2, h=32, a=4, t=2, sequence_parallel=False, recompute=False, value_bytes=4, mask_bytes=4)
    # recompute False (as measured) is the drawn "none"; selective is another configuration
    measured = [{"config": config, "bytes": 3 * MIB, "label": "measured, t = 2"},
                {"config": {**config, "t": 4}, "bytes": 9 * MIB, "label": "measured, t = 4"}]
    ax = plot_activation_memory(**config, measured=measured)
    [line] = ax.lines
    assert list(line.get_xdata()) == [3.0] and [text.get_text() for text in ax.texts] == ["measured, t = 2"]
    assert not plot_activation_memory(**{**config, "recompute": "selective"}, measured=measured).lines


def test_the_widget_redraws_on_a_control_and_reports_a_size_that_does_not_split():
    widget = activation_widget(s=1024, b=1, h=1024, a=16, t=2)
    first_row, second_row, recompute, readout, feedback, image = widget.children
    s_slider = first_row.children[0]
    t_slider, sp = second_row.children[1], second_row.children[2]
    before = (readout.value, image.value)
    assert f"{korthikanti_bytes(1024, 1, 1024, 16, 2) / MIB:.3g} MiB" in readout.value
    sp.value = True
    assert (readout.value, image.value) != before
    assert f"{korthikanti_bytes(1024, 1, 1024, 16, 2, True) / MIB:.3g} MiB" in readout.value
    t_slider.value = 32  # 16 heads do not split over 32 ranks
    assert "the heads over t = 32 ranks" in feedback.children[0].value
    t_slider.value = 4
    assert feedback.children[0].value == ""
    s_slider.value = 2048
    assert f"{korthikanti_bytes(2048, 1, 1024, 16, 4, True) / MIB:.3g} MiB" in readout.value
    assert recompute.value == "none"
    recompute.value = "selective"
    assert f"{korthikanti_bytes(2048, 1, 1024, 16, 4, True, 'selective') / MIB:.3g} MiB" in readout.value
    recompute.value = "full"
    assert f"{korthikanti_bytes(2048, 1, 1024, 16, 4, True, 'full') / MIB:.3g} MiB" in readout.value


def test_bad_sizes_are_refused_before_any_control():
    with pytest.raises(ValueError, match="pick t from 1 to 64"):
        activation_widget(t=128)
    with pytest.raises(ValueError, match="the heads over t = 3 ranks"):
        activation_widget(a=32, t=3)
    with pytest.raises(ValueError, match='recompute must be False'):
        activation_widget(recompute="attention")
