"""parlab bench diloco: one tiny run's shape, its ratios to DDP and its arguments; times are
never judged (the machine is shared), only what the run must hold whatever they are."""

import pytest

import parlab
from parlab import cli
from parlab.bench import ratio_header
from parlab.bench.diloco import REFERENCE, bench_diloco, format_report
from parlab.diloco.costs import METHODS

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def result():
    return bench_diloco(world_size=2, steps=8, compute_s=0.002, links=[parlab.Link(1e-3, 100e6)], d=64, H=4,
                        fragments=2, delay=1, mixing=0.5, target=0.2)


def test_one_row_per_method_with_its_time_to_the_target_over_ddps(result):
    (regime,) = result["regimes"]
    rows = {row["method"]: row for row in regime["rows"]}
    assert list(rows) == list(METHODS)
    assert rows["ddp"]["ratio"] == 1
    for row in rows.values():
        assert row["losses"][-1] == row["final_loss"] < row["losses"][0]  # every method learns
        assert row["times"] == sorted(row["times"]) and row["seconds"] == row["times"][-1]
        assert row["ratio"] == (None if row["time_to_target"] is None
                                else row["time_to_target"] / rows["ddp"]["time_to_target"])
        assert 0 < row["communication_share"] < 1
    # on a quadratic the gradient is linear in w, so local SGD's average is DDP's at every averaging
    assert rows["local"]["final_loss"] == pytest.approx(rows["ddp"]["final_loss"], rel=1e-5)
    assert regime["regime"] == "emulated: link 1 ms + bytes / (100 MB/s)"


def test_the_report_states_the_regime_and_the_ratio(result):
    report = format_report(result)
    assert ratio_header(REFERENCE) in report.split("\n\n")[0] and result["regimes"][0]["regime"] in report
    assert len(report.split("\n\n")[1].splitlines()) == 2 + len(METHODS)


def test_arguments_are_checked_before_any_rank_starts(capsys):
    with pytest.raises(SystemExit):
        cli.main(["bench", "diloco", "--links", "fast"])
    assert "expected a link as LATENCY,BANDWIDTH" in capsys.readouterr().err
    with pytest.raises(ValueError, match="world_size=2 or more"):
        bench_diloco(world_size=1)
    with pytest.raises(ValueError, match="delay=4, mixing=0.5"):
        bench_diloco(H=4, delay=4)
