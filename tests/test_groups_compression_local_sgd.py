"""Gradient compression and local SGD on a subgroup, the data-parallel axis of a mesh. On 4
ranks cut into two groups of 2, each group trains on its own data: parlab's DDP with a
compressing hook (error-feedback top-k, PowerSGD, FP16) and torch's DDP with ``torch_hook``
end where the same compressor ends on a world of 2 ranks, bit for bit, and FP16 where one
process ends with the group's fp16-rounded mean; local SGD with a ``PeriodicAverager`` on the
group holds the group's mean after each averaging step, as one process computes it. Every
message stays inside the group, and a rank outside the group it passes is told."""

import pytest
import torch
import torch.distributed as dist
from test_zero_groups import GROUPS, LR, group_batch, integer_model
from torch import nn

from parlab.async_sgd import local_sgd
from parlab.compression import FP16, ErrorFeedback, PowerSGD, SignSGD, TopK, parlab_hook, torch_hook
from parlab.ddp import DDP

STEPS = 3
COMPRESSORS = {
    "EF(TopK)": lambda: ErrorFeedback(TopK(0.25)),
    "EF(PowerSGD)": lambda: ErrorFeedback(PowerSGD(1, min_compression_rate=1)),
    "FP16": FP16,
    "EF(TopK) in torch's DDP": lambda: ErrorFeedback(TopK(0.25)),
}


def train(name, index, group):
    """The parameters after STEPS of SGD with compressor ``name``, this rank's half of group
    ``index``'s batch, averaged over ``group`` (None: the world)."""
    net, compressor = integer_model(), COMPRESSORS[name]()
    if name.endswith("in torch's DDP"):
        model = nn.parallel.DistributedDataParallel(net, process_group=group)
        model.register_comm_hook(*torch_hook(compressor, group=group))
    else:
        model = DDP(net, comm_hook=parlab_hook(compressor, net, group=group), group=group)
    optimizer = torch.optim.SGD(net.parameters(), lr=LR)
    mine = group_batch(index).chunk(2)[dist.get_rank(group)]
    for _ in range(STEPS):
        optimizer.zero_grad()
        model(mine).sum().backward()
        if isinstance(model, DDP):
            model.finish_gradient_synchronization()
        optimizer.step()
    return [p.detach().clone() for p in net.parameters()]


def train_in_groups():
    groups = [dist.new_group(ranks) for ranks in GROUPS]  # every rank makes every group, in one order
    index = dist.get_rank() // 2
    try:
        return {name: train(name, index, groups[index]) for name in COMPRESSORS}
    finally:
        for group in groups:  # the session's cluster outlives this test
            dist.destroy_process_group(group)


def train_on_a_world_of_two():
    """What each group should end with: the same training on a world of 2 ranks."""
    return [{name: train(name, index, None) for name in COMPRESSORS} for index in range(len(GROUPS))]


def fp16_in_one_process(index):
    """FP16's training of group ``index`` in one process: each half's gradient rounded to fp16
    and halved, the two summed in fp16 (one rounding, in either order), as the hook does."""
    model = integer_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for _ in range(STEPS):
        gradients = []
        for half in group_batch(index).chunk(2):
            optimizer.zero_grad()
            model(half).sum().backward()
            gradients.append([p.grad.half() / 2 for p in model.parameters()])
        for p, g0, g1 in zip(model.parameters(), *gradients):
            p.grad = (g0 + g1).float()
        optimizer.step()
    return [p.detach() for p in model.parameters()]


def messages_stay_in_the_groups(timeline):
    for rank in range(timeline.world_size):
        peers = {ev.peer for ev in timeline.select(rank=rank, kind="comm") if ev.peer is not None}
        assert peers and peers <= set(GROUPS[rank // 2]), (rank, peers)


@pytest.mark.timeout(180)
def test_compressing_hooks_on_a_subgroup_train_each_group_as_a_world_of_its_size(cluster4, cluster2):
    timeline = cluster4.trace(train_in_groups, timeout=180)
    references = cluster2.run(train_on_a_world_of_two, timeout=120)[0]
    for rank, results in enumerate(timeline.results):
        for name, parameters in results.items():
            assert all(map(torch.equal, parameters, references[rank // 2][name])), (name, rank)
        assert all(map(torch.equal, results["FP16"], fp16_in_one_process(rank // 2))), rank
    for name in COMPRESSORS:  # the groups trained on different data
        assert not all(map(torch.equal, timeline.results[0][name], timeline.results[2][name])), name
    messages_stay_in_the_groups(timeline)


WARMUP, PERIOD, LOCAL_STEPS = 1, 2, 5


def rank_model(rank):
    """Rank ``rank``'s replica at the start: integers, apart from the other ranks', so that an
    averaging shows."""
    model = integer_model()
    for p in model.parameters():
        p.data += rank
    return model


def rank_batch(rank):
    return torch.randint(-2, 3, (4, 4), generator=torch.Generator().manual_seed(20 + rank)).float()


def local_sgd_in_groups():
    """Post-local SGD on each group: a warm-up step with averaged gradients, then local steps,
    the parameters averaged over the group every PERIOD steps. The parameters after each step."""
    groups = [dist.new_group(ranks) for ranks in GROUPS]
    rank = dist.get_rank()
    group = groups[rank // 2]
    try:
        model = rank_model(rank)
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)
        averager = local_sgd.PeriodicAverager(PERIOD, WARMUP, group=group)
        after = []
        for _ in range(LOCAL_STEPS):
            optimizer.zero_grad()
            model(rank_batch(rank)).sum().backward()
            if averager.in_warmup:
                local_sgd.average_gradients(model.parameters(), group)
            optimizer.step()
            averager.average_parameters(model.parameters())
            after.append([p.detach().clone() for p in model.parameters()])
        return after
    finally:
        for g in groups:
            dist.destroy_process_group(g)


def local_sgd_in_one_process(index):
    """The same for group ``index``'s two replicas in one process: a mean of two is a/2 + b/2,
    as the ring computes it (one rounding, in either order)."""
    models = [rank_model(rank) for rank in GROUPS[index]]
    optimizers = [torch.optim.SGD(model.parameters(), lr=LR) for model in models]
    averaging = local_sgd.averaging_steps(LOCAL_STEPS, PERIOD, WARMUP)
    after = [[], []]
    for step in range(1, LOCAL_STEPS + 1):
        for model, optimizer, rank in zip(models, optimizers, GROUPS[index]):
            optimizer.zero_grad()
            model(rank_batch(rank)).sum().backward()
        pairs = list(zip(*(model.parameters() for model in models)))
        if step <= WARMUP:
            for a, b in pairs:
                a.grad = b.grad = a.grad / 2 + b.grad / 2
        for optimizer in optimizers:
            optimizer.step()
        if step in averaging:
            with torch.no_grad():
                for a, b in pairs:
                    mean = a / 2 + b / 2
                    a.copy_(mean)
                    b.copy_(mean)
        for kept, model in zip(after, models):
            kept.append([p.detach().clone() for p in model.parameters()])
    return after


@pytest.mark.timeout(120)
def test_local_sgd_on_a_subgroup_averages_each_group_alone(cluster4):
    timeline = cluster4.trace(local_sgd_in_groups, timeout=120)
    references = [local_sgd_in_one_process(index) for index in range(len(GROUPS))]
    averaging = local_sgd.averaging_steps(LOCAL_STEPS, PERIOD, WARMUP)
    assert averaging == [2, 4]
    runs = timeline.results
    for rank, after in enumerate(runs):
        for step, (ours, expected) in enumerate(zip(after, references[rank // 2][rank % 2]), start=1):
            assert all(map(torch.equal, ours, expected)), (rank, step)
    for step in range(1, LOCAL_STEPS + 1):
        equal_in_group = [all(map(torch.equal, runs[first][step - 1], runs[first + 1][step - 1])) for first in (0, 2)]
        assert equal_in_group == [step in averaging] * 2, step  # the replicas meet at averaging steps only
        assert not all(map(torch.equal, runs[0][step - 1], runs[2][step - 1])), step  # and the groups never
    messages_stay_in_the_groups(timeline)


def outside_the_group():
    """Every call with a group this rank is not in: the error each gives (None: none)."""
    group = dist.new_group([0, 1])
    try:
        if dist.get_rank() < 2:
            return {}
        x, parameter = torch.ones(6, 4), nn.Parameter(torch.ones(3))
        parameter.grad = torch.ones(3)
        calls = {
            "FP16": lambda: FP16().aggregate(x, group=group),
            "TopK": lambda: TopK(2).aggregate(x, group=group),
            "SignSGD": lambda: SignSGD().aggregate(x, group=group),
            "PowerSGD": lambda: PowerSGD(1).aggregate(x, group=group),
            "EF(TopK)": lambda: ErrorFeedback(TopK(2)).aggregate(x, group=group),
            "parlab_hook": lambda: parlab_hook(FP16(), group=group)(x.reshape(-1)),
            "average_parameters": lambda: local_sgd.average_parameters([parameter], group),
            "average_gradients": lambda: local_sgd.average_gradients([parameter], group),
            "PeriodicAverager": lambda: local_sgd.PeriodicAverager(2, group=group),
        }
        messages = {}
        for name, call in calls.items():
            try:
                call()
                messages[name] = None
            except ValueError as error:
                messages[name] = str(error)
        return messages
    finally:
        dist.destroy_process_group(group)


@pytest.mark.timeout(60)
def test_a_rank_outside_the_group_it_passes_is_told(cluster4):
    results = cluster4.run(outside_the_group, timeout=60)
    assert results[:2] == [{}, {}]
    for messages in results[2:]:
        assert len(messages) == 9
        assert all(message and "not in the group" in message for message in messages.values()), messages
