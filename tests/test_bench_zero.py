"""parlab bench zero: the structure of its results, its byte counts (counted from storages and
traces, not timed) and how its ratios are made from the times it measured, never its speed."""

import json
import statistics

import pytest

from parlab import Link, cli
from parlab.bench import ratio_header
from parlab.bench.zero import (
    ENGINES,
    REFERENCE,
    STAGE_RATIO,
    bench_zero,
    bench_zero_link,
    format_report,
    overlap_model,
    stage_model,
    time_overlap,
    time_stages,
)
from parlab.memory import FP32_ADAM, STAGES, model_state_bytes, ring_communication_seconds, ring_traffic_bytes

HIDDEN, DEPTH = 64, 2  # Psi = 8320: the padding to a multiple of N_d is far below 2%


@pytest.mark.timeout(120)
def test_command_line_json_measures_every_engine_and_parlab_matches_the_formula(capsys):
    argv = ["bench", "zero", "--json", "--world-sizes", "2", "--steps", "2", "--hidden", str(HIDDEN),
            "--depth", str(DEPTH), "--batch-size", "4"]
    assert cli.main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    psi = result["parameters"]
    assert psi == 2 * (64 * 64 + 64)
    assert result["bench"] == "zero" and result["backend"] == "gloo" and result["steps"] == 2
    assert result["ratio_means"].startswith(ratio_header(REFERENCE))
    assert [(r["implementation"], r["stage"], r["engine"]) for r in result["rows"]] == ENGINES

    rows = {(row["implementation"], row["stage"]): row for row in result["rows"]}
    for (implementation, stage), row in rows.items():
        formula = model_state_bytes(psi, stage, 2, *FP32_ADAM)
        assert row["formula"] == {**formula._asdict(), "total": formula.total}
        assert row["world_size"] == 2 and len(row["per_rank_total"]) == 2
        assert row["bytes"]["total"] == max(row["per_rank_total"])
        assert row["bytes"]["total"] == sum(row["bytes"][f] for f in ("params", "grads", "optimizer"))
        assert len(row["seconds"]) == 2 and row["median_s"] == statistics.median(row["seconds"])
        if implementation == "parlab" or stage == 0:  # torch's ZeRO shards whole parameters, unevenly
            for field in ("params", "grads", "optimizer", "total"):
                assert row["bytes"][field] == pytest.approx(row["formula"][field], rel=0.02), (row["engine"], field)
    for (implementation, stage), row in rows.items():
        if implementation == "parlab":
            theirs = rows.get(("torch", stage))
            if theirs is None:
                assert row["ratio"] is None
            else:
                assert row["ratio"]["time"] == pytest.approx(row["median_s"] / theirs["median_s"])
                assert row["ratio"]["bytes"] == pytest.approx(row["bytes"]["total"] / theirs["bytes"]["total"])
    assert rows["parlab", 2]["ratio"] is None  # torch has no stage-2 engine

    report = format_report(result)
    assert "/ formula" in report and "time / torch" in report and "kappa = 8" in report
    assert all(f"{row['engine']}  " in report for row in result["rows"])


@pytest.mark.timeout(120)
def test_stages_on_the_command_line_measure_only_those_engines(capsys):
    argv = ["bench", "zero", "--json", "--stages", "0", "--world-sizes", "2", "--steps", "1", "--hidden",
            str(HIDDEN), "--depth", str(DEPTH), "--batch-size", "4"]
    assert cli.main(argv) == 0
    ours, theirs = json.loads(capsys.readouterr().out)["rows"]
    assert (ours["engine"], theirs["engine"]) == ("ZeroDP stage 0", "torch DDP")
    assert ours["ratio"]["time"] == pytest.approx(ours["median_s"] / theirs["median_s"])


@pytest.mark.timeout(180)
def test_command_line_link_times_the_stages_and_counts_their_bytes(capsys):
    argv = ["bench", "zero", "--json", "--link", "100us,200MB/s", "--world-sizes", "2", "--steps", "1",
            "--hidden", str(HIDDEN), "--depth", str(DEPTH), "--compute-ms", "1"]
    assert cli.main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    link = Link(latency=100e-6, bandwidth=200e6)
    assert result["link"] == {"latency": link.latency, "bandwidth": link.bandwidth}
    assert result["ratio_means"] == STAGE_RATIO and result["compute_s"] == 0.001 and result["batch_size"] == 4
    rows = result["rows"]
    assert [(row["world_size"], row["stage"]) for row in rows] == [(2, stage) for stage in STAGES]
    for row in rows:
        # counted, not timed: every rank sends exactly the ring's bytes, 2 or 3 collectives of the padded buffers
        assert row["sent"] == [row["sent_formula"]] * 2
        assert len(row["seconds"]) == 1 and row["median_s"] == row["seconds"][0] > 0 and row["real_median_s"] > 0
        assert row["measured_over_model"] == pytest.approx(row["median_s"] / row["model_s"])
        assert row["over_stage_0"] == pytest.approx(row["median_s"] / rows[0]["median_s"])
        assert row["model_over_stage_0"] == pytest.approx(row["model_s"] / rows[0]["model_s"])
        assert row["real_over_stage_0"] == pytest.approx(row["real_median_s"] / rows[0]["real_median_s"])
    assert [row["traffic_over_stage_0"] for row in rows] == [1, 1, 1, 1.5]
    assert rows[3]["sent_formula"] == pytest.approx(1.5 * rows[0]["sent_formula"], rel=1e-3)  # units pad a little
    # stage 0 moves one flat buffer of the 2 layers, stage 3 one per layer: model = compute + alpha-beta, but
    # stage 0's all-reduce runs beside the compute after backward (here shorter than it: hidden)
    all_reduce = ring_communication_seconds([8320], 2, 4, 0, 100e-6, 200e6)
    assert all_reduce < 0.001 and rows[0]["model_s"] == pytest.approx(0.001)
    assert rows[1]["model_s"] == pytest.approx(0.001 + ring_communication_seconds([8320], 2, 4, 1, 100e-6, 200e6))
    assert rows[3]["model_s"] == pytest.approx(0.001 + ring_communication_seconds([4160] * 2, 2, 4, 3, 100e-6, 200e6))
    [target] = result["targets"]
    assert target["value"] == rows[3]["over_stage_0"]
    assert target["met"] == (abs(target["value"] / 1.5 - 1) <= 0.15)
    report = format_report(result)
    assert "emulated: link 100 µs + bytes / (200 MB/s)" in report and "target: stage 3's time over stage 0's" in report
    assert all(f"{row['engine']}  " in report for row in rows)


@pytest.mark.timeout(120)
def test_time_stages_runs_in_the_clusters_regime_and_the_model_reads_its_buffers(cluster2):
    with cluster2.emulate(link=Link(latency=1e-3, bandwidth=1e9)):
        [row] = time_stages(cluster2, stages=(3,), hidden=8, depth=3, batch_size=2, steps=2)
    assert row["stage"] == 3 and row["engine"] == "FSDP FULL_SHARD" and len(row["seconds"]) == 2
    assert row["padded_numels"] == [8 * 8 + 8] * 3  # a unit per Linear, 72 elements (even)
    assert row["sent"] == [ring_traffic_bytes(3 * 72, 2, 4, 3)] * 2 == row["timeline"].bytes_sent()
    assert row["timeline"].regime == "emulated: link 1 ms + bytes / (1 GB/s)"
    assert row["timeline"].duration == row["seconds"][-1]  # the last step
    # each of 3 units x 3 collectives is one 1 ms message at N_d = 2: the steps cannot be shorter
    assert min(row["seconds"]) >= 9e-3
    link = Link(latency=1e-3, bandwidth=1e9)
    assert stage_model(row, 2, link, 0.5) == pytest.approx(0.5 + 9 * (1e-3 + 36 * 4 / 1e9))
    # stages 0 and 2 start the gradients' collective during backward: the compute after it runs beside it
    flat = dict(row, padded_numels=[216])
    communication = 2 * (1e-3 + 108 * 4 / 1e9)  # 2 collectives of one message each at N_d = 2
    for stage, beside in ((0, communication), (1, 0), (2, communication / 2)):
        for compute in (1e-4, 0.5):
            assert stage_model(dict(flat, stage=stage), 2, link, compute) == pytest.approx(
                compute + communication - min(compute, beside)), (stage, compute)


@pytest.mark.timeout(120)
def test_time_overlap_times_fsdp_with_and_without_prefetch_against_its_model(cluster2):
    link = Link(latency=2e-3, bandwidth=1e9)
    with cluster2.emulate(link=link):
        rows = time_overlap(cluster2, hidden=8, depth=3, batch_size=2, layer_s=0.01, steps=1)
    assert [(row["engine"], row["prefetch"]) for row in rows] == [("FSDP FULL_SHARD, prefetch=False", False),
                                                                  ("FSDP FULL_SHARD, prefetch=True", True)]
    collective = 2e-3 + 36 * 4 / 1e9  # one message of half a unit's 72 elements at N_d = 2
    for row in rows:
        assert row["padded_numels"] == [72] * 3 and row["timeline"].duration == row["seconds"][-1]
        model = overlap_model(row, 2, link, 0.01)
        assert model == pytest.approx(3 * 0.01 * 3 + (2 if row["prefetch"] else 9) * collective)
        assert row["median_s"] >= 0.98 * model  # an emulated message or compute is never early
        assert row["timeline"].bytes_sent() == [ring_traffic_bytes(3 * 72, 2, 4, 3)] * 2


@pytest.mark.parametrize("call, message", [
    (lambda: bench_zero_link(None), "pass one, e.g. parlab.Link"),
    (lambda: bench_zero_link("200us,25MB/s"), "link must be a parlab.Link"),
    (lambda: bench_zero_link(Link(1e-4, 1e8), world_sizes=[0]), "each of world_sizes"),
    (lambda: bench_zero_link(Link(1e-4, 1e8), compute_s=-1), "compute_s"),
    (lambda: time_stages(None, stages=(4,)), "ZeRO stages 0 to 3, got 4"),
    (lambda: bench_zero(stages=[4]), "stages must list ZeRO stages"),
    (lambda: bench_zero(stages=[]), "stages must list ZeRO stages"),
])
def test_bad_arguments_are_refused_before_any_rank_starts(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_link_on_the_command_line_is_the_cpus_and_every_stages():
    with pytest.raises(ValueError, match="drop --device cuda"):
        cli.main(["bench", "zero", "--link", "200us,25MB/s", "--device", "cuda"])
    with pytest.raises(ValueError, match="--link measures every stage"):
        cli.main(["bench", "zero", "--link", "200us,25MB/s", "--stages", "0"])
