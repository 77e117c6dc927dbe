"""The planner's chart, table and widget without a browser: the points are the planner's
numbers, the table its rows, the widget answers its controls and shows a bad value as a
sentence; "run this plan" runs the chosen plan on emulated ranks (for the small GPT only) and
shows it beside the prediction; the predicted-vs-measured chart and text show each run."""

import sys
from dataclasses import replace

import matplotlib
import pytest

from parlab.plan import Batch, Hardware, Measured, Model, format_table, measure, plan_table, plans
from parlab.units import GIB
from parlab.widgets.plan import format_measured, hardware_of, plan_widget, plot_plans, plot_predicted_vs_measured

matplotlib.use("Agg")
SEVENTY_B, SIXTY_FOUR_NODES = Model.llama2_70b(), Hardware.dgx_a100(64)


@pytest.fixture(scope="module")
def every():
    return plans(SEVENTY_B, Batch(1536), SIXTY_FOUR_NODES)


def points(ax):
    plotted = [line for line in ax.lines if (line.get_gid() or "").startswith("plan")]
    return {line.get_gid(): tuple(line.get_xydata()[0]) for line in plotted}


def test_the_points_are_the_fastest_plans_time_and_memory(every):
    ax = plot_plans(every, SIXTY_FOUR_NODES, n=5)
    accepted = [p for p in every if not p.rejected][:5]
    assert points(ax) == {f"plan-{i}": (p.time.total, p.memory.total / GIB) for i, p in enumerate(accepted)}
    [limit] = [line for line in ax.lines if line.get_gid() is None]
    assert limit.get_ydata()[0] == 80  # the GPU's memory in GiB
    assert "5 fastest plans on 64 x 8 A100 80 GB" in ax.get_title()


def test_each_point_names_its_plan_recompute_offload_and_shard_group_included():
    node, four_nodes = Hardware.dgx_a100(1), Hardware.dgx_a100(4)
    every = plans(SEVENTY_B, Batch(1024), node)
    best = next(p for p in every if not p.rejected)
    labels = [text.get_text() for text in plot_plans(every, node, n=8).texts]
    assert best.offload and best.recompute == "selective"  # the 70B on one node: offloaded and recomputed
    assert labels[0] == f"{best.N_d}x{best.t}x{best.K} Z{best.zero} sel off"
    full = next(p for p in every if not p.rejected and p.recompute == "full")
    assert plot_plans([full], node).texts[0].get_text().endswith(" rc off")
    hybrid = next(p for p in plans(Model.small_gpt(), Batch(512), four_nodes) if p.shard_group and not p.rejected)
    assert f"Z3 S={hybrid.shard_group}" in plot_plans([hybrid], four_nodes).texts[0].get_text()


def test_a_small_model_is_drawn_in_mib_without_flattening_it_under_the_gpu_line():
    node = Hardware.dgx_a100(1)
    every = plans(Model.small_gpt(), Batch(512), node)
    ax = plot_plans(every, node, n=4)
    accepted = [p for p in every if not p.rejected][:4]
    assert points(ax) == {f"plan-{i}": (p.time.total, p.memory.total / 2**20) for i, p in enumerate(accepted)}
    assert ax.get_ylabel() == "memory per GPU (MiB)" and ax.get_ylim()[1] < 80 * 1024
    [limit] = [line for line in ax.lines if line.get_gid() is None]
    assert len(limit.get_xdata()) == 0 and limit.get_label() == "GPU memory, 80 GiB: far above these plans"


def test_with_nothing_accepted_the_chart_says_why():
    small_host = replace(Hardware.dgx_a100(1), host_memory=2**40)  # the DGX A100 320GB's 1 TB: the 70B does not fit
    every = plans(SEVENTY_B, Batch(1536), small_host)
    ax = plot_plans(every, small_host)
    assert points(ax) == {}
    [text] = ax.texts
    assert f"no plan accepted ({len(every)} rejected)" in text.get_text() and "does not fit" in text.get_text()


def test_the_table_rows_are_the_plans(every):
    rows = plan_table(every, n=3, rejected=2)
    accepted, rejected = [p for p in every if not p.rejected], [p for p in every if p.rejected]
    assert [(r["N_d"], r["t"], r["K"], r["ZeRO"]) for r in rows] == [
        (p.N_d, p.t, p.K, p.zero) for p in accepted[:3] + rejected[:2]]
    assert rows[0]["step (s)"] == accepted[0].time.total and rows[0]["GiB"] == accepted[0].memory.total / GIB
    assert rows[0]["verdict"] == "accepted" and rows[3]["verdict"] == " ".join(rejected[0].reasons)
    lines = format_table(rows).splitlines()
    assert len(lines) == 6 and lines[0].split()[:3] == ["N_d", "t", "K"]
    assert lines[4].endswith(rows[3]["verdict"])
    with pytest.raises(ValueError, match="how many accepted plans"):
        plan_table(every, n=-1)


def test_an_unbuildable_plan_has_dashes_for_its_numbers():
    every = plans(Model.small_gpt(), Batch(64, b=3), Hardware.dgx_a100(1))
    [line] = format_table(plan_table(every, n=0, rejected=1)).splitlines()[1:]
    assert "does not split" in line and line.split().count("-") == 10  # S, M, GiB, the step and its six terms


def test_the_default_micro_batches_stay_within_the_batch():
    assert Batch(512).b == (1, 2, 4, 8) and Batch(2).b == (1, 2)


def test_the_widget_answers_its_controls():
    widget = plan_widget(model="small GPT", B=512, nodes=1)
    (chosen, batch), (machines, per_node, memory), (intra, inter) = (row.children for row in widget.children[:3])
    feedback, image, table = widget.children[3:6]
    status = feedback.children[0]
    assert image.value[:4] == b"\x89PNG" and "accepted" in table.value
    expected = plans(Model.small_gpt(), Batch(512), hardware_of(8, 1, 80, intra.value, inter.value))
    best = expected[0]
    assert table.value.splitlines()[1].split()[:3] == [str(best.N_d), str(best.t), str(best.K)]
    assert status.value == (f"{sum(not p.rejected for p in expected)} of {len(expected)} plans accepted on 1 x 8 GPUs "
                            "of 80 GiB, 300 GB/s inside a node, 25 GB/s between nodes.")
    picture, text = image.value, table.value
    inter.value = 50  # one node: no plan uses the network, but the line says the control moved
    assert (image.value, table.value) == (picture, text) and status.value.endswith("50 GB/s between nodes.")
    picture = image.value
    chosen.value, batch.value = "70B", 1536
    hosted = plans(SEVENTY_B, Batch(1536), hardware_of(8, 1, 80, intra.value, inter.value))[0]
    assert image.value != picture and hosted.offload  # one node holds the 70B only offloaded to its host
    assert table.value.splitlines()[1].split()[:3] == [str(hosted.N_d), str(hosted.t), str(hosted.K)]
    memory.value = 16
    assert "does not fit" in table.value  # nor with GPUs of 16 GiB
    machines.value = 64
    assert "accepted" in table.value
    per_node.value = 1
    assert "plans accepted" in status.value


def test_an_error_while_planning_is_shown_as_its_sentence(monkeypatch):
    widget = plan_widget(model="small GPT", B=512, nodes=1)
    batch, status = widget.children[0].children[1], widget.children[3].children[0]

    def refuse(*args, **kwargs):
        raise ValueError("B must split: change it.")

    monkeypatch.setattr("parlab.widgets.plan.plans", refuse)
    batch.value = 256
    assert "B must split: change it." in status.value and "parlab-error" in status.value


def test_bad_arguments_say_what_to_change():
    with pytest.raises(ValueError, match="model must be one of"):
        plan_widget(model="GPT-5")
    with pytest.raises(ValueError, match="nodes must be one of"):
        plan_widget(nodes=3)
    with pytest.raises(ValueError, match="memory_gib"):
        plan_widget(memory_gib=0)


def test_without_ipywidgets_the_widget_is_the_static_figure(monkeypatch):
    from matplotlib.figure import Figure

    monkeypatch.setitem(sys.modules, "ipywidgets", None)
    with pytest.warns(UserWarning, match="ipywidgets is not installed"):
        figure = plan_widget(model="7B", B=512, nodes=4)
    assert isinstance(figure, Figure) and len(points(figure.axes[0])) == 8


def run_controls(widget):
    """The model dropdown, the status line, the plan to run, the button and the run's output."""
    (to_run, run), measured = widget.children[6].children, widget.children[7]
    return widget.children[0].children[0], widget.children[3].children[0], to_run, run, measured


def test_run_this_plan_measures_the_chosen_plan_of_the_small_gpt():
    widget = plan_widget(model="small GPT", B=512, nodes=1)
    chosen, status, to_run, run, measured = run_controls(widget)
    runnable = sorted(measure.predicted_plans(), key=lambda p: p.time.total)
    assert len(to_run.options) == len(runnable) >= 10 and not run.disabled and not to_run.disabled
    assert f"predicts {runnable[0].time.total:.3g} s per step" in measured.value
    to_run.value = 1
    assert f"predicts {runnable[1].time.total:.3g} s per step" in measured.value
    run.click()
    assert "parlab-error" not in status.value, status.value
    [header, line] = measured.value.removeprefix("<pre>").removesuffix("</pre>").splitlines()
    plan = runnable[1]
    assert line.split()[:5] == ["1", f"{plan.N_d}x{plan.t}x{plan.K}", f"Z{plan.zero}", f"b={plan.b}", f"M={plan.M}"]
    predicted_s, measured_s, ratio = (float(word) for word in line.split()[-6:-3])
    assert predicted_s == round(plan.time.total, 3) and ratio == round(measured_s / plan.time.total, 2)
    assert f"its step took {ratio:.2f} x the prediction" in status.value


def test_run_this_plan_is_for_the_small_gpt_only():
    widget = plan_widget(model="small GPT", B=512, nodes=1)
    chosen, status, to_run, run, measured = run_controls(widget)
    chosen.value = "7B"
    assert run.disabled and to_run.disabled
    assert "Only the small GPT runs here" in measured.value and "the 7B would need a real cluster" in measured.value
    run.click()  # a disabled button's handlers still run when called from Python: they refuse
    assert "only the small GPT runs on this machine, not the 7B" in status.value and "parlab-error" in status.value
    chosen.value = "small GPT"
    assert not run.disabled and "predicts" in measured.value


def test_a_failed_run_is_shown_as_a_sentence(monkeypatch):
    widget = plan_widget(model="small GPT", B=512, nodes=1)
    _, status, _, run, measured = run_controls(widget)
    before = measured.value

    def crash(plan, **options):
        raise RuntimeError("rank 2 died")

    monkeypatch.setattr("parlab.plan.measure.run_plan", crash)
    run.click()
    assert "Running the plan failed: RuntimeError: rank 2 died" in status.value and measured.value == before


def made_up_runs(ratios):
    """Measured runs of the checked plans with step times ``ratio`` x the prediction (no ranks)."""
    chosen = measure.predicted_plans()[:len(ratios)]
    states = [int(p.memory.states.total) for p in chosen]
    return [Measured(p, p.memory, p.time, s, p.time.total * r) for p, s, r in zip(chosen, states, ratios)]


def test_predicted_against_measured_points_and_band():
    rows = made_up_runs([1.0, 1.1, 0.8, 1.3])
    ax = plot_predicted_vs_measured(rows)
    plotted = {line.get_gid(): line for line in ax.lines if (line.get_gid() or "").startswith("measured")}
    assert {gid: tuple(line.get_xydata()[0]) for gid, line in plotted.items()} == {
        f"measured-{i}": (r.predicted_time.total, r.step_seconds) for i, r in enumerate(rows, 1)}
    assert [plotted[f"measured-{i}"].get_color() for i in range(1, 5)] == ["C0", "C0", "C3", "C3"]  # 0.8, 1.3: out
    [diagonal] = [line for line in ax.lines if line.get_gid() is None]
    low, high = diagonal.get_xdata()
    assert list(diagonal.get_ydata()) == [low, high] and (low, high) == ax.get_xlim() == ax.get_ylim()
    [band] = ax.collections
    corners = band.get_paths()[0].vertices
    assert corners[:, 1].min() == pytest.approx(low * 0.85) and corners[:, 1].max() == pytest.approx(high * 1.15)
    assert [t.get_text() for t in ax.texts] == ["1", "2", "3", "4"]  # the numbers of format_measured's lines
    with pytest.raises(ValueError, match="rows is empty"):
        plot_predicted_vs_measured([])


def test_the_measured_text_has_both_times_and_both_byte_counts():
    rows = made_up_runs([1.1, 0.95])
    rows[1] = rows[1]._replace(state_bytes=rows[1].state_bytes * 2)
    header, *lines = format_measured(rows).splitlines()
    assert header.split()[:4] == ["#", "plan", "predicted", "s"] and len(lines) == 2 and lines[1].startswith(" 2 ")
    words = lines[1].split()
    assert words[-1] == "2.00" and words[-4] == "0.95"  # states doubled; time 0.95 x
    assert words[-2] == f"{rows[1].state_bytes:,}" and words[-3] == f"{rows[1].predicted_memory.states.total:,.0f}"
