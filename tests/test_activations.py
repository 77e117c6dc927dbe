"""parlab.tensor_parallel.activations: the bytes autograd saves per layer, counted with
saved-tensor hooks, equal parlab's item-by-item accounting exactly (fp32 and bf16, with and
without dropout, t = 1, 2, 4, with and without sequence parallelism, selective and full
recompute); that accounting differs from Korthikanti et al.'s formulas by exactly the items
the module names; written-out attention keeps its (b, a, s, s) softmax output and torch's
memory-efficient attention keeps none; checkpointing a chain of L layers in segments of c
holds L/c + c layers at its peak."""

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from parlab.gpt import Block, GPTConfig
from parlab.tensor_parallel.activations import (
    SavedBytes,
    checkpoint_peak_units,
    dropout_mask_bytes,
    korthikanti_bytes,
    layer_bytes,
    layer_saved_bytes,
    measure_attention_bytes,
    measure_checkpointed_chain,
    measure_saved_bytes,
    recompute_kind,
)
from parlab.tensor_parallel.model import ParallelBlock

S, B, H, A = 16, 2, 32, 4


def block_and_input(dtype, dropout, seed=0):
    torch.manual_seed(seed)
    block = Block(GPTConfig(s=S, h=H, a=A, dropout=dropout)).to(dtype)
    return block, torch.randn(B, S, H, dtype=dtype, requires_grad=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_one_layer_saves_exactly_the_items_of_the_accounting(dtype, dropout):
    block, x = block_and_input(dtype, dropout)
    value_bytes = torch.finfo(dtype).bits // 8
    expected = layer_bytes(S, B, H, A, value_bytes=value_bytes, mask_bytes=dropout_mask_bytes("cpu", value_bytes),
                           dropout=dropout > 0)
    assert measure_saved_bytes(block, x) == expected


def test_full_recompute_keeps_the_layer_input_only():
    block, x = block_and_input(torch.float32, 0.1)
    with SavedBytes(exclude=block) as saved:
        checkpoint(block, x, use_reentrant=True)
    assert saved.total == layer_bytes(S, B, H, A, recompute=True) == S * B * H * 4


@pytest.mark.parametrize("recompute", [False, "selective"])
@pytest.mark.parametrize("t, sequence_parallel", [(1, False), (2, False), (4, False), (2, True), (4, True)])
def test_the_accounting_is_the_paper_s_formula_plus_the_named_differences(t, sequence_parallel, recompute):
    s, b, h, a = 64, 8, 128, 4
    ours = layer_bytes(s, b, h, a, t, sequence_parallel, recompute, value_bytes=2, mask_bytes=1)
    statistics = 2 * 2 * b * s * 2 // (t if sequence_parallel else 1)  # LayerNorm's mean and 1/std
    gathered = 2 * s * b * h * 2 * (1 - 1 / t) if sequence_parallel else 0  # the column layers' gathered inputs
    assert ours == korthikanti_bytes(s, b, h, a, t, sequence_parallel, recompute) + statistics + gathered
    assert layer_bytes(s, b, h, a, t, sequence_parallel, recompute=True, value_bytes=2) == korthikanti_bytes(
        s, b, h, a, t, sequence_parallel, recompute="full")


def test_korthikanti_bytes_is_table_2_of_the_paper():
    s, b, h, a, t = 64, 8, 128, 4, 4
    sbh = s * b * h
    assert korthikanti_bytes(s, b, h, a) == sbh * (34 + 5 * a * s / h)
    assert korthikanti_bytes(s, b, h, a, t) == sbh * (10 + 24 / t + 5 * a * s / (h * t))
    assert korthikanti_bytes(s, b, h, a, t, True) == sbh * (34 / t + 5 * a * s / (h * t))
    assert korthikanti_bytes(s, b, h, a, t, recompute="selective") == sbh * (10 + 24 / t)
    assert korthikanti_bytes(s, b, h, a, t, True, "selective") == sbh * 34 / t
    assert korthikanti_bytes(s, b, h, a, recompute=True) == korthikanti_bytes(s, b, h, a, recompute="full") == 2 * sbh


def test_written_out_attention_keeps_its_scores_and_memory_efficient_attention_does_not():
    s, b, h, a = 64, 8, 128, 4
    sbh = s * b * h * 4  # fp32
    assert measure_attention_bytes(s, b, h, a) == 3 * sbh + a * s * s * b * 4  # q, k, v, the softmax output
    # q, k, v, its output and one fp32 log-sum-exp per head and position: nothing of size s x s
    assert measure_attention_bytes(s, b, h, a, memory_efficient=True) == 4 * sbh + a * s * b * 4


def measure_parallel_layer(sequence_parallel, dropout, recompute_attention=False):
    import torch.distributed as dist
    t, r = dist.get_world_size(), dist.get_rank()
    full, x = block_and_input(torch.float32, dropout)
    block = ParallelBlock(full, None, sequence_parallel, recompute_attention)
    mine = x.detach().chunk(t, 1)[r].clone().requires_grad_() if sequence_parallel else x  # its own storage
    return measure_saved_bytes(block, mine)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("t", [2, 4])
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_a_tensor_parallel_layer_saves_what_the_accounting_says_on_every_rank(t, sequence_parallel, request):
    cluster = request.getfixturevalue(f"cluster{t}")
    for dropout in (0.0, 0.1):
        for recompute in (False, "selective"):
            expected = layer_bytes(S, B, H, A, t, sequence_parallel, recompute, mask_bytes=4, dropout=dropout > 0)
            measured = cluster.run(measure_parallel_layer, sequence_parallel, dropout, bool(recompute), timeout=60)
            assert measured == [expected] * t, (dropout, recompute)


def test_checkpointing_segments_of_c_of_l_layers_holds_l_over_c_plus_c_at_its_peak():
    L = 16
    peaks = {c: measure_checkpointed_chain(L, c) for c in (1, 2, 4, 8, 16)}
    assert peaks == {c: checkpoint_peak_units(L, c) for c in peaks}
    assert min(peaks, key=peaks.get) == 4  # sqrt(16)


def test_sizes_that_do_not_fit_say_what_to_change():
    with pytest.raises(ValueError, match="choose a dividing h and t dividing a"):
        korthikanti_bytes(64, 8, 128, 6)
    with pytest.raises(ValueError, match="t must be a whole number >= 1, got 0"):
        layer_saved_bytes(64, 8, 128, 4, t=0)
    with pytest.raises(ValueError, match="segments of c = 3 layers must divide the L = 16 layers"):
        checkpoint_peak_units(16, 3)
    with pytest.raises(ValueError, match='recompute must be False .keep everything., "selective" or True'):
        layer_saved_bytes(64, 8, 128, 4, recompute="attention")
    assert [recompute_kind(r) for r in (False, None, "none", "selective", True, "full")] == [
        None, None, None, "selective", "full", "full"]
