"""The ZeRO step-through without a browser: the holdings of each stage and phase (golden, and
what the engines really keep at rest, measured on two ranks), the figure's cells, the widget
answering its controls, and the static fallback."""

import sys

import matplotlib
import pytest
from matplotlib.colors import to_rgba

from parlab.memory import FP32_ADAM
from parlab.widgets.memory import measure_stages, small_model
from parlab.widgets.zero_steps import (
    COLOURS,
    LABELS,
    STEP_PHASES,
    plot_zero_step,
    plot_zero_steps,
    zero_step_holdings,
    zero_step_widget,
)

matplotlib.use("Agg")
_ = None  # a shard the rank does not hold, in the golden tables


def rank(stage, phase, r, n_d=4):
    holding = zero_step_holdings(stage, phase, n_d)[r]
    return holding["params"], holding["grads"], holding["optimizer"]


def test_stage_0_all_reduces_then_steps_everything_everywhere():
    assert rank(0, 0, 0) == (("w",) * 4, ("g_r",) * 4, ("opt",) * 4)
    # rank 1 owns shard 1: the ring reduce-scatter leaves the averaged chunk 1 there
    assert rank(0, 1, 1)[1] == ("partial", "g_avg", "partial", "partial")
    assert rank(0, 2, 3) == (("w",) * 4, ("g_avg",) * 4, ("opt",) * 4)
    assert rank(0, 3, 2) == (("w'",) * 4, ("g_avg",) * 4, ("opt'",) * 4)


def test_stage_1_shards_the_optimizer_state_and_keeps_the_full_gradient_buffer():
    assert rank(1, 0, 1) == (("w",) * 4, ("g_r",) * 4, (_, "opt", _, _))
    assert rank(1, 1, 0) == (("w",) * 4, ("g_avg", "partial", "partial", "partial"), ("opt", _, _, _))
    assert rank(1, 2, 2) == (("w", "w", "w'", "w"), ("partial", "partial", "g_avg", "partial"),
                             (_, _, "opt'", _))
    assert rank(1, 3, 2) == (("w'",) * 4, ("partial", "partial", "g_avg", "partial"), (_, _, "opt'", _))


def test_stage_2_never_holds_a_full_gradient():
    # its buckets are reduce-scattered during backward (parlab.zero.buckets): after backward a
    # rank holds its averaged shard only (the picture once showed every rank's full g_r there)
    assert len(STEP_PHASES[2]) == 3 and "bucket" in STEP_PHASES[2][0]
    assert all("g_r" not in rank(2, phase, r)[1] for phase in range(3) for r in range(4))
    assert rank(2, 0, 3) == (("w",) * 4, (_, _, _, "g_avg"), (_, _, _, "opt"))
    assert rank(2, 1, 2) == (("w", "w", "w'", "w"), (_, _, "g_avg", _), (_, _, "opt'", _))
    assert rank(2, 2, 1) == (("w'",) * 4, (_, "g_avg", _, _), (_, "opt'", _, _))


def test_stage_3_gathers_a_unit_only_around_its_forward_and_backward():
    assert [rank(3, phase, 1)[0] for phase in range(5)] == [
        ("w",) * 4, (_, "w", _, _), ("w",) * 4, (_, "w", _, _), (_, "w'", _, _)]
    assert [rank(3, phase, 1)[1] for phase in range(5)] == [
        (_,) * 4, (_,) * 4, ("g_r",) * 4, (_, "g_avg", _, _), (_, "g_avg", _, _)]
    assert [rank(3, phase, 0)[2] for phase in range(5)] == [("opt", _, _, _)] * 4 + [("opt'", _, _, _)]


@pytest.mark.parametrize("stage", sorted(STEP_PHASES))
@pytest.mark.parametrize("n_d", [1, 2, 3, 5])
def test_sharded_states_are_held_on_the_owned_shard_only(stage, n_d):
    for phase in range(len(STEP_PHASES[stage])):
        for r, holding in enumerate(zero_step_holdings(stage, phase, n_d)):
            held = {part: [shard for shard, label in enumerate(labels) if label] for part, labels in holding.items()}
            if stage > 0:
                assert held["optimizer"] == [r], (stage, phase, r)
            if phase == len(STEP_PHASES[stage]) - 1 and stage >= 2:
                assert held["grads"] == [r]
            if phase == len(STEP_PHASES[stage]) - 1 and stage == 3:
                assert held["params"] == [r]


def test_learner_errors():
    with pytest.raises(ValueError, match="ZeRO stage 0, 1, 2 or 3"):
        zero_step_holdings(4, 0)
    with pytest.raises(ValueError, match="stage 1 has phases 0 to 3"):
        zero_step_holdings(1, 4)
    with pytest.raises(ValueError, match="whole number >= 1, got 0"):
        zero_step_holdings(2, 0, n_d=0)
    with pytest.raises(ValueError, match="whole number from 1 to 8, got 9: the step-through draws 1 to 8 ranks"):
        plot_zero_step(2, 0, n_d=9)
    with pytest.raises(ValueError, match="ZeRO stage 0, 1, 2 or 3 .*got 5"):
        plot_zero_steps(5)  # was a KeyError
    with pytest.raises(ValueError, match="whole number from 1 to 8, got 2.5"):
        plot_zero_steps(2, n_d=2.5)
    with pytest.raises(ValueError, match="ZeRO stage 0, 1, 2 or 3 .*got '2'"):
        zero_step_widget(stage="2")  # was a TraitError of the dropdown
    with pytest.raises(ValueError, match="got 9"):
        zero_step_widget(n_d=9)


def test_the_last_phase_is_what_the_engines_hold_at_rest_on_two_ranks(cluster2):
    """After a step, ZeroDP (stages 0-2) and FSDP (stage 3) hold 4 bytes per parameter and per
    gradient element of each shard the last phase draws, 8 per optimizer-state element
    (fp32 Adam, Psi even: no padding), plus Adam's step counts."""
    measured = measure_stages(cluster2)
    shard = sum(p.numel() for p in small_model().parameters()) // 2
    for stage in STEP_PHASES:
        most = max(zero_step_holdings(stage, len(STEP_PHASES[stage]) - 1, 2),
                   key=lambda holding: sum(label is not None for labels in holding.values() for label in labels))
        drawn = {part: sum(label is not None for label in labels) * shard for part, labels in most.items()}
        state = measured[stage]
        assert (state.params, state.grads) == (FP32_ADAM.param_bytes * drawn["params"],
                                               FP32_ADAM.grad_bytes * drawn["grads"]), stage
        assert 0 <= state.optimizer - FP32_ADAM.kappa * drawn["optimizer"] <= 4 * 8, stage


def cells(ax):
    """{(rank, part, shard): patch} of the step-through's cells."""
    return {tuple(int(x) if x.isdigit() else x for x in patch.get_gid().split("-")): patch
            for patch in ax.patches if patch.get_gid()}


def test_the_figure_draws_one_cell_per_rank_state_and_shard():
    ax = plot_zero_step(1, 2, n_d=4)
    found = cells(ax)
    assert len(found) == 4 * 3 * 4
    holdings = zero_step_holdings(1, 2, 4)
    for (r, part, shard), patch in found.items():
        label = holdings[r][part][shard]
        assert patch.get_facecolor() == to_rgba(COLOURS[label] if label else "white"), (r, part, shard)
        owned = shard == r
        assert (patch.get_edgecolor() == to_rgba("black")) == owned
    written = [text.get_text() for text in ax.texts if not text.get_text().startswith("shard")]
    # each rank: 4 parameter shards, 4 gradient shards (stage 1 keeps the buffer), 1 optimizer shard
    assert len(written) == 4 * 9
    assert written[:9] == [LABELS[label] for label in ("w'", "w", "w", "w", "g_avg", "partial", "partial",
                                                       "partial", "opt'")]
    assert [t.get_text() for t in ax.get_yticklabels()] == [f"rank {r} (owns {r})" for r in range(4)]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["parameters", "gradients", "optimizer state"]
    assert ax.get_title() == "ZeRO stage 1, phase 3/4: optimizer step on the own shard"


def test_an_empty_shard_is_a_white_cell_without_text():
    ax = plot_zero_step(3, 1, n_d=2)  # forward done: one parameter shard, no gradient
    found = cells(ax)
    assert len(found) == 2 * 3 * 2
    assert found[0, "grads", 1].get_facecolor() == to_rgba("white")
    assert found[0, "params", 1].get_facecolor() == to_rgba("white")
    assert found[0, "params", 0].get_facecolor() == to_rgba(COLOURS["w"])  # rank 0 owns shard 0
    assert sum(not text.get_text().startswith("shard") for text in ax.texts) == 2 * 2  # w and opt per rank


def test_plot_zero_steps_draws_every_phase():
    figure = plot_zero_steps(3, n_d=2)
    titles = [ax.get_title() for ax in figure.axes if ax.get_title()]
    assert titles == [f"ZeRO stage 3, phase {i + 1}/5: {name}" for i, name in enumerate(STEP_PHASES[3])]
    assert len(figure.axes) == 6 and not figure.axes[5].axison  # 5 panels, two a row


def test_the_widget_answers_its_controls():
    widget = zero_step_widget(n_d=2)
    (stage, phase), image = widget.children[0].children, widget.children[-1]
    assert (stage.value, phase.value, phase.max) == (2, 1, 3)
    assert image.value[:4] == b"\x89PNG"
    picture = image.value
    phase.value = 3
    assert image.value != picture
    stage.value = 3
    assert phase.max == 5 and phase.value == 3
    phase.value = 5
    stage.value = 1  # four phases: the slider is clamped to the last
    assert (phase.max, phase.value) == (4, 4)


def test_without_ipywidgets_the_widget_is_the_static_figure(monkeypatch):
    from matplotlib.figure import Figure

    monkeypatch.setitem(sys.modules, "ipywidgets", None)
    with pytest.warns(UserWarning, match="ipywidgets is not installed"):
        figure = zero_step_widget(n_d=2)
    assert isinstance(figure, Figure) and len(figure.axes) == 4  # 3 panels, two a row
    assert figure.axes[0].get_title().startswith("ZeRO stage 2, phase 1/3")
