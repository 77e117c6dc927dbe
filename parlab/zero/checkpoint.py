"""Checkpoints of a sharded engine (``ZeroDP``, ``FSDP``): one full file, or one file per rank.

    save_full(engine, "model.pt")        gathered on rank 0, written by rank 0 alone
    load_full(engine, "model.pt")        any world size, any stage: every rank reads the file
    save_sharded(engine, "ckpt/")        ckpt/rank{r}.pt from each rank + ckpt/metadata.json
    load_sharded(engine, "ckpt/")        the same world size (and engine layout) only

A full checkpoint is the model and optimizer as one process would hold them: a plain
``nn.Module`` loads ``["model"]`` with ``load_state_dict`` and a plain
``optimizer_class(model.parameters())`` loads ``["optimizer"]``. Writing it moves every
shard to rank 0 (all-gathers of Psi elements per optimizer state) and needs the whole model
state in rank 0's memory: the price of a file that any world size can read.

A sharded checkpoint is what each rank holds, written in parallel without communication:
the fast way to stop and resume the same job. Its shards only make sense for the same
N_d, so ``load_sharded`` refuses another world size; to change it, go through the full one.

The engine provides ``full_state_dict()`` (a dict on rank 0, None elsewhere),
``load_full_state_dict(sd)`` (sd given on every rank), ``sharded_state_dict()`` (with a
"layout" entry describing its shards) and ``load_sharded_state_dict(sd)``. All four
functions here are collective: call them on every rank, with a path every rank can see.
"""

import json
import os

import torch
import torch.distributed as dist

METADATA = "metadata.json"


def save_full(engine, path):
    """Gather the engine's full state on rank 0 and write it to ``path`` from rank 0."""
    state_dict = engine.full_state_dict()
    if dist.get_rank() == 0:
        torch.save(state_dict, path)
    dist.barrier()  # the file exists for every rank once this returns


def load_full(engine, path):
    """Load a ``save_full`` checkpoint into ``engine``: every rank reads ``path``."""
    engine.load_full_state_dict(torch.load(path))


def save_sharded(engine, directory):
    """Each rank writes ``directory/rank{r}.pt``; rank 0 also writes ``metadata.json`` with
    the world size and every rank's layout."""
    state_dict = engine.sharded_state_dict()
    os.makedirs(directory, exist_ok=True)
    layouts = [None] * dist.get_world_size()
    dist.all_gather_object(layouts, state_dict.get("layout"))
    torch.save(state_dict, _rank_file(directory, dist.get_rank()))
    if dist.get_rank() == 0:
        with open(os.path.join(directory, METADATA), "w") as file:
            json.dump({"world_size": dist.get_world_size(), "layouts": layouts}, file, indent=1, default=str)
    dist.barrier()


def load_sharded(engine, directory):
    """Load a ``save_sharded`` checkpoint written by the same number of ranks: rank r reads
    ``directory/rank{r}.pt``."""
    with open(os.path.join(directory, METADATA)) as file:
        written_by = json.load(file)["world_size"]
    if written_by != dist.get_world_size():
        raise ValueError(
            f"the sharded checkpoint in {directory} was written by {written_by} ranks and this run has "
            f"{dist.get_world_size()}: its shards fit {written_by} ranks only. To change the world size, "
            "save a full checkpoint (save_full) and load it with load_full."
        )
    engine.load_sharded_state_dict(torch.load(_rank_file(directory, dist.get_rank())))


def _rank_file(directory, rank):
    return os.path.join(directory, f"rank{rank}.pt")
