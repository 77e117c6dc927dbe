"""ZeRO stage 2 as DeepSpeed does it (parlab.zero.buckets): the gradients are reduce-scattered
bucket by bucket during backward. Checked at 2 and 4 ranks: the result is stage 1's bit for
bit (the same additions in the same order) and one process's within the rounding band; the
bytes sent are the ring's formula; the peak of the gradient bytes alive, measured by the
engine from the storages of its gradient tensors, is what the buckets predict and below
stage 1's full flat gradient; gradient accumulation and unused parameters still give stage 1's
result."""

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from parlab import trace
from parlab.memory import ring_traffic_bytes
from parlab.numerics import assert_equivalent, backward_in_shards, ring_orders
from parlab.units import MIB
from parlab.zero import ZeroDP
from parlab.zero.formulas import stage2_peak_gradient_bytes

SIZES, BATCH, STEPS = (7, 13, 11, 5), 16, 4  # 104 + 143 + 60 = 307 trainable parameters: padded at N_d = 2, 4
# bucket caps in bytes: each parameter alone; buckets of a few parameters that straddle shard
# boundaries; one bucket for all (what the default 25 MiB gives such a model)
CAPS = {"per parameter": 1, "a few parameters": 500, "one bucket": math.inf}
OPTIMIZERS = {"Adam": (torch.optim.Adam, dict(lr=1e-2)), "SGD momentum": (torch.optim.SGD, dict(lr=0.1, momentum=0.9))}


def build_chain(seed=0):
    """Linear -> tanh -> Linear -> tanh -> frozen Linear x 2 -> Linear... a chain of uneven layers."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(SIZES[0], SIZES[1]), nn.Tanh(), nn.Linear(SIZES[1], SIZES[2]), nn.Tanh(),
                         nn.Linear(SIZES[2], SIZES[2]).requires_grad_(False), nn.Linear(SIZES[2], SIZES[3]))


def full_batch():
    generator = torch.Generator().manual_seed(7)
    return torch.randn(BATCH, SIZES[0], generator=generator), torch.randn(BATCH, SIZES[3], generator=generator)


def my_shard():
    return [part.chunk(dist.get_world_size())[dist.get_rank()] for part in full_batch()]


def train(stage, optimizer_name, cap=None):
    optimizer_class, options = OPTIMIZERS[optimizer_name]
    engine = ZeroDP(build_chain(seed=dist.get_rank()), optimizer_class, stage=stage,
                    **({} if cap is None else dict(bucket_cap_mb=cap / MIB)), **options)
    x, y = my_shard()
    for _ in range(STEPS):
        engine.zero_grad()
        F.mse_loss(engine(x), y).backward()
        engine.step()
    return engine


def stage2_against_stage1():
    results = {}
    for optimizer_name in OPTIMIZERS:
        results[optimizer_name, "stage 1"] = train(1, optimizer_name).full_parameters()
        for label, cap in CAPS.items():
            engine = train(2, optimizer_name, cap)
            results[optimizer_name, label] = engine.full_parameters()
            results["buckets", label] = len(engine.buckets.buckets)
    return results


def reference(optimizer_name, shards=1, order=None):
    model = build_chain()
    optimizer_class, options = OPTIMIZERS[optimizer_name]
    optimizer = optimizer_class([p for p in model.parameters() if p.requires_grad], **options)
    parts = list(zip(*(part.chunk(shards) for part in full_batch())))
    for _ in range(STEPS):
        backward_in_shards(lambda x, y: F.mse_loss(model(x), y), model.parameters(), parts, order)
        optimizer.step()
    return {name: p.detach().clone() for name, p in model.named_parameters()}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", ["cluster2", "cluster4"])
def test_bucketed_stage_2_is_stage_1_bit_for_bit_and_one_process_within_the_band(world, request):
    cluster = request.getfixturevalue(world)
    N = cluster.world_size
    for rank, results in enumerate(cluster.run(stage2_against_stage1, timeout=120)):
        assert results["buckets", "per parameter"] == 6 and results["buckets", "one bucket"] == 1
        assert 1 < results["buckets", "a few parameters"] < 6
        for optimizer_name in OPTIMIZERS:
            stage1 = results[optimizer_name, "stage 1"]
            yardstick = [reference(optimizer_name, N, tuple(order)) for order in ring_orders(N)]
            for label in CAPS:
                stage2 = results[optimizer_name, label]
                assert all(torch.equal(stage2[name], stage1[name]) for name in stage1), (rank, optimizer_name, label)
                assert_equivalent(stage2, reference(optimizer_name), yardstick,
                                  f"rank {rank}, {optimizer_name}, {label}")


def traced_step(cap):
    engine = ZeroDP(build_chain(), torch.optim.Adam, stage=2, bucket_cap_mb=cap / MIB)
    x, y = my_shard()
    with trace.span("steps"):
        for _ in range(2):
            engine.zero_grad()
            F.mse_loss(engine(x), y).backward()
            engine.step()
    return engine.layout.padded_numel, len(engine.buckets.buckets)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", ["cluster2", "cluster4"])
def test_the_buckets_send_the_bytes_of_one_ring_reduce_scatter(world, request):
    cluster = request.getfixturevalue(world)
    N = cluster.world_size
    for cap in (CAPS["per parameter"], CAPS["a few parameters"]):
        timeline = cluster.trace(traced_step, cap, timeout=120)
        padded, buckets = timeline.results[0]
        for rank in range(N):
            start = timeline.select(rank=rank, name="steps")[0].start
            sent = sum(ev.nbytes for ev in timeline.select(rank=rank, kind="comm")
                       if ev.name in ("send", "isend") and ev.start >= start)
            assert sent == 2 * ring_traffic_bytes(padded, N, 4, 2) == 2 * 2 * (N - 1) * padded * 4 / N
            assert len(timeline.select(rank=rank, name="reduce-scatter gradients")) == 2 * buckets


LAYERS, WIDTH = 7, 100  # 7 x 10 100 = 70 700 parameters: N_d = 2 and 4 divide them


STAGE2_CAPS = {"per layer": (WIDTH + 1) * WIDTH * 4, "per parameter": 1, "one bucket": math.inf}  # bytes


def layers_engine(stage, buckets=None):
    """ZeroDP over LAYERS Linear + tanh layers, at stage 2 with ``buckets`` (a STAGE2_CAPS key);
    an input batch."""
    torch.manual_seed(0)
    model = nn.Sequential(*[layer for _ in range(LAYERS) for layer in (nn.Linear(WIDTH, WIDTH), nn.Tanh())])
    cap = {"bucket_cap_mb": STAGE2_CAPS[buckets] / MIB} if stage == 2 else {}
    return ZeroDP(model, torch.optim.Adam, stage=stage, lr=1e-3, **cap), torch.randn(4, WIDTH)


def peaks():
    measured = {}
    for stage, buckets in ((1, None), *((2, buckets) for buckets in STAGE2_CAPS)):
        engine, x = layers_engine(stage, buckets)
        for _ in range(2):
            engine.zero_grad()
            engine(x).square().mean().backward()
            engine.step()
        predicted = engine.buckets.peak_bytes() if stage == 2 else None
        measured[buckets] = (engine.peak_gradient_bytes, predicted, engine.model_state_bytes().grads)
    return measured


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", ["cluster2", "cluster4"])
def test_the_measured_peak_of_stage_2_is_its_buckets_and_below_stage_1(world, request):
    cluster = request.getfixturevalue(world)
    N, psi = cluster.world_size, LAYERS * (WIDTH + 1) * WIDTH
    weight, layer = WIDTH * WIDTH, (WIDTH + 1) * WIDTH
    for rank, measured in enumerate(cluster.run(peaks, timeout=120)):
        stage1 = measured[None][0]
        assert stage1 == 4 * psi  # the flat gradient buffer, all the time
        expected = {  # B_(b-1) in flight + B_b + G_b + padded Psi / N_d of the largest bucket
            "per layer": (4 * (layer + layer + weight + psi // N), [(layer, weight)] * LAYERS),
            # a weight's bucket is its gradient: no buffer beside it, and a bias's bucket in flight
            "per parameter": (4 * (WIDTH + weight + psi // N), [(WIDTH, WIDTH), (weight, weight)] * LAYERS),
            # its buffer, a whole flat gradient, and the shard's gradient, in its reduce-scatter
            "one bucket": (4 * (psi + psi // N), [(psi, weight)]),
        }
        for buckets, (formula, sizes) in expected.items():
            peak, predicted, at_rest = measured[buckets]
            assert peak == predicted == formula == stage2_peak_gradient_bytes(sizes, psi // N), (rank, buckets)
            assert at_rest == 4 * psi // N, (rank, buckets)
            assert (peak < stage1) == (buckets != "one bucket"), (rank, buckets)


def test_the_stage_2_peak_formula_counts_the_first_bucket_without_the_shard_and_the_one_in_flight():
    # the shard's gradient is allocated at the first launch, after the first bucket's last
    # gradient was added and freed: bucket 0 meets one or the other, later buckets both, and
    # the bucket before them in flight
    assert stage2_peak_gradient_bytes([(10, 6), (4, 3)], 5) == 4 * max(10 + 6, 10 + 4 + 3 + 5)
    assert stage2_peak_gradient_bytes([(10, 3), (4, 3)], 5, element_bytes=2) == 2 * max(10 + 5, 10 + 4 + 3 + 5)
    assert stage2_peak_gradient_bytes([(4, 3), (10, 6)], 5) == 4 * (4 + 10 + 6 + 5)
    assert stage2_peak_gradient_bytes([(20, 3), (1, 1), (2, 1)], 5) == 4 * max(20 + 5, 20 + 1 + 5, 1 + 2 + 1 + 5)
    # a bucket that is one gradient is that gradient: no copy beside it
    assert stage2_peak_gradient_bytes([(4, 4), (10, 10)], 5) == 4 * (4 + 10 + 5)
    assert stage2_peak_gradient_bytes([(10, 10)], 5) == 4 * (10 + 5)
    with pytest.raises(ValueError, match="G_b <= B_b"):
        stage2_peak_gradient_bytes([(4, 5)], 2)
    with pytest.raises(ValueError, match="buckets is empty"):
        stage2_peak_gradient_bytes([], 2)


class TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.body, self.heads = nn.Linear(4, 4), nn.ModuleList([nn.Linear(4, 2), nn.Linear(4, 2)])
        for p in self.parameters():  # integer-valued: every gradient below is exact in fp32
            p.data = torch.randint(-2, 3, p.shape).float()

    def forward(self, x, both_heads):
        hidden = self.body(x)
        return self.heads[0](hidden) + self.heads[1](hidden) if both_heads else self.heads[0](hidden)


def two_heads():
    torch.manual_seed(0)
    return TwoHeads()


def accumulate_two_micro_batches(stage, second_head):
    """Two micro-batches accumulated before one step; the second head gets a gradient from
    the micro-batches ``second_head`` says (when not from the last, its bucket is
    reduced in step()). Integer data: any order of additions gives the same bits."""
    engine = ZeroDP(two_heads(), torch.optim.SGD, stage=stage, lr=2.0**-6,
                    **({"bucket_cap_mb": 1 / MIB} if stage != 1 else {}))
    x = torch.randint(-2, 3, (8, 4), generator=torch.Generator().manual_seed(dist.get_rank())).float()
    engine.zero_grad()
    for micro, part in enumerate(x.chunk(2)):
        engine(part, both_heads=second_head[micro]).sum().backward()
    engine.step()
    return engine.full_parameters()


def both_stages_accumulating(second_head):
    return [accumulate_two_micro_batches(stage, second_head) for stage in (1, 2)]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("second_head", [(True, False), (False, True)])
def test_accumulated_micro_batches_and_an_unused_parameter_give_stage_1s_result(cluster4, second_head):
    start = dict(two_heads().named_parameters())
    for stage1, stage2 in cluster4.run(both_stages_accumulating, second_head, timeout=60):
        assert all(torch.equal(stage1[name], stage2[name]) for name in stage1)
        assert all(not torch.equal(stage2[name], start[name]) for name in start)  # every parameter stepped


def step_without_backward():
    engine = ZeroDP(build_chain(), torch.optim.SGD, stage=2, lr=0.1)
    engine.zero_grad()
    try:
        engine.step()
    except ValueError as error:
        return str(error)


@pytest.mark.timeout(60)
def test_stage_2_mistakes_are_explained(cluster2):
    assert all("backward first" in message for message in cluster2.run(step_without_backward, timeout=60))
    with pytest.raises(ValueError, match="bucket_cap_mb is for stages 0 and 2"):
        ZeroDP(build_chain(), torch.optim.SGD, stage=1, bucket_cap_mb=1, lr=0.1)
    with pytest.raises(ValueError, match="bucket must hold something"):
        ZeroDP(build_chain(), torch.optim.SGD, stage=2, bucket_cap_mb=0, lr=0.1)


def profiled_step(stage):
    """All the CPU memory torch allocates in one step (activations, autograd's temporaries, the
    optimizer's, the receive buffers), from the profiler's allocation events: the largest
    running total, plus the gradient bytes the engine held when the step began (stage 1's
    flat gradient; nothing at stage 2). Parameters and optimizer state, the same at both
    stages, are left out."""
    engine, x = layers_engine(stage, "per layer")
    engine.zero_grad()
    engine(x).square().mean().backward()
    engine.step()  # the first step makes the optimizer state and the receive buffers
    engine.zero_grad()
    held = engine.gradient_bytes()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as profile:
        engine(x).square().mean().backward()
        engine.step()
    allocations = sorted((event.start_ns(), event.nbytes()) for event in profile.profiler.kineto_results.events()
                         if event.name() == "[memory]")
    running = peak = 0
    for _, nbytes in allocations:  # frees are negative
        running += nbytes
        peak = max(peak, running)
    return held + peak


def both_profiled():
    return [profiled_step(stage) for stage in (1, 2)]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", ["cluster2", "cluster4"])
def test_torchs_profiler_sees_stage_2_allocate_less_than_stage_1(world, request):
    """A second witness beside the engine's own accounting: a gradient the engine forgot to
    free (or a reference it kept) would show here. What stage 2 saves is at least the part of
    stage 1's flat gradient outside the shard, less the two bucket buffers (one filling, one in
    flight) and the gradient it adds."""
    cluster = request.getfixturevalue(world)
    N, psi = cluster.world_size, LAYERS * (WIDTH + 1) * WIDTH
    saving = 4 * (psi - psi // N) - 4 * (2 * (WIDTH + 1) * WIDTH + WIDTH * WIDTH)
    for stage1, stage2 in cluster.run(both_profiled, timeout=120):
        assert stage2 <= stage1 - saving, (stage1, stage2, saving)
