"""parlab bench async: one tiny run's shape, its ratios to sync and its arguments; times are
never judged (the machine is shared), only what the run must hold whatever they are."""

import pytest

import parlab
from parlab import cli
from parlab.async_sgd.training import METHODS
from parlab.bench import ratio_header
from parlab.bench.async_sgd import REFERENCE, bench_async, format_report

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def result():
    devices = parlab.Devices(straggler=parlab.Straggler(factor=3, probability=0.2, seed=1))
    return bench_async(world_size=2, steps=4, compute_s=0.002, link=parlab.Link(1e-3, 100e6), devices=devices)


def test_one_row_per_method_with_its_time_over_sync_s(result):
    rows = {row["method"]: row for row in result["rows"]}
    assert list(rows) == list(METHODS)
    assert rows["sync"]["ratio"] == 1
    for row in rows.values():
        assert row["ratio"] == row["seconds"] / rows["sync"]["seconds"]
        assert row["losses"][-1] == row["final_loss"] < row["losses"][0]  # every method learns
        assert row["times"] == sorted(row["times"]) and row["seconds"] == row["times"][-1]
    assert (rows["async"]["workers"], rows["async"]["gradients"]) == (1, 4)  # rank 0 serves
    assert (rows["sync"]["workers"], rows["sync"]["gradients"]) == (2, 8)
    assert result["regime"] == "emulated: link 1 ms + bytes / (100 MB/s); devices: each step with p = 0.2 3x slower"


def test_the_report_states_the_regime_and_the_ratio(result):
    report = format_report(result)
    assert ratio_header(REFERENCE) in report.split("\n\n")[0] and result["regime"] in report
    assert len(report.split("\n\n")[1].splitlines()) == 1 + len(METHODS)


def test_arguments_are_checked_before_any_rank_starts(capsys):
    with pytest.raises(SystemExit):
        cli.main(["bench", "async", "--straggler", "fast"])
    assert "expected FACTOR,PROBABILITY such as 5,0.1" in capsys.readouterr().err
    with pytest.raises(ValueError, match="at least 2 ranks"):
        bench_async(world_size=1)
