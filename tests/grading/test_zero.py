"""Graded: ZeRO stage 1's sharded optimizer and stage 2's reduce-scatter of gradients (``zero.py``).

``ShardedOptimizer`` trains a toy MLP (Psi = 901 parameters: the flat buffer is padded at
4 ranks) with Adam for 5 steps at 2 and 4 ranks, every replica starting from its own seed
and reading its own shard of the batch, the gradients averaged by an all-reduce as DDP
would; after every step each rank's parameters are compared with Adam on one process over
the full batch, within the rounding band of ``parlab.numerics`` (twice what one process
differs by when it averages the shards' gradients as the ranks do, plus 16 roundings of the
largest parameter: Adam amplifies the rounding of gradients near zero). At 4 ranks it
trains again on gradient shards handed over as stage 2 does (by parlab's own
reduce-scatter). The optimizer state each rank holds is measured
(``parlab.memory.storage_bytes``) and must be about 8 Psi / N_d bytes, and the step's
traffic, read from the trace, must be one all-gather of the parameters.

``reduce_scatter_gradients`` is called on two batches in turn at 2 and 4 ranks: the shard
it returns must equal this rank's shard of the full-batch gradient; afterwards the rank
must hold no full-size gradient, and it must have sent a reduce-scatter's bytes, not an
all-reduce's.
"""

import functools
import importlib

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from parlab import trace
from parlab.flat import FlatLayout, reduce_scatter
from parlab.memory import storage_bytes
from parlab.numerics import backward_in_shards, max_abs_difference, ring_orders, rounding_band

RUN_TIMEOUT_S = 10
# The first torch optimizer a process builds imports torch._dynamo: seconds per rank on a
# busy machine. Each rank does it beforehand under this timeout, so that a hang in the
# learner's code still ends after RUN_TIMEOUT_S.
IMPORT_TIMEOUT_S = 60
WORLD_SIZES = [2, 4]
IN, HIDDEN, OUT, BATCH, STEPS, LR = 8, 64, 5, 24, 5, 1e-2
PSI = IN * HIDDEN + HIDDEN + HIDDEN * OUT + OUT  # 901
KAPPA_ADAM, FP32 = 8, 4  # bytes per parameter: Adam's exp_avg and exp_avg_sq (kappa); an fp32 gradient
MEMORY_TOLERANCE = 0.02  # Adam's step counters and the padding: under 1% here
SEND_OPS = ("send", "isend")


def ranks(world_size):
    return f"{world_size} ranks"


@pytest.mark.task("sharded_optimizer")
class TestShardedOptimizer:
    @pytest.mark.points(1)
    @pytest.mark.parametrize("cluster", WORLD_SIZES, indirect=True, ids=ranks)
    def test_trains_like_adam_on_one_process(self, cluster, impl):
        per_rank = run_sharded(cluster, impl, STEPS)
        check_training([record["steps"] for record in per_rank], cluster.world_size)

    @pytest.mark.points(1)
    def test_steps_on_a_reduce_scattered_gradient(self, cluster4, impl):
        per_rank = run_sharded(cluster4, impl, STEPS, stage=2)
        check_training([record["steps"] for record in per_rank], 4, stage=2)

    @pytest.mark.points(1)
    @pytest.mark.parametrize("cluster", WORLD_SIZES, indirect=True, ids=ranks)
    def test_holds_one_shard_of_the_optimizer_state(self, cluster, impl):
        N = cluster.world_size
        per_rank = run_sharded(cluster, impl, 1)
        expected = KAPPA_ADAM * PSI / N
        for rank, record in enumerate(per_rank):
            held = record["optimizer_state_bytes"]
            if abs(held - expected) <= MEMORY_TOLERANCE * expected:
                continue
            if held >= (1 - MEMORY_TOLERANCE) * KAPPA_ADAM * PSI:
                assert False, (
                    f"{N} ranks: rank {rank} holds the full optimizer state ({held} bytes, expected about "
                    f"{expected:g} = 8 Psi / N_d): build the optimizer over this rank's shard only"
                )
            assert False, (
                f"{N} ranks: rank {rank} holds {held} bytes of optimizer state after a step, expected about "
                f"{expected:g} = 8 Psi / N_d (Psi = {PSI}): Adam's state for self.shard, one shard of the parameters"
            )

    @pytest.mark.points(1)
    def test_all_gathers_the_updated_parameters(self, cluster4, impl):
        timeline = run_sharded(cluster4, impl, 1, traced=True)
        formula = "(N_d - 1)/N_d x 4 x padded Psi, one all-gather of the parameters"
        check_bytes_sent(timeline, "step", ring_bytes(4), formula, {
            0: "nothing was traced; all-gather self.flat_param with the provided all_gather",
            2 * ring_bytes(4): "an all-reduce's worth; every rank's own shard is already up to date, all_gather the "
                               "rest",
        })


@pytest.mark.task("reduce_scatter_gradients")
class TestReduceScatterGradients:
    @pytest.mark.points(1)
    @pytest.mark.parametrize("cluster", WORLD_SIZES, indirect=True, ids=ranks)
    def test_gives_this_ranks_shard_of_the_averaged_gradient(self, cluster, impl):
        per_rank = cluster.run(reduce_scatter_on_rank, impl.reduce_scatter_gradients, timeout=RUN_TIMEOUT_S)
        check_gradient_shards(per_rank, cluster.world_size)

    @pytest.mark.points(1)
    def test_keeps_no_full_size_gradient(self, cluster4, impl):
        per_rank = cluster4.run(reduce_scatter_on_rank, impl.reduce_scatter_gradients, timeout=RUN_TIMEOUT_S)
        layout = flat_layout(4)
        expected = FP32 * layout.shard_numel
        for rank, calls in enumerate(per_rank):
            for call in calls:
                if call["full_gradients_left"]:
                    assert False, (
                        f"4 ranks: rank {rank} still holds {call['full_gradients_left']} full-size p.grad after "
                        "reduce_scatter_gradients: set every p.grad to None once the shard is taken"
                    )
                held = call["gradient_bytes"]
                if held == expected:
                    continue
                hint = ""
                if held >= FP32 * layout.padded_numel:
                    hint = ": the shard keeps the full flat gradient alive; return a copy (clone()), not a view of it"
                assert False, (
                    f"4 ranks: rank {rank} holds {held} bytes of gradient after reduce_scatter_gradients, "
                    f"expected {expected} = 4 Psi / N_d (its shard){hint}"
                )

    @pytest.mark.points(1)
    def test_sends_a_reduce_scatter_not_an_all_reduce(self, cluster4, impl):
        timeline = cluster4.trace(reduce_scatter_on_rank, impl.reduce_scatter_gradients, timeout=RUN_TIMEOUT_S)
        reduce_scatters = 2 * ring_bytes(4)  # two calls
        check_bytes_sent(timeline, "reduce_scatter_gradients", reduce_scatters,
                         "2 x (N_d - 1)/N_d x 4 x padded Psi, one reduce-scatter of the gradients per call", {
            0: "nothing was traced; reduce-scatter with the provided reduce_scatter",
            2 * reduce_scatters: "that is an all-reduce, twice a reduce-scatter; each rank needs only its own shard "
                                 "of the average: reduce_scatter(flat, layout, rank)",
        })


# --- The model, the data and one process's reference --------------------------------------


def build_model(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, OUT))


def full_batch(index=0):
    generator = torch.Generator().manual_seed(1234 + index)
    return torch.randn(BATCH, IN, generator=generator), torch.randn(BATCH, OUT, generator=generator)


def shard(rank, world_size, index=0):
    inputs, targets = full_batch(index)
    return inputs[rank::world_size], targets[rank::world_size]


def flat_layout(world_size):
    return FlatLayout([p.shape for p in build_model(0).parameters()], world_size)


def snapshot(model):
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def gradient_of(model, inputs, targets):
    """The gradient of the mean loss over ``inputs`` on one process, flat (unpadded)."""
    model.zero_grad()
    F.mse_loss(model(inputs), targets).backward()
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


@functools.cache
def adam_reference(world_size=1, order=None):
    """Parameters after each of STEPS Adam steps of one process on the full batch; with
    world_size > 1 on the ranks' arithmetic (parlab.numerics: the shards' gradients summed
    in ``order``, divided by N_d), the runs the rounding band is measured with."""
    model = build_model(seed=0)
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    shards = [shard(rank, world_size) for rank in range(world_size)]
    after = []
    for _ in range(STEPS):
        backward_in_shards(lambda x, y: F.mse_loss(model(x), y), model.parameters(), shards, order)
        optimizer.step()
        after.append(snapshot(model))
    return after


@functools.cache
def parameter_bands(world_size):
    """After each step, how far from ``adam_reference()`` rounding may take the ranks:
    parlab.numerics' band from the runs in each ring order."""
    in_orders = [adam_reference(world_size, tuple(order)) for order in ring_orders(world_size)]
    return [rounding_band(expected, [run[step] for run in in_orders])[0]
            for step, expected in enumerate(adam_reference())]


@functools.cache
def gradient_reference(world_size, index):
    """(full-batch gradient, each rank's own shard gradient, the band rounding allows around
    the full-batch one), padded flat, for batch ``index``. The band is parlab.numerics': one
    process averaging the shards' gradients in each ring order."""
    layout, model = flat_layout(world_size), build_model(seed=0)
    pad = layout.padded_numel - layout.numel
    full = F.pad(gradient_of(model, *full_batch(index)), (0, pad))
    shards = [shard(rank, world_size, index) for rank in range(world_size)]
    local = [F.pad(gradient_of(model, *part), (0, pad)) for part in shards]
    in_orders = [F.pad(torch.cat([g.reshape(-1) for g in backward_in_shards(
        lambda x, y: F.mse_loss(model(x), y), model.parameters(), shards, order)]), (0, pad))
        for order in ring_orders(world_size)]
    return full, local, rounding_band(full, in_orders)[0]


# --- On the ranks -------------------------------------------------------------------------


def run_sharded(cluster, impl, steps, stage=1, traced=False):
    """``train_on_rank`` on the cluster (run, or traced), after two preparations: the
    learner's constructor is tried with a stand-in optimizer (an unwritten one fails at
    once), then every rank imports what torch's optimizers need, under its own timeout."""
    cluster.run(construct_on_rank, impl.ShardedOptimizer, timeout=RUN_TIMEOUT_S)
    cluster.run(import_optimizer_machinery, timeout=IMPORT_TIMEOUT_S)
    call = cluster.trace if traced else cluster.run
    return call(train_on_rank, impl.ShardedOptimizer, steps, stage, timeout=RUN_TIMEOUT_S)


class StandInOptimizer:
    """Takes an optimizer's arguments and nothing else: building it imports nothing."""

    def __init__(self, params, **options):
        self.params, self.options = list(params), options


def construct_on_rank(ShardedOptimizer):
    ShardedOptimizer(build_model(seed=0).parameters(), StandInOptimizer, lr=LR)


def import_optimizer_machinery():
    importlib.import_module("torch._dynamo")


def train_on_rank(ShardedOptimizer, steps, stage=1):
    """``steps`` Adam steps on this rank's shard from this rank's seed (the optimizer must
    broadcast rank 0's weights). Stage 1: every p.grad all-reduced as DDP would; stage 2:
    parlab's reduce-scatter sets ``shard.grad`` and drops p.grad. Returns the parameters
    before and after each step and the optimizer state's bytes."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = build_model(seed=rank)
    optimizer = ShardedOptimizer(model.parameters(), torch.optim.Adam, lr=LR)
    inputs, targets = shard(rank, world_size)
    steps_taken = []
    for _ in range(steps):
        optimizer.zero_grad()
        F.mse_loss(model(inputs), targets).backward()
        if stage == 1:
            for p in model.parameters():
                dist.all_reduce(p.grad)  # torch's own: not traced, not the learner's traffic
                p.grad /= world_size
        else:
            grads = optimizer.layout.flatten([p.grad for p in model.parameters()])
            optimizer.shard.grad = reduce_scatter(grads, optimizer.layout, rank).clone()
            model.zero_grad(set_to_none=True)
        before = snapshot(model)
        with trace.span("step"):
            try:
                optimizer.step()
            except Exception as exc:
                if stage == 1:
                    raise
                raise RuntimeError(
                    f"at stage 2, step() raised {type(exc).__name__}: {exc}; there self.shard.grad is set already "
                    "and every p.grad is None: use self.shard.grad as it is"
                ) from exc
        steps_taken.append((before, snapshot(model)))
    state = [value for per_param in optimizer.optimizer.state.values() for value in per_param.values()]
    return {"steps": steps_taken, "optimizer_state_bytes": storage_bytes(t for t in state if torch.is_tensor(t))}


def reduce_scatter_on_rank(reduce_scatter_gradients):
    """Two calls, on batches 0 and 1, of the same model (seed 0 on every rank). Per call: the
    returned shard, the gradient bytes held afterwards, how many p.grad are left."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = build_model(seed=0)
    params = list(model.parameters())
    layout = FlatLayout([p.shape for p in params], world_size)
    calls = []
    for index in range(2):
        model.zero_grad()
        F.mse_loss(model(shard(rank, world_size, index)[0]), shard(rank, world_size, index)[1]).backward()
        with trace.span("reduce_scatter_gradients"):
            gradient = reduce_scatter_gradients(params, layout)
        calls.append({
            "shard": gradient.detach().clone() if torch.is_tensor(gradient) else gradient,
            "gradient_bytes": storage_bytes([gradient if torch.is_tensor(gradient) else None,
                                             *(p.grad for p in params)]),
            "full_gradients_left": sum(p.grad is not None for p in params),
        })
    return calls


# --- Checks in the parent -----------------------------------------------------------------


def ring_bytes(world_size):
    """Bytes one rank sends in a ring reduce-scatter or all-gather of the padded flat buffer."""
    layout = flat_layout(world_size)
    return (world_size - 1) * layout.shard_numel * FP32


def check_bytes_sent(timeline, span_name, expected, formula, hints):
    """Every rank sent ``expected`` bytes (``formula`` in words) during its compute spans
    named ``span_name``; ``hints``: {bytes sent: what that amount says} for the message."""
    sent = [0] * timeline.world_size
    for span in timeline.select(name=span_name, kind=trace.COMPUTE):
        for event in timeline.select(rank=span.rank, kind=trace.COMM):
            if event.name in SEND_OPS and span.start <= event.start and event.end <= span.end:
                sent[span.rank] += event.nbytes
    for rank, nbytes in enumerate(sent):
        hint = f": {hints[nbytes]}" if nbytes in hints else ""
        assert nbytes == expected, (
            f"{timeline.world_size} ranks: in {span_name}(), rank {rank} sent {nbytes} bytes, expected {expected} = "
            f"{formula}{hint}"
        )


def close(a, b, band):
    return a.shape == b.shape and max_abs_difference(a, b) <= band


def flat(params):
    return torch.cat([t.reshape(-1) for t in params.values()])


def check_training(per_rank, world_size, stage=1):
    """Compare every rank's parameters after every step with Adam on one process, naming the
    first difference and, where it recognises one, the mistake behind it."""
    layout = flat_layout(world_size)
    for step, expected in enumerate(adam_reference()):
        band = parameter_bands(world_size)[step]
        for rank, steps in enumerate(per_rank):
            before, after = steps[step]
            if all(close(after[name], expected[name], band) for name in expected):
                continue
            where = f"stage {stage}, {world_size} ranks, step {step}, rank {rank}"
            start, end = layout.shard_bounds(rank)
            got, old, want = flat(after), flat(before), flat(expected)
            own = slice(start, min(end, layout.numel))
            elsewhere = torch.ones(layout.numel, dtype=torch.bool)
            elsewhere[own] = False
            if torch.equal(got, old):
                why = (
                    "no parameter changed in step(): the optimizer must step self.shard, the view "
                    "self.layout.shard(self.flat_param, self.rank) (shard r, the one all_gather sends from rank r), in "
                    "place before the all-gather"
                )
                if stage == 2:
                    why += "; at stage 2 only self.shard.grad holds a gradient, every p.grad is None"
            elif close(got[own], want[own], band) and torch.equal(got[elsewhere], old[elsewhere]):
                why = "only this rank's own shard was updated: all-gather self.flat_param after the optimizer's step"
            else:
                name = next(name for name in expected if not close(after[name], expected[name], band))
                worst = max_abs_difference(after[name], expected[name])
                why = (f"{name} differs from Adam on one process over the full batch by up to {worst:.3g} (rounding "
                       f"explains {band:.1g})")
                if stage == 2:
                    why += " (at stage 2 reduce_scatter_gradients has set self.shard.grad and every p.grad is None)"
            assert False, f"{where}: {why}"


def check_gradient_shards(per_rank, world_size):
    layout = flat_layout(world_size)
    for index in range(2):
        full, local, band = gradient_reference(world_size, index)
        for rank, calls in enumerate(per_rank):
            got = calls[index]["shard"]
            start, end = layout.shard_bounds(rank)
            expected = full[start:end]
            where = f"{world_size} ranks, call {index}, rank {rank}"
            if not torch.is_tensor(got) or got.shape != expected.shape:
                shape = tuple(got.shape) if torch.is_tensor(got) else type(got).__name__
                assert False, (
                    f"{where}: reduce_scatter_gradients returned {shape}, expected a tensor of shape "
                    f"({layout.shard_numel},): this rank's shard of the padded flat gradient"
                )
            if close(got, expected, band):
                continue
            chunks = {c: full[c * layout.shard_numel : (c + 1) * layout.shard_numel] for c in range(world_size)}
            if close(got, local[rank][start:end], band):
                why = "is this rank's own gradient, not the average over the ranks: reduce_scatter it"
            elif close(got, expected * world_size, band * world_size):
                why = "is the SUM over the ranks: average it (reduce_scatter's op='avg')"
            elif any(close(got, chunk, band) for c, chunk in chunks.items() if c != rank):
                why = f"is another chunk's average; rank {rank} owns chunk {rank}: layout.shard(flat, rank)"
            else:
                worst = max_abs_difference(got, expected)
                why = (f"differs from this rank's shard of the full-batch gradient by up to {worst:.3g}, more than "
                       f"rounding explains ({band:.1g}; rank {rank} owns chunk {rank}, the one reduce_scatter "
                       "averages for it)")
            assert False, f"{where}: the gradient shard {why}"
