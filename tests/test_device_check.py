"""parlab.device_check, the GPU check (``parlab doctor --gpu``, ``pytest -m gpu``), run on the CPU:
the same harness, only the device differs, so a GPU machine runs code these tests have run."""

import pytest
import torch

from parlab import device_check
from parlab.plan import measure

pytestmark = pytest.mark.timeout(240)
# One plan of each kind of engine: DDP with accumulation, ZeRO-2, FSDP, a data x tensor grid, a data x pipeline grid.
KINDS = [layout for layout in measure.LAYOUTS if layout[:4] in {(4, 1, 1, 0), (4, 1, 1, 2), (4, 1, 1, 3),
                                                                  (2, 2, 1, 0), (2, 1, 2, 0)}]


def test_every_kind_of_engine_trains_like_one_process_on_the_cpu(cluster4):
    rows = device_check.check_engines("cpu", layouts=KINDS, runtime=cluster4)
    assert len(rows) == len(KINDS) >= 5
    for row in rows:
        assert row["ok"] and row["difference"] <= row["band"], row
        assert row["peak_bytes"] is None and row["tokens_per_s"] > 0  # no CUDA peak on a CPU
        assert row["state_bytes"] >= row["formula_state_bytes"] * 0.999, row  # the formula is the least a rank holds
    table = device_check.format_engines(rows, "cpu")
    assert table.count("\n") == len(rows) + 1 and "differs" not in table


def test_a_plan_that_trains_differently_is_reported(cluster4, monkeypatch):
    # A wrong learning rate on the ranks only: the losses leave the band after the first step.
    monkeypatch.setattr(device_check.runs, "train_plan", _train_with_a_larger_step)
    rows = device_check.check_engines("cpu", layouts=KINDS[:1], runtime=cluster4)
    assert not rows[0]["ok"] and rows[0]["difference"] > rows[0]["band"]
    assert "<- differs from one process" in device_check.format_engines(rows, "cpu")


def _train_with_a_larger_step(layout, B, forward_s, steps):
    from parlab.plan import runs

    right = runs.LR
    runs.LR = 2 * right
    try:
        return runs.train_plan(layout, B, forward_s, steps)
    finally:
        runs.LR = right  # the shared cluster's later tests train with the right step


def test_a_bench_runs_in_process_with_the_device_appended():
    report = device_check.run_bench("tensor_parallel", ["--world-sizes", "1", "--steps", "1", "--hidden", "32",
                                                        "--seq", "16", "--layers", "1", "--batch-size", "2"], "cpu")
    assert report.startswith("parlab bench tensor_parallel") and " cpu" in report


@pytest.mark.skipif(torch.cuda.is_available(), reason="only a machine without a GPU has nothing to check")
def test_without_a_gpu_the_check_says_so_and_exits_2():
    said = []
    assert device_check.run("cuda", out=said.append) == 2
    assert said == ["parlab doctor --gpu: torch sees no CUDA GPU here, so there is nothing to check "
                    "(torch.cuda.is_available() is False)."]
