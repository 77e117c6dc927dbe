"""parlab.zero.FSDP on real ranks: every strategy and wrap policy trains a toy model with a
tied weight, a root parameter and uneven unit sizes exactly like one process on the full
batch (and like torch's fully_shard); memory at rest is the ZeRO formula; the trace shows
the traffic (3, 2 transfers per unit) and the flow (unshard right before each unit, reshard
after); mixed precision, deferred init, CPU offload, state dicts and learner errors."""

import copy
import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from parlab import trace
from parlab.memory import model_state_bytes, ring_traffic_bytes, storage_bytes
from parlab.numerics import (
    assert_equivalent,
    assert_within,
    backward_in_shards,
    max_abs_difference,
    ring_orders,
    rounding_band,
)
from parlab.zero import checkpoint
from parlab.zero.fsdp import FSDP, _shard_group_size
from parlab.zero.units import init_by_unit, min_params, plan_units

VOCAB, BATCH, STEPS = 11, 40, 5
ADAM = (torch.optim.Adam, dict(lr=1e-2))
SGD = (torch.optim.SGD, dict(lr=0.5, momentum=0.9))


class Toy(nn.Module):
    """Embedding -> residual MLP block -> LayerNorm -> output layer sharing the embedding's
    weight, times a parameter of the model itself (the root unit's)."""

    def __init__(self, dim=6, hidden=9):
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, dim)
        self.block = nn.Sequential(nn.Linear(dim, hidden), nn.Tanh(), nn.Linear(hidden, dim))
        self.norm = nn.LayerNorm(dim)
        self.output = nn.Linear(dim, VOCAB, bias=False)
        self.output.weight = self.embedding.weight
        self.scale = nn.Parameter(1 + 0.1 * torch.randn(VOCAB))

    def forward(self, tokens):
        h = self.embedding(tokens)
        h = h + self.block(h)
        return self.output(self.norm(h)) * self.scale


def build(seed, **sizes):
    torch.manual_seed(seed)
    return Toy(**sizes)


def full_batch():
    generator = torch.Generator().manual_seed(1234)
    return torch.randint(VOCAB, (BATCH,), generator=generator), torch.randint(VOCAB, (BATCH,), generator=generator)


def my_shard():
    return [part.chunk(dist.get_world_size())[dist.get_rank()] for part in full_batch()]


def loss_on(model, tokens, targets):
    return F.cross_entropy(model(tokens).float(), targets)


def one_process(optimizer, steps=STEPS, shards=1, order=None, model=None, start=None):
    """One process trains ``model`` (default build(seed=0)), from the full state dict
    ``start`` if given, ``steps`` steps with the plain ``optimizer`` ("adam" or "sgd") on the
    full batch; with ``shards`` > 1 in the ranks' arithmetic (parlab.numerics): the shards'
    gradients summed in ``order``. Returns the model and the optimizer."""
    model = build(seed=0) if model is None else model
    optimizer_class, options = {"adam": ADAM, "sgd": SGD}[optimizer]
    plain = optimizer_class(model.parameters(), **options)
    if start is not None:
        model.load_state_dict(start["model"])
        plain.load_state_dict(copy.deepcopy(start["optimizer"]))  # Adam would count up start's step tensors
    parts = list(zip(*(part.chunk(shards) for part in full_batch())))
    for _ in range(steps):
        backward_in_shards(functools.partial(loss_on, model), model.parameters(), parts, order)
        plain.step()
    return model, plain


def parameters_of(model):
    return {name: p.detach().clone() for name, p in model.named_parameters()}


@functools.cache
def reference(optimizer, steps=STEPS, shards=1, order=None):
    """Parameters of one process trained ``steps`` steps from build(seed=0) (``one_process``)."""
    return parameters_of(one_process(optimizer, steps, shards, order)[0])


def ring_arithmetic(optimizer, shards, steps=STEPS):
    """The yardstick's runs: ``reference`` in each order in which a ring sums the shards."""
    return [reference(optimizer, steps, shards, tuple(order)) for order in ring_orders(shards)]


def train(engine, steps=STEPS, microbatches=1):
    tokens, targets = my_shard()
    for _ in range(steps):
        engine.zero_grad()
        for x, y in zip(tokens.chunk(microbatches), targets.chunk(microbatches)):
            (loss_on(engine, x, y) / microbatches).backward()
        engine.step()
    return engine


def assert_identical(actual, expected, label):
    """Bit for bit: the same operations on the same numbers."""
    assert actual.keys() == expected.keys(), label
    for name in expected:
        assert torch.equal(actual[name], expected[name]), f"{label}, {name}: not bit for bit equal"


# --- equivalence with one process -----------------------------------------------------------

CONFIGS = {  # label -> (reference optimizer, FSDP keyword arguments, micro-batches)
    "FULL_SHARD adam": ("adam", dict(strategy="FULL_SHARD"), 1),
    "FULL_SHARD sgd": ("sgd", dict(strategy="FULL_SHARD"), 1),
    "SHARD_GRAD_OP adam": ("adam", dict(strategy="SHARD_GRAD_OP"), 1),
    "SHARD_GRAD_OP sgd": ("sgd", dict(strategy="SHARD_GRAD_OP"), 1),
    "NO_SHARD adam": ("adam", dict(strategy="NO_SHARD"), 1),
    "NO_SHARD sgd": ("sgd", dict(strategy="NO_SHARD"), 1),
    "HYBRID_SHARD adam": ("adam", dict(strategy="HYBRID_SHARD"), 1),
    "HYBRID_SHARD sgd": ("sgd", dict(strategy="HYBRID_SHARD"), 1),
    "per_layer adam": ("adam", dict(wrap_policy="per_layer"), 1),
    "min_params(50) sgd": ("sgd", dict(wrap_policy=min_params(50)), 1),
    "cpu_offload adam": ("adam", dict(cpu_offload=True), 1),
    "2 micro-batches adam": ("adam", dict(wrap_policy="per_layer"), 2),
}


def train_every_config():
    """Each config from a replica initialised with this rank's seed (FSDP must broadcast
    rank 0's): its full parameters after STEPS steps, the units' padding, the shards' device.
    HYBRID_SHARD at 4 ranks only (2 x 2; on 2 ranks it would be NO_SHARD)."""
    results = {}
    for label, (optimizer, options, microbatches) in CONFIGS.items():
        if options.get("strategy") == "HYBRID_SHARD" and dist.get_world_size() != 4:
            continue
        optimizer_class, optimizer_options = {"adam": ADAM, "sgd": SGD}[optimizer]
        engine = FSDP(build(seed=dist.get_rank()), optimizer_class, **options, **optimizer_options)
        train(engine, microbatches=microbatches)
        padding = [unit.layout.padded_numel - unit.layout.numel for unit in engine.units]
        results[label] = engine.full_parameters(), padding, engine.shards[0].device
    return results


@pytest.mark.timeout(90)
@pytest.mark.parametrize("world", ["cluster2", "cluster4"])
def test_every_strategy_and_policy_trains_like_one_process(world, request):
    cluster = request.getfixturevalue(world)
    for rank, results in enumerate(cluster.run(train_every_config, timeout=90)):
        assert len(results) == len(CONFIGS) - 2 * (world == "cluster2")
        for label, (parameters, _, _) in results.items():
            optimizer, _, microbatches = CONFIGS[label]
            decomposed = ring_arithmetic(optimizer, cluster.world_size * microbatches)  # each rank's micro-batches
            assert_equivalent(parameters, reference(optimizer), decomposed, f"rank {rank}, {label}")
        assert any(results["FULL_SHARD adam"][1]), "no unit needed padding: the uneven case is not tested"
        assert results["cpu_offload adam"][2] == torch.device("cpu")
    moved = reference("adam")["block.0.weight"] - build(seed=0).block[0].weight
    assert moved.abs().max() > 1e-2  # training moved the parameters: the comparison can fail


def train_torch_fully_shard():
    """torch's FSDP2 on the same units (block, norm, the root), gloo on CPU."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = build(seed=0)  # fully_shard does not broadcast: every rank builds rank 0's model
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for unit in (model.block, model.norm, model):
        fully_shard(unit, mesh=mesh)
    train(TorchEngine(model, ADAM))
    ours = train(FSDP(build(seed=dist.get_rank()), ADAM[0], **ADAM[1]))
    return {name: p.full_tensor() for name, p in model.named_parameters()}, ours.full_parameters()


class TorchEngine:
    """A torch-sharded model and its optimizer behind the engine interface ``train`` uses."""

    def __init__(self, model, optimizer):
        self.model, self.optimizer = model, optimizer[0](model.parameters(), **optimizer[1])

    def __call__(self, tokens):
        return self.model(tokens)

    def zero_grad(self):
        self.optimizer.zero_grad()

    def step(self):
        self.optimizer.step()


@pytest.mark.timeout(60)
def test_same_parameters_as_torch_fully_shard_on_gloo(cluster2):
    band = rounding_band(reference("adam"), ring_arithmetic("adam", 2))[0]
    for rank, (torch_fsdp, ours) in enumerate(cluster2.run(train_torch_fully_shard, timeout=60)):
        assert_equivalent(torch_fsdp, reference("adam"), ring_arithmetic("adam", 2), f"rank {rank}, torch fully_shard")
        assert_within(ours, torch_fsdp, 2 * band, f"rank {rank}, parlab FSDP vs torch fully_shard",
                      "2 x the band, as both are within it of one process")


def trained_with_vectors_replicated():
    """FSDP per layer with every 1-D parameter (biases, the norm, the scale) left replicated:
    its full parameters, memory at rest, units and replicated Parameters; and a replicate
    that is not a function."""
    def one_dimensional(name, p):
        return p.ndim == 1

    engine = FSDP(build(seed=dist.get_rank()), torch.optim.Adam, wrap_policy="per_layer", replicate=one_dimensional,
                  **ADAM[1])
    train(engine)
    units = [(unit.name, unit.layout.world_size, unit.layout.padded_numel) for unit in engine.units]
    replicated = {name: p.detach().clone() for name, p in engine.module.named_parameters()
                  if name.endswith("flat_replicated")}
    try:
        FSDP(build(seed=0), torch.optim.Adam, replicate="norm", **ADAM[1])
        refused = None
    except ValueError as error:
        refused = str(error)
    return engine.full_parameters(), engine.model_state_bytes(), units, replicated, refused


@pytest.mark.timeout(90)
def test_replicated_parameters_stay_whole_and_train_like_one_process(cluster2):
    results = cluster2.run(trained_with_vectors_replicated, timeout=90)
    vectors = sum(p.numel() for p in build(seed=0).parameters() if p.ndim == 1)
    for rank, (parameters, memory, units, replicated, refused) in enumerate(results):
        assert_equivalent(parameters, reference("adam"), ring_arithmetic("adam", 2), f"rank {rank}, replicate")
        whole = [(name, numel) for name, S, numel in units if S == 1]
        assert {name for name, _ in whole} == {"flat_replicated", "block.0.flat_replicated",
                                               "block.2.flat_replicated", "norm.flat_replicated"}
        assert sum(numel for _, numel in whole) == vectors  # kept whole: no padding, no shard
        sharded = sum(numel // 2 for _, S, numel in units if S == 2)
        assert memory.params == 4 * (vectors + sharded)  # at rest: the replicated whole, the rest's shards
        assert replicated.keys() == {name for name, _ in whole}
        assert refused is not None and "function (name, parameter)" in refused
    for name, tensor in results[0][3].items():
        assert torch.equal(tensor, results[1][3][name]), f"{name}: the replicas differ"


def trained_hybrid_with_vectors_replicated():
    """HYBRID_SHARD (2 x 2) per layer with the 1-D parameters left replicated: the full
    parameters, each unit's (name, shard-group size) and the replicated Parameters' values."""
    engine = FSDP(build(seed=dist.get_rank()), torch.optim.Adam, strategy="HYBRID_SHARD", wrap_policy="per_layer",
                  replicate=lambda name, p: p.ndim == 1, **ADAM[1])
    train(engine)
    units = [(unit.name, unit.layout.world_size) for unit in engine.units]
    replicated = {name: p.detach().clone() for name, p in engine.module.named_parameters()
                  if name.endswith("flat_replicated")}
    return engine.full_parameters(), units, replicated


@pytest.mark.timeout(90)
def test_replicated_parameters_beside_hybrid_shard_on_4_ranks_train_like_one_process(cluster4):
    """Four ranks in two shard groups of 2: the matrices are sharded within a pair (and the
    shards all-reduced across pairs), the vectors stay whole on all 4 and are all-reduced over
    all 4; the same Adam steps as one process on the full batch."""
    results = cluster4.run(trained_hybrid_with_vectors_replicated, timeout=90)
    for rank, (parameters, units, replicated) in enumerate(results):
        assert_equivalent(parameters, reference("adam"), ring_arithmetic("adam", 4), f"rank {rank}, hybrid replicate")
        sizes = dict(units)
        assert {sizes[name] for name in sizes if name.endswith("flat_replicated")} == {1}
        assert {size for name, size in sizes.items() if not name.endswith("flat_replicated")} == {2}
        for name, tensor in replicated.items():
            assert torch.equal(tensor, results[0][2][name]), f"{name}: rank {rank}'s replica differs from rank 0's"


def resumed_with_vectors_replicated(directory):
    """Save full and sharded checkpoints of a replicate= engine after 2 steps; fresh engines
    load each and take step 3: the parameters of 3 steps straight?"""
    def make(seed):
        return FSDP(build(seed=seed), torch.optim.Adam, wrap_policy="per_layer",
                    replicate=lambda name, p: p.ndim == 1, **ADAM[1])

    straight = train(make(0), 3).full_parameters()
    saved = train(make(0), 2)
    checkpoint.save_full(saved, f"{directory}/full.pt")
    checkpoint.save_sharded(saved, f"{directory}/sharded")
    same = []
    for load, path in [(checkpoint.load_full, "full.pt"), (checkpoint.load_sharded, "sharded")]:
        resumed = make(1)
        load(resumed, f"{directory}/{path}")
        parameters = train(resumed, 1).full_parameters()
        same.append(all(torch.equal(parameters[name], straight[name]) for name in straight))
    return same


@pytest.mark.timeout(90)
def test_replicated_parameters_resume_from_full_and_sharded_checkpoints(cluster2, tmp_path):
    assert cluster2.run(resumed_with_vectors_replicated, str(tmp_path), timeout=90) == [[True, True]] * 2


# --- memory at rest and traffic --------------------------------------------------------------


def memory_at_rest(strategy, **options):
    engine = train(FSDP(build(seed=0, dim=32, hidden=100), torch.optim.Adam, strategy=strategy, lr=1e-3, **options), 2)
    return engine.model_state_bytes(), sum(unit.layout.numel for unit in engine.units)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world", ["cluster2", "cluster4"])
def test_memory_at_rest_is_the_zero_formula(world, request):
    cluster = request.getfixturevalue(world)
    N = cluster.world_size
    for strategy, options, stage in [("FULL_SHARD", {}, 3), ("SHARD_GRAD_OP", {}, 3),
                                     ("FULL_SHARD", dict(cpu_offload=True), 3), ("NO_SHARD", {}, 0)]:
        for measured, psi in cluster.run(memory_at_rest, strategy, **options, timeout=60):
            expected = model_state_bytes(psi, stage, N, kappa=8, param_bytes=4, grad_bytes=4)
            for field in ("params", "grads", "optimizer"):  # Adam: 16 Psi / N_d in all
                assert getattr(measured, field) == pytest.approx(getattr(expected, field), rel=0.02), (strategy, field)


def traced_steps(strategy, steps):
    engine = FSDP(build(seed=0), torch.optim.SGD, strategy=strategy, wrap_policy="per_layer", lr=0.1)
    with trace.span("steps"):
        train(engine, steps)
    return [unit.layout.padded_numel for unit in engine.units]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world", ["cluster2", "cluster4"])
def test_traffic_is_three_transfers_full_shard_two_shard_grad_op(world, request):
    cluster = request.getfixturevalue(world)
    N, steps = cluster.world_size, 2
    for strategy, transfers in [("FULL_SHARD", 3), ("SHARD_GRAD_OP", 2)]:
        timeline = cluster.trace(traced_steps, strategy, steps, timeout=60)
        padded = sum(timeline.results[0])
        per_rank = steps * transfers * (N - 1) * padded // N * 4  # each transfer (N-1)/N x padded x 4 bytes
        assert timeline.bytes_sent() == [per_rank] * N, strategy
        if transfers == 3:
            assert per_rank == steps * ring_traffic_bytes(padded, N, 4, stage=3)
        gathers = len(timeline.select(rank=0, name="all-gather"))
        assert gathers == steps * (transfers - 1) * len(timeline.results[0]), strategy
    # NO_SHARD all-reduces the unpadded gradients (DDP): 2 (N - 1) x numel x 4 bytes over all ranks
    timeline = cluster.trace(traced_steps, "NO_SHARD", steps, timeout=60)
    assert sum(timeline.bytes_sent()) == steps * 2 * (N - 1) * sum(timeline.results[0]) * 4
    if N == 4:  # HYBRID_SHARD 2 x 2: the sharded traffic within pairs, then the shard all-reduced across
        timeline = cluster.trace(traced_steps, "HYBRID_SHARD", steps, timeout=60)
        in_pairs = 3 * (2 - 1) * sum(timeline.results[0]) // 2 * 4 * N  # every rank
        across = 2 * (2 - 1) * sum(timeline.results[0]) // 2 * 4 * 2  # 2 rings of 2 over a shard each
        assert sum(timeline.bytes_sent()) == steps * (in_pairs + across)


# --- the flow: unit by unit -----------------------------------------------------------------


def watched_step(strategy, prefetch):
    """One step with each unit's forward entry marked (a hook after FSDP's: the unit is
    unsharded by then); the storage of every unit's full buffer after forward and after
    backward."""
    engine = FSDP(build(seed=0), torch.optim.SGD, strategy=strategy, wrap_policy="per_layer", prefetch=prefetch,
                  lr=0.1)
    for unit in engine.units:
        unit.module.register_forward_pre_hook(functools.partial(mark_entry, unit))
    tokens, targets = my_shard()
    loss = loss_on(engine, tokens, targets)
    after_forward = [unit.full.untyped_storage().nbytes() for unit in engine.units]
    loss.backward()
    after_backward = [unit.full.untyped_storage().nbytes() for unit in engine.units]
    return [unit.name for unit in engine.units], after_forward, after_backward, [u.entered for u in engine.units]


def mark_entry(unit, module, args):
    unit.entered = unit.full.untyped_storage().nbytes()
    with trace.span("enter", stage=unit.index):
        pass


@pytest.mark.timeout(60)
def test_unshards_unit_by_unit_right_before_use_and_reshards_after(cluster2):
    """Without prefetch (``prefetch=False``) every collective runs where it is needed."""
    # units: 0 the root (tied embedding/output weight, scale), 1 block.0, 2 block.2, 3 norm
    forward = [("all-gather", u) if i % 2 == 0 else ("enter", u) for u in range(4) for i in range(2)]
    flows = {  # backward: the root first (its output), then each unit's unshard right before its reduce-scatter
        "FULL_SHARD": forward + [("all-gather", 0), ("all-gather", 3), ("reduce-scatter", 3),
                                 ("all-gather", 2), ("reduce-scatter", 2), ("all-gather", 1), ("reduce-scatter", 1),
                                 ("reduce-scatter", 0)],
        "SHARD_GRAD_OP": forward + [("reduce-scatter", u) for u in (3, 2, 1, 0)],
    }
    for strategy, flow in flows.items():
        timeline = cluster2.trace(watched_step, strategy, False, timeout=60)
        for rank, (names, after_forward, after_backward, entered) in enumerate(timeline.results):
            assert names == ["", "block.0", "block.2", "norm"]
            spans = [(ev.name, ev.stage) for ev in timeline.select(rank=rank) if ev.name in ("all-gather", "enter",
                                                                                            "reduce-scatter")]
            assert spans == flow, strategy
            assert_unsharded_in_use_and_resharded_after(strategy, after_forward, after_backward, entered)


@pytest.mark.timeout(60)
def test_prefetch_unshards_the_next_unit_before_this_one_computes(cluster2):
    """With prefetch (the default) the collectives run on the communication thread, one at a
    time in the order they were started: in forward each unit's entry starts the next unit's
    all-gather; in backward each unit's (the reverse of the order the units returned from
    forward: root, norm, block.2, block.0) starts the next one's before its own backward, and
    a unit's reduce-scatter runs while the next unit computes. A unit still enters unsharded."""
    forward = [("all-gather", u) for u in range(4)]
    flows = {
        "FULL_SHARD": forward + [("all-gather", 0), ("all-gather", 3), ("all-gather", 2), ("reduce-scatter", 3),
                                 ("all-gather", 1), ("reduce-scatter", 2), ("reduce-scatter", 1),
                                 ("reduce-scatter", 0)],
        "SHARD_GRAD_OP": forward + [("reduce-scatter", u) for u in (3, 2, 1, 0)],
    }
    for strategy, flow in flows.items():
        timeline = cluster2.trace(watched_step, strategy, True, timeout=60)
        for rank, (_, after_forward, after_backward, entered) in enumerate(timeline.results):
            collectives = [ev for ev in timeline.select(rank=rank) if ev.name in ("all-gather", "reduce-scatter")]
            assert [(ev.name, ev.stage) for ev in collectives] == flow, strategy
            assert all(earlier.end <= later.start for earlier, later in zip(collectives, collectives[1:]))
            enters = timeline.select(rank=rank, name="enter")
            assert [ev.stage for ev in enters] == [0, 1, 2, 3]
            for unit, enter in enumerate(enters):  # entered after its first all-gather ended
                assert collectives[unit].end <= enter.start
            assert_unsharded_in_use_and_resharded_after(strategy, after_forward, after_backward, entered)


def assert_unsharded_in_use_and_resharded_after(strategy, after_forward, after_backward, entered):
    assert all(entered), "a unit computed without its parameters"
    assert all(after_backward[u] == 0 for u in range(4)), "full parameters kept after backward"
    if strategy == "FULL_SHARD":
        assert after_forward == [0] * 4, "full parameters kept between forward and backward"
    else:
        assert after_forward == entered, "SHARD_GRAD_OP must keep the unsharded parameters for backward"


# --- mixed precision, deferred init ----------------------------------------------------------


def mixed_precision_reference(world_size, steps=STEPS):
    """One process doing FSDP's casts and reduction: a bf16 copy of the fp32 master computes
    forward and backward on each rank's part of the batch, the parts' bf16 gradients are
    averaged in bf16, cast to fp32 and step the master."""
    master = build(seed=0)
    optimizer = SGD[0](master.parameters(), **SGD[1])
    for _ in range(steps):
        compute = copy.deepcopy(master).to(torch.bfloat16)
        parts = []
        for tokens, targets in zip(*(part.chunk(world_size) for part in full_batch())):
            compute.zero_grad()
            loss_on(compute, tokens, targets).backward()
            parts.append([p.grad for p in compute.parameters()])
        for p, *grads in zip(master.parameters(), *parts):
            p.grad = (sum(grads[1:], grads[0]) / world_size).float()
        optimizer.step()
    return {name: p.detach().clone() for name, p in master.named_parameters()}


def train_in_bf16():
    engine = FSDP(build(seed=0), SGD[0], mixed_precision=torch.bfloat16, **SGD[1])
    seen = []
    block = engine.module.block[0]
    block.register_forward_hook(lambda module, args, out: seen.append((module.weight.dtype, out.dtype)))
    train(engine)
    # the reference runs here: the same process settings (threads) give the same bf16 kernels
    reference = mixed_precision_reference(dist.get_world_size())
    masters = {s.dtype for s in engine.shards} | {s.grad.dtype for s in engine.shards}
    return engine.full_parameters(), reference, seen[0], masters


@pytest.mark.timeout(60)
def test_bf16_computes_in_bf16_and_keeps_fp32_masters(cluster2):
    for parameters, reference_casts, compute_dtypes, master_dtypes in cluster2.run(train_in_bf16, timeout=60):
        assert compute_dtypes == (torch.bfloat16, torch.bfloat16) and master_dtypes == {torch.float32}
        # On 2 ranks the bf16 reduction is one bf16 addition and a halving, as in the reference,
        # so the same bf16 arithmetic happens on the same numbers: bit for bit. (On more
        # ranks the ring adds in another order and bf16 rounding, 2^-8 relative, would differ.)
        assert_identical(parameters, reference_casts, "bf16 FSDP vs one process's casts")
        fp32_band = rounding_band(reference("sgd"), ring_arithmetic("sgd", 2))[0]  # bf16 does differ from fp32
        assert max_abs_difference(parameters, reference("sgd")) > fp32_band, "no bf16 in the run?"


def init_scale(module):
    """The deferred init: reset_parameters where there is one, the root's own scale by hand."""
    if isinstance(module, Toy):
        nn.init.normal_(module.scale, 1.0, 0.1)
    else:
        module.reset_parameters()


def deferred_init(wrap_policy):
    with torch.device("meta"):
        model = Toy(dim=16, hidden=40)
    slots = [(m, name) for m in model.modules() for name, _ in m.named_parameters(recurse=False)]
    live = []

    def watched_init(module):  # bytes of all materialised parameters while a module is initialised
        live.append(storage_bytes([t for t in (getattr(m, name) for m, name in slots) if not t.is_meta]))
        init_scale(module)

    engine = FSDP(model, ADAM[0], wrap_policy=wrap_policy, init_fn=watched_init, init_seed=7, **ADAM[1])
    initial = engine.full_parameters()
    train(engine)
    return initial, engine.full_parameters(), max(live)


@pytest.mark.timeout(60)
def test_deferred_init_materialises_one_unit_at_a_time(cluster2):
    wrap_policy = "per_layer"
    model = init_by_unit(Toy(dim=16, hidden=40), wrap_policy, init_fn=init_scale, seed=7)
    initial = parameters_of(model)
    unit_bytes = [4 * sum(p.numel() for p in plan.parameters) for plan in plan_units(model, wrap_policy)]
    trained = parameters_of(one_process("adam", model=copy.deepcopy(model))[0])
    decomposed = [parameters_of(one_process("adam", shards=2, order=order, model=copy.deepcopy(model))[0])
                  for order in ring_orders(2)]
    for rank, (start, end, peak) in enumerate(cluster2.run(deferred_init, wrap_policy, timeout=60)):
        assert_identical(start, initial, f"rank {rank}, initial parameters")  # the same seeds, unit by unit
        assert_equivalent(end, trained, decomposed, f"rank {rank}, trained")
        assert peak == max(unit_bytes) < sum(unit_bytes) / 2  # one unit at a time, never the model


# --- state dicts ------------------------------------------------------------------------------


def resume(tmp_path):
    """2 steps, save full and sharded state, 3 more steps; two fresh engines (other seeds,
    one NO_SHARD) load the saved states and take the same 3 steps."""
    engine = train(FSDP(build(seed=0), ADAM[0], wrap_policy="per_layer", **ADAM[1]), 2)
    full = checkpoint.full_state_dict(engine)
    checkpoint.save_full(engine, tmp_path / "full.pt")
    checkpoint.save_sharded(engine, tmp_path / "sharded")
    train(engine, 3)
    from_full = FSDP(build(seed=3), ADAM[0], strategy="NO_SHARD", **ADAM[1])
    checkpoint.load_full(from_full, tmp_path / "full.pt")
    from_shards = FSDP(build(seed=4), ADAM[0], wrap_policy="per_layer", **ADAM[1])
    checkpoint.load_sharded(from_shards, tmp_path / "sharded")
    try:
        other_units = FSDP(build(seed=0), ADAM[0], **ADAM[1])
        checkpoint.load_sharded_state_dict(other_units, checkpoint.sharded_state_dict(engine))
    except ValueError as error:
        mismatch = str(error)
    return (full, engine.full_parameters(), train(from_full, 3).full_parameters(),
            train(from_shards, 3).full_parameters(), mismatch)


@pytest.mark.timeout(60)
def test_full_state_dict_is_one_process_state_and_both_resume_exactly(cluster2, tmp_path):
    results = cluster2.run(resume, tmp_path, timeout=60)
    full = results[0][0]
    model, optimizer = one_process("adam", steps=2)
    decomposed = [one_process("adam", 2, 2, order) for order in ring_orders(2)]
    assert_equivalent(full["model"], model.state_dict(), [m.state_dict() for m, _ in decomposed],
                      "full state dict vs one process's model")
    expected = optimizer.state_dict()
    assert full["optimizer"]["param_groups"] == expected["param_groups"]
    for index, state in expected["state"].items():
        for key, value in state.items():  # each on its own scale: exp_avg_sq is about exp_avg squared
            in_ring_orders = [o.state_dict()["state"][index][key] for _, o in decomposed]
            saved = full["optimizer"]["state"][index][key]
            assert_equivalent(saved, value, in_ring_orders, f"{key} of parameter {index}")
        for value in full["optimizer"]["state"][index].values():  # its own storage, not the unit's
            assert value.untyped_storage().nbytes() == value.numel() * value.element_size()
    continued = parameters_of(one_process("adam", 3, start=full)[0])  # a plain model and optimizer load it
    continued_decomposed = [parameters_of(one_process("adam", 3, 2, order, start=full)[0])
                            for order in ring_orders(2)]
    for rank, (saved, trained, from_full, from_shards, mismatch) in enumerate(results):
        assert saved is None if rank else saved is not None
        assert_equivalent(trained, continued, continued_decomposed, f"rank {rank}, never stopped")
        assert_equivalent(from_full, continued, continued_decomposed, f"rank {rank}, resumed from the full state dict")
        assert_identical(from_shards, trained, f"rank {rank}, resumed from the sharded state dict")  # same engine
        assert "load it with the same world size, strategy and units" in mismatch


# --- wrap policies and learner errors ---------------------------------------------------------


def test_wrap_policies_pick_units_and_tied_weights_go_to_the_unit_around_both_uses():
    model = build(seed=0)
    units = lambda policy: {plan.name: plan.names for plan in plan_units(model, policy)}  # noqa: E731
    root = ["scale", "embedding.weight"]  # the tied weight is used by embedding and output
    assert units(None) == {"": root, "block": ["block.0.weight", "block.0.bias", "block.2.weight", "block.2.bias"],
                           "norm": ["norm.weight", "norm.bias"]}
    assert list(units("per_layer")) == ["", "block.0", "block.2", "norm"]
    assert list(units(min_params(50))) == ["", "block.0", "block.2"]  # 63 and 60 parameters; norm's 12 stay
    assert units(lambda m: isinstance(m, nn.LayerNorm)) == {
        "": root + ["block.0.weight", "block.0.bias", "block.2.weight", "block.2.bias"],
        "norm": ["norm.weight", "norm.bias"]}


def hybrid_error(world_size):
    with pytest.raises(ValueError) as error:
        _shard_group_size("HYBRID_SHARD", world_size, None)
    return str(error.value)


def learner_errors():
    frozen = build(seed=0)
    frozen.norm.requires_grad_(False)
    with torch.device("meta"):
        no_reset = nn.Sequential(nn.Linear(2, 2), Toy())
    attempts = {
        "strategy": lambda: FSDP(build(seed=0), torch.optim.SGD, strategy="ZERO3", lr=0.1),
        "shard_group_size": lambda: FSDP(build(seed=0), torch.optim.SGD, strategy="HYBRID_SHARD", shard_group_size=3),
        "not hybrid": lambda: FSDP(build(seed=0), torch.optim.SGD, shard_group_size=1, lr=0.1),
        "precision": lambda: FSDP(build(seed=0), torch.optim.SGD, mixed_precision=torch.float64, lr=0.1),
        "frozen": lambda: FSDP(frozen, torch.optim.SGD, lr=0.1),
        "policy": lambda: FSDP(build(seed=0), torch.optim.SGD, wrap_policy="per_block", lr=0.1),
        "min_params": lambda: FSDP(build(seed=0), torch.optim.SGD, wrap_policy=min_params(0), lr=0.1),
        "init_fn": lambda: FSDP(build(seed=0), torch.optim.SGD, init_fn=init_scale, lr=0.1),
        "reset_parameters": lambda: FSDP(no_reset, torch.optim.SGD, lr=0.1),
    }
    messages = {}
    for name, attempt in attempts.items():
        try:
            attempt()
        except ValueError as error:
            messages[name] = str(error)
    return messages


def test_learner_errors_say_what_to_change(cluster2):
    assert "use an even world size, pass shard_group_size=S" in hybrid_error(3)
    messages = cluster2.run(learner_errors, timeout=60)[0]
    expected = {
        "strategy": "strategy must be one of 'FULL_SHARD'", "shard_group_size": "must divide the world size 2",
        "not hybrid": "drop the argument", "precision": "torch.bfloat16 or torch.float16",
        "frozen": "unfreeze them", "policy": "min_params(n) or a function", "min_params": "n >= 1",
        "init_fn": "build the model under `with torch.device('meta'):`", "reset_parameters": "pass init_fn=fn",
    }
    assert messages.keys() == expected.keys()
    for name, text in expected.items():
        assert text in messages[name], (name, messages[name])


# --- no_sync: gradient accumulation without communication; closing HYBRID_SHARD's groups ----

INTEGER_BATCH, MICROBATCHES = 16, 2


def integer_chain():
    """Linear -> ReLU -> Linear with small integer weights: on integer inputs, with losses and
    averages scaled by powers of two, every gradient and SGD step below is exact in fp32, so
    any order of additions gives the same bits."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3))
    for p in model.parameters():
        p.data = torch.randint(-2, 3, p.shape).float()
    return model


def integer_batch():
    return torch.randint(-3, 4, (INTEGER_BATCH, 4), generator=torch.Generator().manual_seed(5)).float()


def integer_loss(out, share):
    return out.sum() * 2.0**-4 / share


def integer_one_process(steps, world_size):
    model = integer_chain()
    optimizer = torch.optim.SGD(model.parameters(), lr=2.0**-6)
    for _ in range(steps):
        optimizer.zero_grad()
        integer_loss(model(integer_batch()), world_size * MICROBATCHES).backward()  # as the ranks' average
        optimizer.step()
    return parameters_of(model)


def accumulate_with_no_sync(strategy, steps=2):
    """``steps`` steps of MICROBATCHES micro-batches on this rank's shard, all but the last
    inside no_sync; the full gradients held after the no_sync backward; the reduce-scatters."""
    engine = FSDP(integer_chain(), torch.optim.SGD, strategy=strategy, wrap_policy="per_layer", lr=2.0**-6)
    micro = integer_batch().chunk(dist.get_world_size())[dist.get_rank()].chunk(MICROBATCHES)
    share = MICROBATCHES  # each micro-batch's loss / M; the ranks' average divides by N_d
    with trace.span("steps"):
        for _ in range(steps):
            engine.zero_grad()
            with engine.no_sync():
                integer_loss(engine(micro[0]), share).backward()
            held = engine.model_state_bytes().grads
            integer_loss(engine(micro[1]), share).backward()
            engine.step()
    parameters = engine.full_parameters()
    engine.close()
    return parameters, held, sum(4 * unit.layout.padded_numel for unit in engine.units), len(engine.units)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world", ["cluster2", "cluster4"])
def test_no_sync_accumulates_locally_and_reduces_once_like_one_process(world, request):
    cluster = request.getfixturevalue(world)
    steps, expected = 2, integer_one_process(2, cluster.world_size)
    strategies = ["FULL_SHARD", "SHARD_GRAD_OP"] + (["HYBRID_SHARD"] if cluster.world_size == 4 else [])
    for strategy in strategies:
        timeline = cluster.trace(accumulate_with_no_sync, strategy, steps, timeout=60)
        for rank, (parameters, held, full_gradient_bytes, units) in enumerate(timeline.results):
            assert_identical(parameters, expected, f"rank {rank}, {strategy}")
            assert held == full_gradient_bytes  # every unit's full gradient, no shard gradient yet
            # one reduction per unit and step: on the last micro-batch only
            assert len(timeline.select(rank=rank, name="reduce-scatter")) == steps * units, strategy
    assert not torch.equal(expected["0.weight"], integer_chain()[0].weight.detach())  # the steps moved it


def hybrid_groups_opened_and_closed(engines):
    world = dist.distributed_c10d._world
    before = len(world.pg_map)
    during = []
    for _ in range(engines):
        engine = FSDP(integer_chain(), torch.optim.SGD, strategy="HYBRID_SHARD", lr=0.1)
        during.append(len(world.pg_map))
        engine.close()
        engine.close()  # a second close is a no-op
    return before, during, len(world.pg_map)


@pytest.mark.timeout(60)
def test_a_closed_hybrid_shard_engine_leaves_no_process_groups(cluster4):
    for before, during, after in cluster4.run(hybrid_groups_opened_and_closed, 3, timeout=60):
        assert during == [before + 2] * 3  # this rank's shard group and replicate group
        assert after == before
