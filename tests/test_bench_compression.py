"""parlab bench compression and lecture 05's experiments: the structure of the bench's result,
its byte counts (counted in the trace, equal to the compressors' formulas), its steps taken in
turns, how its ratios and the twin's noise are made from the times it measured, never its
speed; how far a run got beside dense, and where the alpha-beta model puts the crossover."""

import json
import statistics

import pytest
import torch

from parlab import Link, cli
from parlab.bench import ratio_header
from parlab.bench.compression import (
    COMPRESSORS,
    REFERENCE,
    TORCH_HOOKS,
    bench_compression,
    format_report,
    mlp,
    predicted_step,
    train,
)
from parlab.bench.compression_experiments import TWIN, compare, crossover, progress, steps_to_reach
from parlab.compression import PowerSGD

HIDDEN, DEPTH = 16, 2  # d = 2 (16 x 16 + 16) = 544 parameters: even chunks at N = 2


@pytest.mark.timeout(180)
def test_command_line_json_counts_the_bytes_and_makes_the_ratios(capsys):
    argv = ["bench", "compression", "--json", "--links", "1ms,100MB/s", "100us,1GB/s", "--world-size", "2",
            "--steps", "2", "--hidden", str(HIDDEN), "--depth", str(DEPTH), "--compute-ms", "1",
            "--compressors", "top-k 1% + EF", "PowerSGD R=2 + EF"]
    assert cli.main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    d = result["parameters"]
    assert d == 544 and result["ratio_means"] == ratio_header(REFERENCE) and result["compute_s"] == 0.001
    shapes = [tuple(p.shape) for p in mlp(HIDDEN, DEPTH).parameters()][::-1]  # a bucket holds them in reverse
    flat = torch.zeros(d)
    expected = {name: COMPRESSORS[name]().sent_bytes(flat, 2, shapes)[0]
                for name in ("dense", "top-k 1% + EF", "PowerSGD R=2 + EF")}
    assert expected["dense"] == 2 * (2 - 1) * 4 * d // 2 and expected["top-k 1% + EF"] == (2 - 1) * 5 * (4 + 8)
    assert [regime["link"] for regime in result["regimes"]] == [{"latency": 1e-3, "bandwidth": 1e8},
                                                                 {"latency": 1e-4, "bandwidth": 1e9}]
    for rows in [regime["rows"] for regime in result["regimes"]] + [result["real"]]:
        assert [row["name"] for row in rows] == ["dense", "top-k 1% + EF", "PowerSGD R=2 + EF"]
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
    assert torch_rows["torch powerSGD_hook R=2"]["bytes_ratio"] == after / before
    assert torch_rows["torch fp16_compress_hook"]["parlab_over_torch"] is None  # fp16 was not measured here
    real = {row["name"]: row for row in result["real"]}
    assert torch_rows["torch powerSGD_hook R=2"]["parlab_over_torch"] == pytest.approx(
        real["PowerSGD R=2 + EF"]["median_s"] / torch_rows["torch powerSGD_hook R=2"]["median_s"])
    report = format_report(result)
    assert "emulated: link 1 ms + bytes / (100 MB/s)" in report and "real time (loopback" in report
    assert "top-k 1% + EF  " in report and "torch powerSGD_hook R=2  " in report


@pytest.mark.parametrize("call, message", [
    (lambda: bench_compression([]), "pass at least one parlab.Link"),
    (lambda: bench_compression(["200us,25MB/s"]), "link must be a parlab.Link"),
    (lambda: bench_compression([Link(1e-4, 1e8)], world_size=0), "world_size"),
    (lambda: bench_compression([Link(1e-4, 1e8)], compute_s=-1), "compute_s"),
])
def test_bad_arguments_are_refused_before_any_rank_starts(call, message):
    with pytest.raises(ValueError, match=message):
        call()


@pytest.mark.timeout(120)
def test_the_runs_take_their_steps_in_turns(cluster2):
    # dense's step sends 2 (N - 1)/N 4 d bytes, top-k's (N - 1) k 12: in turns, the trace's steps alternate
    timeline = cluster2.trace(train, ["dense", "top-k 1% + EF"], 3, HIDDEN, DEPTH)
    sent = [max(timeline.window("step", index).bytes_sent()) for index in range(6)]
    assert sent == [4 * 544, 5 * 12] * 3


@pytest.mark.timeout(120)
def test_compare_makes_each_ratio_step_by_step_and_the_noise_from_the_twin(cluster2):
    rows, noise = compare(cluster2, ["top-k 1% + EF"], 8, HIDDEN, DEPTH)
    assert [row["name"] for row in rows] == ["dense", "top-k 1% + EF"] and noise["name"] == TWIN
    dense = rows[0]["seconds"]
    for row in [*rows, noise]:
        assert row["step_ratios"] == [a / b for a, b in zip(row["seconds"], dense)]
        assert row["ratio"] == statistics.median(row["step_ratios"])
    assert rows[0]["ratio"] == 1.0 and rows[0]["losses"] == noise["losses"]  # the twin trains as dense does
    first, _, third = statistics.quantiles(noise["step_ratios"], n=4, method="inclusive")
    assert noise["standard_error"] == pytest.approx(1.2533 * (third - first) / 1.349 / 8**0.5)


def test_progress_is_each_runs_loss_drop_and_when_dense_got_there():
    rows = [{"name": "dense", "losses": [3.0, 2.0, 1.0], "times": [0.1, 0.2, 0.3]},
            {"name": "slow learner", "losses": [3.5, 3.0, 2.0], "times": [0.05, 0.1, 0.15]},
            {"name": "ahead", "losses": [2.0, 1.0, 0.5], "times": [0.1, 0.2, 0.3]}]
    assert steps_to_reach(rows[0], 2.0) == 2 and steps_to_reach(rows[0], 0.5) is None
    slow, ahead = progress(rows, start=4.0)
    assert slow == {"name": "slow learner", "loss": 2.0, "share": 2 / 3, "seconds": 0.15, "dense_steps": 2,
                    "dense_seconds": 0.2}
    assert ahead["share"] == 3.5 / 3 and ahead["dense_steps"] is None and ahead["dense_seconds"] is None


def test_crossover_is_where_the_model_plus_the_cpu_cost_meets_dense():
    N, latency = 4, 500e-6

    def step(name, bandwidth):
        return predicted_step(COMPRESSORS[name](), N, Link(latency, bandwidth), compute_s=0.01)[1]

    # no CPU cost: top-k's bytes and its N - 1 messages (dense's ring sends 2 (N - 1)) save time at any bandwidth
    assert crossover("top-k 1% + EF", 0.0, N, latency, 0.01) is None
    extra = 0.005
    found = crossover("top-k 1% + EF", extra, N, latency, 0.01)
    grid = [10 ** (5 + i / 20) for i in range(101)]
    before = grid[grid.index(found) - 1]
    assert step("top-k 1% + EF", found) + extra >= step("dense", found)
    assert step("top-k 1% + EF", before) + extra < step("dense", before)
    assert crossover("top-k 1% + EF", 100.0, N, latency, 0.01) == grid[0]  # 100 s of CPU: it pays nowhere
