"""Resume after a failure: checkpoint every I steps, lose a rank, restart from the last
checkpoint on the same ranks or on fewer, and end where the uninterrupted run ends.

    recovery = train_with_failure(cluster4, steps=12, interval=4, fail_at=6, directory="ckpt",
                                  resume_on=cluster2)
    recovery["steps_lost"]                            # 2: steps 4 and 5 are computed twice
    recovery["uninterrupted"], recovery["resumed"]    # the final parameters of both runs

The training (``train``, run on every rank) is ZeRO stage 2 (``parlab.zero.ZeroDP``) or
FSDP FULL_SHARD (``parlab.zero.FSDP``, ``engine="fsdp"``) with Adam on a small MLP. Its data
order does not depend on the world size N: step j's global batch of B samples is drawn from
a generator seeded with j, and rank r takes its slice ``chunk(N)[r]`` (B / N samples). Each
rank's mean loss over its slice, averaged over the N ranks, is the mean loss of the whole
batch, so any N computes the gradient of the same loss and the run's mathematics is one
process's; only the order of the gradients' sums changes with N (``parlab.numerics``).

After step j (counting from 0) with (j + 1) a multiple of I, every rank writes its shard
(``parlab.zero.checkpoint.save_sharded``, no communication but a barrier) into
``directory/step{j + 1}``; then rank 0 records that step in ``directory/latest`` by an atomic
rename: a failure while the files are written leaves the previous checkpoint as the latest.
A failure at step f loses f - I floor(f / I) steps of work (they are computed again).

A sharded checkpoint fits its own N only: rank r's file holds shard r of the flat
parameters and of Adam's two moments (FSDP: of each unit's). ``reshard`` rewrites it for N'
ranks without a process group: it lays the N shards end to end (the padded flat buffer),
drops the padding and cuts the Psi elements into N' shards, padded to a multiple of N'
(``parlab.flat``); FSDP does so unit by unit. Adam acts elementwise, so the N' ranks step
exactly the elements the N ranks stepped.
"""

import json
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from parlab.failures.injection import Faults
from parlab.flat import FlatLayout
from parlab.numerics import backward_in_shards, ring_orders
from parlab.runtime import RankError
from parlab.zero.checkpoint import METADATA, load_sharded, save_sharded
from parlab.zero.fsdp import FSDP
from parlab.zero.stages import ZeroDP
from parlab.zero.units import REPLICATED_NAME

BATCH, FEATURES, HIDDEN, OUTPUTS = 8, 6, 16, 3  # B a multiple of every N used: 1, 2, 4, 8
LATEST = "latest"


def build_model(seed=0):
    """Linear(6, 16) -> tanh -> Linear(16, 3): Psi = 163, not a multiple of N, so the flat
    buffer is padded and resharding must drop and redo the padding."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, OUTPUTS))


def global_batch(step, batch=BATCH):
    """Step ``step``'s global batch (x (B, 6), y (B, 3)): the same in every run and on every rank."""
    generator = torch.Generator().manual_seed(step)
    return torch.randn(batch, FEATURES, generator=generator), torch.randn(batch, OUTPUTS, generator=generator)


def train(steps, interval=None, directory=None, start=0, resume_from=None, faults=None, lr=1e-2, batch=BATCH,
          engine="zero2"):
    """Run on every rank: steps ``start`` .. ``steps`` - 1 of ``engine`` ("zero2": ZeRO stage 2,
    "fsdp": FSDP FULL_SHARD with a unit per layer) with Adam, loading the sharded checkpoint
    ``resume_from`` first (written after step ``start`` - 1) when given, checkpointing every
    ``interval`` steps into ``directory``, calling ``faults.at(step)`` before each step.
    Returns {name: final full parameter} on every rank."""
    world_size, rank = dist.get_world_size(), dist.get_rank()
    if batch % world_size:
        raise ValueError(f"the global batch B = {batch} does not split into {world_size} equal slices: choose "
                         f"B a multiple of the world size, so that every world size trains on the same batches.")
    engine = build_engine(engine, lr)
    if resume_from is not None:
        load_sharded(engine, resume_from)
    for step in range(start, steps):
        if faults is not None:
            faults.at(step)
        x, y = (part.chunk(world_size)[rank] for part in global_batch(step, batch))  # (B/N, 6), (B/N, 3)
        engine.zero_grad()
        F.mse_loss(engine(x), y).backward()
        engine.step()
        if interval and (step + 1) % interval == 0:
            checkpoint(engine, directory, step + 1)
    return engine.full_parameters()


def build_engine(engine, lr):
    """``build_model()`` in the engine named ``engine``, with Adam. Both reduce the gradients by
    ring reduce-scatters of their mean (ZeroDP's flat buffer, FSDP's each unit's), so either
    computes the same Adam step on the global batch's mean gradient (``recovery_yardstick``)."""
    if engine == "zero2":
        return ZeroDP(build_model(), torch.optim.Adam, stage=2, lr=lr)
    if engine == "fsdp":
        return FSDP(build_model(), torch.optim.Adam, strategy="FULL_SHARD", wrap_policy="per_layer", lr=lr)
    raise ValueError(f"engine must be 'zero2' (ZeRO stage 2) or 'fsdp' (FSDP FULL_SHARD), got {engine!r}: pick one.")


def checkpoint(engine, directory, step):
    """Save the engine's shards as ``directory/step{step}``, then make it the latest."""
    save_sharded(engine, checkpoint_path(directory, step))  # returns after a barrier: every file is written
    if dist.get_rank() == 0:
        partial = os.path.join(directory, LATEST + ".partial")
        with open(partial, "w") as file:
            file.write(str(step))
        os.replace(partial, os.path.join(directory, LATEST))  # atomic: the old or the new, never half


def checkpoint_path(directory, step):
    return os.path.join(directory, f"step{step}")


def latest_checkpoint(directory):
    """The step of the last complete checkpoint in ``directory``, 0 when there is none."""
    try:
        with open(os.path.join(directory, LATEST)) as file:
            return int(file.read())
    except FileNotFoundError:
        return 0


def train_with_failure(cluster, steps, interval, fail_at, directory, lost_rank=None, resume_on=None, timeout=60,
                       **options):
    """Train ``steps`` steps on ``cluster`` twice: uninterrupted, and with ``lost_rank``
    (default: the last) killed at step ``fail_at`` while checkpointing every ``interval``
    steps into ``directory``; then resume from the last checkpoint on ``resume_on``
    (another cluster, e.g. with fewer ranks; default: ``cluster``, whose dead worker was
    replaced), resharded when its N differs. ``options`` go to ``train`` (lr, batch, engine).

    Returns {"uninterrupted", "resumed": {name: final parameter}, "failure": the RankError's
    first line, "checkpoint_step": k, the step resumed from, "steps_lost": fail_at - k,
    "world_sizes": (N, N')}."""
    resume_on = cluster if resume_on is None else resume_on
    lost_rank = cluster.world_size - 1 if lost_rank is None else lost_rank
    if not 0 <= fail_at < steps or interval < 1:
        raise ValueError(f"fail_at = {fail_at} must be a step of the run (0 .. {steps - 1}) and interval = {interval} "
                         "a whole number >= 1, so that the failure happens and checkpoints are written.")
    uninterrupted = cluster.run(train, steps, timeout=timeout, **options)[0]
    try:
        cluster.run(train, steps, interval, directory, faults=Faults(kill={lost_rank: fail_at}), timeout=timeout,
                    **options)
    except RankError as error:
        failure = str(error).splitlines()[0]
    else:
        raise RuntimeError(f"rank {lost_rank} was to die at step {fail_at}, but the run ended normally")
    start = latest_checkpoint(directory)
    resume_from = None
    if start:
        resume_from = checkpoint_path(directory, start)
        if resume_on.world_size != cluster.world_size:
            resume_from = reshard(resume_from, f"{resume_from}_on{resume_on.world_size}", resume_on.world_size)
    resumed = resume_on.run(train, steps, interval, directory, start=start, resume_from=resume_from,
                            timeout=timeout, **options)[0]
    return {"uninterrupted": uninterrupted, "resumed": resumed, "failure": failure, "checkpoint_step": start,
            "steps_lost": fail_at - start, "world_sizes": (cluster.world_size, resume_on.world_size)}


def reshard(source, target, world_size):
    """Rewrite the sharded checkpoint in ``source`` for ``world_size`` ranks (N') into
    ``target``, in this process, without communication. Returns ``target``.

    ZeroDP stages 1 and 2: one flat buffer. FSDP under FULL_SHARD or SHARD_GRAD_OP (the same
    shards: they differ only in when a unit reshards) or NO_SHARD: one flat buffer per unit;
    a unit kept whole (``replicate=``) stays whole. Each tensor of a shard's size (the
    parameters' shard, Adam's ``exp_avg`` and ``exp_avg_sq``) is concatenated over the S
    shards of one shard group in rank order (the padded flat buffer), cut to its Psi
    elements and laid out again by ``FlatLayout(shapes, S')``; the rest (Adam's step, the
    options, frozen tensors, buffers) is copied. The layouts written are those of the same
    engine built on N' ranks (``parlab.zero.checkpoint._layout``), so ``load_sharded`` takes
    them."""
    with open(os.path.join(source, METADATA)) as file:
        metadata = json.load(file)
    saved = [torch.load(os.path.join(source, f"rank{r}.pt")) for r in range(metadata["world_size"])]
    layout = saved[0]["layout"]
    if layout.get("engine") == "ZeroDP" and layout.get("stage") in (1, 2):
        files = _reshard_zero(saved, world_size)
    elif layout.get("engine") == "FSDP" and layout.get("strategy") in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"):
        files = _reshard_fsdp(saved, world_size)
    else:  # HYBRID_SHARD's shard group size on N' ranks is a choice the files cannot make
        kind = f"{layout.get('engine')} {layout.get('stage', layout.get('strategy', ''))}".strip()
        raise ValueError(f"reshard rewrites checkpoints of ZeroDP stages 1 and 2 and of FSDP under FULL_SHARD, "
                         f"SHARD_GRAD_OP or NO_SHARD, not of {kind}: for another engine, stage or strategy, save a "
                         "full checkpoint (save_full) and load it with load_full.")
    os.makedirs(target, exist_ok=True)
    for r, state_dict in enumerate(files):
        torch.save(state_dict, os.path.join(target, f"rank{r}.pt"))
    with open(os.path.join(target, METADATA), "w") as file:
        json.dump({"world_size": world_size, "layouts": [f["layout"] for f in files]}, file, indent=1, default=str)
    return target


def _reshard_zero(saved, world_size):
    """ZeroDP: the N ranks' files -> the N' ranks' (one flat shard, optimizer param 0)."""
    layout, model, optimizer = saved[0]["layout"], saved[0]["model"], saved[0]["optimizer"]
    new = FlatLayout(layout["shapes"], world_size)
    shards = _cut([s["model"]["flat_shard"] for s in saved], new)
    states = _cut_states([s["optimizer"]["state"].get(0, {}) for s in saved], model["flat_shard"].numel(), new)
    return [{"model": {**model, "flat_shard": shards[r]},
             "optimizer": {**optimizer, "state": {0: states[r]} if states[r] else {}},
             "layout": {**layout, "world_size": world_size, "rank": r}} for r in range(world_size)]


def _reshard_fsdp(saved, world_size):
    """FSDP: unit i (optimizer param i) is sharded over S ranks, S' after (1 for a unit kept
    whole and under NO_SHARD); ranks g S .. g S + S - 1 hold its S shards, every group the same."""
    layout, model, optimizer = saved[0]["layout"], saved[0]["model"], saved[0]["optimizer"]
    shards, states, units = {}, {}, []
    for i, unit in enumerate(layout["units"]):
        whole = unit["name"].rpartition(".")[2] == REPLICATED_NAME or layout["strategy"] == "NO_SHARD"
        S = 1 if whole else layout["shard_group_size"]
        new = FlatLayout(unit["shapes"], 1 if whole else world_size)
        shards[unit["name"]] = _cut([s["model"]["shards"][unit["name"]] for s in saved[:S]], new)
        states[i] = _cut_states([s["optimizer"]["state"].get(i, {}) for s in saved[:S]],
                                model["shards"][unit["name"]].numel(), new)
        units.append(new)
    files = []
    for r in range(world_size):
        place = [r % new.world_size for new in units]  # this rank's shard of each unit
        files.append({
            "model": {**model, "shards": {name: cuts[p] for (name, cuts), p in zip(shards.items(), place)}},
            "optimizer": {**optimizer, "state": {i: states[i][p] for i, p in enumerate(place) if states[i][p]}},
            "layout": {**layout, "world_size": world_size, "rank": r,
                       "shard_group_size": 1 if layout["strategy"] == "NO_SHARD" else world_size,
                       "units": [{**unit, "padded_numel": new.padded_numel, "shard_bounds": list(new.shard_bounds(p))}
                                 for unit, new, p in zip(layout["units"], units, place)]}})
    return files


def _cut(pieces, new):
    """S shards in rank order -> the S' shards of the ``new`` layout (padded for S')."""
    flat = torch.cat(pieces)[:new.numel]  # (Psi,)
    padded = torch.cat([flat, flat.new_zeros(new.padded_numel - new.numel)])  # (padded Psi for S')
    return [new.shard(padded, r).clone() for r in range(new.world_size)]


def _cut_states(states, shard_numel, new):
    """One optimizer param's state on each of the S old shards -> on each of the S' new: the
    tensors of a shard's size cut, anything else (Adam's step) copied. [{}] x S' if none."""
    cuts = {key: _cut([s[key] for s in states], new) for key, value in states[0].items()
            if key != "step" and torch.is_tensor(value) and value.shape == (shard_numel,)}
    return [{**states[0], **{key: pieces[r] for key, pieces in cuts.items()}} for r in range(new.world_size)]


def in_one_process(steps, shards_at, lr=1e-2, batch=BATCH):
    """``train``'s run in one process, for ``parlab.numerics``' band: ``shards_at[j]`` = (N,
    order) says how step j's gradient is made: the batch in N slices, their gradients summed
    in ``order`` (``backward_in_shards``; (1, None): the full batch's gradient, the
    reference). Returns {name: final parameter}."""
    model = build_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    for step in range(steps):
        world_size, order = shards_at[step]
        slices = list(zip(*(part.chunk(world_size) for part in global_batch(step, batch))))
        backward_in_shards(lambda x, y: F.mse_loss(model(x), y), model.parameters(), slices, order)
        optimizer.step()
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def recovery_yardstick(steps, checkpoint_step, world_sizes, lr=1e-2, batch=BATCH):
    """(reference, decomposed) for ``parlab.numerics.rounding_band``: one process on the full
    batches, and one process in the ranks' arithmetic for every pair of ring orders: N
    slices up to ``checkpoint_step``, N' after (``world_sizes`` = (N, N')). The same for both
    engines: ZeroDP stage 2 (``parlab.zero.buckets``) and FSDP (``FlatUnit.reduce_gradient``) each
    reduce-scatter the ranks' gradients in a ring with op "avg", each element summed in one
    of ``ring_orders(N)`` and divided by N, as ``backward_in_shards`` sums and divides."""
    before, after = world_sizes
    reference = in_one_process(steps, [(1, None)] * steps, lr, batch)
    decomposed = [in_one_process(steps, [(before, o)] * checkpoint_step + [(after, o2)] * (steps - checkpoint_step),
                                 lr, batch)
                  for o in ring_orders(before) for o2 in ring_orders(after)]
    return reference, decomposed
