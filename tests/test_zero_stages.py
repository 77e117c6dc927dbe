"""parlab.zero.ZeroDP on real ranks: stages 0, 1 and 2 train exactly like one process on the
full batch (Adam and SGD with momentum, uneven sizes so the flat buffer is padded, a frozen
layer) and like torch's ZeroRedundancyOptimizer; the bytes each rank holds match the ZeRO
paper's formula; the traffic of a step is the ring's, counted from the trace."""

import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer

from parlab import trace
from parlab.memory import model_state_bytes, ring_traffic_bytes
from parlab.numerics import assert_equivalent, assert_within, backward_in_shards, ring_orders, rounding_band
from parlab.zero import ZeroDP

IN, HIDDEN, OUT, BATCH, STEPS = 6, 9, 5, 24, 5  # 63 + 50 = 113 trainable parameters: padded at N_d = 2, 4
OPTIMIZERS = {
    "Adam": (torch.optim.Adam, dict(lr=1e-2)),
    "SGD momentum": (torch.optim.SGD, dict(lr=0.1, momentum=0.9)),
}


class Toy(nn.Module):
    """Linear -> tanh -> frozen Linear x buffer -> Linear."""

    def __init__(self):
        super().__init__()
        self.first = nn.Linear(IN, HIDDEN)
        self.frozen = nn.Linear(HIDDEN, HIDDEN).requires_grad_(False)
        self.last = nn.Linear(HIDDEN, OUT)
        self.register_buffer("scale", 1 + 0.1 * torch.randn(HIDDEN))

    def forward(self, x):
        return self.last(self.frozen(torch.tanh(self.first(x))) * self.scale)


def build_toy(seed):
    torch.manual_seed(seed)
    return Toy()


def full_batch():
    generator = torch.Generator().manual_seed(1234)
    return torch.randn(BATCH, IN, generator=generator), torch.randn(BATCH, OUT, generator=generator)


def my_shard():
    return [part.chunk(dist.get_world_size())[dist.get_rank()] for part in full_batch()]


@functools.cache
def reference_parameters(optimizer_name, shards=1, order=None):
    """One process, the plain optimizer over model.parameters(), the full batch; with
    ``shards`` > 1, the ranks' arithmetic: the shards' gradients summed in ``order``."""
    model = build_toy(seed=0)
    optimizer_class, options = OPTIMIZERS[optimizer_name]
    optimizer = optimizer_class(model.parameters(), **options)
    parts = list(zip(*(part.chunk(shards) for part in full_batch())))
    for _ in range(STEPS):
        backward_in_shards(lambda x, y: F.mse_loss(model(x), y), model.parameters(), parts, order)
        optimizer.step()
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def ring_arithmetic(optimizer_name, world_size):
    """The yardstick's runs (parlab.numerics): one per order in which a ring sums the shards."""
    return [reference_parameters(optimizer_name, world_size, tuple(order)) for order in ring_orders(world_size)]


def train_zero(stage, optimizer_name, steps=STEPS):
    """On every rank: a toy initialised from this rank's seed (the engine must use rank 0's),
    trained ``steps`` steps on this rank's shard."""
    optimizer_class, options = OPTIMIZERS[optimizer_name]
    engine = ZeroDP(build_toy(seed=dist.get_rank()), optimizer_class, stage=stage, **options)
    for _ in range(steps):
        engine.zero_grad()
        F.mse_loss(engine(my_shard()[0]), my_shard()[1]).backward()
        engine.step()
    return engine


def train_every_stage():
    return {(stage, name): train_zero(stage, name).full_parameters() for stage in (0, 1, 2) for name in OPTIMIZERS}


def assert_like_one_process(actual, optimizer_name, world_size, label):
    assert_equivalent(actual, reference_parameters(optimizer_name), ring_arithmetic(optimizer_name, world_size), label)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world", ["cluster2", "cluster4"])
def test_every_stage_trains_like_one_process_on_the_full_batch(world, request):
    cluster = request.getfixturevalue(world)
    results = cluster.run(train_every_stage, timeout=60)
    initial = dict(build_toy(seed=0).named_parameters())
    for name in OPTIMIZERS:
        expected = reference_parameters(name)
        assert (expected["first.weight"] - initial["first.weight"]).abs().max() > 1e-2  # it trained
        assert torch.equal(expected["frozen.weight"], initial["frozen.weight"])
        for rank, per_stage in enumerate(results):
            for stage in (0, 1, 2):
                label = f"rank {rank}, stage {stage}, {name}"
                assert_like_one_process(per_stage[stage, name], name, cluster.world_size, label)


def stage1_and_torch_zero_redundancy_optimizer():
    ours = train_zero(1, "Adam").full_parameters()
    model = build_toy(seed=dist.get_rank())
    ddp = nn.parallel.DistributedDataParallel(model)
    optimizer = ZeroRedundancyOptimizer(
        [p for p in model.parameters() if p.requires_grad], optimizer_class=torch.optim.Adam, **OPTIMIZERS["Adam"][1]
    )
    for _ in range(STEPS):
        optimizer.zero_grad()
        F.mse_loss(ddp(my_shard()[0]), my_shard()[1]).backward()
        optimizer.step()
    return ours, {name: p.detach().clone() for name, p in model.named_parameters()}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world", ["cluster2", "cluster4"])
def test_stage_1_equals_torch_zero_redundancy_optimizer(world, request):
    cluster = request.getfixturevalue(world)
    band = rounding_band(reference_parameters("Adam"), ring_arithmetic("Adam", cluster.world_size))[0]
    for rank, (ours, theirs) in enumerate(cluster.run(stage1_and_torch_zero_redundancy_optimizer, timeout=60)):
        assert_like_one_process(theirs, "Adam", cluster.world_size, f"rank {rank}, ZeroRedundancyOptimizer")
        assert_within(ours, theirs, 2 * band, f"rank {rank}, stage 1 vs ZeroRedundancyOptimizer",
                      "2 x the band, as both are within it of one process")


# --- memory: measured bytes against the ZeRO paper's formula --------------------------------

WIDE = (200, 250, 199)  # 50 250 + 49 949 = 100 199 parameters


def measured_bytes_after_one_step():
    results = {}
    for stage in (0, 1, 2):
        for name, (optimizer_class, options) in OPTIMIZERS.items():
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(WIDE[0], WIDE[1]), nn.Tanh(), nn.Linear(WIDE[1], WIDE[2]))
            engine = ZeroDP(model, optimizer_class, stage=stage, **options)
            engine.zero_grad()
            engine(torch.randn(4, WIDE[0])).square().mean().backward()
            engine.step()
            grads_held = [p.grad is not None for p in model.parameters()]
            results[stage, name] = (engine.model_state_bytes(), engine.layout.padded_numel, grads_held)
    return results


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world", ["cluster2", "cluster4"])
def test_measured_model_state_bytes_match_the_formula(world, request):
    cluster = request.getfixturevalue(world)
    N = cluster.world_size
    psi = WIDE[0] * WIDE[1] + WIDE[1] + WIDE[1] * WIDE[2] + WIDE[2]
    kappa = {"Adam": 8, "SGD momentum": 4}  # optimizer-state bytes per parameter
    for rank, results in enumerate(cluster.run(measured_bytes_after_one_step, timeout=60)):
        for (stage, name), (measured, padded, grads_held) in results.items():
            # Exactly the formula for the padded flat buffer, plus Adam's step count (one fp32 scalar). At
            # stage 0 the optimizer steps the 4 parameters, as DDP + Adam: kappa Psi, unpadded, 4 step counts.
            assert 0 < padded - psi < N  # WIDE needs padding at N_d = 2 and 4
            formula = model_state_bytes(padded, stage, N, kappa=kappa[name], param_bytes=4, grad_bytes=4)
            if stage == 0:
                formula = formula._replace(optimizer=model_state_bytes(psi, 0, N, kappa=kappa[name]).optimizer)
            step_count = (4 if stage == 0 else 1) * 4 if name == "Adam" else 0
            assert (measured.params, measured.grads, measured.optimizer) == (
                formula.params, formula.grads, formula.optimizer + step_count), (rank, stage, name)
            assert all(grads_held) == (stage < 2) and any(grads_held) == (stage < 2)


# --- traffic: the ring's exact bytes ---------------------------------------------------------


def traced_steps(stage, steps):
    engine = ZeroDP(build_toy(seed=0), torch.optim.Adam, stage=stage)
    with trace.span("steps"):
        for _ in range(steps):
            engine.zero_grad()
            F.mse_loss(engine(my_shard()[0]), my_shard()[1]).backward()
            engine.step()
    return engine.layout.padded_numel


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world", ["cluster2", "cluster4"])
def test_a_step_sends_the_ring_bytes_of_a_reduce_scatter_and_an_all_gather(world, request):
    cluster = request.getfixturevalue(world)
    N, steps = cluster.world_size, 2
    for stage in (0, 1, 2):
        timeline = cluster.trace(traced_steps, stage, steps, timeout=60)
        padded = timeline.results[0]
        assert padded == 116 if N == 4 else padded == 114
        for rank in range(N):
            start = timeline.select(rank=rank, name="steps")[0].start
            sent = sum(ev.nbytes for ev in timeline.select(rank=rank, kind="comm")
                       if ev.name in ("send", "isend") and ev.start >= start)
            assert sent == steps * ring_traffic_bytes(padded, N, 4, stage) == steps * 2 * (N - 1) * padded * 4 / N
            # stage 0: one all-reduce per bucket (one bucket for the toy), stages 1 and 2: one reduce-scatter
            name = "all-reduce gradients" if stage == 0 else "reduce-scatter gradients"
            assert len(timeline.select(rank=rank, name=name)) == steps


# --- mistakes ----------------------------------------------------------------------------------


def step_after_model_zero_grad():
    engine = ZeroDP(build_toy(seed=0), torch.optim.SGD, stage=1, lr=0.1)
    engine.module.zero_grad()
    F.mse_loss(engine(my_shard()[0]), my_shard()[1]).backward()
    try:
        engine.step()
    except ValueError as error:
        return str(error)


@pytest.mark.timeout(30)
def test_learner_mistakes_are_explained(cluster2):
    with pytest.raises(ValueError, match="stage 3 .* is parlab.zero.FSDP"):
        ZeroDP(Toy(), torch.optim.Adam, stage=3)
    with pytest.raises(ValueError, match="stages 0, 1 and 2"):
        ZeroDP(Toy(), torch.optim.Adam, stage="os")
    model = Toy()
    with pytest.raises(ValueError, match="pass the class"):
        ZeroDP(model, torch.optim.Adam(model.parameters()), stage=1)
    with pytest.raises(ValueError, match="pass the class"):
        ZeroDP(model, nn.Linear, stage=1)
    with pytest.raises(ValueError, match="no trainable parameters"):
        ZeroDP(Toy().requires_grad_(False), torch.optim.Adam)
    assert all("engine.zero_grad()" in message for message in cluster2.run(step_after_model_zero_grad, timeout=30))
