"""parlab bench ddp: the structure and arithmetic of its result, never its speed."""

import json
import statistics

import pytest

from parlab import cli
from parlab.bench import ratio_header
from parlab.bench.ddp import REFERENCE, VARIANTS, bench_ddp, format_report, mlp_parameters, time_steps

TINY = dict(width=8, depth=2, batch_size=4)


@pytest.fixture(scope="module")
def result():
    return bench_ddp(world_sizes=[2], steps=3, **TINY)


@pytest.mark.timeout(120)
def test_every_variant_with_its_median_and_ratio_to_torch(result):
    rows = result["rows"]
    assert [(r["world_size"], r["variant"]) for r in rows] == [(2, v) for v in VARIANTS]
    torch_row = rows[0]
    for row in rows:
        assert len(row["seconds"]) == 3 and all(s > 0 for s in row["seconds"])
        assert row["median_s"] == statistics.median(row["seconds"])
        assert row["ratio"] == pytest.approx(row["median_s"] / torch_row["median_s"])
    assert torch_row["ratio"] == 1
    assert result["parameters"] == mlp_parameters(8, 2) == 2 * (8 * 8 + 8)
    assert result["backend"] == "gloo" and result["device"] == "cpu"


@pytest.mark.timeout(60)
def test_step_times_are_the_slowest_ranks_on_every_rank(cluster2):
    per_rank = cluster2.run(time_steps, 2, 8, 2, 4, 25.0, timeout=30)
    assert per_rank[0] == per_rank[1]
    assert set(per_rank[0]["seconds"]) == set(VARIANTS)


@pytest.mark.timeout(60)
def test_report_has_a_row_per_variant(result):
    report = format_report(result)
    assert "/ torch DDP" in report and "bucket_cap_mb=25" in report
    assert all(f"  {variant}  " in report for variant in VARIANTS)


@pytest.mark.timeout(120)
def test_command_line_json(capsys):
    argv = ["bench", "ddp", "--json", "--world-sizes", "2", "--steps", "1", "--width", "8", "--depth", "2",
            "--batch-size", "4", "--bucket-cap-mb", "0.001"]
    assert cli.main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["bench"] == "ddp" and out["bucket_cap_mb"] == 0.001
    assert out["ratio_means"] == ratio_header(REFERENCE)
    assert [row["variant"] for row in out["rows"]] == VARIANTS


@pytest.mark.timeout(60)
def test_a_bucket_cap_of_zero_is_refused():
    with pytest.raises(ValueError, match="bucket_cap_mb must be above 0"):
        bench_ddp(world_sizes=[2], bucket_cap_mb=0)
