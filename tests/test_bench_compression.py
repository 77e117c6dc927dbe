"""parlab bench compression: the structure of its result, its byte counts (counted in the
trace, equal to the compressors' formulas) and how its ratios are made from the times it
measured, never its speed."""

import json

import pytest
import torch

from parlab import Link, cli
from parlab.bench import ratio_header
from parlab.bench.compression import COMPRESSORS, REFERENCE, TORCH_HOOKS, bench_compression, format_report, mlp
from parlab.compression import PowerSGD

HIDDEN, DEPTH = 16, 2  # d = 2 (16 x 16 + 16) = 544 parameters: even chunks at N = 2


@pytest.mark.timeout(180)
def test_command_line_json_counts_the_bytes_and_makes_the_ratios(capsys):
    argv = ["bench", "compression", "--json", "--links", "1ms,100MB/s", "100us,1GB/s", "--world-size", "2",
            "--steps", "2", "--hidden", str(HIDDEN), "--depth", str(DEPTH), "--compute-ms", "1",
            "--compressors", "top-k 1% + EF", "PowerSGD r=2 + EF"]
    assert cli.main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    d = result["parameters"]
    assert d == 544 and result["ratio_means"] == ratio_header(REFERENCE) and result["compute_s"] == 0.001
    shapes = [tuple(p.shape) for p in mlp(HIDDEN, DEPTH).parameters()][::-1]  # a bucket holds them in reverse
    flat = torch.zeros(d)
    expected = {name: COMPRESSORS[name]().sent_bytes(flat, 2, *([shapes] if "PowerSGD" in name else []))[0]
                for name in ("dense", "top-k 1% + EF", "PowerSGD r=2 + EF")}
    assert expected["dense"] == 2 * (2 - 1) * 4 * d // 2 and expected["top-k 1% + EF"] == (2 - 1) * 5 * (4 + 8)
    assert [regime["link"] for regime in result["regimes"]] == [{"latency": 1e-3, "bandwidth": 1e8},
                                                                 {"latency": 1e-4, "bandwidth": 1e9}]
    for rows in [regime["rows"] for regime in result["regimes"]] + [result["real"]]:
        assert [row["name"] for row in rows] == ["dense", "top-k 1% + EF", "PowerSGD r=2 + EF"]
        for row in rows:
            assert row["sent"] == expected[row["name"]], row["name"]  # counted in the trace, not timed
            assert row["bytes_ratio"] == row["sent"] / rows[0]["sent"]
            assert row["time_ratio"] == pytest.approx(row["median_s"] / rows[0]["median_s"])
            assert len(row["seconds"]) == len(row["losses"]) == 2 and row["times"][-1] == pytest.approx(
                sum(row["seconds"]))
    # on a 1 ms link every step pays at least dense's two messages (N = 2): 2 x (1 ms + 1088 B / 100 MB/s)
    assert min(result["regimes"][0]["rows"][0]["seconds"]) >= 2 * (1e-3 + 1088 / 1e8)
    torch_rows = {row["name"]: row for row in result["torch"]}
    assert list(torch_rows) == ["torch dense", *TORCH_HOOKS]
    before, after = PowerSGD(2).compression_sizes(shapes)
    assert torch_rows["torch powerSGD_hook r=2"]["bytes_ratio"] == after / before
    assert torch_rows["torch fp16_compress_hook"]["parlab_over_torch"] is None  # fp16 was not measured here
    real = {row["name"]: row for row in result["real"]}
    assert torch_rows["torch powerSGD_hook r=2"]["parlab_over_torch"] == pytest.approx(
        real["PowerSGD r=2 + EF"]["median_s"] / torch_rows["torch powerSGD_hook r=2"]["median_s"])
    report = format_report(result)
    assert "emulated: link 1 ms + bytes / (100 MB/s)" in report and "real time (loopback" in report
    assert "top-k 1% + EF  " in report and "torch powerSGD_hook r=2  " in report


@pytest.mark.parametrize("call, message", [
    (lambda: bench_compression([]), "pass at least one parlab.Link"),
    (lambda: bench_compression(["200us,25MB/s"]), "link must be a parlab.Link"),
    (lambda: bench_compression([Link(1e-4, 1e8)], world_size=0), "world_size"),
    (lambda: bench_compression([Link(1e-4, 1e8)], compute_s=-1), "compute_s"),
])
def test_bad_arguments_are_refused_before_any_rank_starts(call, message):
    with pytest.raises(ValueError, match=message):
        call()
