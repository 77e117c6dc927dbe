"""parlab bench tensor_parallel: the structure of its results and how its tokens/s, MFU and
ratios are made from the times it measured, never its speed; bad arguments are refused."""

import json
import statistics

import pytest

from parlab import cli
from parlab.bench import ratio_header
from parlab.bench.tensor_parallel import REFERENCE, VARIANTS, bench_tensor_parallel, mfu, model_flops
from parlab.gpt import GPTConfig


@pytest.mark.timeout(180)
def test_command_line_json_measures_every_variant_at_every_t(capsys):
    argv = ["bench", "tensor_parallel", "--json", "--world-sizes", "1", "2", "--steps", "2", "--hidden", "32",
            "--seq", "16", "--layers", "1", "--batch-size", "2"]
    assert cli.main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["bench"] == "tensor_parallel" and result["backend"] == "gloo" and result["steps"] == 2
    assert result["ratio_means"] == ratio_header(REFERENCE)
    assert [(r["t"], r["implementation"], r["variant"]) for r in result["rows"]] == [
        (1, *VARIANTS[0]), (1, *VARIANTS[1]), *((2, *variant) for variant in VARIANTS)]
    rows = {(r["t"], r["implementation"], r["variant"]): r for r in result["rows"]}
    for (t, implementation, variant), row in rows.items():
        assert len(row["seconds"]) == 2 and row["median_s"] == statistics.median(row["seconds"])
        assert row["tokens_per_s"] == pytest.approx(2 * 16 / row["median_s"])
        assert row["mfu"] is None  # on a CPU
        if implementation == "parlab":
            assert row["ratio"] == pytest.approx(row["median_s"] / rows[(t, "torch", variant)]["median_s"])


def test_mfu_counts_the_layers_flops_over_t_peaks():
    config = GPTConfig(s=64, h=128, a=4, L=2)
    assert model_flops(config, 8) == 3 * 2 * (24 * 8 * 64 * 128**2 + 4 * 8 * 64**2 * 128)
    assert mfu(config, 8, 0.5, 2, 10.0) == pytest.approx(model_flops(config, 8) / 0.5 / 2e13)
    assert mfu(config, 8, 0.5, 2, None) is None


def test_bad_arguments_say_what_to_change():
    with pytest.raises(ValueError, match="t = 3 must divide the heads a = 4 and the sequence s = 64"):
        bench_tensor_parallel([3])
    with pytest.raises(ValueError, match="MFU is measured on a GPU: drop --peak-tflops"):
        bench_tensor_parallel([1], peak_tflops=10.0)
