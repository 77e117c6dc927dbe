"""Graded: bucket assignment and a bucketed, overlapped DDP (``ddp.py``).

``assign_buckets`` is compared with golden cases. ``BucketedDDP`` trains a toy MLP with a
frozen layer for 3 SGD steps at 2 and 4 ranks, every replica starting from its own seed and
reading its own shard; before every optimizer step each rank's parameters and averaged
gradients are compared with one process on the full batch, within the rounding band of
``parlab.numerics`` (twice what one process differs by when it averages the shards'
gradients as the ranks do, plus 16 roundings of the largest value). The
all-reduces are read from the trace: how many, of how many bytes, in what order, and whether
the first one starts inside backward.
"""

import functools
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from parlab import trace
from parlab.numerics import backward_in_shards, max_abs_difference, ring_orders, rounding_band
from parlab.units import MIB

RUN_TIMEOUT_S = 10
WORLD_SIZES = [2, 4]
IN, HIDDEN, OUT, BATCH, STEPS, LR = 6, 8, 3, 24, 3, 0.2
# Trainable gradients in registration order (bytes): first.weight 192, first.bias 32,
# middle.weight 256, middle.bias 32, last.weight 96, last.bias 12; frozen.* has none.
# In reverse with a cap of 160 bytes: [12 + 96 + 32], [256], [32], [192].
CAP_BYTES = 160
BUCKET_BYTES = [140, 256, 32, 192]
PARAMETER_BYTES_REVERSED = [12, 96, 32, 256, 32, 192]
WEIGHTS_NOT_GRADIENTS = "your hook synchronises weights, not gradients: all-reduce param.grad, not param or param.data"


def ranks(world_size):
    return f"{world_size} ranks"


@pytest.mark.task("assign_buckets")
class TestAssignBuckets:
    @pytest.mark.points(1)
    def test_reverse_order_and_cap(self, impl):
        check_buckets(impl, [264, 144, 24], 168, [[2, 1], [0]])
        check_buckets(impl, PARAMETER_BYTES_REVERSED[::-1], CAP_BYTES, [[5, 4, 3], [2], [1], [0]])
        check_buckets(impl, [100, 100, 100, 100], 200, [[3, 2], [1, 0]])  # exactly full stays one

    @pytest.mark.points(1)
    def test_edge_cases(self, impl):
        check_buckets(impl, [264, 144, 24], 0, [[2], [1], [0]])
        check_buckets(impl, [264, 144, 24], math.inf, [[2, 1, 0]])
        check_buckets(impl, [10, 500, 10, 10], 100, [[3, 2], [1], [0]])  # larger than the cap: alone
        check_buckets(impl, [10, 10, 500], 100, [[2], [1, 0]])
        check_buckets(impl, [7], 1, [[0]])
        check_buckets(impl, [], 100, [])


def check_buckets(impl, sizes, cap, expected):
    got = impl.assign_buckets(sizes, cap)
    got = [list(bucket) for bucket in got] if isinstance(got, (list, tuple)) else got
    hint = ""
    if got == [bucket[::-1] for bucket in expected[::-1]]:
        hint = ": fill the buckets in REVERSE registration order, last parameter first"
    assert got == expected, f"assign_buckets({sizes}, {cap}) returned {got}, expected {expected}{hint}"


@pytest.mark.task("bucketed_ddp")
class TestBucketedDDP:
    @pytest.mark.points(1)
    @pytest.mark.parametrize("cluster", WORLD_SIZES, indirect=True, ids=ranks)
    def test_trains_like_one_process_on_the_full_batch(self, cluster, impl):
        per_rank = cluster.run(train_on_rank, impl.BucketedDDP, timeout=RUN_TIMEOUT_S)
        check_training(per_rank, cluster.world_size)

    @pytest.mark.points(1)
    def test_one_all_reduce_per_bucket_in_reverse_order(self, cluster2, impl):
        timeline = cluster2.trace(traced_steps_on_rank, impl.BucketedDDP, 2, timeout=RUN_TIMEOUT_S)
        expected = BUCKET_BYTES * 2
        for rank in range(2):
            got = [event.nbytes for event in timeline.select(rank=rank, name="all_reduce")]
            if got == expected:
                continue
            hint = ""
            if not got:
                hint = ": none was traced; launch every bucket's all-reduce with launch_all_reduce"
            elif got == PARAMETER_BYTES_REVERSED * 2:
                hint = ": that is one all-reduce per parameter; group the gradients into self.buckets"
            elif sorted(got) == sorted(expected):
                hint = ": the right buckets in the wrong order; launch buckets 0, 1, 2, ... in order"
            assert False, (
                f"2 steps, rank {rank}: all-reduces of {got} bytes, expected {expected} (buckets of at most "
                f"{CAP_BYTES} bytes in reverse registration order, one all-reduce each per step){hint}"
            )

    @pytest.mark.points(1)
    def test_the_first_all_reduce_starts_during_backward(self, cluster2, impl):
        timeline = cluster2.trace(traced_steps_on_rank, impl.BucketedDDP, 1, timeout=RUN_TIMEOUT_S)
        for rank in range(2):
            backward = timeline.select(rank=rank, name="backward")[0]
            all_reduces = timeline.select(rank=rank, name="all_reduce")
            assert all_reduces, f"rank {rank}: no all-reduce was traced; launch them with launch_all_reduce"
            first = all_reduces[0]
            assert first.start < backward.end, (
                f"rank {rank}: the first all-reduce starts {(first.start - backward.end) * 1e3:.2f} ms after "
                "backward ends: launch each bucket from the gradient hook as soon as its last gradient is "
                "ready, not in finish_gradient_synchronization"
            )


# --- The model, the data and one process's reference --------------------------------------


class Toy(nn.Module):
    def __init__(self):
        super().__init__()
        self.first = nn.Linear(IN, HIDDEN)
        self.frozen = nn.Linear(HIDDEN, HIDDEN).requires_grad_(False)
        self.middle = nn.Linear(HIDDEN, HIDDEN)
        self.last = nn.Linear(HIDDEN, OUT)

    def forward(self, x):
        return self.last(torch.tanh(self.middle(torch.tanh(self.frozen(torch.tanh(self.first(x)))))))


def build_model(seed):
    torch.manual_seed(seed)
    return Toy()


def full_batch():
    generator = torch.Generator().manual_seed(1234)
    return torch.randn(BATCH, IN, generator=generator), torch.randn(BATCH, OUT, generator=generator)


def shard(rank, world_size):
    inputs, targets = full_batch()
    return inputs[rank::world_size], targets[rank::world_size]


def trainable(model):
    return {name: p for name, p in model.named_parameters() if p.requires_grad}


def snapshot(tensors):
    return {name: t.detach().clone() for name, t in tensors.items()}


@functools.cache
def reference(world_size, order=None):
    """Per step: (parameters before the step, full-batch gradients, each rank's own shard
    gradients) of one process trained on the full batch. With ``order``, the ranks'
    arithmetic instead of the full batch (parlab.numerics: the shards' gradients summed in
    that order, divided by N_d): the runs the rounding band is measured with."""
    model = build_model(seed=0)
    shards = [shard(rank, world_size) for rank in range(world_size)]
    steps = []
    for _ in range(STEPS):
        params = snapshot(trainable(model))
        local = []
        for inputs, targets in shards:
            model.zero_grad()
            F.mse_loss(model(inputs), targets).backward()
            local.append(snapshot({n: p.grad for n, p in trainable(model).items()}))
        model.zero_grad()
        if order is None:
            F.mse_loss(model(full_batch()[0]), full_batch()[1]).backward()
        else:
            backward_in_shards(lambda x, y: F.mse_loss(model(x), y), model.parameters(), shards, order)
        steps.append((params, snapshot({n: p.grad for n, p in trainable(model).items()}), local))
        sgd_step(model)
    return steps


@functools.cache
def bands(world_size):
    """Per step: (band of the parameters, band of the gradients), parlab.numerics' rounding
    band around ``reference(world_size)`` from its runs in each ring order."""
    in_orders = [reference(world_size, tuple(order)) for order in ring_orders(world_size)]
    return [(rounding_band(params, [run[step][0] for run in in_orders])[0],
             rounding_band(grads, [run[step][1] for run in in_orders])[0])
            for step, (params, grads, _) in enumerate(reference(world_size))]


def sgd_step(model):
    """torch.optim.SGD's step without momentum, p <- p - LR * grad (importing torch.optim
    costs every rank a second and a half)."""
    with torch.no_grad():
        for p in trainable(model).values():
            p.add_(p.grad, alpha=-LR)


# --- On the ranks -------------------------------------------------------------------------


def train_on_rank(BucketedDDP):
    """STEPS SGD steps on this rank's shard from this rank's seed (the DDP must broadcast
    rank 0's weights). Per step: parameters before backward, parameters and gradients after
    finish_gradient_synchronization."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = build_model(seed=rank)
    ddp = BucketedDDP(model, bucket_cap_mb=CAP_BYTES / MIB)
    inputs, targets = shard(rank, world_size)
    steps = []
    for _ in range(STEPS):
        model.zero_grad()
        before = snapshot(trainable(model))
        F.mse_loss(ddp(inputs), targets).backward()
        ddp.finish_gradient_synchronization()
        grads = {n: (None if p.grad is None else p.grad.detach().clone()) for n, p in trainable(model).items()}
        steps.append((before, snapshot(trainable(model)), grads))
        sgd_step(model)
    return steps


def traced_steps_on_rank(BucketedDDP, steps):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = build_model(seed=rank)
    ddp = BucketedDDP(model, bucket_cap_mb=CAP_BYTES / MIB)
    inputs, targets = shard(rank, world_size)
    for _ in range(steps):
        model.zero_grad()
        loss = F.mse_loss(ddp(inputs), targets)
        with trace.span("backward"):
            loss.backward()
        ddp.finish_gradient_synchronization()
        sgd_step(model)


# --- Checks in the parent -----------------------------------------------------------------


def close(a, b, band):
    return a.shape == b.shape and max_abs_difference(a, b) <= band


def check_training(per_rank, world_size):
    """Compare every rank's record of every step with the reference, naming the first
    difference and, where it recognises one, the mistake behind it."""
    for step, (params, full_grads, local_grads) in enumerate(reference(world_size)):
        param_band, band = bands(world_size)[step]
        for rank, steps in enumerate(per_rank):
            before, after, grads = steps[step]
            where = f"{world_size} ranks, step {step}, rank {rank}"
            for name in params:
                if not close(before[name], params[name], param_band):
                    assert False, (
                        f"{where}: {name} before backward differs from one process on the full batch "
                        "(the averaged gradients of the steps before were wrong)"
                    )
                if not torch.equal(after[name], before[name]):
                    assert False, (
                        f"{where}: the parameters themselves changed during gradient synchronisation "
                        f"({name}); {WEIGHTS_NOT_GRADIENTS}"
                    )
                grad = grads[name]
                if grad is not None and close(grad, full_grads[name], band):
                    continue
                if grad is None:
                    why = "has no gradient after finish_gradient_synchronization"
                elif close(grad, before[name], band):
                    why = f"holds the (averaged) weights instead of the averaged gradient; {WEIGHTS_NOT_GRADIENTS}"
                elif close(grad, local_grads[rank][name], band):
                    why = (
                        "is still this rank's own shard gradient, not the average over the ranks (does your hook "
                        "all-reduce the weights instead of param.grad, or not copy the result back into param.grad?)"
                    )
                elif close(grad, full_grads[name] * world_size, band * world_size):
                    why = "is the SUM over the ranks: divide by N_d to average"
                else:
                    worst = max_abs_difference(grad, full_grads[name])
                    why = (f"differs from one process's full-batch gradient by up to {worst:.3g} (rounding explains "
                           f"{band:.1g})")
                assert False, f"{where}: {name}.grad {why}"
