"""The ZeRO lecture's memory widget without a browser: the bars are the paper's formula, the
device line, measured bars beside predicted ones, the widget answering its controls, and
(when the engines exist) the stages measured on two real ranks."""

import importlib.util
import sys

import matplotlib
import pytest

from parlab.memory import FP32_ADAM, STAGES, ModelState, model_state_bytes
from parlab.units import GB
from parlab.widgets.memory import (
    PSI_PRESETS,
    measure_stages,
    memory_bars,
    memory_readout,
    memory_widget,
    parse_psi,
    small_model,
)

matplotlib.use("Agg")
ENGINES = all(importlib.util.find_spec(name) for name in ("parlab.zero.stages", "parlab.zero.fsdp"))
needs_engines = pytest.mark.skipif(not ENGINES, reason="parlab.zero.stages and parlab.zero.fsdp are not written yet")
SMALL_PSI = 32 * 64 + 64 + 64 * 64 + 64 + 64 * 8 + 8


def bars(ax, kind):
    """{(stage, part): (x centre, bottom, height)} of the bar rectangles of ``kind``."""
    found = {}
    for patch in ax.patches:
        gid = patch.get_gid() or ""
        if gid.startswith(kind + "-"):
            _, stage, part = gid.split("-")
            found[int(stage), part] = (patch.get_x() + patch.get_width() / 2, patch.get_y(), patch.get_height())
    return found


def horizontal_lines(ax):
    return [line.get_ydata()[0] for line in ax.lines if line.get_ydata()[0] == line.get_ydata()[1]]


def test_parse_psi():
    assert [parse_psi(text) for text in ("7.5B", "125M", "20k", "1e9", "6792", " 1,000 ", "2T")] == [
        7.5e9, 125e6, 20e3, 1e9, 6792, 1000, 2e12]
    assert parse_psi("70B") == PSI_PRESETS["70B"]
    with pytest.raises(ValueError, match="like 7.5B"):
        parse_psi("seven")
    with pytest.raises(ValueError, match="at least 0"):
        parse_psi("-1B")
    for endless in ("nan", "inf", "1e400"):  # all three were taken as numbers of parameters
        with pytest.raises(ValueError, match=f"finite number of at least 0, not '{endless}'"):
            parse_psi(endless)


@pytest.mark.parametrize("call, message", [
    (lambda: memory_bars(7.5e9, 0), "n_d .* must be a whole number >= 1, got 0"),
    (lambda: memory_bars(7.5e9, 64, device_gb=0), "device_gb must be above 0 .*, got 0"),
    (lambda: memory_bars(7.5e9, 64, kappa=-1), "kappa must be at least 0 .*, got -1"),
    (lambda: memory_readout(7.5e9, 2.5), "whole number >= 1, got 2.5"),
    (lambda: memory_widget(n_d=2000), "must be a whole number from 1 to 1024, got 2000: the N_d slider"),
    (lambda: memory_widget(psi="lots"), "like 7.5B, 125M or 1e9, not 'lots'"),
    (lambda: memory_widget(device_gb=0), "device_gb must be a number from 1 to 10000, got 0"),
])
def test_bad_input_gets_a_sentence_saying_what_to_change(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_bar_heights_are_the_papers_formula_in_gigabytes():
    ax = memory_bars(7.5e9, 64)
    found = bars(ax, "predicted")
    assert len(found) == 12 and not bars(ax, "measured")
    for stage in STAGES:
        state = model_state_bytes(7.5e9, stage, 64)
        x, bottom = stage, 0.0
        for part in ("params", "grads", "optimizer"):
            centre, y, height = found[stage, part]
            assert (centre, y, height) == pytest.approx((x, bottom, getattr(state, part) / GB))
            bottom += height
    assert [text.get_text() for text in ax.texts if text.get_text()[0].isdigit()] == ["120", "31.4", "16.6", "1.88"]
    assert ax.get_ylabel() == "model states per device (GB)"
    assert horizontal_lines(ax) == [80]  # the device line, within view of the 120 GB bar
    assert ax.get_title().startswith("Psi = 7.5B, N_d = 64, kappa = 12, 2+2 bytes")
    assert ax.get_title().endswith("fits an 80 GB device from stage 1")


def test_the_device_line_moves_with_device_gb_and_says_when_nothing_fits():
    ax = memory_bars(70e9, 8, device_gb=40)
    assert horizontal_lines(ax) == [40]
    assert ax.get_title().endswith("no stage fits a 40 GB device")  # 70B / 8 x 16 bytes = 140 GB


@pytest.mark.parametrize("device_gb, article", [
    (8, "an"), (11, "an"), (18, "an"), (80, "an"), (89, "an"), (8.5, "an"), (800, "an"), (11000, "an"),
    (1, "a"), (16, "a"), (24, "a"), (40, "a"), (90, "a"), (110, "a"), (180, "a"), (1100, "a")])
def test_the_title_says_a_or_an_as_the_device_size_is_read(device_gb, article):
    assert f"fits {article} {device_gb:g} GB device" in memory_bars(7.5e9, 64, device_gb=device_gb).get_title()


def test_a_small_model_is_drawn_in_kilobytes_without_a_far_away_device_line():
    ax = memory_bars(SMALL_PSI, 2, *FP32_ADAM)
    assert ax.get_ylabel() == "model states per device (KB)"
    assert bars(ax, "predicted")[0, "optimizer"][2] == pytest.approx(8 * SMALL_PSI / 1e3)
    assert horizontal_lines(ax) == []


def test_measured_bars_stand_beside_the_predicted_ones():
    measured = {0: ModelState(4000, 4000, 8000), 3: ModelState(2000, 2000, 4100)}
    ax = memory_bars(1000, 2, *FP32_ADAM, measured=measured)
    predicted, found = bars(ax, "predicted"), bars(ax, "measured")
    assert sorted(found) == sorted((stage, part) for stage in (0, 3) for part in ("params", "grads", "optimizer"))
    assert found[3, "optimizer"] == pytest.approx((3.2, 4.0, 4.1))  # KB
    assert predicted[3, "optimizer"] == pytest.approx((2.8, 4.0, 4.0))
    assert predicted[1, "params"][0] == pytest.approx(0.8)
    assert "measured" in [text.get_text() for text in ax.get_legend().get_texts()]


def test_highlighted_stage_is_outlined():
    ax = memory_bars(7.5e9, 64, highlight=2)
    edge = {patch.get_gid(): patch.get_edgecolor() for patch in ax.patches if patch.get_gid()}
    assert edge["predicted-2-params"] == (0, 0, 0, 1) != edge["predicted-1-params"]


def test_memory_readout_table():
    html = memory_readout(7.5e9, 64, highlight=1)
    assert "<tr><td>0: DDP</td><td>15</td><td>15</td><td>90</td><td>120</td><td>no</td></tr>" in html
    assert "<b>31.4</b>" in html and "<td>16.6</td>" in html and "<td>1.88</td><td>yes</td>" in html


def test_widget_answers_its_controls():
    widget = memory_widget(psi="7.5B", n_d=64)
    (preset, psi_text), (dtype, device), (kappa, ranks) = (row.children for row in widget.children[:3])
    feedback, image, readout = widget.children[-3:]
    status = feedback.children[0]
    assert "<td>31.4</td>" in readout.value and image.value[:4] == b"\x89PNG"
    picture = image.value
    ranks.value = 1  # plain data parallelism: every stage holds everything
    assert readout.value.count(">120<") == 4 and image.value != picture
    preset.value = "1.5B"
    assert psi_text.value == "1.5B" and readout.value.count(">24<") == 4
    dtype.value = "fp32"
    assert kappa.value == 8 and readout.value.count(">24<") == 4  # 4 + 4 + 8 bytes, 16 again
    assert kappa.description == "kappa"  # the ZeRO paper's K: K counts pipeline stages here
    device.value = 20
    assert readout.value.count(">no<") == 4
    psi_text.value = "lots"
    assert "like 7.5B" in status.value and "parlab-error" in status.value
    psi_text.value = "7.5B"  # a good value again: the error goes
    assert status.value == "" and readout.value.count(">120<") == 4  # 7.5B x 16 bytes on one rank
    assert len(widget.children) == 7  # no cluster, no button


def test_without_ipywidgets_the_widget_is_the_static_figure(monkeypatch):
    from matplotlib.figure import Figure

    monkeypatch.setitem(sys.modules, "ipywidgets", None)
    with pytest.warns(UserWarning, match="ipywidgets is not installed"):
        figure = memory_widget()
    assert isinstance(figure, Figure) and len(bars(figure.axes[0], "predicted")) == 12


def test_measure_stages_rejects_a_stage_that_is_not_zero():
    with pytest.raises(ValueError, match="ZeRO stages 0 to 3"):
        measure_stages(None, stages=(1, 4))


@needs_engines
def test_measured_stages_on_two_ranks_match_the_formula(cluster2):
    measured = measure_stages(cluster2)
    assert sum(p.numel() for p in small_model().parameters()) == SMALL_PSI
    for stage in STAGES:
        predicted = model_state_bytes(SMALL_PSI, stage, 2, *FP32_ADAM)
        assert measured[stage][:2] == predicted[:2], stage  # no padding: every layer's size is even
        # fp32 Adam also holds a 4-byte step per flat group (a few groups at most)
        assert 0 <= measured[stage].optimizer - predicted.optimizer <= 4 * 8, stage
    totals = [measured[stage].total for stage in STAGES]
    assert totals == sorted(totals, reverse=True)


@needs_engines
def test_the_widget_button_measures_and_overlays(cluster2, monkeypatch):
    import parlab.widgets.memory as module

    drawn = []  # the measured argument of every figure the widget draws
    draw = module.memory_bars
    monkeypatch.setattr(module, "memory_bars", lambda *args: drawn.append(args[7]) or draw(*args))
    widget = memory_widget(cluster2)
    (preset, psi_text), (dtype, _), (kappa, ranks) = (row.children for row in widget.children[:3])
    button, bar = widget.children[4], widget.children[5].children[1]
    assert button.description == "measure on the cluster" and drawn == [None]
    progress = []  # the bar's value after each step
    bar.observe(lambda change: progress.append(change["new"]), names="value")
    button.click()
    assert progress == [1, 2, 3, 4] and bar.max == 4 and bar.layout.display == "none"  # one step per stage
    assert (psi_text.value, ranks.value, dtype.value, kappa.value) == (str(SMALL_PSI), 2, "fp32", 8)
    assert sorted(drawn[-1]) == list(STAGES)  # measured bars beside the predicted ones
    assert drawn[-1][3].params == model_state_bytes(SMALL_PSI, 3, 2, *FP32_ADAM).params
    ranks.value = 4  # away from the measured configuration: the overlay goes
    assert drawn[-1] is None
