"""Training ZeRO engines by name: what lecture 04 and ``parlab bench zero`` run, and how.

    build_engine(name, model, lr)        parlab's ZeroDP / FSDP or torch's DDP, ZeroRedundancyOptimizer,
                                         fully_shard, all behind one interface
    train(engine, batch, steps)          steps on this rank's shard of the batch, each a trace span "step"
    train_and_measure(name, ...)         on every rank: train the lecture's model, measure what it holds
    train_one_process(...)               the single-process reference (and the ranks' arithmetic)
    start_from_different_weights()       on every rank: which initial weights each engine keeps
    mlp(sizes), lecture_model(), lecture_batch()

Every engine answers ``engine(inputs)``, ``zero_grad()``, ``step()`` (after ``backward``),
``model_state_bytes()`` (this rank's ``parlab.memory.ModelState``, measured from its storages)
and ``full_parameters()`` ({name: full parameter}, on every rank). torch's engines are wrapped
in ``TorchEngine`` to answer the same; their bytes count a DTensor by its local shard, and
torch's DDP runs with ``gradient_as_bucket_view=True`` so that its gradients are its buckets.
"""

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from parlab import trace
from parlab.memory import measure_model_state, storage_bytes
from parlab.numerics import backward_in_shards, ring_orders
from parlab.runtime import emulation
from parlab.zero import FSDP, ZeroDP
from parlab.zero.strategies import STRATEGIES

SEED, DATA_SEED = 0, 1234
LECTURE_SIZES = (64, 256, 256, 256, 8)  # Psi = 150,280; its units differ in size (section 11's peak)
LECTURE_BATCH, LECTURE_LR, LECTURE_STEPS = 32, 1e-2, 3

PARLAB_ENGINES = {  # name -> (engine class, options); FSDP makes every Linear a unit ("per_layer")
    "ZeroDP stage 0": (ZeroDP, dict(stage=0)),
    "ZeroDP stage 1": (ZeroDP, dict(stage=1)),
    "ZeroDP stage 2": (ZeroDP, dict(stage=2)),
    **{f"FSDP {strategy}": (FSDP, dict(strategy=strategy, wrap_policy="per_layer")) for strategy in STRATEGIES},
}
TORCH_ENGINES = ("torch DDP", "torch DDP + ZeroRedundancyOptimizer", "torch fully_shard")
STAGE_ENGINES = {0: "ZeroDP stage 0", 1: "ZeroDP stage 1", 2: "ZeroDP stage 2", 3: "FSDP FULL_SHARD"}


def mlp(sizes, seed=SEED):
    """Linear layers ``sizes[0] -> sizes[1] -> ...`` with ReLU between them, seeded so that
    every rank and every process builds the same initial weights."""
    torch.manual_seed(seed)
    layers = []
    for index, (features_in, features_out) in enumerate(zip(sizes, sizes[1:])):
        layers.append(nn.Linear(features_in, features_out))
        if index < len(sizes) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def lecture_model():
    """Lecture 04's MLP, 64 -> 256 -> 256 -> 256 -> 8 (Psi = 150,280)."""
    return mlp(LECTURE_SIZES)


def random_batch(samples, features_in, features_out, seed=DATA_SEED):
    """(inputs, targets) of ``samples`` rows, standard normal, the same wherever it is made."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(samples, features_in, generator=generator), torch.randn(samples, features_out,
                                                                                 generator=generator)


def lecture_batch():
    """Lecture 04's full batch: 32 samples of the lecture model's 64 inputs and 8 targets."""
    return random_batch(LECTURE_BATCH, LECTURE_SIZES[0], LECTURE_SIZES[-1])


def rank_shard(batch):
    """This rank's 1/N of every tensor of ``batch`` (rows), as ranks of data parallelism read it."""
    return [part.chunk(dist.get_world_size())[dist.get_rank()] for part in batch]


class TorchEngine:
    """torch's engine, a wrapped model and its optimizer, behind parlab's engine interface."""

    def __init__(self, wrapped, optimizer, module):
        self.wrapped, self.optimizer, self.module = wrapped, optimizer, module

    def __call__(self, *args):
        return self.wrapped(*args)

    def zero_grad(self):
        self.optimizer.zero_grad()

    def step(self):
        self.optimizer.step()

    def model_state_bytes(self):
        # ZeroRedundancyOptimizer keeps this rank's partition in an inner optimizer, .optim
        state = getattr(self.optimizer, "optim", self.optimizer).state
        params = list(self.module.parameters())
        states = [_local(value) for per_parameter in state.values() for value in per_parameter.values()
                  if torch.is_tensor(value)]
        return measure_model_state(map(_local, params), [_local(p.grad) for p in params], states)

    def full_parameters(self):
        return {name: p.full_tensor() if hasattr(p, "full_tensor") else p.detach().clone()
                for name, p in self.module.named_parameters()}


def _local(tensor):
    """A DTensor's shard on this rank (what it really holds); any other tensor as it is."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def build_engine(name, model, lr=LECTURE_LR, **options):
    """The engine called ``name`` around ``model`` (built the same on every rank), training
    with fp32 Adam at ``lr``: a key of ``PARLAB_ENGINES`` (``options`` go to its class, e.g.
    ``mixed_precision=torch.bfloat16`` to FSDP) or one of ``TORCH_ENGINES`` ("torch
    fully_shard" shards every Linear of an ``nn.Sequential``, then the model)."""
    if name in PARLAB_ENGINES:
        engine_class, own_options = PARLAB_ENGINES[name]
        return engine_class(model, torch.optim.Adam, lr=lr, **own_options, **options)
    if options:
        raise ValueError(f"options {sorted(options)} are for parlab's engines; {name!r} takes none: drop them.")
    if name == "torch fully_shard":
        from torch.distributed.fsdp import fully_shard

        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        return TorchEngine(fully_shard(model), torch.optim.Adam(model.parameters(), lr=lr), model)
    if name in TORCH_ENGINES:
        device = next(model.parameters()).device
        ids = [device] if device.type == "cuda" else None
        wrapped = nn.parallel.DistributedDataParallel(model, device_ids=ids, gradient_as_bucket_view=True)
        if name == "torch DDP":
            return TorchEngine(wrapped, torch.optim.Adam(model.parameters(), lr=lr), model)
        from torch.distributed.optim import ZeroRedundancyOptimizer

        optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=lr)
        return TorchEngine(wrapped, optimizer, model)
    raise ValueError(f"engine must be one of {', '.join(map(repr, [*PARLAB_ENGINES, *TORCH_ENGINES]))}, got "
                     f"{name!r}: pick one of them.")


def take_step(engine, inputs, targets, compute_s=0.0):
    """One step of ``engine`` in a trace span "step" (its backward in "backward"): zero the
    gradients, mean squared error, backward, ``compute_s`` of emulated compute (declared: the
    CPU is released), the engine's step. Returns the loss (a 0-dim tensor)."""
    with trace.span("step"):
        engine.zero_grad()
        loss = F.mse_loss(engine(inputs), targets)
        with trace.span("backward"):
            loss.backward()
        if compute_s:
            with trace.span("emulated compute"):
                emulation.compute(compute_s)
        engine.step()
    return loss.detach()


def train(engine, batch, steps=LECTURE_STEPS, compute_s=0.0):
    """``steps`` steps of ``engine`` on this rank's shard of ``batch`` (``take_step``), the
    ranks starting each step together (a barrier, outside the step). Returns the mean loss
    over the ranks of each step."""
    inputs, targets = rank_shard(batch)
    losses = []
    for _ in range(steps):
        dist.barrier()
        losses.append(take_step(engine, inputs, targets, compute_s).float())
    losses = torch.stack(losses)
    dist.all_reduce(losses)  # plain torch.distributed: outside the steps, never emulated
    return (losses / dist.get_world_size()).tolist()


def train_and_measure(name, steps=LECTURE_STEPS, lr=LECTURE_LR, **options):
    """On every rank: ``steps`` steps of engine ``name`` (``build_engine(name, model, lr,
    **options)``) on the lecture's model and batch, and what it holds. Returns a dict:
    ``state`` (ModelState at rest, after the last step), ``parameters`` (full, on every rank),
    ``losses`` (of each step); for parlab's engines also ``padded`` (elements of the flat
    buffers a step moves) and ``held_after_forward`` (bytes of full-size parameters still
    allocated when the engine's forward has returned); for FSDP also ``gathered`` ((dtype,
    bytes) of each unit's full buffer while the unit computes, in the first forward) and
    ``dtypes`` (of the shards, their gradients and the optimizer state)."""
    engine = build_engine(name, lecture_model(), lr, **options)
    held, gathered = [], []
    if name in PARLAB_ENGINES:  # a hook on the engine fires when its whole forward has returned
        engine.register_forward_hook(lambda module, args, output: held.append(full_parameter_bytes(engine)))
    for unit in getattr(engine, "units", []):  # a unit's own pre-hook runs after FSDP's unshard
        unit.module.register_forward_pre_hook(lambda module, args, unit=unit: gathered.append(
            (unit.full.dtype, unit.full.untyped_storage().nbytes())))
    losses = train(engine, lecture_batch(), steps)
    result = dict(state=engine.model_state_bytes(), parameters=engine.full_parameters(), losses=losses)
    if name in PARLAB_ENGINES:
        result.update(padded=sum(padded_numels(engine)), held_after_forward=held[-1])
    if isinstance(engine, FSDP):
        optimizer_state = [v for state in engine.optimizer.state.values() for v in state.values() if v.dim()]
        result.update(gathered=gathered[:len(engine.units)], dtypes={
            "shards": {str(unit.shard.dtype) for unit in engine.units},
            "gradients": {str(unit.shard.grad.dtype) for unit in engine.units},
            "optimizer state": {str(v.dtype) for v in optimizer_state}})
    return result


def padded_numels(engine):
    """Elements of each flat buffer a step of a parlab engine moves: one for ZeroDP, one per
    unit for FSDP (each padded to a multiple of its shard count)."""
    if isinstance(engine, FSDP):
        return [unit.layout.padded_numel for unit in engine.units]
    return [engine.layout.padded_numel]


def full_parameter_bytes(engine):
    """Bytes of full-size (unsharded) parameters allocated right now on this rank."""
    return storage_bytes([unit.full for unit in engine.units] if isinstance(engine, FSDP) else [engine.flat_param])


def train_one_process(steps=LECTURE_STEPS, lr=LECTURE_LR, shards=1, order=None, start=None, rounded_to=None):
    """Adam on the lecture's model and full batch in one process: returns ({name: parameter},
    [loss of each step]). ``shards`` > 1: each step's gradient is the ``shards`` shards'
    gradients summed in ``order``, as that many ranks compute it (``backward_in_shards``).
    ``start``: a full checkpoint (``{"model", "optimizer"}``) to continue from. ``rounded_to``:
    a dtype the initial weights are rounded to first (e.g. torch.bfloat16), training in fp32."""
    model = lecture_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    if start is not None:
        model.load_state_dict(start["model"])
        optimizer.load_state_dict(copy.deepcopy(start["optimizer"]))  # Adam would count up start's step tensors
    if rounded_to is not None:
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p.to(rounded_to))
    parts = list(zip(*(part.chunk(shards) for part in lecture_batch())))
    losses = []

    def loss_of(inputs, targets):
        loss = F.mse_loss(model(inputs), targets)
        losses.append(loss.item())
        return loss

    for _ in range(steps):
        backward_in_shards(loss_of, model.parameters(), parts, order)
        optimizer.step()
    per_step = [sum(losses[i:i + shards]) / shards for i in range(0, len(losses), shards)]
    return {name: p.detach() for name, p in model.named_parameters()}, per_step


def start_from_different_weights():
    """On every rank: build the lecture's model from the rank's own seed, wrap it, and say which
    weights the rank then holds: {engine: the labels among "rank 0's", "its own" and "chunk r of
    rank r's" (every parameter's rows cut in N chunks, chunk r as rank r built it) that its
    full parameters equal}. Shows who broadcasts at construction: torch's DDP and parlab's
    engines do; ZeroRedundancyOptimizer and fully_shard do not."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    rank, N = dist.get_rank(), dist.get_world_size()
    built = [dict(mlp(LECTURE_SIZES, seed=seed).named_parameters()) for seed in range(N)]
    patchwork = {name: torch.cat([weights[name].chunk(N)[r] for r, weights in enumerate(built)]) for name in built[0]}
    candidates = {"rank 0's": built[0], "its own": built[rank], "chunk r of rank r's": patchwork}
    held = {}
    model = mlp(LECTURE_SIZES, seed=rank)
    nn.parallel.DistributedDataParallel(model)
    held["torch DistributedDataParallel(model)"] = dict(model.named_parameters())
    model = mlp(LECTURE_SIZES, seed=rank)
    ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam)
    held["torch ZeroRedundancyOptimizer(params)"] = dict(model.named_parameters())
    for name in ("torch fully_shard", "ZeroDP stage 1", "FSDP FULL_SHARD"):
        held[name] = build_engine(name, mlp(LECTURE_SIZES, seed=rank)).full_parameters()
    return {engine: [label for label, weights in candidates.items()
                     if all(torch.equal(parameters[name], weights[name]) for name in weights)]
            for engine, parameters in held.items()}


def ring_arithmetic(n_d, steps=LECTURE_STEPS, start=None):
    """``train_one_process``'s parameters with the gradient of ``n_d`` shards summed in each
    of the ``n_d`` orders of a ring: the yardstick of ``parlab.numerics.rounding_band``."""
    return [train_one_process(steps, shards=n_d, order=order, start=start)[0] for order in ring_orders(n_d)]
