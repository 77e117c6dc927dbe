"""parlab bench zero: the structure of its result and its byte counts (deterministic: counted
from storages, not timed), never its speed."""

import json
import statistics

import pytest

from parlab import cli
from parlab.bench import ratio_header
from parlab.bench.ddp import mlp_parameters
from parlab.bench.zero import REFERENCE, available_engines, format_report
from parlab.memory import FP32_ADAM, model_state_bytes

HIDDEN, DEPTH = 64, 2  # Psi = 8320: the padding to a multiple of N_d is far below 2%


@pytest.mark.timeout(120)
def test_command_line_json_measures_every_engine_and_parlab_matches_the_formula(capsys):
    argv = ["bench", "zero", "--json", "--world-sizes", "2", "--steps", "2", "--hidden", str(HIDDEN),
            "--depth", str(DEPTH), "--batch-size", "4"]
    assert cli.main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    psi = result["parameters"]
    assert psi == mlp_parameters(HIDDEN, DEPTH) == 2 * (64 * 64 + 64)
    assert result["bench"] == "zero" and result["backend"] == "gloo" and result["steps"] == 2
    assert result["ratio_means"].startswith(ratio_header(REFERENCE))
    assert [(r["implementation"], r["stage"], r["engine"]) for r in result["rows"]] == available_engines()

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
    assert "/ formula" in report and "time / torch" in report
    assert all(f"{row['engine']}  " in report for row in result["rows"])
