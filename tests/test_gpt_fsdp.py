"""The small GPT (parlab.gpt) under FSDP mixed precision on 2 real ranks: in bf16 it equals, bit
for bit, one process doing FSDP's casts (a bf16 copy of the fp32 master computes each rank's
half of the batch, the halves' bf16 gradients are averaged in bf16 and step the master), as
tests/test_zero_fsdp.py checks for its block model; with the parameters all-gathered in fp8 it
trains, within E4M3's unit roundoff of the bf16 run."""

import copy

import pytest
import torch
import torch.distributed as dist

from parlab import fp8
from parlab.gpt import GPT, Block, GPTConfig, batches
from parlab.zero import FSDP

CONFIG = GPTConfig(V=64, s=16, h=32, a=4, L=2)
STEPS, LR = 4, 0.3


def gpt():
    torch.manual_seed(0)
    return GPT(CONFIG)


def engine_of(all_gather_dtype=None):
    # the blocks are units; the embeddings, final norm and head stay in the root unit, whose
    # forward reads position_embedding.weight directly
    return FSDP(gpt(), torch.optim.SGD, wrap_policy=lambda m: isinstance(m, Block), mixed_precision=torch.bfloat16,
                all_gather_dtype=all_gather_dtype, lr=LR)


def data():
    """STEPS full batches of (tokens (4 N, s), targets (4 N, s)), the same on every rank."""
    return batches(4 * dist.get_world_size(), CONFIG.s, STEPS)


def train(engine):
    """Each rank steps on its part of each batch; returns the full batch's mean loss per step."""
    N, rank = dist.get_world_size(), dist.get_rank()
    losses = []
    for tokens, targets in data():
        engine.zero_grad()
        loss = engine.module.loss(tokens.chunk(N)[rank], targets.chunk(N)[rank])
        loss.backward()
        engine.step()
        mean = loss.detach().float()
        dist.all_reduce(mean)
        losses.append(mean / N)
    return torch.stack(losses)


def one_process_casts():
    """FSDP's mixed precision in one process: the GPT's fp32 master, a bf16 copy per step
    computing each rank's part, the parts' bf16 gradients averaged in bf16, cast to fp32."""
    master, N = gpt(), dist.get_world_size()
    optimizer = torch.optim.SGD(master.parameters(), lr=LR)
    for tokens, targets in data():
        compute = copy.deepcopy(master).to(torch.bfloat16)
        parts = []
        for part in zip(tokens.chunk(N), targets.chunk(N)):
            compute.zero_grad()
            compute.loss(*part).backward()
            parts.append([p.grad for p in compute.parameters()])
        for p, *grads in zip(master.parameters(), *parts):
            p.grad = (sum(grads[1:], grads[0]) / N).float()
        optimizer.step()
    return {name: p.detach().clone() for name, p in master.named_parameters()}


def train_in_bf16():
    engine = engine_of()
    losses = train(engine)
    # the reference runs here: the same process settings (threads) give the same bf16 kernels
    return losses, engine.full_parameters(), one_process_casts()


@pytest.mark.timeout(60)
def test_the_gpt_trains_under_fsdp_bf16_as_one_process_with_its_casts(cluster2):
    for losses, parameters, reference in cluster2.run(train_in_bf16, timeout=60):
        assert losses[-1] < losses[0]  # it trains
        assert parameters.keys() == reference.keys()
        # 2 ranks: the bf16 average is one addition and a halving, as in the reference
        for name, value in parameters.items():
            assert torch.equal(value, reference[name]), name


def train_both():
    return train(engine_of()), train(engine_of(fp8.E4M3))


@pytest.mark.timeout(60)
def test_the_gpt_trains_with_the_fp8_gather_within_u_of_bf16(cluster2):
    bf16, e4m3 = cluster2.run(train_both, timeout=60)[0]
    assert e4m3[-1] < e4m3[0]  # it trains
    # every gathered parameter is within u = 2^-4 relative of its master: the loss within u of bf16's
    assert ((e4m3 - bf16).abs() <= fp8.unit_roundoff(fp8.E4M3) * bf16).all(), (e4m3 - bf16).abs().max()
    assert not torch.equal(e4m3, bf16)  # the gather did quantise
