"""parlab's sharded engines in ordinary torch code: FSDP keeps the wrapped module's
parameters visible (each unit's shard registered as a Parameter); FSDP and ZeroDP train
without an optimizer of their own (the caller's optimizer over ``engine.parameters()``, or
``[engine.shard]``); ``finish_gradient_synchronization`` on DDP, ZeroDP and FSDP is the call
between backward and the optimizer step. Each way ends bit for bit where the engine's own
``step()`` ends, at 2 ranks."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from parlab.ddp import DDP
from parlab.zero import FSDP, ZeroDP, checkpoint

STEPS = 3


def build():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 9), nn.Tanh(), nn.Linear(9, 5))


def my_batch():
    generator = torch.Generator().manual_seed(3 + dist.get_rank())
    return torch.randn(4, 6, generator=generator), torch.randn(4, 5, generator=generator)


def trained_both_ways(make):
    """``make(caller's)`` -> (engine, optimizer): trained STEPS steps with the engine as its
    own optimizer (False) and with the caller's optimizer (True). Returns ({caller's: full
    parameters}, the last engine)."""
    x, y = my_batch()
    results = {}
    for callers in (False, True):
        engine, optimizer = make(callers)
        for _ in range(STEPS):
            engine.zero_grad()
            F.mse_loss(engine(x), y).backward()  # from step 2 on, the forward unshards the caller's update first
            engine.finish_gradient_synchronization()
            optimizer.step()
        results[callers] = engine.full_parameters()
    return results, engine


def refusals(*attempts):
    """The sentence of each attempt's ValueError (an attempt that raises none adds nothing)."""
    sentences = []
    for attempt in attempts:
        try:
            attempt()
        except ValueError as error:
            sentences.append(str(error))
    return sentences


def fsdp_own_optimizer_against_its_step():
    def make(callers):
        if callers:
            engine = FSDP(build(), None, wrap_policy="per_layer")
            return engine, torch.optim.Adam(list(engine.parameters()), lr=1e-2)
        engine = FSDP(build(), torch.optim.Adam, wrap_policy="per_layer", lr=1e-2)
        return engine, engine

    results, engine = trained_both_ways(make)
    return results, refusals(engine.step, lambda: checkpoint.full_state_dict(engine),
                             lambda: FSDP(build(), None, lr=1e-2))


@pytest.mark.timeout(60)
def test_fsdp_trains_with_the_callers_optimizer_like_with_its_own(cluster2):
    for results, refusals in cluster2.run(fsdp_own_optimizer_against_its_step, timeout=60):
        assert all(torch.equal(results[True][name], results[False][name]) for name in results[False])
        assert all(not torch.equal(results[True][name], p) for name, p in build().named_parameters())
        assert len(refusals) == 3 and "optimizer you built" in refusals[0] and "optimizer_class" in refusals[2]


def zerodp_synchronized_first(stage):
    x, y = my_batch()
    results, averaged = {}, None
    for synchronize_first in (False, True):
        engine = ZeroDP(build(), torch.optim.Adam, stage=stage, lr=1e-2)
        for _ in range(STEPS):
            engine.zero_grad()
            F.mse_loss(engine(x), y).backward()
            if synchronize_first:
                engine.finish_gradient_synchronization()
                averaged = engine.shard.grad.clone()
            engine.step()  # does not average again
        results[synchronize_first] = engine.full_parameters()
    return results, averaged, engine.layout.shard_numel


@pytest.mark.timeout(60)
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_zerodp_finish_gradient_synchronization_is_the_first_half_of_its_step(cluster2, stage):
    for rank, (results, averaged, shard) in enumerate(cluster2.run(zerodp_synchronized_first, stage, timeout=60)):
        assert all(torch.equal(results[True][name], results[False][name]) for name in results[False]), rank
        assert averaged.numel() == (2 * shard if stage == 0 else shard)


def test_the_engines_share_the_synchronization_call():
    for engine in (DDP, ZeroDP, FSDP):
        assert callable(getattr(engine, "finish_gradient_synchronization", None)), engine.__name__


def registered_after_a_backward():
    model = build()
    engine = FSDP(model, torch.optim.SGD, wrap_policy="per_layer", lr=0.1)
    x, y = my_batch()
    F.mse_loss(engine(x), y).backward()
    named = dict(model.named_parameters())
    return ({name: (tuple(p.shape), p.grad is not None) for name, p in named.items()},
            all(any(p is unit.shard for p in named.values()) for unit in engine.units),
            [name for name, _ in engine.named_parameters()])


@pytest.mark.timeout(60)
def test_fsdp_keeps_the_modules_parameters_visible_as_its_shards(cluster2):
    # before, FSDP deleted them: model.named_parameters() was empty
    for named, every_shard, engine_names in cluster2.run(registered_after_a_backward, timeout=60):
        # Linear(6, 9): 63 elements, Linear(9, 5): 50, each unit cut into 2 shards
        assert named == {"0.flat_shard": ((32,), True), "2.flat_shard": ((25,), True)}
        assert every_shard and engine_names == ["module.0.flat_shard", "module.2.flat_shard"]


ZERO_CONFIGS = {"stage 0": dict(stage=0), "stage 1": dict(stage=1), "stage 2": dict(stage=2),
                "stage 1, offload": dict(stage=1, offload=True)}


def zerodp_own_optimizer_against_its_step(config):
    def make(callers):
        if callers:
            engine = ZeroDP(build(), None, **ZERO_CONFIGS[config])
            return engine, torch.optim.Adam([engine.shard], lr=1e-2)
        engine = ZeroDP(build(), torch.optim.Adam, lr=1e-2, **ZERO_CONFIGS[config])
        return engine, engine

    results, engine = trained_both_ways(make)
    return results, refusals(engine.step, lambda: ZeroDP(build(), None, lr=1e-2))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("config", ZERO_CONFIGS)
def test_zerodp_trains_with_the_callers_optimizer_like_with_its_own(cluster2, config):
    for results, refusals in cluster2.run(zerodp_own_optimizer_against_its_step, config, timeout=60):
        assert all(torch.equal(results[True][name], results[False][name]) for name in results[False])
        assert all(not torch.equal(results[True][name], p) for name, p in build().named_parameters())
        assert len(refusals) == 2 and "[engine.shard]" in refusals[0] and "optimizer_class" in refusals[1]
