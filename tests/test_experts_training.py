"""parlab.experts.training on real ranks: the small GPT with mixture-of-experts MLPs
(``MoEGPT``) trained with ``ExpertDataParallel`` on ep x dp meshes gives one process's losses
over 4 Adam steps and its gradients of the first step (dense and expert, by the one-process
names), at ep = 2 x dp = 2 on 4 ranks and ep = 4 x dp = 2 on 8 ranks (an MoE in every other
layer there), with and without dropped tokens.

The reference: the MoEGPT in one process on the whole batch, routed in R = dp x ep groups
(``loss(tokens, targets, groups=R)``: capacity is counted per rank's tokens). The yardstick
(``parlab.numerics``): the same training with each gradient computed as the ranks cut the
batch, R shards each routed as one group, their gradients summed in each ring order of R."""

import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import parlab
from parlab.gpt import GPT, GPTConfig, batches
from parlab.numerics import assert_equivalent, backward_in_shards, ring_orders

CONFIG = GPTConfig(V=64, s=16, h=32, a=4, L=2)
B, STEPS, LR, K, AUX = 8, 4, 1e-2, 2, 0.1
DROPS = 1.0  # capacity ceil(T K / E) per rank: some tokens overflow
# (mesh shape, E, every): an MoE in every layer on 4 ranks, in every other layer on 8
FOUR, EIGHT = (dict(dp=2, ep=2), 4, 1), (dict(dp=2, ep=4), 8, 2)


def build(E, every, capacity_factor):
    from parlab.experts import MoEGPT

    torch.manual_seed(0)
    return MoEGPT(CONFIG, E, K, capacity_factor, AUX, every)


def train_on_mesh(shape, E, every, capacity_factor):
    """On every rank: (loss_r at each step, float64; this rank's gradients of step 1 by the
    one-process names; the (token, choice) pairs its MoE layers dropped over the steps)."""
    from parlab.experts import ExpertDataParallel

    with parlab.Mesh(**shape) as mesh:
        trainer = ExpertDataParallel(build(E, every, capacity_factor), mesh, lr=LR)
        losses, gradients, dropped = [], None, 0
        for i, (tokens, targets) in enumerate(batches(B, CONFIG.s, STEPS, seed=1)):
            losses.append(trainer.step(tokens, targets, keep_gradients=i == 0))
            gradients = gradients or trainer.gradients
            dropped += sum(int(layer.routing.dropped.sum()) for layer in trainer.model.moe_layers())
    return torch.tensor(losses, dtype=torch.float64), gradients, dropped


@functools.cache
def one_process(E, every, capacity_factor, R, shards=1, order=None):
    """(the batch's loss L before each step, float32; the gradients of step 1 by name) of the
    MoEGPT trained with Adam in one process, each gradient computed in ``shards`` parts of
    R / shards routing groups each, summed in ``order`` (shards = 1: the reference)."""
    model = build(E, every, capacity_factor)
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    losses, first = [], None
    for tokens, targets in batches(B, CONFIG.s, STEPS, seed=1):
        with torch.no_grad():
            losses.append(model.loss(tokens, targets, groups=R))
        parts = list(zip(tokens.tensor_split(shards), targets.tensor_split(shards)))
        backward_in_shards(functools.partial(model.loss, groups=R // shards), model.parameters(), parts, order)
        first = first or {name: p.grad.clone() for name, p in model.named_parameters()}
        optimizer.step()
    return torch.stack(losses), first


def assert_like_one_process(cluster, shape, E, every, capacity_factor):
    R = shape["dp"] * shape["ep"]
    reference = one_process(E, every, capacity_factor, R)
    decomposed = [one_process(E, every, capacity_factor, R, R, tuple(order)) for order in ring_orders(R)]
    results = cluster.run(train_on_mesh, shape, E, every, capacity_factor, timeout=240)
    what = f"ep {shape['ep']} x dp {shape['dp']}, capacity factor {capacity_factor:g}"
    mean_loss = (sum(losses for losses, _, _ in results) / R).float()
    assert_equivalent(mean_loss, reference[0], [d[0] for d in decomposed], f"{what}: losses")
    for rank, (_, gradients, _) in enumerate(results):
        experts = [name for name in gradients if ".experts." in name]
        assert len(experts) == 4 * (E // shape["ep"]) * len(range(0, CONFIG.L, every))  # fc1, fc2: weight, bias
        for kind, names in (("expert", experts), ("dense", [n for n in gradients if n not in experts])):
            assert_equivalent({n: gradients[n] for n in names}, {n: reference[1][n] for n in names},
                              [{n: d[1][n] for n in names} for d in decomposed],
                              f"{what}, rank {rank}: {kind} gradients of step 1")
    dropped = sum(d for _, _, d in results)
    assert (dropped > 0) == (capacity_factor == DROPS), f"{what}: {dropped} pairs dropped"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("capacity_factor", [DROPS, None], ids=["drops", "no drops"])
def test_ep_2_by_dp_2_trains_like_one_process(cluster4, capacity_factor):
    shape, E, every = FOUR
    assert_like_one_process(cluster4, shape, E, every, capacity_factor or E / K)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("capacity_factor", [DROPS, None], ids=["drops", "no drops"])
def test_ep_4_by_dp_2_trains_like_one_process(cluster8, capacity_factor):
    shape, E, every = EIGHT
    assert_like_one_process(cluster8, shape, E, every, capacity_factor or E / K)


def test_the_moe_gpt_s_loss_adds_each_layer_s_auxiliary_loss():
    model = build(4, 2, DROPS)
    assert [type(block.mlp).__name__ for block in model.blocks] == ["GPTLayerMoE", "MLP"]
    names = [name for name, _ in model.named_parameters()]
    assert "blocks.0.mlp.router.weight" in names and "blocks.0.mlp.experts.3.fc2.bias" in names
    assert "blocks.1.mlp.fc1.weight" in names
    tokens, targets = batches(B, CONFIG.s, 1, seed=1)[0]
    for groups in (1, 4):
        loss = model.loss(tokens, targets, groups)
        moe = model.blocks[0].mlp
        assert len(moe.routings) == groups
        cross_entropy = F.cross_entropy(model(tokens, groups).flatten(0, 1), targets.flatten())
        assert torch.equal(loss, cross_entropy + moe.aux_loss)


def learner_mistakes():
    from parlab.experts import ExpertDataParallel

    messages = []
    with parlab.Mesh(dp=2, tp=2) as mesh:
        try:
            ExpertDataParallel(build(4, 1, DROPS), mesh)
        except ValueError as error:
            messages.append(str(error))
    with parlab.Mesh(dp=2, ep=2) as mesh:
        trainer = ExpertDataParallel(build(4, 1, DROPS), mesh)
        tokens, targets = batches(6, CONFIG.s, 1, seed=1)[0]
        for attempt in (lambda: trainer.step(tokens, targets), lambda: trainer.model(tokens, groups=2)):
            try:
                attempt()
            except ValueError as error:
                messages.append(str(error))
        dist.barrier()
    return messages


@pytest.mark.timeout(120)
def test_bad_arguments_say_what_to_change(cluster4):
    from parlab.experts import ExpertDataParallel

    with pytest.raises(ValueError, match="ExpertDataParallel trains a parlab.experts.MoEGPT, got GPT"):
        ExpertDataParallel(GPT(CONFIG), None)
    for messages in cluster4.run(learner_mistakes, timeout=60):
        tensor_axis, batch, groups = messages
        assert "this mesh has tp = 2: build it with only dp and ep" in tensor_axis
        assert "a batch of 6 sequences does not split into dp x ep = 4 shards: use a multiple of 4" in batch
        assert "an expert-parallel layer routes its rank's tokens as one group, got groups = 2" in groups
