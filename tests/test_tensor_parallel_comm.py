"""The communication of tensor parallelism, counted from the trace: per transformer layer 2
all-reduces of b s h elements forward and 2 backward; with sequence parallelism 2 all-gathers
and 2 reduce-scatters each way instead, with the same bytes. Against torch: an MLP block
split with parallelize_module (ColwiseParallel, RowwiseParallel, SequenceParallel) on a CPU
device mesh gives parlab's outputs and gradients, and CommDebugMode counts the collectives
parlab's trace shows."""

import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from parlab import trace
from parlab.bench.tensor_parallel import COLLECTIVES, collectives_by_phase
from parlab.gpt import GPT, MLP, CharDataset, GPTConfig
from parlab.numerics import assert_equivalent
from parlab.tensor_parallel import ParallelGPT
from parlab.tensor_parallel.model import ParallelMLP

CONFIG = GPTConfig(V=64, s=16, h=32, a=4, L=3)
B = 4
TORCH_NAMES = {"all_reduce": "all-reduce", "all_gather_into_tensor": "all-gather",
               "reduce_scatter_tensor": "reduce-scatter"}  # CommDebugMode's names of the same collectives


def traced_step(sequence_parallel):
    torch.manual_seed(0)
    model = ParallelGPT(GPT(CONFIG), sequence_parallel=sequence_parallel)
    x, y = CharDataset().batch(B, CONFIG.s, torch.Generator().manual_seed(1))
    with trace.span("forward"):
        loss = model.loss(x, y)
    with trace.span("backward"):
        loss.backward()


def split_by_size(found, least):
    """``found`` as two dicts: the calls that sent at least ``least`` bytes, and the others."""
    big = {key: [n for n in sizes if n >= least] for key, sizes in found.items()}
    small = {key: [n for n in sizes if n < least] for key, sizes in found.items()}
    return {k: v for k, v in big.items() if v}, {k: v for k, v in small.items() if v}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("t", [2, 4])
def test_each_layer_costs_two_all_reduces_each_way_or_their_gather_and_scatter(t, request):
    cluster = request.getfixturevalue(f"cluster{t}")
    L, bsh, bs = CONFIG.L, B * CONFIG.s * CONFIG.h * 4, B * CONFIG.s * 4  # bytes of (b, s, h) and of (b, s)
    ring = 2 * (t - 1) * bsh // t  # what one rank sends in a ring all-reduce of b s h elements
    totals = {}
    for sequence_parallel in (False, True):
        timeline = cluster.trace(traced_step, sequence_parallel, timeout=120)
        for rank in range(t):
            found = collectives_by_phase(timeline, rank)
            big, small = split_by_size(found, (t - 1) * bsh // t)
            if not sequence_parallel:
                # 2 per layer each way; forward adds the embedding's g, backward the head's f
                assert big == {("forward", "all-reduce"): [ring] * (2 * L + 1),
                               ("backward", "all-reduce"): [ring] * (2 * L + 1)}
            else:
                half = ring // 2  # an all-gather or a reduce-scatter: (t - 1)/t of b s h
                assert big == {("forward", "all-gather"): [half] * (2 * L + 1),
                               ("forward", "reduce-scatter"): [half] * (2 * L + 1),
                               ("backward", "all-gather"): [half] * (2 * L + 1),
                               ("backward", "reduce-scatter"): [half] * (2 * L + 1)}
            # the parallel cross-entropy: 3 all-reduces of b s numbers (max, sum of exponentials, target)
            assert small == {("forward", "all-reduce"): [2 * (t - 1) * bs // t] * 3}
            totals.setdefault(sequence_parallel, []).append(sum(sum(v) for v in big.values()))
    assert totals[False] == totals[True]  # the same bytes, in other collectives


class NormMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.mlp = nn.LayerNorm(CONFIG.h), MLP(CONFIG)

    def forward(self, x):
        return self.mlp(self.norm(x))


def against_torch(sequence_parallel):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module

    t, r = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    full = NormMLP()
    x = torch.randn(B, CONFIG.s, CONFIG.h, generator=torch.Generator().manual_seed(1))
    mine = x.chunk(t, 1)[r] if sequence_parallel else x  # (b, s/t, h) or (b, s, h)

    norm = nn.LayerNorm(CONFIG.h)
    norm.load_state_dict(full.norm.state_dict())
    mlp = ParallelMLP(full.mlp, None, sequence_parallel)
    ours_in = mine.clone().requires_grad_()
    with trace.span("forward"):
        ours = mlp(norm(ours_in))
    with trace.span("backward"):
        ours.sum().backward()

    # The yardstick: the one-process block, and the same with fc2 as the sum of t partial products
    results = []
    for split in (False, True):
        whole = x.clone().requires_grad_()
        hidden = F.gelu(full.mlp.fc1(full.norm(whole)))
        if split:
            parts = [F.linear(hr, wr) for hr, wr in zip(hidden.chunk(t, -1), full.mlp.fc2.weight.chunk(t, 1))]
            out = functools.reduce(torch.add, parts) + full.mlp.fc2.bias
        else:
            out = full.mlp.fc2(hidden)
        out.sum().backward()
        pick = (lambda z: z.chunk(t, 1)[r]) if sequence_parallel else (lambda z: z)
        results.append({"output": pick(out.detach()), "input gradient": pick(whole.grad)})

    if sequence_parallel:
        plan = {"norm": SequenceParallel(), "mlp.fc1": ColwiseParallel(input_layouts=Shard(1)),
                "mlp.fc2": RowwiseParallel(output_layouts=Shard(1))}
    else:
        plan = {"mlp.fc1": ColwiseParallel(), "mlp.fc2": RowwiseParallel()}
    theirs_model = parallelize_module(full, init_device_mesh("cpu", (t,)), plan)
    theirs_in = mine.clone().requires_grad_()
    with CommDebugMode() as forward_counts:
        theirs = theirs_model(theirs_in)
    with CommDebugMode() as backward_counts:
        theirs.sum().backward()
    counts = [{TORCH_NAMES[str(op).split(".")[-1]]: n for op, n in mode.get_comm_counts().items()}
              for mode in (forward_counts, backward_counts)]
    ours, theirs = ({"output": o.detach(), "input gradient": i.grad}
                    for o, i in ((ours, ours_in), (theirs.wait(), theirs_in)))
    return ours, theirs, results, counts


@pytest.mark.timeout(180)
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_torch_parallelize_module_gives_our_outputs_and_collectives(sequence_parallel, cluster2):
    timeline = cluster2.trace(against_torch, sequence_parallel, timeout=120)
    for rank, (ours, theirs, (reference, split), counts) in enumerate(timeline.results):
        assert_equivalent(ours, reference, [split], f"rank {rank}, parlab")
        assert_equivalent(theirs, reference, [split], f"rank {rank}, torch")
        found = collectives_by_phase(timeline, rank)
        ours_counted = [{name: len(found.get((phase, name), [])) for name in COLLECTIVES
                         if found.get((phase, name))} for phase in ("forward", "backward")]
        assert ours_counted == counts
        expected = {"reduce-scatter": 1, "all-gather": 1} if sequence_parallel else {"all-reduce": 1}
        assert counts == [expected, expected]
