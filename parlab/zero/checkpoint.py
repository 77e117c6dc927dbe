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

The state dicts behind the files, for either engine:

    full_state_dict(engine)               a dict on rank 0, None elsewhere (collective)
    load_full_state_dict(engine, sd)      sd given on every rank; each keeps its shards
    sharded_state_dict(engine)            this rank's part, with a "layout" entry
    load_sharded_state_dict(engine, sd)   the same layout only

Every function here is collective: call it on every rank (with a path every rank can see).
An optimizer state shaped like its parameter (Adam's momentum and variance) is sharded like
the parameters; anything else (the step count, which torch keeps as a 0-dim tensor, so that
a 0-dim parameter's shape matches it: hence "step" is named) is copied whole.
"""

import copy
import json
import os

import torch
import torch.distributed as dist

from parlab.flat import all_gather
from parlab.zero.fsdp import FSDP
from parlab.zero.stages import ZeroDP

METADATA = "metadata.json"


def save_full(engine, path):
    """Gather the engine's full state on rank 0 and write it to ``path`` from rank 0."""
    state_dict = full_state_dict(engine)
    if dist.get_rank() == 0:
        torch.save(state_dict, path)
    dist.barrier()  # the file exists for every rank once this returns


def load_full(engine, path):
    """Load a ``save_full`` checkpoint into ``engine``: every rank reads ``path``."""
    load_full_state_dict(engine, torch.load(path))


def save_sharded(engine, directory):
    """Each rank writes ``directory/rank{r}.pt``; rank 0 also writes ``metadata.json`` with
    the world size and every rank's layout."""
    state_dict = sharded_state_dict(engine)
    os.makedirs(directory, exist_ok=True)
    layouts = [None] * dist.get_world_size()
    dist.all_gather_object(layouts, state_dict["layout"])
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
    load_sharded_state_dict(engine, torch.load(_rank_file(directory, dist.get_rank())))


def full_state_dict(engine):
    """{"model": the plain model's state_dict (tied names, frozen parameters and buffers
    included), "optimizer": the state_dict of ``optimizer_class(model.parameters())``} on
    rank 0, None on the others. Every rank must call it: the shards are all-gathered."""
    _check_all_ranks(engine)
    return _fsdp_full_state_dict(engine) if _is_fsdp(engine) else _zero_full_state_dict(engine)


def load_full_state_dict(engine, state_dict):
    """Load what ``full_state_dict`` returned (or a plain model's and optimizer's state dicts
    in that format). Every rank passes the dict (e.g. each reads the same file) and copies
    its own shards out of it, without communication."""
    _check_all_ranks(engine)
    if _is_fsdp(engine):
        _fsdp_load_full_state_dict(engine, state_dict)
    else:
        _zero_load_full_state_dict(engine, state_dict)


def sharded_state_dict(engine):
    """This rank's part, as copies: {"model": its shards of the parameters and what it holds
    whole (frozen parameters, buffers), "optimizer": its inner optimizer's state_dict (over
    the shards), "layout": what the shards are (engine, stage or strategy, world size, rank,
    shapes; for FSDP per unit its parameter names, padded numel and shard bounds)}."""
    _check_all_ranks(engine)
    if _is_fsdp(engine):
        model = {"shards": {unit.name: unit.shard.detach().clone() for unit in engine.units},
                 "buffers": {name: b.detach().clone() for name, b in engine.module.named_buffers()}}
    else:
        model = {"flat_shard": engine.layout.shard(engine.flat_param, engine.rank).clone(),
                 "unsharded": {name: t.detach().clone() for name, t in engine.unsharded_tensors().items()}}
    return {"model": model, "optimizer": copy.deepcopy(engine.optimizer.state_dict()), "layout": _layout(engine)}


def load_sharded_state_dict(engine, state_dict):
    """Load this rank's ``sharded_state_dict``, written by an engine of the same layout; the
    full parameters are made from the loaded shards (ZeroDP: all-gathered now; FSDP: by the
    next forward)."""
    _check_all_ranks(engine)
    if state_dict["layout"] != _layout(engine):
        same = "world size, strategy and units" if _is_fsdp(engine) else "stage, world size and model"
        raise ValueError(
            f"this sharded state dict was written for {state_dict['layout']}, not for this engine's "
            f"{_layout(engine)}: load it with the same {same}, or save and load a full state dict instead "
            "(it fits any engine, stage and world size)."
        )
    model = state_dict["model"]
    with torch.no_grad():
        if _is_fsdp(engine):
            for unit in engine.units:
                unit.shard.copy_(model["shards"][unit.name])
                unit.reshard()  # the next forward unshards the loaded shards
            for name, buffer in engine.module.named_buffers():
                buffer.copy_(model["buffers"][name])
        else:
            engine.layout.shard(engine.flat_param, engine.rank).copy_(model["flat_shard"])
            for name, tensor in engine.unsharded_tensors().items():
                tensor.copy_(model["unsharded"][name])
            all_gather(engine.flat_param, engine.layout)
            _zero_offloaded_shard_from_flat(engine)
    engine.optimizer.load_state_dict(state_dict["optimizer"])


# --- ZeroDP: one flat buffer; the optimizer steps this rank's shard of it (stage 0: the parameters) --


def _zero_full_state_dict(engine):
    if engine.stage == 0:  # its optimizer steps the model's parameters: their states are whole already
        per_parameter = [{key: value.clone() if torch.is_tensor(value) else copy.deepcopy(value)
                          for key, value in engine.optimizer.state.get(p, {}).items()} for p in engine.trainable]
    else:  # every rank takes part in the all-gathers; only rank 0 assembles the dict
        full_state = {key: _zero_gather(engine, value)
                      for key, value in engine.optimizer.state.get(engine.shard, {}).items()}
        per_parameter = [{key: _zero_piece(engine, value, position) for key, value in full_state.items()}
                         for position in range(len(engine.trainable))]
    if engine.rank != 0:
        return None
    index = {id(p): i for i, p in enumerate(engine.module.parameters())}
    state = {index[id(p)]: s for p, s in zip(engine.trainable, per_parameter) if s}
    group = {**engine.optimizer.state_dict()["param_groups"][0], "params": list(index.values())}
    model = {name: tensor.detach().clone() for name, tensor in engine.module.state_dict().items()}
    return {"model": model, "optimizer": {"state": state, "param_groups": [group]}}


def _zero_load_full_state_dict(engine, state_dict):
    engine.module.load_state_dict(state_dict["model"])  # copies into the flat buffer's views
    with torch.no_grad():
        _zero_offloaded_shard_from_flat(engine)
    index = {id(p): i for i, p in enumerate(engine.module.parameters())}
    per_parameter = [state_dict["optimizer"]["state"].get(index[id(p)], {}) for p in engine.trainable]
    # torch's load_state_dict keeps a given tensor as it is: copies, so that training on
    # does not count up the caller's "step" (or change its other states).
    if engine.stage == 0:  # the optimizer steps the model's parameters, state by state as saved
        states = {i: {key: _copy(value) for key, value in s.items()} for i, s in enumerate(per_parameter) if s}
        group = {**state_dict["optimizer"]["param_groups"][0], "params": list(range(len(per_parameter)))}
        engine.optimizer.load_state_dict({"state": states, "param_groups": [group]})
        return
    state = {}
    for key, value in per_parameter[0].items():
        if key != "step" and torch.is_tensor(value) and value.shape == engine.trainable[0].shape:
            value = engine.layout.shard(engine.layout.flatten([s[key] for s in per_parameter]), engine.rank)
        state[key] = _copy(value)
    group = {**state_dict["optimizer"]["param_groups"][0], "params": [0]}
    engine.optimizer.load_state_dict({"state": {0: state} if state else {}, "param_groups": [group]})


def _copy(value):
    return value.clone() if torch.is_tensor(value) else value


def _zero_offloaded_shard_from_flat(engine):
    """With offload the optimizer steps a host copy of the shard: give it the loaded values."""
    if engine.offload:
        engine.shard.copy_(engine.layout.shard(engine.flat_param, engine.rank))


def _zero_gather(engine, value):
    """A state tensor of the shard's shape as the full padded flat tensor; anything else
    (Adam's step count) as it is."""
    if not torch.is_tensor(value) or value.shape != engine.shard.shape:
        return value
    flat = torch.zeros_like(engine.flat_param)
    engine.layout.shard(flat, engine.rank).copy_(value)
    return all_gather(flat, engine.layout)


def _zero_piece(engine, value, position):
    if torch.is_tensor(value) and value.shape == engine.flat_param.shape:
        return engine.layout.views(value)[position].clone()
    return value.clone() if torch.is_tensor(value) else value


# --- FSDP: one flat parameter per unit; the optimizer steps the units' shards ------------------
# A unit knows each parameter by its first name (``unit.names``) and its place in the plain
# model's ``parameters()`` (``unit.positions``: where a plain optimizer's state_dict numbers it).


def _fsdp_full_state_dict(engine):
    full = engine.full_parameters()  # all-gathered on every rank
    state = {}
    for unit in engine.units:
        for key, value in engine.optimizer.state.get(unit.shard, {}).items():
            per_element = torch.is_tensor(value) and value.shape == unit.shard.shape
            pieces = unit.gather_full(value) if per_element else [value] * len(unit.names)
            for position, piece in zip(unit.positions, pieces):
                # clone: a view would carry (and torch.save would write) the whole unit's storage
                piece = piece.clone() if torch.is_tensor(piece) else copy.deepcopy(piece)
                state.setdefault(position, {})[key] = piece
    if dist.get_rank() != 0:
        return None
    model = {alias: full[name] for alias, name in _fsdp_aliases(engine).items()}
    model.update({name: buffer.detach().clone() for name, buffer in engine.module.named_buffers()})
    parameters = sum(len(unit.positions) for unit in engine.units)
    group = {**engine.optimizer.state_dict()["param_groups"][0], "params": list(range(parameters))}
    return {"model": model, "optimizer": {"state": state, "param_groups": [group]}}


def _fsdp_aliases(engine):
    """{every name a plain model's state_dict gives a parameter (a tied one has several): the
    unit's name for it}, from the (module, attribute) slots that hold each parameter."""
    prefixes = {}  # id(module) -> every qualified name of the module (a shared one has several)
    for prefix, module in engine.module.named_modules(remove_duplicate=False):
        prefixes.setdefault(id(module), []).append(prefix)
    return {f"{prefix}.{attribute}" if prefix else attribute: name
            for unit in engine.units for name, slots in zip(unit.names, unit.slots)
            for module, attribute in slots for prefix in prefixes[id(module)]}


def _fsdp_load_full_state_dict(engine, state_dict):
    model, saved = state_dict["model"], state_dict["optimizer"]
    state = {}
    with torch.no_grad():
        for i, unit in enumerate(engine.units):
            unit.shard.copy_(unit.shard_of([model[name] for name in unit.names]))
            per_parameter = [saved["state"].get(position, {}) for position in unit.positions]
            shape = model[unit.names[0]].shape
            state[i] = {key: unit.shard_of([s[key] for s in per_parameter])
                        if key != "step" and torch.is_tensor(value) and value.shape == shape
                        else copy.deepcopy(value)  # the optimizer would keep the caller's tensor
                        for key, value in per_parameter[0].items()}
            unit.reshard()  # the next forward unshards the loaded shards
        for name, buffer in engine.module.named_buffers():
            buffer.copy_(model[name])
    group = {**saved["param_groups"][0], "params": list(range(len(engine.units)))}
    engine.optimizer.load_state_dict({"state": {i: s for i, s in state.items() if s}, "param_groups": [group]})


# --- both ------------------------------------------------------------------------------------


def _is_fsdp(engine):
    if not isinstance(engine, (ZeroDP, FSDP)):
        raise ValueError(f"checkpoints here are for parlab's sharded engines, ZeroDP and FSDP, not "
                         f"{type(engine).__name__}: save a plain module with torch.save(module.state_dict(), path).")
    return isinstance(engine, FSDP)


def _layout(engine):
    """What this rank's shards are: a sharded state dict loads only into the same layout."""
    if not _is_fsdp(engine):
        return {"engine": "ZeroDP", "stage": engine.stage, "world_size": engine.world_size, "rank": engine.rank,
                "shapes": [list(shape) for shape in engine.layout.shapes]}
    return {"engine": "FSDP", "strategy": engine.strategy, "world_size": engine.world_size,
            "shard_group_size": engine.shard_group_size, "rank": dist.get_rank(),
            "units": [{"name": u.name, "parameters": list(u.names), "shapes": [list(s) for s in u.layout.shapes],
                       "padded_numel": u.layout.padded_numel, "shard_bounds": list(u.layout.shard_bounds(u.rank))}
                      for u in engine.units]}


def _rank_file(directory, rank):
    return os.path.join(directory, f"rank{rank}.pt")


def _check_all_ranks(engine):
    _is_fsdp(engine)  # one of parlab's engines, first
    # The gathers and files here are over all ranks; an engine on a subgroup would mix groups.
    if getattr(engine, "group", None) is not None:
        raise ValueError("checkpoints are made over all ranks: this ZeroDP works on a process group (group=...); "
                         "save its full_parameters() yourself, or build it without group to checkpoint it.")
    if engine.optimizer is None:
        raise ValueError("a checkpoint holds the engine's optimizer state, and this engine was built without an "
                         "optimizer (optimizer_class=None): build it with one, or save your optimizer yourself.")
