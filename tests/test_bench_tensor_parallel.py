"""parlab bench tensor_parallel: the structure of its results and how its tokens/s, MFU and
ratios are made from the times it measured, never its speed; every variant it times computes
the one-process layers; bad arguments are refused."""

import functools
import json
import statistics

import pytest
import torch
import torch.distributed as dist
from test_tensor_parallel import split_linear
from torch import nn

from parlab import cli
from parlab.bench import ratio_header
from parlab.bench.tensor_parallel import REFERENCE, VARIANTS, bench_tensor_parallel, build, mfu, model_flops
from parlab.gpt import Block, GPTConfig
from parlab.numerics import assert_equivalent


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


def variant_outputs(config, batch_size):
    """Every variant of the bench, built as the bench builds it, on one input: its output."""
    torch.manual_seed(0)
    layers = [Block(config) for _ in range(config.L)]
    x = torch.randn(batch_size, config.s, config.h, generator=torch.Generator().manual_seed(1))
    t, r = dist.get_world_size(), dist.get_rank()
    outputs = {}
    for implementation, variant in VARIANTS:
        model, _ = build(implementation, variant, layers, "cpu")
        mine = x.chunk(t, 1)[r].contiguous() if variant == "TP + SP" else x
        out = model(mine)
        outputs[f"{implementation} {variant}"] = (out.wait() if hasattr(out, "wait") else out).detach()
    return outputs


@pytest.mark.timeout(120)
def test_every_variant_computes_the_one_process_layers(cluster2):
    """The bench compares like with like: parlab's and torch's variants all give the output of
    the one-process layers, within the band of the same layers computing each row-parallel
    product as two partial sums (the ranks' arithmetic in one process)."""
    config, batch_size = GPTConfig(s=16, h=32, a=4, L=2), 2
    torch.manual_seed(0)
    layers = nn.Sequential(*(Block(config) for _ in range(config.L)))
    x = torch.randn(batch_size, config.s, config.h, generator=torch.Generator().manual_seed(1))
    reference = layers(x).detach()
    for name, module in layers.named_modules():
        if isinstance(module, nn.Linear):
            kind = "row" if name.endswith(("proj", "fc2")) else "column"
            module.forward = functools.partial(split_linear, module, 2, (0, 1), kind)
    split = layers(x).detach()
    for rank, outputs in enumerate(cluster2.run(variant_outputs, config, batch_size, timeout=60)):
        for name, out in outputs.items():
            sequence_parallel = name.endswith("SP")
            expected, decomposed = ((z.chunk(2, 1)[rank] for z in (reference, split)) if sequence_parallel
                                    else (reference, split))
            assert_equivalent(out, expected, [decomposed], f"rank {rank}, {name}")
