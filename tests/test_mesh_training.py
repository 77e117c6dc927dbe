"""parlab.mesh_training on real ranks: the small GPT trained in 3-D (data x tensor x pipeline,
ZeRO 0-3 on the data axis, sequence parallelism, M micro-batches, recompute) gives one
process's losses over 5 Adam steps and its gradients of the first step, within the rounding
band of the same training with the batch cut as the ranks cut it; at 2 x 2 x 2 on 8 ranks and
at 4-rank shapes with two axes."""

import functools

import pytest
import torch
import torch.distributed as dist

import parlab
from parlab.gpt import GPT, GPTConfig, batches, train_in_one_process
from parlab.numerics import assert_equivalent, ring_orders
from parlab.tensor_parallel import ParallelGPT

CONFIG = GPTConfig(V=64, s=16, h=32, a=4, L=2)
B, STEPS, LR = 8, 5, 1e-2
CUBE = dict(dp=2, tp=2, pp=2)
# (mesh shape, ZeRO stage, micro-batches, recompute)
EIGHT = [(CUBE, 0, 2, None), (CUBE, 1, 2, "full"), (CUBE, 2, 2, "selective"), (CUBE, 3, 2, None),
         (CUBE, 3, 1, "full")]
FOUR = [(dict(dp=2, tp=2), 1, 1, None), (dict(dp=2, tp=2), 3, 2, "selective"), (dict(tp=2, pp=2), 0, 2, None),
        (dict(dp=2, pp=2), 2, 2, "full"), (dict(dp=2, pp=2), 3, 2, None), (dict(tp=2, pp=2), 3, 2, "full")]


def train_on_mesh(shape, zero, M, recompute, references):
    """On every rank: (the full batch's mean loss at each step, this rank's gradients of step 1
    by name, the one-process ``references``' gradients as they would be on this rank: a
    ParallelGPT stage built from a GPT holding them)."""
    from parlab.mesh_training import MeshGPT

    torch.manual_seed(0)
    with parlab.Mesh(**shape) as mesh:
        trainer = MeshGPT(GPT(CONFIG), mesh, zero=zero, microbatches=M, recompute=recompute, lr=LR)
        losses, gradients = [], None
        for i, (tokens, targets) in enumerate(batches(B, CONFIG.s, STEPS, seed=1)):
            losses.append(torch.tensor(trainer.step(tokens, targets, keep_gradients=i == 0), dtype=torch.float64))
            gradients = gradients or trainer.gradients
        total = torch.stack(losses)
        dist.all_reduce(total)  # each sequence's loss counted once, by the rank that owns it
        expected = [{name: shards[name] for name in gradients}
                    for shards in (stage_of(grads, mesh, trainer.sequence_parallel) for _, grads in references)]
        return (total / B).float(), gradients, expected


def references(shape, M):
    """One process's (losses, gradients) on the full batch, then in the ranks' dp x M shards
    summed in each ring order (the yardstick)."""
    shards = shape.get("dp", 1) * M
    return [one_process()] + [one_process(shards, tuple(order)) for order in ring_orders(shards)]


def stage_of(named, mesh, sequence_parallel):
    """This rank's slices of the one-process tensors ``named``, by ParallelGPT's names."""
    holder = GPT(CONFIG)
    with torch.no_grad():
        for name, p in holder.named_parameters():
            p.copy_(named[name])
    model = ParallelGPT(holder, mesh.group("tp"), sequence_parallel, stage=(mesh.coordinate("pp"), mesh.size("pp")))
    return {name: p.detach() for name, p in model.named_parameters()}


@functools.cache
def one_process(shards=1, order=None):
    """(losses of the STEPS steps, gradients of step 1) of the GPT in one process, Adam, each
    gradient computed in ``shards`` parts summed in ``order`` (``backward_in_shards``)."""
    return train_in_one_process(CONFIG, batches(B, CONFIG.s, STEPS, seed=1), LR, shards, order)


def assert_like_one_process(cluster, config):
    reference = references(config[0], config[2])
    results = cluster.run(train_on_mesh, *config, reference, timeout=120)
    reference_losses = [losses for losses, _ in reference]
    for rank, (losses, gradients, expected) in enumerate(results):
        what = f"{label(*config)}, rank {rank}"
        assert gradients, f"{what}: holds no gradient"
        assert_equivalent(losses, reference_losses[0], reference_losses[1:], f"{what}: losses")
        assert_equivalent(gradients, expected[0], expected[1:], f"{what}: gradients of step 1")


def label(shape, zero, M, recompute):
    axes = " x ".join(f"{axis} {size}" for axis, size in shape.items())
    return f"{axes}, ZeRO {zero}, M = {M}, recompute {recompute}"


@pytest.mark.timeout(300)
def test_the_gpt_trains_in_three_dimensions_like_one_process(cluster8):
    for config in EIGHT:
        assert_like_one_process(cluster8, config)


@pytest.mark.timeout(300)
def test_the_gpt_trains_on_every_pair_of_axes_like_one_process(cluster4):
    for config in FOUR:
        assert_like_one_process(cluster4, config)


def learner_mistakes():
    from parlab.mesh_training import MeshGPT

    messages = []
    with parlab.Mesh(dp=2) as mesh:
        for options in (dict(zero=4), dict(zero=0, offload=True), dict(recompute="attention"), dict(microbatches=0)):
            try:
                MeshGPT(GPT(CONFIG), mesh, **options)
            except ValueError as error:
                messages.append(str(error))
        tokens, targets = batches(B, CONFIG.s, 1, seed=1)[0]
        try:
            MeshGPT(GPT(CONFIG), mesh, microbatches=2).step(tokens[:6], targets[:6])
        except ValueError as error:
            messages.append(str(error))
    return messages


@pytest.mark.timeout(120)
def test_bad_arguments_say_what_to_change(cluster2):
    from parlab.mesh_training import MeshGPT

    with pytest.raises(ValueError, match="mesh must be a parlab.Mesh"):
        MeshGPT(GPT(CONFIG), (2, 2, 2))
    for messages in cluster2.run(learner_mistakes, timeout=60):
        zero, offload, recompute, microbatches, batch = messages
        assert "zero must be a ZeRO stage 0, 1, 2 or 3, got 4" in zero
        assert "offload moves the optimizer's shard to the host at ZeRO stages 1 and 2" in offload
        assert '"full" the whole layer' in recompute and "microbatches must be a whole number" in microbatches
        assert "a batch of 6 sequences does not split into dp = 2 replicas of M = 2" in batch
