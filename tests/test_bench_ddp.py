"""parlab bench ddp: the structure and arithmetic of its result, never its speed; --link and
the emulated table beside the overlap model."""

import json
import statistics

import pytest

import parlab
from parlab import cli
from parlab.bench import ratio_header
from parlab.bench.ddp import (
    REFERENCE,
    VARIANTS,
    bench_ddp,
    emulated_rows,
    format_report,
    layer_caps_mb,
    mlp_parameters,
    time_steps,
)
from parlab.units import MIB

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
    assert result["link"] is None and result["emulated_rows"] == []  # real time only without --link


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


# --- --link: emulated devices beside the overlap model ------------------------------------------


def test_the_sweep_caps_hold_one_layer_two_four_and_all():
    assert layer_caps_mb(256, 16) == [0.25, 0.5, 1, 2, 4]  # a layer of 256 x 256 fp32 is 256 KiB
    assert [cap * MIB / (4 * 8 * 8) for cap in layer_caps_mb(8, 3)] == [1, 2, 3]
    assert [cap * MIB / (4 * 8 * 8) for cap in layer_caps_mb(8, 1)] == [1]


def made_up_rows():
    rows = [dict(variant="flat", bucket_cap_mb=None, buckets=1, median_s=0.5, seconds=[0.5]),
            dict(variant="bucketed", bucket_cap_mb=1.0, buckets=4, median_s=0.3, seconds=[0.3])]
    return emulated_rows(2, rows, [0.4, 0.32], backward_s=0.01)


def test_emulated_rows_put_each_measurement_beside_the_model_and_the_saving_over_flat():
    flat, bucketed = made_up_rows()
    assert (flat["measured_over_model"], flat["saving_s"], flat["model_saving_s"]) == (1.25, 0, 0)
    assert bucketed["measured_over_model"] == pytest.approx(0.3 / 0.32)
    assert (bucketed["saving_s"], bucketed["model_saving_s"]) == pytest.approx((0.2, 0.08))
    assert bucketed["world_size"] == 2 and bucketed["buckets"] == 4 and bucketed["backward_s"] == 0.01


def test_the_report_adds_the_emulated_table_and_its_link():
    result = {"device": "cpu", "backend": "gloo", "torch_version": "t", "cpu_count": 2, "parameters": 72,
              "width": 8, "depth": 1, "batch_size": 4, "bucket_cap_mb": 25.0, "steps": 3, "rows": [],
              "link": {"latency": 200e-6, "bandwidth": 100e6}, "emulated_rows": made_up_rows()}
    emulated = format_report(result).split("\n\n", 2)[2]
    assert "link 200 µs + bytes / (100 MB/s)" in emulated and "measured / model" in emulated
    assert "  bucketed  1 MiB        4" in emulated and "1.25" in emulated and "80.00 ms" in emulated


@pytest.mark.timeout(180)
def test_command_line_link_runs_every_variant_and_the_sweep_beside_the_model(capsys):
    argv = ["bench", "ddp", "--json", "--world-sizes", "2", "--steps", "1", "--width", "8", "--depth", "2",
            "--batch-size", "4", "--link", "100us,1GB/s", "--backward-ms", "1"]
    assert cli.main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["link"] == {"latency": pytest.approx(100e-6), "bandwidth": 1e9}
    rows = out["emulated_rows"]
    assert [(row["variant"], row["buckets"]) for row in rows] == [
        ("naive", 2), ("flat", 1), ("overlapped", 2), ("bucketed", 2), ("bucketed", 1)]
    assert [row["bucket_cap_mb"] for row in rows[3:]] == layer_caps_mb(8, 2)
    for row in rows:
        assert row["backward_s"] == 0.001 and row["model_s"] > 0
        assert row["measured_over_model"] == pytest.approx(row["median_s"] / row["model_s"])


@pytest.mark.parametrize("argv, message", [
    (["--link", "200us"], "--link: expected a link as LATENCY,BANDWIDTH"),
    (["--link", "200us,fast"], "--link: expected a link as LATENCY,BANDWIDTH"),
    (["--backward-ms", "0"], "--backward-ms: expected a number above 0"),
])
def test_command_line_refuses_a_link_it_cannot_read(argv, message, capsys):
    with pytest.raises(SystemExit):
        cli.main(["bench", "ddp", *argv])
    assert message in capsys.readouterr().err


def test_a_link_that_is_not_a_link_is_refused_before_any_rank_starts():
    with pytest.raises(ValueError, match="link must be a parlab.Link or None"):
        bench_ddp(world_sizes=[2], link="200us,100MB/s")
    with pytest.raises(ValueError, match="backward_s must be above 0"):
        bench_ddp(world_sizes=[2], link=parlab.Link(200e-6, 100e6), backward_s=0)
