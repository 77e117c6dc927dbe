"""Lecture 09's ring-attention widget without a browser: the plan it draws against
``parlab.context_parallel``'s ring_sources and block_task, the filled cells against the work
of block_pairs, the bars and the sentence against load_imbalance, the widget answering its
controls, learners' mistakes refused with a sentence, and the static picture."""

import base64
import sys

import matplotlib
import pytest
from IPython.utils.capture import capture_output
from test_widgets_common import shell  # noqa: F401 (a fixture: an IPython shell, as in a notebook)
from test_widgets_pipeline import controls

from parlab.context_parallel import SPLITS, block_pairs, block_task, load_imbalance, ring_sources
from parlab.widgets.context_parallel import (
    CELL,
    plot_ring_steps,
    plot_work_per_rank,
    ring_attention_widget,
    ring_figure,
    ring_plan,
    ring_readout,
)

matplotlib.use("Agg")
SETTINGS = [(cp, split, causal) for cp in (1, 2, 4, 8) for split in SPLITS for causal in (True, False)]


# --- the plain functions -------------------------------------------------------------------------


@pytest.mark.parametrize("cp, split, causal", SETTINGS)
def test_the_plan_is_the_packages_ring_and_block_tasks(cp, split, causal):
    plan = ring_plan(cp, split, causal)
    assert len(plan) == cp and all(len(row) == cp for row in plan)
    for i, row in enumerate(plan):
        for r, (src, task) in enumerate(row):
            assert src == ring_sources(r, cp)[i]
            assert task == block_task(r, src, cp, split, causal)


def filled(ax):
    """{(step, rank): area} of the cells' filled patches, from their gids "step-rank"."""
    return {tuple(map(int, patch.get_gid().split("-"))): patch.get_width() * patch.get_height()
            for patch in ax.patches if patch.get_gid()}


@pytest.mark.parametrize("cp, split, causal", SETTINGS)
def test_each_filled_cell_is_the_part_of_the_block_the_rank_computes(cp, split, causal):
    areas = filled(plot_ring_steps(cp, split, causal))
    plan = ring_plan(cp, split, causal)
    assert set(areas) == {(i, r) for i in range(cp) for r in range(cp) if plan[i][r][1] is not None}
    for (i, r), area in areas.items():
        assert area == pytest.approx(plan[i][r][1].area * CELL**2)
    for r, work in enumerate(block_pairs(cp, split, causal)):  # summed over the steps: the rank's work
        assert sum(area for (_, rank), area in areas.items() if rank == r) == pytest.approx(work * CELL**2)


def test_the_causal_contiguous_ring_skips_the_blocks_above_the_diagonal():
    ax = plot_ring_steps(4, "contiguous", True)
    assert sorted(filled(ax)) == sorted((i, r) for r in range(4) for i in range(r + 1))  # rank r: steps 0 .. r
    labels = [text.get_text() for text in ax.texts]
    assert labels.count("K/V of 0") == 4 and "K/V of 3" in labels
    assert "rank 0\nQ chunks 0, 1" in [label.get_text() for label in ax.get_yticklabels()]
    legend = [text.get_text() for text in ax.get_legend().get_texts()]
    assert legend == ["computed (every key visible)", "computed with the causal mask (diagonal)",
                      "skipped (above the diagonal)"]


def test_zig_zag_halves_and_the_diagonal_mask_are_drawn_where_block_task_puts_them():
    ax = plot_ring_steps(4, "zigzag", True)
    areas = filled(ax)
    assert areas[(0, 2)] == pytest.approx(CELL**2)  # the diagonal block, computed whole with the mask
    assert areas[(1, 2)] == pytest.approx(CELL**2 / 2)  # keys of rank 1 < 2: their first half
    cells = {patch.get_gid(): patch for patch in ax.patches if patch.get_gid()}
    below, beside = cells["1-2"], cells["1-0"]  # rank 2 with src 1 (first half of the keys); rank 0 with src 3
    assert below.get_width() == pytest.approx(CELL / 2) and below.get_height() == pytest.approx(CELL)
    assert beside.get_y() == pytest.approx(CELL / 2) and beside.get_width() == pytest.approx(CELL)  # 2nd half of Q
    assert "rank 1\nQ chunks 1, 6" in [label.get_text() for label in ax.get_yticklabels()]
    assert "skipped (above the diagonal)" not in [text.get_text() for text in ax.get_legend().get_texts()]


def test_the_step_frames_its_column_and_fades_the_steps_after_it():
    ax = plot_ring_steps(4, "zigzag", True, step=1)
    cells = {patch.get_gid(): patch for patch in ax.patches if patch.get_gid()}
    assert [cells[f"{i}-0"].get_alpha() for i in range(4)] == [1.0, 1.0, 0.25, 0.25]
    frames = [patch for patch in ax.patches if patch.get_linewidth() == 1.6]
    assert len(frames) == 1 and frames[0].get_x() == pytest.approx(1 - 0.12)


@pytest.mark.parametrize("cp", [2, 4, 8])
@pytest.mark.parametrize("causal", [True, False])
def test_the_bars_are_block_pairs_and_the_legend_gives_the_imbalance(cp, causal):
    ax = plot_work_per_rank(cp, causal, "zigzag")
    for split in SPLITS:
        bars = [patch for patch in ax.patches if patch.get_gid() == split]
        assert [bar.get_height() for bar in bars] == pytest.approx(block_pairs(cp, split, causal))
    legend = [text.get_text() for text in ax.get_legend().get_texts()]
    contiguous = load_imbalance(block_pairs(cp, "contiguous", causal))
    assert f"contiguous: slowest / mean {contiguous:.2f}" in legend[1]
    assert legend[2] == "zig-zag: slowest / mean 1.00"
    if causal:
        assert contiguous == pytest.approx(2 * cp / (cp + 1))
        assert legend[1].endswith(f"= 2cp/(cp+1) = {2 * cp}/{cp + 1}")
    else:
        assert contiguous == 1.0 and "2cp/(cp+1)" not in legend[1]


def test_the_figure_puts_the_steps_beside_the_work():
    steps, work = ring_figure(8, "contiguous", True, step=3).axes[:2]
    assert "cp = 8, contiguous split, causal" in steps.get_title()
    assert work.get_title() == "work per rank over all the steps"


def test_the_sentence_gives_each_ranks_block_pairs_and_the_imbalance():
    assert ring_readout(4, "contiguous", True, 1) == (
        "step 1: 3 of 4 ranks compute with the block they hold. Over all 4 steps the ranks compute 1, 2, 3, 4 "
        "block pairs of (s/cp) x (s/cp) (the diagonal block counts whole): slowest / mean = 1.60 "
        "(2cp/(cp+1) = 1.60).")
    zigzag = ring_readout(8, "zigzag", True, 5)
    assert "8 of 8 ranks compute" in zigzag and "4.5, 4.5, 4.5" in zigzag and zigzag.endswith("= 1.00.")
    assert "compute 4, 4, 4, 4 block pairs" in ring_readout(4, "contiguous", False, 0)


@pytest.mark.parametrize("call, message", [
    (lambda: ring_plan(9, "zigzag", True), r"cp \(the context-parallel degree\) must be a whole number from 1 to 8, "
                                           "got 9: the step-through draws 1 to 8 ranks."),
    (lambda: ring_plan(4, "zig-zag", True), "split must be 'contiguous' or 'zigzag', got 'zig-zag': pick one"),
    (lambda: ring_plan(4, "zigzag", "yes"), "causal must be True or False, got 'yes'"),
    (lambda: plot_ring_steps(4, step=4), r"step \(of the ring\) must be a whole number from 0 to 3, got 4: the ring"),
    (lambda: ring_readout(2, "contiguous", True, -1), "the ring of cp = 2 ranks has steps 0 to 1"),
    (lambda: ring_attention_widget(cp=3), "cp must be one of 2, 4, 8 .the widget's choices., got 3"),
    (lambda: ring_attention_widget(cp=4, split="diagonal"), "split must be 'contiguous' or 'zigzag'"),
])
def test_bad_input_gets_a_sentence_saying_what_to_change(call, message):
    with pytest.raises(ValueError, match=message):
        call()


# --- the widget ------------------------------------------------------------------------------------


def test_the_widget_redraws_when_its_controls_change():
    widget = ring_attention_widget(cp=4, split="zigzag", causal=True)
    found, readout, image = controls(widget), widget.children[-2], widget.children[-1]
    assert image.value[:8] == b"\x89PNG\r\n\x1a\n"
    assert readout.value == ring_readout(4, "zigzag", True, 0)
    assert found["step"].max == 3
    pictures = [image.value]
    found["step"].value = 2
    assert readout.value.startswith("step 2: 4 of 4 ranks") and image.value not in pictures
    pictures.append(image.value)
    found["split"].value = "contiguous"
    assert "1, 2, 3, 4 block pairs" in readout.value and "step 2: 2 of 4 ranks" in readout.value
    assert image.value not in pictures
    pictures.append(image.value)
    found["attention"].value = False
    assert "4, 4, 4, 4 block pairs" in readout.value and image.value not in pictures
    found["cp"].value = 8
    assert found["step"].max == 7 and "Over all 8 steps" in readout.value
    found["step"].value = 7
    found["cp"].value = 2
    assert found["step"].value == 1 and readout.value.startswith("step 1: 2 of 2 ranks")
    assert "parlab-error" not in widget.children[-3].children[0].value


def test_without_ipywidgets_the_widget_is_the_static_figure_of_every_step(monkeypatch):
    from matplotlib.figure import Figure

    monkeypatch.setitem(sys.modules, "ipywidgets", None)
    with pytest.warns(UserWarning, match="ipywidgets is not installed"):
        figure = ring_attention_widget(cp=2, split="contiguous")
    assert isinstance(figure, Figure) and "cp = 2, contiguous split" in figure.axes[0].get_title()
    assert all(patch.get_alpha() in (None, 1.0) for patch in figure.axes[0].patches)  # no step: nothing faded


def static_picture(make):
    """(the widget, the PNG it displayed, its captions) of ``make()`` in an IPython shell."""
    with capture_output() as captured:
        widget = make()
    [picture] = [base64.b64decode(output.data["image/png"]) for output in captured.outputs
                 if "image/png" in output.data]
    assert picture[:8] == b"\x89PNG\r\n\x1a\n"
    return widget, picture, [output.data.get("text/markdown", "") for output in captured.outputs]


@pytest.mark.usefixtures("shell")
def test_in_a_notebook_the_widget_leaves_a_png_of_its_first_state():
    widget, picture, captions = static_picture(lambda: ring_attention_widget(cp=4))
    assert picture == widget.children[-1].value
    assert any("ring attention on cp = 4 ranks, zig-zag split, step 0" in caption for caption in captions)
