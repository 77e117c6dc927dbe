"""ZeRO stage 0 as DDP("bucketed") does it (parlab.zero.buckets.AllReduceBuckets): the flat
gradient is all-reduced bucket by bucket during backward, on the communication thread, with
the all-reduce DDP takes in the regime (``parlab.ddp.engine.regime_all_reduce``): torch's
``dist.all_reduce`` in real time, parlab's ring on an emulated link or inside ``cluster.trace``
(so the trace counts its bytes, as lecture 04 does). Checked at 2 and 4 ranks with buckets of
every size on a chain of uneven layers, in the three cases: one process's result within the
rounding band, and which collective ran: in real time, untraced, one ``dist.all_reduce`` per
range; traced (real time or on the emulated link) no ``dist.all_reduce``, one "all-reduce
gradients" span per non-empty range and exactly the ring's bytes (every bucket's range holds a
multiple of N_d elements). Gradient accumulation and unused parameters give stage 1's
result; the optimizer steps the model's parameters; with the default cap the first bucket is
torch DDP's (1 MiB)."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from test_zero_stage2 import CAPS, OPTIMIZERS, accumulate_two_micro_batches, build_chain, my_shard, reference
from torch import nn

import parlab
from parlab import trace
from parlab.bench.zero_engines import mlp
from parlab.memory import ring_traffic_bytes
from parlab.numerics import assert_equivalent, ring_orders
from parlab.units import MIB
from parlab.zero import ZeroDP
from parlab.zero.buckets import assign_buckets_with_first

STEPS = 4
FAST_LINK = parlab.Link(latency=1e-5, bandwidth=1e9)  # emulated, so the ring runs, and quick
# (link, traced): the ring runs where its messages are timed or counted
REGIMES = {"real time": (None, False), "real time, traced": (None, True), "emulated link": (FAST_LINK, True)}


def traced_training(optimizer_name, cap):
    """Train stage 0 with ``dist.all_reduce`` counted: the sizes of the tensors it summed."""
    summed, all_reduce = [], dist.all_reduce

    def counted_all_reduce(tensor, *args, **kwargs):
        summed.append(tensor.numel())
        return all_reduce(tensor, *args, **kwargs)

    dist.all_reduce = counted_all_reduce  # before the engine is built: it takes the function then
    try:
        optimizer_class, options = OPTIMIZERS[optimizer_name]
        engine = ZeroDP(build_chain(seed=dist.get_rank()), optimizer_class, stage=0, bucket_cap_mb=cap / MIB,
                        **options)
        x, y = my_shard()
        with trace.span("steps"):
            for _ in range(STEPS):
                engine.zero_grad()
                F.mse_loss(engine(x), y).backward()
                engine.step()
    finally:
        dist.all_reduce = all_reduce
    ranges = [(start, end) for start, end in engine.buckets.ranges if end > start]
    stepped = [p for group in engine.optimizer.param_groups for p in group["params"]]
    return dict(parameters=engine.full_parameters(), padded=engine.layout.padded_numel, ranges=ranges,
                buckets=len(engine.buckets.ranges), steps_the_parameters=stepped == engine.trainable, summed=summed)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", ["cluster2", "cluster4"])
@pytest.mark.parametrize("cap", CAPS)
@pytest.mark.parametrize("regime", REGIMES)
def test_bucketed_stage_0_trains_like_one_process_with_the_regimes_all_reduce(world, cap, regime, request):
    cluster = request.getfixturevalue(world)
    N = cluster.world_size
    link, traced = REGIMES[regime]
    for optimizer_name in OPTIMIZERS:
        with cluster.emulate(link=link):
            if traced:
                timeline = cluster.trace(traced_training, optimizer_name, CAPS[cap], timeout=120)
                results = timeline.results
            else:
                results = cluster.run(traced_training, optimizer_name, CAPS[cap], timeout=120)
        yardstick = [reference(optimizer_name, N, tuple(order)) for order in ring_orders(N)]
        for rank, result in enumerate(results):
            assert result["buckets"] == {"per parameter": 6, "one bucket": 1}.get(cap, result["buckets"]) > 0
            assert result["steps_the_parameters"]
            ranges = result["ranges"]
            assert all((end - start) % N == 0 for start, end in ranges), ranges  # whole ring chunks
            assert ranges[0][1] == result["padded"] and ranges[-1][0] == 0  # ends to beginning, no gaps:
            assert all(earlier[0] == later[1] for earlier, later in zip(ranges, ranges[1:]))
            assert_equivalent(result["parameters"], reference(optimizer_name), yardstick,
                              f"rank {rank}, {optimizer_name}, {cap}, {regime}")
            if not traced:  # torch's all-reduce, one per range and step
                assert result["summed"] == [end - start for start, end in ranges] * STEPS
                continue
            start = timeline.select(rank=rank, name="steps")[0].start
            sent = sum(ev.nbytes for ev in timeline.select(rank=rank, kind="comm")
                       if ev.name in ("send", "isend") and ev.start >= start)
            assert len(timeline.select(rank=rank, name="all-reduce gradients")) == STEPS * len(ranges)
            # parlab's ring, whose messages the trace counts: exactly one ring all-reduce of padded Psi
            assert result["summed"] == [] and sent == STEPS * ring_traffic_bytes(result["padded"], N, 4, 0)


def both_stages_accumulating(second_head):
    return [accumulate_two_micro_batches(stage, second_head) for stage in (0, 1)]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("second_head", [(True, False), (False, True)])
def test_accumulated_micro_batches_and_an_unused_parameter_give_stage_1s_result(cluster4, second_head):
    """Each backward is a round of all-reduces (the second adds its shares to the first's
    averages, which are equal on every rank); a parameter without a gradient in a backward
    adds zeros, or the average it holds, to its round. Integer data: the same bits as stage 1."""
    for stage0, stage1 in cluster4.run(both_stages_accumulating, second_head, timeout=60):
        assert all(torch.equal(stage0[name], stage1[name]) for name in stage1)


def default_buckets():
    return [len(ZeroDP(mlp([1024] * 5), stage=0, **cap).buckets.ranges) for cap in ({}, {"bucket_cap_mb": 25})]


@pytest.mark.timeout(60)
def test_the_default_cap_makes_torch_ddps_first_bucket(cluster2):
    """torch's DDP, with its default cap only, closes its first bucket once it holds 1 MiB: on
    the bench's MLP of 4 layers of 1024 x 1024 (4 MiB a weight) it buckets the parameters
    [[7, 6], [5, 4, 3, 2, 1, 0]] (its logging data's rebuilt_per_bucket_param_indices), so the
    last layer's all-reduce runs during backward; an explicit cap of 25 MiB makes one bucket."""
    sizes = [p.numel() * 4 for p in mlp([1024] * 5).parameters()]
    assert assign_buckets_with_first(sizes, MIB, 25 * MIB) == [[7, 6], [5, 4, 3, 2, 1, 0]]
    assert assign_buckets_with_first([264, 144, 24], 100, 1000) == [[2, 1], [0]]
    assert assign_buckets_with_first([264, 144, 24], 1000, 150) == [[2, 1, 0]]
    assert assign_buckets_with_first([264, 144, 24], 10, 150) == [[2], [1], [0]]
    assert assign_buckets_with_first([], MIB, 25 * MIB) == []
    assert cluster2.run(default_buckets, timeout=60) == [[2, 1]] * 2


def step_without_backward():
    engine = ZeroDP(nn.Linear(3, 2), torch.optim.SGD, stage=0, lr=0.1)
    before = engine.full_parameters()
    engine.zero_grad()
    engine.step()
    return before, engine.full_parameters(), [p.grad.abs().max().item() for p in engine.module.parameters()]


@pytest.mark.timeout(30)
def test_a_step_without_backward_takes_zero_gradients(cluster2):
    """zero_grad sets the gradients to None (torch's way); with no backward to hand them over,
    step() finds zeros in the flat gradient, as the module's gradients."""
    for before, after, largest in cluster2.run(step_without_backward, timeout=30):
        assert all(torch.equal(before[name], after[name]) for name in before) and largest == [0.0, 0.0]
