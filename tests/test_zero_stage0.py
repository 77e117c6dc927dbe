"""ZeRO stage 0 as DDP("bucketed") does it (parlab.zero.buckets.AllReduceBuckets): the flat
gradient is all-reduced bucket by bucket during backward, on the communication thread.
Checked at 2 and 4 ranks with buckets of every size on a chain of uneven layers: one process's
result within the rounding band, exactly the ring's bytes (every bucket's range holds a multiple
of N_d elements), one "all-reduce gradients" span per non-empty range; gradient accumulation
and an unused parameter give stage 1's result; the optimizer steps the model's parameters."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from test_zero_stage2 import CAPS, OPTIMIZERS, accumulate_two_micro_batches, build_chain, my_shard, reference

from parlab import trace
from parlab.memory import ring_traffic_bytes
from parlab.numerics import assert_equivalent, ring_orders
from parlab.units import MIB
from parlab.zero import ZeroDP

STEPS = 4


def traced_training(optimizer_name, cap):
    optimizer_class, options = OPTIMIZERS[optimizer_name]
    engine = ZeroDP(build_chain(seed=dist.get_rank()), optimizer_class, stage=0, bucket_cap_mb=cap / MIB, **options)
    x, y = my_shard()
    with trace.span("steps"):
        for _ in range(STEPS):
            engine.zero_grad()
            F.mse_loss(engine(x), y).backward()
            engine.step()
    ranges = [(start, end) for start, end in engine.buckets.ranges if end > start]
    stepped = [p for group in engine.optimizer.param_groups for p in group["params"]]
    return dict(parameters=engine.full_parameters(), padded=engine.layout.padded_numel, ranges=ranges,
                buckets=len(engine.buckets.ranges), steps_the_parameters=stepped == engine.trainable)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", ["cluster2", "cluster4"])
@pytest.mark.parametrize("cap", CAPS)
def test_bucketed_stage_0_trains_like_one_process_and_sends_one_ring_all_reduce(world, cap, request):
    cluster = request.getfixturevalue(world)
    N = cluster.world_size
    for optimizer_name in OPTIMIZERS:
        timeline = cluster.trace(traced_training, optimizer_name, CAPS[cap], timeout=120)
        yardstick = [reference(optimizer_name, N, tuple(order)) for order in ring_orders(N)]
        for rank, result in enumerate(timeline.results):
            assert result["buckets"] == {"per parameter": 6, "one bucket": 1}.get(cap, result["buckets"]) > 0
            assert result["steps_the_parameters"]
            ranges = result["ranges"]
            assert all((end - start) % N == 0 for start, end in ranges), ranges  # whole ring chunks
            assert ranges[0][1] == result["padded"] and ranges[-1][0] == 0  # ends to beginning, no gaps:
            assert all(earlier[0] == later[1] for earlier, later in zip(ranges, ranges[1:]))
            assert_equivalent(result["parameters"], reference(optimizer_name), yardstick,
                              f"rank {rank}, {optimizer_name}, {cap}")
            start = timeline.select(rank=rank, name="steps")[0].start
            sent = sum(ev.nbytes for ev in timeline.select(rank=rank, kind="comm")
                       if ev.name in ("send", "isend") and ev.start >= start)
            assert sent == STEPS * ring_traffic_bytes(result["padded"], N, 4, 0)
            assert len(timeline.select(rank=rank, name="all-reduce gradients")) == STEPS * len(ranges)


def both_stages_accumulating(second_head):
    return [accumulate_two_micro_batches(stage, second_head) for stage in (0, 1)]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("second_head", [(True, False), (False, True)])
def test_accumulated_micro_batches_and_an_unused_parameter_give_stage_1s_result(cluster4, second_head):
    """Each backward launches its round of all-reduces (the second adds its gradients to the
    first's averages, which are equal on every rank); a bucket whose parameter got no
    gradient is reduced in step(). Integer data: the same bits as stage 1."""
    for stage0, stage1 in cluster4.run(both_stages_accumulating, second_head, timeout=60):
        assert all(torch.equal(stage0[name], stage1[name]) for name in stage1)

