"""parlab bench pipeline: the structure and arithmetic of its result, never its speed."""

import contextlib
import io
import json
import statistics

import pytest

import parlab
from parlab import cli
from parlab.bench import ratio_header
from parlab.bench.pipeline import (
    BUBBLE_MICROBATCHES,
    LINK_WORLD_SIZES,
    REFERENCE,
    bench_pipeline,
    format_report,
    targets,
    valid_schedules,
)
from parlab.pipeline.schedule import make_schedule
from parlab.pipeline.simulate import bubble_formula, simulate

ARGV = ["bench", "pipeline", "--json", "--world-sizes", "2", "--microbatches", "2", "--steps", "2", "--width", "8",
        "--depth", "3", "--batch-size", "4", "--sleep-ms", "2", "--repeats", "2", "--bubble-microbatches", "2", "4",
        "--activation-bytes", "1K", "--link", "1ms,1GB/s"]
LINK = parlab.Link(latency=1e-3, bandwidth=1e9)


@pytest.fixture(scope="module")
def result():
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main(ARGV) == 0
    return json.loads(out.getvalue())


@pytest.mark.timeout(180)
def test_a_step_time_row_per_schedule_with_medians_and_ratio(result):
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


@pytest.mark.timeout(180)
def test_a_bubble_row_per_microbatches_and_schedule_on_the_emulated_link(result):
    assert result["link"] == {"latency_s": 1e-3, "bandwidth_bytes_per_s": 1e9}
    assert result["regime"] == "emulated: link 1 ms + bytes / (1 GB/s)" and result["activation_bytes"] == 1024
    rows = result["bubble_rows"]
    assert [(row["microbatches"], row["schedule"], row["v"]) for row in rows] == [
        (m, name, v) for m in (2, 4) for name, v in (("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2))]
    for row in rows:
        assert len(row["bubbles_measured"]) == 2 and all(0 <= b <= 1 for b in row["bubbles_measured"])
        assert row["bubble_measured"] == statistics.median(row["bubbles_measured"])
        M, v = row["microbatches"], row["v"]
        assert row["t_comm_s"] == pytest.approx(1e-3 + 1024 / 1e9)  # alpha + n beta of one activation
        simulation = simulate(make_schedule(row["schedule"], 2, M, v), 0.002 / v, 0.002 / v, t_comm=row["t_comm_s"])
        assert row["bubble_simulated"] == pytest.approx(float(simulation.bubble_fraction))
        assert row["step_simulated_s"] == pytest.approx(float(simulation.step_time))
        assert row["bubble_formula"] == pytest.approx(bubble_formula(2, M, v))
        assert row["bubble_allowed"] >= 0 and row["step_measured_s"] > 0
    assert result["targets"] == []  # the report's target is stated for K = 4 at M = 4, 8, 16, 32


@pytest.mark.timeout(60)
def test_report_has_both_tables(result):
    report = format_report(result)
    assert "time / torch" in report and "bubble measured" in report and "2 ms per F and B" in report
    assert all(f"  {name}  " in report for name in ("gpipe", "1f1b")) and "interleaved_1f1b v=2" in report
    assert result["regime"] in report and "activations of 1K" in report and "(K-1)/(vM+K-1)" in report


def test_the_target_is_the_farthest_bubble_from_the_formula_at_k_4():
    def row(name, M, measured):
        return {"world_size": 4, "schedule": name, "microbatches": M, "bubble_measured": measured,
                "bubble_formula": bubble_formula(4, M)}

    rows = [row("gpipe", M, bubble_formula(4, M) + gap) for M, gap in zip(BUBBLE_MICROBATCHES, (0.01, -0.02, 0, 0))]
    rows += [row("1f1b", M, bubble_formula(4, M) + 0.04 * (M == 32)) for M in BUBBLE_MICROBATCHES]
    rows += [row("interleaved_1f1b", 4, 0.5)]  # not measured at every M: no target
    (gpipe, one_f_one_b) = targets(rows)
    assert gpipe["met"] and gpipe["value"] == pytest.approx(0.02) and "the farthest: M = 8" in gpipe["target"]
    assert not one_f_one_b["met"] and one_f_one_b["value"] == pytest.approx(0.04) and "M = 32" in one_f_one_b["target"]
    report = format_report({**made_up_result(), "bubble_rows": [dict(r, v=1, bubble_simulated=0.1, bubble_allowed=0.01,
                                                                        step_measured_s=1.0, step_simulated_s=1.0)
                                                                 for r in rows], "targets": targets(rows)})
    assert "    met  0.020  gpipe" in report and "NOT met  0.040  1f1b" in report


def made_up_result():
    return {"device": "cpu", "backend": "gloo", "torch_version": "t", "cpu_count": 2, "parameters": 72, "width": 8,
            "depth": 1, "batch_size": 4, "microbatches": 2, "steps": 3, "sleep_s": 0.05, "repeats": 2, "rows": [],
            "activation_bytes": 4096, "regime": "real time"}


def test_only_schedules_that_can_run_are_benched():
    assert valid_schedules(2, 4, 8) == ["gpipe", "1f1b", "interleaved_1f1b"]
    assert valid_schedules(4, 2, 8) == ["gpipe"]  # 1F1B needs M >= K, interleaved M a multiple of K
    assert valid_schedules(2, 3, 8) == ["gpipe", "1f1b"]
    assert valid_schedules(4, 8, 3) == ["gpipe", "1f1b"]  # 5 layers cannot make K v = 8 stages
    assert valid_schedules(4, 8) == ["gpipe", "1f1b", "interleaved_1f1b"]  # sleep stages need no layers


def test_defaults_with_a_link_are_issue_12s_k_and_m():
    args = cli.build_parser().parse_args(["bench", "pipeline", "--link", "200us,100MB/s"])
    assert args.link == parlab.Link(200e-6, 100e6) and args.world_sizes is None
    assert args.bubble_microbatches == BUBBLE_MICROBATCHES == [4, 8, 16, 32] and LINK_WORLD_SIZES == [4]
    assert args.activation_bytes == 4096


@pytest.mark.parametrize("argv, complaint", [
    (["--link", "fast"], "expected a link as LATENCY,BANDWIDTH"),
    (["--activation-bytes", "2"], "at least 4 bytes"),
    (["--bubble-microbatches", "0"], "at least 1"),
])
def test_bad_options_are_refused_by_the_command_line(argv, complaint, capsys):
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["bench", "pipeline", *argv])
    assert complaint in capsys.readouterr().err


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="does not split into M = 8"):
        bench_pipeline(world_sizes=[2], microbatches=8, batch_size=12)
    with pytest.raises(ValueError, match="sleep_s must be above 0"):
        bench_pipeline(world_sizes=[2], sleep_s=0)
    with pytest.raises(ValueError, match="a multiple of 4"):
        bench_pipeline(world_sizes=[2], activation_bytes=6)
    with pytest.raises(ValueError, match="link must be a parlab.Link"):
        bench_pipeline(world_sizes=[2], link="200us,100MB/s")
