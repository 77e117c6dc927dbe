"""parlab bench plan: one plan's run, its row beside the planner's prediction and its
arguments; times are never judged here (the machine is shared), only what the row must hold
whatever they are."""

import pytest

from parlab import cli
from parlab.bench import ratio_header
from parlab.bench.plan import REFERENCE, bench_plan, format_report
from parlab.memory import FP32_ADAM, model_state_bytes
from parlab.plan import measure

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def result():
    return bench_plan(steps=1, plans=[0])


def test_a_row_per_plan_with_measured_over_predicted(result):
    (row,) = result["rows"]
    plan = measure.predicted_plans(layouts=[measure.LAYOUTS[0]])[0]
    assert row["plan"] == "4x1x1 Z0 b=4 M=1"
    assert row["predicted_s"] == plan.time.total == sum(row["terms"].values())
    assert row["ratio"] == row["measured_s"] / row["predicted_s"] and row["measured_s"] > 0
    psi = measure.model().psi
    assert row["predicted_state_bytes"] == model_state_bytes(psi, 0, 4, *FP32_ADAM).total
    assert row["measured_state_bytes"] == row["predicted_state_bytes"] + 4 * psi  # DDP's bucket copies


def test_the_report_states_the_regime_and_the_ratio(result):
    report = format_report(result)
    header, table = report.split("\n\n")
    assert ratio_header(REFERENCE) in header and measure.LINK.describe() in header
    assert len(table.splitlines()) == 2


def test_arguments_are_checked_before_any_rank_starts(capsys):
    with pytest.raises(SystemExit):
        cli.main(["bench", "plan", "--plans", str(len(measure.LAYOUTS))])
    assert "invalid choice" in capsys.readouterr().err
    with pytest.raises(ValueError, match="steps"):
        bench_plan(steps=0)
