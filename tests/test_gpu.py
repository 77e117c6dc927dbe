"""The GPU check, asserted: ``pytest -m gpu`` on a machine with CUDA (skipped without one).
Every engine trains the small GPT like one process on the GPU (nccl with a GPU per rank, or
the ranks sharing the GPUs over gloo), and each lecture's bench runs with ``--device cuda``.
``parlab doctor --gpu`` prints the same with the benches' reports."""

import pytest
import torch

from parlab import device_check, fp8

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="the GPU check needs a CUDA GPU")]


def test_every_engine_trains_like_one_process_on_the_gpu():
    rows = device_check.check_engines("cuda")
    print("\n" + device_check.format_engines(rows, "cuda"))
    assert len(rows) == len(device_check.measure.LAYOUTS)
    for row in rows:
        assert row["ok"], row
        # What a rank's process held at its peak covers at least the model states it measured.
        assert row["peak_bytes"] >= row["state_bytes"], row


@pytest.mark.parametrize("name, argv", device_check.BENCHES, ids=[name for name, _ in device_check.BENCHES])
def test_each_lectures_bench_runs_on_the_gpu(name, argv):
    report = device_check.run_bench(name, argv, "cuda")
    print("\n" + report)
    assert report.startswith(f"parlab bench {name}") and "cuda" in report


def test_fp8_matmuls_run_on_the_gpu_beside_bf16():
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("torch._scaled_mm needs fp8 tensor cores (compute capability 8.9 or more)")
    tflops = fp8.scaled_mm_throughput(n=4096, repeats=10)
    print(f"\nfp8 E4M3 {tflops['fp8 E4M3']:.0f} TFLOP/s, bf16 {tflops['bf16']:.0f} TFLOP/s")
    assert tflops["fp8 E4M3"] > 0 and tflops["bf16"] > 0
