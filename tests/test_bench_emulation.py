"""parlab bench emulation: the shape of its result and report, and its arguments; the
emulation's speed is only held to the lower bound it guarantees (never faster than declared)."""

import json

import pytest

import parlab
from parlab import cli
from parlab.bench import ratio_header
from parlab.bench.emulation import (
    REFERENCE,
    TARGET_BYTES,
    bench_emulation,
    compute_row,
    format_report,
    message_row,
    targets,
)

pytestmark = pytest.mark.timeout(120)
LINK = parlab.Link(latency=1e-3, bandwidth=1e9)


@pytest.fixture(scope="module")
def result():
    return bench_emulation(LINK, sizes=[1024, TARGET_BYTES], compute_s=[0.002], repeats=2)


def test_one_row_per_message_size_and_per_compute_time(result):
    messages, computes = ([row for row in result["rows"] if row["kind"] == kind] for kind in ("message", "compute"))
    assert [row["bytes"] for row in messages] == [1024, TARGET_BYTES]
    assert [row["declared_s"] for row in messages] == [LINK.time(1024), LINK.time(TARGET_BYTES)]
    assert [(row["bytes"], row["declared_s"]) for row in computes] == [(None, 0.004)]  # forward + backward
    for row in result["rows"]:
        assert row["ratio"] == row["median_s"] / row["declared_s"]
        assert row["p90_ratio"] == row["p90_s"] / row["declared_s"] and row["p90_s"] >= row["median_s"]
        assert row["ratio"] >= 1  # a message or a compute sleeps until its deadline: never early
    assert [row["repeats"] for row in result["rows"]] == [2, 2, 4]  # a compute runs on both ranks
    assert result["regime"] == "emulated: link 1 ms + bytes / (1 GB/s)"
    assert result["ratio_means"] == ratio_header(REFERENCE)
    assert [t["value"] for t in result["targets"]] == [messages[1]["ratio"]]


def test_rows_and_target_from_made_up_times():
    message = message_row(2**20, 0.010, [[1.0, 2.0, 3.0], [1.0105, 2.0110, 3.0200]])  # durations 10.5, 11, 20 ms
    assert (message["median_s"], message["p90_s"]) == (pytest.approx(0.011), pytest.approx(0.020))
    assert message["ratio"] == pytest.approx(1.1)
    compute = compute_row(0.001, [[0.0021, 0.0022], [0.0020, 0.0030]])
    assert (compute["declared_s"], compute["median_s"], compute["repeats"]) == (0.002, pytest.approx(0.00215), 4)
    assert targets([message, compute]) == [
        {"target": "an emulated message of 1M < 5% above its declared time (median)", "value": message["ratio"],
         "met": False}]
    assert targets([compute]) == []  # no message of 1 MiB measured: no target to read
    quick = message_row(2**20, 0.010, [[1.0], [1.0102]])
    report = format_report({"rows": [quick, compute], "targets": targets([quick]), "regime": "emulated: link",
                            "torch_version": "t", "cpu_count": 2, "repeats": 1})
    assert ratio_header(REFERENCE) in report.split("\n\n")[0]
    assert "message of 1M" in report and "SleepLayer fwd + bwd" in report
    assert "    met  1.020  an emulated message of 1M < 5% above its declared time (median)" in report


def test_command_line_reads_its_options():
    args = cli.build_parser().parse_args(
        ["bench", "emulation", "--link", "2ms,50MB/s", "--sizes", "1K", "1M", "--compute-ms", "5", "--repeats", "3"])
    assert (args.link, args.sizes, args.compute_ms, args.repeats) == (parlab.Link(2e-3, 50e6), [1024, 2**20], [5.0], 3)
    defaults = cli.build_parser().parse_args(["bench", "emulation"])
    assert defaults.link == parlab.Link(200e-6, 100e6) and defaults.sizes[-1] == 64 * 2**20


def test_command_line_json(capsys):
    argv = ["bench", "emulation", "--json", "--link", "1ms,1GB/s", "--sizes", "4K", "--compute-ms", "1",
            "--repeats", "1"]
    assert cli.main(argv) == 0
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    assert out["bench"] == "emulation" and [row["kind"] for row in out["rows"]] == ["message", "compute"]
    assert "parlab bench emulation" in captured.err  # the progress bar, on stderr


@pytest.mark.parametrize("argv, complaint", [
    (["--link", "fast"], "expected a link as LATENCY,BANDWIDTH such as 200us,100MB/s"),
    (["--compute-ms", "0"], "expected a number above 0"),
    (["--repeats", "0"], "expected a whole number of at least 1"),
])
def test_bad_options_are_refused(argv, complaint, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bench", "emulation", *argv])
    assert exit_info.value.code == 2
    assert complaint in capsys.readouterr().err


@pytest.mark.parametrize("call, complaint", [
    (lambda: bench_emulation(None), "measures an emulated link: pass one"),
    (lambda: bench_emulation("200us,100MB/s"), "link must be a parlab.Link or None"),
    (lambda: bench_emulation(LINK, repeats=0), "repeats must be a whole number >= 1"),
    (lambda: bench_emulation(LINK, compute_s=[-1.0]), "each of compute_s must be above 0"),
])
def test_bad_arguments_are_refused_before_any_rank_starts(call, complaint):
    with pytest.raises(ValueError, match=complaint):
        call()
