"""parlab bench collectives: the structure and arithmetic of its result, never its speed."""

import json

import matplotlib
import pytest

from parlab import cli
from parlab.bench import ratio_header
from parlab.bench.collectives import (
    ALGORITHMS,
    REFERENCE,
    bench_collectives,
    format_report,
    plot_busbw,
    time_algorithms,
)

matplotlib.use("Agg")
pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def result():
    return bench_collectives(world_sizes=[2], sizes=[4096, 40000])


def test_every_algorithm_at_every_size_with_nccl_tests_bandwidths(result):
    rows = result["rows"]
    assert [(r["bytes"], r["algorithm"]) for r in rows] == [(s, a) for s in (4096, 40000) for a in ALGORITHMS]
    for row in rows:
        assert row["seconds"] > 0
        assert row["algbw"] == pytest.approx(row["bytes"] / row["seconds"])
        assert row["busbw"] == pytest.approx(row["algbw"] * 2 * (2 - 1) / 2)
        torch_row = next(r for r in rows if r["bytes"] == row["bytes"] and r["algorithm"] == "torch")
        assert row["ratio"] == row["seconds"] / torch_row["seconds"]  # time / time: below 1, parlab is faster
    assert result["backend"] == "gloo" and result["device"] == "cpu"


def test_time_algorithms_agrees_on_every_rank(cluster2):
    per_rank = cluster2.run(time_algorithms, 1024)
    assert per_rank[0] == per_rank[1]  # the slowest rank's time, shared by all-reduce(max)
    assert set(per_rank[0]["seconds"]) == set(ALGORITHMS)


def test_report_and_plot(result):
    report = format_report(result)
    assert "time / torch" in report and report.count("ring") == 2
    ax = plot_busbw(result)
    assert len(ax.get_lines()) == len(ALGORITHMS)
    assert ax.get_ylabel() == "busbw (GB/s)"


def test_command_line_json(capsys):
    assert cli.main(["bench", "collectives", "--json", "--world-sizes", "2", "--sizes", "1K"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["bench"] == "collectives" and out["ratio_means"] == ratio_header(REFERENCE)
    assert {row["algorithm"] for row in out["rows"]} == set(ALGORITHMS)


@pytest.mark.parametrize("size", ["0", "3", "lots"])
def test_bad_sizes_are_refused(size, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bench", "collectives", "--sizes", size])
    assert exit_info.value.code == 2
    assert "expected a size of at least 4 bytes" in capsys.readouterr().err
