"""parlab bench pipeline: the structure and arithmetic of its result, never its speed."""

import contextlib
import io
import json
import statistics

import pytest

from parlab import cli
from parlab.bench import ratio_header
from parlab.bench.pipeline import REFERENCE, bench_pipeline, format_report, valid_schedules
from parlab.pipeline.schedule import make_schedule
from parlab.pipeline.simulate import simulate

ARGV = ["bench", "pipeline", "--json", "--world-sizes", "2", "--microbatches", "2", "--steps", "2", "--width", "8",
        "--depth", "3", "--batch-size", "4", "--sleep-ms", "2", "--repeats", "2"]


@pytest.fixture(scope="module")
def result():
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main(ARGV) == 0
    return json.loads(out.getvalue())


@pytest.mark.timeout(120)
def test_a_row_per_schedule_with_medians_ratio_and_bubbles(result):
    assert result["bench"] == "pipeline" and result["backend"] == "gloo" and result["device"] == "cpu"
    assert result["ratio_means"] == ratio_header(REFERENCE)
    assert (result["microbatches"], result["steps"], result["sleep_s"]) == (2, 2, 0.002)
    assert result["parameters"] == 3 * (8 * 8 + 8)
    rows = result["rows"]
    assert [(row["world_size"], row["schedule"], row["v"]) for row in rows] == [
        (2, "gpipe", 1), (2, "1f1b", 1), (2, "interleaved_1f1b", 2)]
    for row in rows:
        for runner in ("parlab", "torch"):
            seconds = row[f"{runner}_seconds"]
            assert len(seconds) == 2 and all(s > 0 for s in seconds)
            assert row[f"{runner}_median_s"] == statistics.median(seconds)
        assert row["ratio"] == pytest.approx(row["parlab_median_s"] / row["torch_median_s"])
        assert len(row["bubbles_measured"]) == 2 and all(0 <= b <= 1 for b in row["bubbles_measured"])
        assert row["bubble_measured"] == statistics.median(row["bubbles_measured"])
        v = row["v"]
        expected = simulate(make_schedule(row["schedule"], 2, 2, v), 0.002 / v, 0.002 / v).bubble_fraction
        assert row["bubble_simulated"] == pytest.approx(expected)
    assert [row["bubble_formula"] for row in rows] == pytest.approx([1 / 3, 1 / 3, 1 / 5])


@pytest.mark.timeout(60)
def test_report_has_a_row_per_schedule(result):
    report = format_report(result)
    assert "time / torch" in report and "bubble measured" in report and "2 ms per F and B" in report
    assert all(f"  {name}  " in report for name in ("gpipe", "1f1b")) and "interleaved_1f1b v=2" in report


def test_only_schedules_that_can_run_are_benched():
    assert valid_schedules(2, 4, 8) == ["gpipe", "1f1b", "interleaved_1f1b"]
    assert valid_schedules(4, 2, 8) == ["gpipe"]  # 1F1B needs M >= K, interleaved M a multiple of K
    assert valid_schedules(2, 3, 8) == ["gpipe", "1f1b"]
    assert valid_schedules(4, 8, 3) == ["gpipe", "1f1b"]  # 5 layers cannot make K v = 8 stages


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="does not split into M = 8"):
        bench_pipeline(world_sizes=[2], microbatches=8, batch_size=12)
    with pytest.raises(ValueError, match="sleep_s must be above 0"):
        bench_pipeline(world_sizes=[2], sleep_s=0)
