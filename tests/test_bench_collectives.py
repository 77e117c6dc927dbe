"""parlab bench collectives: the structure and arithmetic of its result, never its speed."""

import json

import matplotlib
import pytest

import parlab
from parlab import cli
from parlab.alpha_beta import cost_model
from parlab.bench import parse_link, ratio_header
from parlab.bench.collectives import (
    ALGORITHMS,
    LINK_SIZES,
    LINK_WORLD_SIZES,
    PARLAB_ALGORITHMS,
    REFERENCE,
    bench_collectives,
    emulated_rows,
    format_report,
    plot_busbw,
    targets,
    time_algorithms,
)

matplotlib.use("Agg")
pytestmark = pytest.mark.timeout(120)
MiB = 2**20
LINK = parlab.Link(latency=1e-3, bandwidth=1e9)  # 1 ms per message: a few seconds for the whole run


@pytest.fixture(scope="module")
def result():
    return bench_collectives(world_sizes=[2], sizes=[4096, 40000])


@pytest.fixture(scope="module")
def emulated_result():
    return bench_collectives(world_sizes=[2], sizes=[4096], link=LINK)


def test_every_algorithm_at_every_size_with_nccl_tests_bandwidths(result):
    rows = result["rows"]
    assert [(r["bytes"], r["algorithm"]) for r in rows] == [(s, a) for s in (4096, 40000) for a in ALGORITHMS]
    for row in rows:
        assert row["seconds"] > 0 and row["regime"] == "real"
        assert row["algbw"] == pytest.approx(row["bytes"] / row["seconds"])
        assert row["busbw"] == pytest.approx(row["algbw"] * 2 * (2 - 1) / 2)
        torch_row = next(r for r in rows if r["bytes"] == row["bytes"] and r["algorithm"] == "torch")
        assert row["ratio"] == row["seconds"] / torch_row["seconds"]  # time / time: below 1, parlab is faster
    assert result["backend"] == "gloo" and result["device"] == "cpu"
    assert result["link"] is None and result["regime"] == "real time" and result["targets"] == []


def test_an_emulated_link_adds_parlabs_algorithms_beside_the_model(emulated_result):
    real = [row for row in emulated_result["rows"] if row["regime"] == "real"]
    emulated = [row for row in emulated_result["rows"] if row["regime"] == "emulated"]
    assert [row["algorithm"] for row in real] == list(ALGORITHMS)  # torch stays the real reference
    assert [row["algorithm"] for row in emulated] == list(PARLAB_ALGORITHMS)  # torch is not shaped
    for row in emulated:
        assert row["model_seconds"] == cost_model(row["algorithm"], 4096, 2, LINK.latency, 1 / LINK.bandwidth)
        assert row["model_ratio"] == row["seconds"] / row["model_seconds"]
        assert row["iters"] >= 2 and row["free_seconds"] > 0  # timed again on FREE_LINK
    assert emulated_result["link"] == {"latency_s": 1e-3, "bandwidth_bytes_per_s": 1e9}
    assert emulated_result["regime"] == "emulated: link 1 ms + bytes / (1 GB/s)"
    report = format_report(emulated_result)
    assert "real time:" in report and "time / model" in report and emulated_result["regime"] in report
    assert "free link" in report
    assert plot_busbw(emulated_result, regime="emulated").get_title().endswith(f"({emulated_result['regime']})")


def test_time_algorithms_agrees_on_every_rank(cluster2):
    per_rank = cluster2.run(time_algorithms, 1024)
    assert per_rank[0] == per_rank[1]  # the slowest rank's time, shared by all-reduce(max)
    assert set(per_rank[0]["seconds"]) == set(ALGORITHMS)
    alone = cluster2.run(time_algorithms, 1024, {"ring": 3}, alone=True)
    assert alone[0] == alone[1] and list(alone[0]["seconds"]) == ["ring"] and alone[0]["iters"] == {"ring": 3}


def test_report_and_plot(result):
    report = format_report(result)
    assert "time / torch" in report and report.count("ring") == 2
    assert "time / model" not in report  # no emulated link, no model table
    ax = plot_busbw(result)
    assert len(ax.get_lines()) == len(ALGORITHMS)
    assert ax.get_ylabel() == "busbw (GB/s)"


def made_up_rows(ring_ratios, naive_s=None):
    """Emulated rows on Link(200 µs, 100 MB/s) whose ring takes ring_ratios[(N, D)] times the model."""
    link, rows = parlab.Link(200e-6, 100e6), []
    for (world_size, size), ratio in ring_ratios.items():
        model = cost_model("ring", size, world_size, link.latency, 1 / link.bandwidth)
        seconds = {"ring": ratio * model}
        if naive_s is not None and (world_size, size) == (4, 16 * MiB):
            seconds["naive"] = naive_s
        rows += emulated_rows(world_size, size, {"seconds": seconds, "iters": 2, "backend": "gloo"}, link)
    return rows


def test_targets_read_the_ring_against_the_model_and_against_naive():
    ring_16 = cost_model("ring", 16 * MiB, 4, 200e-6, 1e-8)
    rows = made_up_rows({(4, MiB): 1.09, (4, 16 * MiB): 1.02, (8, MiB): 1.3, (8, 64 * MiB): 1.0, (8, 4096): 3.0},
                        naive_s=1.9 * ring_16)
    found = {t["target"].split(" (")[0]: t for t in targets(rows)}
    n4, n8 = (found[f"ring within 10% of the alpha-beta model, 1-64 MiB, N = {n}"] for n in (4, 8))
    assert (n4["value"], n4["met"]) == (pytest.approx(1.09), True)
    assert (n8["value"], n8["met"]) == (pytest.approx(1.3), False)  # 4 KiB is outside 1-64 MiB: not the worst
    speedup = found["ring at least 2x faster than naive at 16 MiB, N = 4"]
    assert (speedup["value"], speedup["met"]) == (pytest.approx(1.9 / 1.02), False)  # naive / ring: 1.86
    assert len(targets(made_up_rows({(2, MiB): 1.0}))) == 1  # no 16 MiB on 4 ranks: that target is left out


def test_report_lists_each_target_as_met_or_not():
    rows = made_up_rows({(4, 16 * MiB): 1.2}, naive_s=1.0)  # the ring: 1.2 x 252.9 ms
    result = {"device": "cpu", "backend": "gloo", "torch_version": "t", "cpu_count": 2, "rows": rows,
              "regime": "emulated: link 200 µs + bytes / (100 MB/s)", "targets": targets(rows)}
    report = format_report(result)
    assert "NOT met  1.20  ring within 10% of the alpha-beta model, 1-64 MiB, N = 4" in report
    assert "    met  3.30  ring at least 2x faster than naive at 16 MiB, N = 4" in report


def test_command_line_json(capsys):
    assert cli.main(["bench", "collectives", "--json", "--world-sizes", "2", "--sizes", "1K"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["bench"] == "collectives" and out["ratio_means"] == ratio_header(REFERENCE)
    assert {row["algorithm"] for row in out["rows"]} == set(ALGORITHMS)


class FakeCluster:
    """Stands in for parlab.Cluster where only the arguments a bench passes matter."""

    started = []

    def __init__(self, world_size, device):
        self.world_size = world_size
        self.started.append(world_size)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass


@pytest.mark.parametrize("argv, world_sizes, sizes", [
    ([], [2, 4], [2**10 * 4**k for k in range(9)]),
    (["--link", "200us,100MB/s"], LINK_WORLD_SIZES, LINK_SIZES),
    (["--link", "1ms,1GB/s", "--world-sizes", "3", "--sizes", "2K"], [3], [2048]),
])
def test_link_is_read_from_the_command_line_and_chooses_its_own_defaults(argv, world_sizes, sizes, monkeypatch):
    args = cli.build_parser().parse_args(["bench", "collectives", *argv])
    measured = []
    monkeypatch.setattr(FakeCluster, "started", [])
    monkeypatch.setattr("parlab.bench.collectives.runtime.Cluster", FakeCluster)
    monkeypatch.setattr("parlab.bench.collectives.measure_all_reduce",
                        lambda cluster, sizes, link, bar: measured.append((sizes, link)) or [])
    cli.BENCHES["collectives"].run(args)
    assert FakeCluster.started == world_sizes
    assert measured == [(sizes, args.link)] * len(world_sizes)
    # where the report's targets are stated
    assert LINK_WORLD_SIZES == [4, 8] and LINK_SIZES == [MiB, 4 * MiB, 16 * MiB, 64 * MiB]
    if argv:
        assert args.link == parse_link(argv[1])
    assert parse_link("200us,100MB/s") == parlab.Link(latency=200e-6, bandwidth=100e6)


@pytest.mark.parametrize("size", ["0", "3", "lots"])
def test_bad_sizes_are_refused(size, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bench", "collectives", "--sizes", size])
    assert exit_info.value.code == 2
    assert "expected a size of at least 4 bytes" in capsys.readouterr().err


@pytest.mark.parametrize("link", ["200us", "200,100", "fast,100MB/s", "200us,100Mb/s", "-1ms,100MB/s", "1ms,0MB/s"])
def test_a_bad_link_is_refused_with_the_syntax_to_write(link, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bench", "collectives", f"--link={link}"])
    assert exit_info.value.code == 2
    assert "expected a link as LATENCY,BANDWIDTH such as 200us,100MB/s" in capsys.readouterr().err


def test_a_link_that_is_not_a_parlab_link_is_refused_before_any_rank_starts():
    with pytest.raises(ValueError, match=r"link must be a parlab.Link or None, got '200us,100MB/s': pass e.g."):
        bench_collectives(world_sizes=[2], sizes=[4096], link="200us,100MB/s")
