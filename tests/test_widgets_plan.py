"""The planner's chart, table and widget without a browser: the points are the planner's
numbers, the table its rows, the widget answers its controls and shows a bad value as a
sentence."""

import sys

import matplotlib
import pytest

from parlab.plan import GIB, Batch, Cluster, Model, format_table, plan_table, plans
from parlab.widgets.plan import cluster_of, plan_widget, plot_plans

matplotlib.use("Agg")
SEVENTY_B, SIXTY_FOUR_NODES = Model.llama2_70b(), Cluster.dgx_a100(64)


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


def test_with_nothing_accepted_the_chart_says_why():
    every = plans(SEVENTY_B, Batch(1536), Cluster.dgx_a100(1))
    ax = plot_plans(every, Cluster.dgx_a100(1))
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
    every = plans(Model.small_gpt(), Batch(64, b=3), Cluster.dgx_a100(1))
    [line] = format_table(plan_table(every, n=0, rejected=1)).splitlines()[1:]
    assert "does not split" in line and line.split().count("-") == 8  # M, GiB, the step and its five terms


def test_the_default_micro_batches_stay_within_the_batch():
    assert Batch(512).b == (1, 2, 4, 8) and Batch(2).b == (1, 2)


def test_the_widget_answers_its_controls():
    widget = plan_widget(model="small GPT", B=512, nodes=1)
    (chosen, batch), (machines, per_node, memory), (intra, inter) = (row.children for row in widget.children[:3])
    feedback, image, table = widget.children[-3:]
    status = feedback.children[0]
    assert image.value[:4] == b"\x89PNG" and "accepted" in table.value
    expected = plans(Model.small_gpt(), Batch(512), cluster_of(8, 1, 80, intra.value, inter.value))
    best = expected[0]
    assert table.value.splitlines()[1].split()[:3] == [str(best.N_d), str(best.t), str(best.K)]
    assert status.value == f"{sum(not p.rejected for p in expected)} of {len(expected)} plans accepted."
    picture = image.value
    chosen.value, batch.value = "70B", 1536
    assert image.value != picture and "does not fit" in table.value  # one node cannot hold the 70B
    machines.value = 64
    assert "accepted" in table.value
    per_node.value = 1
    assert "plans accepted" in status.value


def test_an_error_while_planning_is_shown_as_its_sentence(monkeypatch):
    widget = plan_widget(model="small GPT", B=512, nodes=1)
    batch, status = widget.children[0].children[1], widget.children[-3].children[0]

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
