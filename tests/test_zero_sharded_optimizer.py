"""parlab.zero.ShardedOptimizer: ZeRO stage 1 as a torch.optim.Optimizer. After parlab's DDP
averages the gradients, Adam through it trains like one process on the full batch (within the
parlab.numerics band) at 2 and 4 ranks, each rank's state holds its shard only, its state dict
round-trips, the all-gather goes through parlab's collectives, and bad input is explained."""

import copy
import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from parlab.ddp import DDP
from parlab.numerics import assert_equivalent, backward_in_shards, ring_orders
from parlab.zero import ShardedOptimizer

BATCH, STEPS = 40, 3
LRS = (1e-2, 3e-3)  # one per param group: the options of each group reach its shard


def build(seed=0):
    torch.manual_seed(seed)
    # 54 + 9 and 45 + 5 elements: odd sizes, so the flat buffers are padded at 2 and 4 ranks
    return nn.Sequential(nn.Linear(6, 9), nn.Tanh(), nn.Linear(9, 5))


def param_groups(model):
    return [{"params": model[0].parameters(), "lr": LRS[0]}, {"params": model[2].parameters(), "lr": LRS[1]}]


def full_batch():
    generator = torch.Generator().manual_seed(7)
    return torch.randn(BATCH, 6, generator=generator), torch.randn(BATCH, 5, generator=generator)


def loss_on(model, x, y):
    return F.mse_loss(model(x), y)


@functools.cache
def one_process(shards=1, order=None):
    """Parameters of torch.optim.Adam in one process after STEPS steps on the full batch; with
    ``shards`` > 1 the gradient summed over the ranks' shards in ``order`` (the yardstick)."""
    model = build()
    optimizer = torch.optim.Adam(param_groups(model))
    parts = list(zip(*(part.chunk(shards) for part in full_batch())))
    for _ in range(STEPS):
        backward_in_shards(functools.partial(loss_on, model), model.parameters(), parts, order)
        optimizer.step()
    return dict(model.named_parameters())


def train(steps=STEPS, model=None, optimizer=None):
    """On every rank: a replica from this rank's seed, DDP averaging, Adam sharded."""
    model = build(seed=dist.get_rank()) if model is None else model
    ddp = DDP(model)
    optimizer = ShardedOptimizer(param_groups(model), torch.optim.Adam) if optimizer is None else optimizer
    x, y = (part.chunk(dist.get_world_size())[dist.get_rank()] for part in full_batch())
    for _ in range(steps):
        optimizer.zero_grad()
        loss_on(ddp, x, y).backward()
        ddp.finish_gradient_synchronization()
        optimizer.step()
    return model, optimizer


def trained_parameters_and_state_numel():
    model, optimizer = train()
    state_numel = sum(value.numel() for state in optimizer.state.values()
                      for name, value in state.items() if name != "step")
    return ({name: p.detach().clone() for name, p in model.named_parameters()}, state_numel,
            [layout.shard_numel for layout in optimizer.layouts], [g["lr"] for g in optimizer.param_groups])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", ["cluster2", "cluster4"])
def test_adam_after_ddp_trains_like_one_process_and_keeps_only_its_shard(world, request):
    cluster = request.getfixturevalue(world)
    N = cluster.world_size
    decomposed = [one_process(N, tuple(order)) for order in ring_orders(N)]
    psi = sum(p.numel() for p in build().parameters())
    for rank, (parameters, state_numel, shard_numels, lrs) in enumerate(cluster.run(
            trained_parameters_and_state_numel, timeout=90)):
        assert_equivalent(parameters, one_process(), decomposed, f"rank {rank}, {N} ranks")
        assert shard_numels == [-(-63 // N), -(-50 // N)]  # ceil(Psi_g / N_d) per param group
        assert state_numel == 2 * sum(shard_numels) < 2 * psi  # Adam's exp_avg and exp_avg_sq, shards only
        assert lrs == list(LRS)


def resumed_from_a_state_dict():
    """2 steps, save, a fresh optimizer loads the state, 1 step more; against 3 steps straight."""
    straight, _ = train()
    model, optimizer = train(steps=2)
    saved = copy.deepcopy({"model": model.state_dict(), "optimizer": optimizer.state_dict()})
    resumed = build(seed=5)
    resumed.load_state_dict(saved["model"])
    fresh = ShardedOptimizer(param_groups(resumed), torch.optim.Adam)
    for group in fresh.param_groups:
        group["lr"] = 1.0  # the state dict brings back each group's own
    fresh.load_state_dict(saved["optimizer"])
    train(steps=1, model=resumed, optimizer=fresh)
    other = dict(saved["optimizer"], rank=1 - dist.get_rank())
    try:
        fresh.load_state_dict(other)
        refused = None
    except ValueError as error:
        refused = str(error)
    try:
        fresh.add_param_group({"params": [nn.Parameter(torch.ones(3))]})
        added = None
    except ValueError as error:
        added = str(error)
    same = all(torch.equal(a, b) for a, b in zip(straight.parameters(), resumed.parameters()))
    return same, [g["lr"] for g in fresh.param_groups], refused, added


@pytest.mark.timeout(120)
def test_state_dict_round_trip_resumes_bit_for_bit(cluster2):
    for same, lrs, refused, added in cluster2.run(resumed_from_a_state_dict, timeout=90):
        assert same
        assert lrs == list(LRS)
        assert refused is not None and "same world size" in refused
        assert added is not None and "constructor" in added


def given_gradient(p, step):
    """The same gradient on every rank and in one process, different at each step."""
    return torch.sin(torch.arange(p.numel(), dtype=p.dtype) + 10 * step).reshape(p.shape)


def adam_with_given_gradients(first, last, saved=None, path=None):
    """Steps ``first`` .. ``last`` - 1 of Adam through ShardedOptimizer with given gradients,
    after loading ``saved`` (model and full optimizer state, a file) if given; rank 0 saves
    the same to ``path`` if given. Returns the parameters and the full state dict."""
    model = build(seed=0)
    if saved is not None:
        checkpoint = torch.load(saved)
        model.load_state_dict(checkpoint["model"])
    optimizer = ShardedOptimizer(param_groups(model), torch.optim.Adam)
    if saved is not None:
        optimizer.load_full_state_dict(checkpoint["optimizer"])
    for step in range(first, last):
        for p in model.parameters():
            p.grad = given_gradient(p, step)
        optimizer.step()
    full = optimizer.full_state_dict()
    if path is not None and dist.get_rank() == 0:
        torch.save({"model": model.state_dict(), "optimizer": full}, path)
    return [p.detach().clone() for p in model.parameters()], full


def plain_adam(steps):
    model = build(seed=0)
    optimizer = torch.optim.Adam(param_groups(model))
    for step in range(steps):
        for p in model.parameters():
            p.grad = given_gradient(p, step)
        optimizer.step()
    return model, optimizer


@pytest.mark.timeout(120)
def test_the_full_state_dict_is_adams_state_and_resumes_on_another_world_size(cluster4, cluster2, tmp_path):
    """Two steps on 4 ranks, the gathered state saved; loaded on 2 ranks for step 3: the very
    parameters and state of torch's Adam in one process (the same elementwise arithmetic)."""
    path = str(tmp_path / "checkpoint.pt")
    saved = cluster4.run(adam_with_given_gradients, 0, 2, path=path, timeout=60)
    _, adam = plain_adam(2)
    for _, full in saved:
        for group, params in enumerate(adam.param_groups):
            for key in ("exp_avg", "exp_avg_sq"):
                expected = torch.cat([adam.state[p][key].flatten() for p in params["params"]])
                assert torch.equal(full["state"][group][key], expected), (group, key)
            assert full["state"][group]["step"] == 2 and full["param_groups"][group]["lr"] == LRS[group]
    resumed = cluster2.run(adam_with_given_gradients, 2, 3, saved=path, timeout=60)
    straight, _ = plain_adam(3)
    for parameters, _ in resumed:
        assert all(torch.equal(a, b) for a, b in zip(parameters, straight.parameters()))
    for refused in cluster2.run(load_a_full_state_of_another_model, path, timeout=60):
        assert "same model and param groups" in refused


def load_a_full_state_of_another_model(path):
    optimizer = ShardedOptimizer(param_groups(build(seed=0)), torch.optim.Adam)
    try:
        optimizer.load_full_state_dict({**torch.load(path)["optimizer"], "numels": [1, 2]})
    except ValueError as error:
        return str(error)
    return None


def steps_with_given_gradients(steps):
    model = build(seed=0)
    optimizer = ShardedOptimizer(param_groups(model), torch.optim.SGD)
    for _ in range(steps):
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        optimizer.step()
    return [layout.padded_numel for layout in optimizer.layouts]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", ["cluster2", "cluster4"])
def test_each_step_all_gathers_the_shards_through_parlabs_ring(world, request):
    cluster = request.getfixturevalue(world)
    N = cluster.world_size
    one, two = (cluster.trace(steps_with_given_gradients, steps, timeout=60) for steps in (1, 2))
    padded = one.results[0]
    step = [a - b for a, b in zip(two.bytes_sent(), one.bytes_sent())]
    assert step == [sum((N - 1) * numel // N * 4 for numel in padded)] * N  # one ring all-gather per group


def one_sgd_step_in_pairs():
    """Ranks {0, 1} and {2, 3} each a group: every rank's replica from its own seed, every
    gradient ones; one SGD step of lr 0.5."""
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    model = build(seed=dist.get_rank())
    optimizer = ShardedOptimizer(model.parameters(), torch.optim.SGD, group=pairs[dist.get_rank() // 2], lr=0.5)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.timeout(60)
def test_on_a_group_each_pair_starts_from_its_first_rank_and_gathers_inside(cluster4):
    for rank, parameters in enumerate(cluster4.run(one_sgd_step_in_pairs, timeout=60)):
        start = build(seed=rank // 2 * 2)  # the group's rank 0 broadcast its values
        expected = [p.detach() - 0.5 for p in start.parameters()]
        assert all(torch.equal(a, b) for a, b in zip(parameters, expected)), f"rank {rank}"


def test_bad_input_is_explained():
    model = build()
    with pytest.raises(ValueError, match="optimizer class"):
        ShardedOptimizer(model.parameters(), torch.optim.Adam(model.parameters()))
    for p in model.parameters():
        p.requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters"):
        ShardedOptimizer(model.parameters(), torch.optim.Adam)
    with pytest.raises(ValueError, match="one floating dtype"):
        ShardedOptimizer([nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(2, dtype=torch.float64))],
                         torch.optim.Adam)
    with pytest.raises(ValueError, match="not a mix"):
        ShardedOptimizer([{"params": [nn.Parameter(torch.ones(2))]}, nn.Parameter(torch.ones(2))], torch.optim.Adam)
    with pytest.raises(ValueError, match="not param groups"):
        ShardedOptimizer([nn.Parameter(torch.ones(2)), {"params": [nn.Parameter(torch.ones(2))]}], torch.optim.Adam)
