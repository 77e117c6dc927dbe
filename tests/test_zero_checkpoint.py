"""parlab.zero.checkpoint: stopping after 3 steps, saving, and resuming in a fresh engine
gives the same next 3 steps as never stopping, for full and sharded checkpoints of ZeroDP
(stages 0-2) and FSDP; a full checkpoint loads into a plain model and optimizer and into
another stage or engine; a sharded one refuses another world size or layout."""

import copy
import json
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from parlab.numerics import assert_equivalent, backward_in_shards, ring_orders
from parlab.zero import FSDP, ZeroDP
from parlab.zero.checkpoint import (
    full_state_dict,
    load_full,
    load_full_state_dict,
    load_sharded,
    save_full,
    save_sharded,
)

BATCH, STEPS, LR = 8, 3, 1e-2


def build_model(seed, frozen):
    """Linear -> tanh -> Linear (frozen, or not: FSDP shards trainable parameters only) -> Linear."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 7).requires_grad_(not frozen), nn.Linear(7, 3))


ENGINES = {  # name -> (engine around a model, does it take frozen parameters?)
    **{f"stage {s}": (lambda model, s=s: ZeroDP(model, torch.optim.Adam, stage=s, lr=LR), True) for s in (0, 1, 2)},
    "FSDP": (lambda model: FSDP(model, torch.optim.Adam, strategy="FULL_SHARD", wrap_policy="per_layer", lr=LR), False),
}


def build_engine(name, seed, frozen):
    return ENGINES[name][0](build_model(seed, frozen))


def batch(step):
    generator = torch.Generator().manual_seed(step)
    return torch.randn(BATCH, 5, generator=generator), torch.randn(BATCH, 3, generator=generator)


def train(engine, first_step, steps):
    """Steps first_step.. on this rank's shard of each step's batch (a new batch each step)."""
    for step in range(first_step, first_step + steps):
        x, y = (part.chunk(dist.get_world_size())[dist.get_rank()] for part in batch(step))
        engine.zero_grad()
        F.mse_loss(engine(x), y).backward()
        engine.step()


SAVE_LOAD = {"full": (save_full, load_full), "sharded": (save_sharded, load_sharded)}


def interrupted_and_uninterrupted(name, kind, path, resume_name):
    """Trajectory A: 3 steps, save, 3 more. Trajectory B: a fresh engine ``resume_name``
    (another seed) loads the checkpoint and takes the same 3 more steps."""
    save, load = SAVE_LOAD[kind]
    frozen = ENGINES[name][1] and ENGINES[resume_name][1]
    engine = build_engine(name, 0, frozen)
    train(engine, 0, STEPS)
    save(engine, path)
    train(engine, STEPS, STEPS)
    resumed = build_engine(resume_name, 1, frozen)
    load(resumed, path)
    train(resumed, STEPS, STEPS)
    return engine.full_parameters(), resumed.full_parameters()


def assert_identical(actual, expected, label):
    """Bit for bit: a resumed engine of the same kind repeats the same operations."""
    assert actual.keys() == expected.keys()
    for name in expected:
        assert torch.equal(actual[name], expected[name]), f"{label}, {name}: not bit for bit equal"


def continue_in_one_process(path, frozen, shards=1, order=None):
    """A plain model and Adam load the full checkpoint at ``path`` and take steps STEPS to
    2 STEPS - 1 on the whole batches; with ``shards`` > 1 in the ranks' arithmetic
    (parlab.numerics: the shards' gradients summed in ``order``)."""
    model = build_model(seed=1, frozen=frozen)
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    checkpoint = torch.load(path)
    model.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    for step in range(STEPS, 2 * STEPS):
        parts = list(zip(*(part.chunk(shards) for part in batch(step))))
        backward_in_shards(lambda x, y: F.mse_loss(model(x), y), model.parameters(), parts, order)
        optimizer.step()
    return {name: p.detach().clone() for name, p in model.named_parameters()}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", list(SAVE_LOAD))
def test_resuming_from_a_checkpoint_continues_the_same_trajectory(kind, cluster2, tmp_path):
    for name in ENGINES:
        path = str(tmp_path / name / ("model.pt" if kind == "full" else ""))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        results = cluster2.run(interrupted_and_uninterrupted, name, kind, path, name, timeout=60)
        for rank, (uninterrupted, resumed) in enumerate(results):
            assert_identical(resumed, uninterrupted, f"{kind}, {name}, rank {rank}")
        if kind == "sharded":
            assert sorted(os.listdir(tmp_path / name)) == ["metadata.json", "rank0.pt", "rank1.pt"]
            metadata = json.loads((tmp_path / name / "metadata.json").read_text())
            assert metadata["world_size"] == 2 and [layout["rank"] for layout in metadata["layouts"]] == [0, 1]


@pytest.mark.timeout(60)
def test_a_full_checkpoint_is_a_plain_model_and_optimizer_and_loads_into_another_engine(cluster2, tmp_path):
    """Another engine adds in other orders than the saver, so both trajectories are compared
    with a plain model and optimizer that load the file, within parlab.numerics' band."""
    path = str(tmp_path / "model.pt")
    for saved_by, resumed_by in [("FSDP", "stage 2"), ("stage 2", "FSDP"), ("stage 1", "stage 2")]:
        runs = cluster2.run(interrupted_and_uninterrupted, saved_by, "full", path, resumed_by, timeout=60)
        uninterrupted, other = runs[0]
        frozen = ENGINES[saved_by][1] and ENGINES[resumed_by][1]
        plain = continue_in_one_process(path, frozen)
        decomposed = [continue_in_one_process(path, frozen, 2, order) for order in ring_orders(2)]
        assert_equivalent(uninterrupted, plain, decomposed, f"saved by {saved_by}, never stopped")
        assert_equivalent(other, plain, decomposed, f"saved by {saved_by}, resumed by {resumed_by}")


def save_sharded_at(name, directory):
    engine = build_engine(name, 0, frozen=False)
    train(engine, 0, 1)
    save_sharded(engine, directory)


def load_sharded_at(name, directory):
    engine = build_engine(name, 0, frozen=False)
    try:
        load_sharded(engine, directory)
    except ValueError as error:
        return str(error)


@pytest.mark.timeout(60)
def test_a_sharded_checkpoint_refuses_another_world_size_stage_or_engine(cluster2, cluster4, tmp_path):
    cluster2.run(save_sharded_at, "stage 1", str(tmp_path), timeout=60)
    for message in cluster4.run(load_sharded_at, "stage 1", str(tmp_path), timeout=60):
        assert "written by 2 ranks and this run has 4" in message and "load_full" in message
    for other in ("stage 2", "FSDP"):
        for message in cluster2.run(load_sharded_at, other, str(tmp_path), timeout=60):
            assert "full state dict" in message, other


def train_on_after_loading(name):
    """Load a full state dict into a fresh engine, train on, and return the dict as it was
    given and as it is now: loading must copy, not alias (torch keeps "step" tensors as given)."""
    engine = build_engine(name, 0, frozen=False)
    train(engine, 0, STEPS)
    box = [full_state_dict(engine)]  # on rank 0; every rank loads it
    dist.broadcast_object_list(box, src=0)
    state = box[0]
    given = copy.deepcopy(state)
    resumed = build_engine(name, 1, frozen=False)
    load_full_state_dict(resumed, state)
    train(resumed, STEPS, STEPS)
    return given, state


@pytest.mark.timeout(60)
def test_loading_a_full_state_dict_leaves_the_callers_dict_alone(cluster2):
    for name in ("stage 2", "FSDP"):
        given, after = cluster2.run(train_on_after_loading, name, timeout=60)[1]
        for index, state in given["optimizer"]["state"].items():
            for key, value in state.items():
                torch.testing.assert_close(after["optimizer"]["state"][index][key], value, rtol=0, atol=0,
                                           msg=lambda m, n=name, k=key: f"{n}: training on changed the dict's {k}: {m}")
