"""parlab.ddp and parlab.ddp on real ranks: every DDP variant trains a toy model with a
frozen and a tied parameter exactly like one process on the full batch (and like torch's
DistributedDataParallel); the number, sizes and order of all-reduces are read from the trace;
gradient accumulation with no_sync; the sampler gives torch's indices."""

import functools
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import parlab
from parlab import trace
from parlab.collectives import ring_all_reduce
from parlab.ddp import DDP, VARIANTS, DistributedSampler, assign_buckets, trainable_parameters
from parlab.numerics import assert_equivalent, assert_within, backward_in_shards, ring_orders, rounding_band
from parlab.units import MIB

VOCAB, DIM, BATCH, STEPS, LR = 11, 6, 40, 5, 0.5
# Trainable parameters in registration order: embedding.weight (tied with output.weight),
# hidden.weight, hidden.bias; frozen.* is not reduced. Bytes in reverse order:
BIAS, HIDDEN, EMBEDDING = 6 * 4, DIM * DIM * 4, VOCAB * DIM * 4  # 24, 144, 264


class TiedToy(nn.Module):
    """Embedding -> tanh(Linear) -> frozen Linear * buffer -> output layer sharing the
    embedding's weight."""

    def __init__(self):
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, DIM)
        self.hidden = nn.Linear(DIM, DIM)
        self.frozen = nn.Linear(DIM, DIM).requires_grad_(False)
        self.output = nn.Linear(DIM, VOCAB, bias=False)
        self.output.weight = self.embedding.weight
        self.register_buffer("scale", 1 + 0.1 * torch.randn(DIM))

    def forward(self, tokens):
        return self.output(self.frozen(torch.tanh(self.hidden(self.embedding(tokens)))) * self.scale)


def build_model(seed):
    torch.manual_seed(seed)
    return TiedToy()


def full_batch():
    generator = torch.Generator().manual_seed(1234)
    return torch.randint(VOCAB, (BATCH,), generator=generator), torch.randint(VOCAB, (BATCH,), generator=generator)


def loss_on(model, tokens, targets):
    return F.cross_entropy(model(tokens), targets)


@functools.cache
def reference_states(steps):
    """Parameters and buffers of one process trained on the full batch, after each step."""
    model = build_model(seed=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    states = [_state(model)]
    for _ in range(steps):
        optimizer.zero_grad()
        loss_on(model, *full_batch()).backward()
        optimizer.step()
        states.append(_state(model))
    return states


def _state(model):
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


@functools.cache
def ring_arithmetic_states(world_size, steps, microbatches=1, dtype=None):
    """The yardstick's runs (parlab.numerics): one process, the ranks' arithmetic. The batch in
    world_size x microbatches pieces (each rank's shard in micro-batches), their gradients
    summed (in ``dtype``, as a casting comm hook does) in each ring order, divided by their
    number; the state after ``steps`` SGD steps, one per order."""
    tokens, targets = full_batch()
    shards = [torch.tensor(list(DistributedSampler(BATCH, world_size, r, shuffle=False))) for r in range(world_size)]
    pieces = [(tokens[i], targets[i]) for shard in shards for i in shard.chunk(microbatches)]
    states = []
    for order in ring_orders(len(pieces)):
        model = build_model(seed=0)
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)
        for _ in range(steps):
            backward_in_shards(functools.partial(loss_on, model), model.parameters(), pieces, order, dtype)
            optimizer.step()
        states.append(_state(model))
    return states


def assert_like_one_process(actual, world_size, label, steps=STEPS, **arithmetic):
    """``actual`` equals one process on the full batch after ``steps`` steps, within the
    rounding band of the ranks' arithmetic (``arithmetic``: microbatches, dtype)."""
    decomposed = ring_arithmetic_states(world_size, steps, **arithmetic)
    assert_equivalent(actual, reference_states(steps)[-1], decomposed, label)


@pytest.fixture(scope="module")
def cluster1():
    with parlab.Cluster(world_size=1, timeout=60) as cluster:
        yield cluster


def cluster_of(world_size, request):
    return request.getfixturevalue(f"cluster{world_size}")


def my_shard():
    tokens, targets = full_batch()
    shard = list(DistributedSampler(BATCH, shuffle=False))
    return tokens[shard], targets[shard]


def wrap(model, variant, **options):
    if variant == "torch":
        return torch.nn.parallel.DistributedDataParallel(model)
    return DDP(model, variant, **options)


def train(variant, steps, **options):
    """On every rank: a replica initialised from this rank's seed (DDP must broadcast rank
    0's), trained ``steps`` SGD steps on this rank's shard. Returns its state."""
    model = build_model(seed=dist.get_rank())
    ddp = wrap(model, variant, **options)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for _ in range(steps):
        optimizer.zero_grad()
        loss_on(ddp, *my_shard()).backward()
        if variant != "torch":
            ddp.finish_gradient_synchronization()
        optimizer.step()
    return _state(model)


def train_each_variant(steps):
    return {variant: train(variant, steps) for variant in [*VARIANTS, "torch"]}


# --- numerical equivalence ----------------------------------------------------------------


@pytest.mark.timeout(90)
@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_every_variant_trains_like_one_process_and_like_torch_ddp(world_size, request):
    results = cluster_of(world_size, request).run(train_each_variant, STEPS)
    expected = reference_states(STEPS)[-1]
    assert expected["hidden.weight"].sub(reference_states(STEPS)[0]["hidden.weight"]).abs().max() > 1e-2
    band = rounding_band(expected, ring_arithmetic_states(world_size, STEPS))[0]
    for rank, states in enumerate(results):
        for variant, state in states.items():
            assert_like_one_process(state, world_size, f"rank {rank}, {variant}")
            assert_within(state, states["torch"], 2 * band, f"rank {rank}, {variant} vs torch DDP",
                          "2 x the band, as both are within it of one process")


def train_on_the_dp_axis(variant, steps):
    """On a 2 x 2 mesh (dp = 2, tp = 2; the tp axis only makes two dp groups, {0, 2} and
    {1, 3}): each group trains DDP over its own group from its first rank's weights (ranks
    0 and 1 seed theirs differently), on the batch split over the group's two ranks."""
    with parlab.Mesh(dp=2, tp=2) as mesh:
        model = build_model(seed=dist.get_rank())
        ddp = DDP(model, variant, group=mesh.group("dp"))
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)
        tokens, targets = full_batch()
        shard = list(DistributedSampler(BATCH, 2, mesh.coordinate("dp"), shuffle=False))
        for _ in range(steps):
            optimizer.zero_grad()
            loss_on(ddp, tokens[shard], targets[shard]).backward()
            ddp.finish_gradient_synchronization()
            optimizer.step()
        return _state(model)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("variant", ["naive", "bucketed"])
def test_ddp_over_a_mesh_axis_averages_within_its_group_only(variant, cluster4):
    states = cluster4.run(train_on_the_dp_axis, variant, STEPS)
    assert_like_one_process(states[0], 2, "rank 0, group {0, 2}")
    for rank, first in ((2, 0), (3, 1)):
        for name, tensor in states[rank].items():
            assert torch.equal(tensor, states[first][name]), (rank, name)  # one group, one replica
    # Group {1, 3} started from rank 1's weights and never averaged with {0, 2}.
    assert not torch.equal(states[1]["hidden.weight"], states[0]["hidden.weight"])


def accumulate_then_sync(variant, microbatches):
    """One optimizer step over ``microbatches`` micro-batches of this rank's shard, all but
    the last inside no_sync, each loss divided by their number."""
    model = build_model(seed=0)
    ddp = DDP(model, variant)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    pieces = list(zip(*(part.chunk(microbatches) for part in my_shard())))
    with trace.span("accumulate"), ddp.no_sync():
        for tokens, targets in pieces[:-1]:
            (loss_on(ddp, tokens, targets) / microbatches).backward()
            ddp.finish_gradient_synchronization()  # a no-op inside no_sync
    (loss_on(ddp, *pieces[-1]) / microbatches).backward()
    ddp.finish_gradient_synchronization()
    optimizer.step()
    return _state(model)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_no_sync_over_four_microbatches_then_a_synced_one_is_one_full_batch_step(world_size, request):
    cluster = cluster_of(world_size, request)
    for variant, buckets in [("naive", 3), ("flat", 1), ("overlapped", 3), ("bucketed", 1)]:
        timeline = cluster.trace(accumulate_then_sync, variant, 5)
        for rank, state in enumerate(timeline.results):
            assert_like_one_process(state, world_size, f"rank {rank}, {variant}", steps=1, microbatches=5)
            accumulated = timeline.select(rank=rank, name="accumulate")[0]
            all_reduces = timeline.select(rank=rank, name="all_reduce")
            assert len(all_reduces) == buckets, variant
            assert all(event.start > accumulated.end for event in all_reduces), "communication inside no_sync"


# --- buckets: the plan, and the all-reduces it produces -----------------------------------


def test_assign_buckets_fills_in_reverse_order_up_to_the_cap():
    # Plain sizes in bytes and a cap in bytes, the exercise's signature (it took parameters
    # and a cap in MiB before).
    sizes = [EMBEDDING, HIDDEN, BIAS]  # 264, 144 and 24 bytes
    assert assign_buckets(sizes, BIAS + HIDDEN + EMBEDDING) == [[2, 1, 0]]
    assert assign_buckets(sizes, BIAS + HIDDEN) == [[2, 1], [0]]  # exactly full, then too big
    assert assign_buckets(sizes, 100) == [[2], [1], [0]]  # larger than the cap: a bucket each
    assert assign_buckets(sizes, 0) == [[2], [1], [0]]
    assert assign_buckets(sizes, math.inf) == [[2, 1, 0]]
    assert assign_buckets([4, 4, 4000, 4, 4], 8) == [[4, 3], [2], [1, 0]]
    assert assign_buckets([], 8) == []


def test_assign_buckets_refuses_parameters_and_a_cap_that_is_not_a_size():
    with pytest.raises(ValueError, match=r"sizes_in_bytes\[0\] .* p.numel\(\) \* p.element_size\(\)"):
        assign_buckets([torch.empty(3)], 25 * MIB)
    with pytest.raises(ValueError, match=r"bucket_cap_bytes .* got -1: pass a number of bytes, e.g. 25 \* MIB"):
        assign_buckets([12], -1)


def test_trainable_parameters_are_what_ddp_averages_a_tied_one_once_frozen_ones_left_out():
    model = TiedToy()
    named = trainable_parameters(model)
    assert [name for name, _ in named] == ["embedding.weight", "hidden.weight", "hidden.bias"]
    assert named[0][1] is model.output.weight  # tied: one parameter, reduced once
    assert [p.numel() * p.element_size() for _, p in named] == [EMBEDDING, HIDDEN, BIAS]


def mark_gradient_ready(param):
    with trace.span("gradient ready"):
        pass


def traced_steps(variant, bucket_cap_mb, steps):
    """``steps`` steps with every trainable parameter marking when its gradient is ready
    (this hook runs after DDP's) and backward marked as a span."""
    model = build_model(seed=0)
    ddp = DDP(model, variant, bucket_cap_mb=bucket_cap_mb)
    for p in ddp.parameters_to_sync:
        p.register_post_accumulate_grad_hook(mark_gradient_ready)
    for _ in range(steps):
        model.zero_grad()
        loss = loss_on(ddp, *my_shard())
        with trace.span("backward"):
            loss.backward()
        ddp.finish_gradient_synchronization()
    return [len(bucket.parameters) for bucket in ddp.buckets]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize(
    "variant, bucket_cap_mb, sizes",
    [
        ("bucketed", (BIAS + HIDDEN + EMBEDDING) / MIB, [BIAS + HIDDEN + EMBEDDING]),
        ("bucketed", (BIAS + HIDDEN) / MIB, [BIAS + HIDDEN, EMBEDDING]),
        ("bucketed", 100 / MIB, [BIAS, HIDDEN, EMBEDDING]),
        ("naive", 25, [BIAS, HIDDEN, EMBEDDING]),
        ("flat", 25, [BIAS + HIDDEN + EMBEDDING]),
        ("overlapped", 25, [BIAS, HIDDEN, EMBEDDING]),
    ],
)
def test_one_all_reduce_per_bucket_per_step_in_reverse_order(world_size, variant, bucket_cap_mb, sizes, request):
    steps = 2
    timeline = cluster_of(world_size, request).trace(traced_steps, variant, bucket_cap_mb, steps)
    for rank in range(world_size):
        assert [event.nbytes for event in timeline.select(rank=rank, name="all_reduce")] == sizes * steps
    assert sum(timeline.results[0]) == 3  # the tied weight is one parameter, the frozen ones none


@pytest.mark.timeout(60)
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_overlapped_and_bucketed_start_all_reduces_during_backward(variant, cluster2):
    timeline = cluster2.trace(traced_steps, variant, 100 / MIB, 1)
    overlaps = variant in ("overlapped", "bucketed")
    for rank in range(2):
        backward = timeline.select(rank=rank, name="backward")[0]
        last_gradient = timeline.select(rank=rank, name="gradient ready")[-1]
        first_all_reduce = timeline.select(rank=rank, name="all_reduce")[0]
        assert (first_all_reduce.start < last_gradient.start) == overlaps
        assert (first_all_reduce.start < backward.end) == overlaps


# --- the seams: another all-reduce, communication hooks, buffers -------------------------


def train_with_custom_communication(steps):
    N = dist.get_world_size()
    calls = []

    def fp16_average(bucket):
        calls.append(bucket.numel())
        half = bucket.to(torch.float16)
        dist.all_reduce(half)
        return half.to(bucket.dtype) / N

    def future_average(bucket):
        return dist.all_reduce(bucket, async_op=True).get_future().then(lambda future: future.value()[0] / N)

    cap = (BIAS + HIDDEN) / MIB
    return {
        "ring": train("bucketed", steps, bucket_cap_mb=cap, all_reduce=ring_all_reduce),
        "future": train("bucketed", steps, bucket_cap_mb=cap, comm_hook=future_average),
        "fp16": train("bucketed", steps, bucket_cap_mb=cap, comm_hook=fp16_average),
        "fp16 calls": calls,
    }


@pytest.mark.timeout(60)
def test_another_all_reduce_and_comm_hooks_plug_in(cluster2):
    timeline = cluster2.trace(train_with_custom_communication, STEPS)
    for rank, results in enumerate(timeline.results):
        assert_like_one_process(results["ring"], 2, f"rank {rank}, ring_all_reduce")
        assert_like_one_process(results["future"], 2, f"rank {rank}, Future hook")
        assert_like_one_process(results["fp16"], 2, f"rank {rank}, fp16 hook", dtype=torch.float16)
        assert results["fp16 calls"] == [(BIAS + HIDDEN) // 4, EMBEDDING // 4] * STEPS
        # Only the default hook records all-reduces: the ring run's, with its sends beneath.
        assert [ev.nbytes for ev in timeline.select(rank=rank, name="all_reduce")] == [BIAS + HIDDEN, EMBEDDING] * STEPS
    assert min(timeline.bytes_sent()) > 0


def buffers_after_forward(broadcast_buffers):
    model = build_model(seed=dist.get_rank())
    ddp = DDP(model, broadcast_buffers=broadcast_buffers)
    constructed = model.scale.clone()
    model.scale.fill_(dist.get_rank())
    ddp(torch.zeros(1, dtype=torch.long))
    return constructed, model.scale.clone()


@pytest.mark.timeout(60)
def test_buffers_come_from_rank_0_at_construction_and_at_each_forward(cluster2):
    rank0_scale = build_model(seed=0).scale
    for broadcast_buffers in (True, False):
        for rank, (constructed, after_forward) in enumerate(cluster2.run(buffers_after_forward, broadcast_buffers)):
            assert torch.equal(constructed, rank0_scale)
            expected = torch.zeros(DIM) if broadcast_buffers else torch.full((DIM,), float(rank))
            assert torch.equal(after_forward, expected)


# --- mistakes -----------------------------------------------------------------------------


@pytest.mark.timeout(10)
def trained_replica_and_its_bytes():
    model = build_model(seed=dist.get_rank())
    ddp = DDP(model, "bucketed", bucket_cap_mb=0.0002)  # several buckets
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for _ in range(2):
        ddp.zero_grad()
        loss_on(ddp, *my_shard()).backward()
        ddp.finish_gradient_synchronization()
        optimizer.step()
    return ddp.full_parameters(), {name: p.detach().clone() for name, p in model.named_parameters()}, \
        ddp.model_state_bytes(), len(ddp.buckets)


@pytest.mark.timeout(60)
def test_full_parameters_and_model_state_bytes_as_the_other_engines(cluster2):
    (full0, own0, memory, buckets), (full1, _, memory1, _) = cluster2.run(trained_replica_and_its_bytes, timeout=60)
    assert buckets > 1
    assert full0.keys() == own0.keys() == {name for name, _ in build_model(0).named_parameters()}
    for name in own0:
        assert torch.equal(full0[name], own0[name]) and torch.equal(full0[name], full1[name]), name
    trainable, frozen = EMBEDDING + HIDDEN + BIAS, (DIM * DIM + DIM) * 4
    assert memory == memory1
    assert (memory.params, memory.grads, memory.optimizer) == (trainable + frozen, 2 * trainable, 0)
    for engine in (DDP, parlab.zero.ZeroDP, parlab.zero.FSDP):  # the names of parlab.ddp's table
        for method in ("finish_gradient_synchronization", "zero_grad", "full_parameters", "model_state_bytes"):
            assert callable(getattr(engine, method, None)), f"{engine.__name__}.{method}"


def test_learner_mistakes_are_explained():
    with pytest.raises(ValueError, match=r"bucket_cap_mb .* must be above 0"):
        DDP(TiedToy(), bucket_cap_mb=0)
    with pytest.raises(ValueError, match=r"bucket_cap_mb .* must be above 0"):
        DDP(TiedToy(), bucket_cap_mb=-1)
    with pytest.raises(ValueError, match="variant must be one of 'naive', 'flat', 'overlapped', 'bucketed'"):
        DDP(TiedToy(), variant="fast")
    with pytest.raises(ValueError, match="no trainable parameters"):
        DDP(TiedToy().requires_grad_(False))
    mixed = TiedToy()
    mixed.hidden.half()
    with pytest.raises(ValueError, match="one dtype"):
        DDP(mixed)
    with pytest.raises(ValueError, match="not both"):
        DDP(TiedToy(), all_reduce=ring_all_reduce, comm_hook=lambda bucket: bucket)
    with pytest.raises(ValueError, match="rank must be between 0 and"):
        DistributedSampler(10, num_replicas=2, rank=2)


# --- the sampler --------------------------------------------------------------------------


@pytest.mark.timeout(30)
@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("drop_last", [False, True])
def test_sampler_gives_torchs_indices(shuffle, drop_last):
    for length in (0, 1, 3, 10, 11, 13):
        for replicas in (1, 2, 3, 4):
            for epoch in (0, 1):
                shards = []
                for rank in range(replicas):
                    ours = DistributedSampler(length, replicas, rank, shuffle=shuffle, seed=7, drop_last=drop_last)
                    theirs = torch.utils.data.distributed.DistributedSampler(
                        range(length), replicas, rank, shuffle=shuffle, seed=7, drop_last=drop_last
                    )
                    ours.set_epoch(epoch)
                    theirs.set_epoch(epoch)
                    assert list(ours) == list(theirs) and len(ours) == len(theirs), (length, replicas, rank, epoch)
                    shards.append(list(ours))
                dealt = [i for shard in shards for i in shard]
                assert len({len(shard) for shard in shards}) == 1
                if drop_last:
                    assert len(set(dealt)) == len(dealt) == length - length % replicas
                else:
                    assert set(dealt) == set(range(length))


@pytest.mark.timeout(10)
def test_sampler_reshuffles_each_epoch():
    sampler = DistributedSampler(list(range(100)), num_replicas=2, rank=1)
    first = list(sampler)
    assert list(sampler) == first
    sampler.set_epoch(1)
    assert list(sampler) != first
