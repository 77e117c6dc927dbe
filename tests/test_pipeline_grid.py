"""parlab.pipeline.grid on 4 real ranks: N_d = 2 pipelines of K = 2 ranks (GPipe, 1F1B, and
interleaved 1F1B with two stages per rank; also N_d = 4, K = 1 and N_d = 1, K = 4), laid out
as parlab.Mesh(dp=N_d, pp=K) lays out every grid, give every
rank the one-process full-batch gradient of its layers and the same parameters after 3 SGD
steps, even when the replicas start from different weights; the trace shows p2p only
inside a pipeline and the all-reduce only inside a data-parallel group, with exactly the
ring's bytes; a world that is not N_d x K and a batch that does not split raise ValueError."""

import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from parlab import trace
from parlab.numerics import assert_equivalent, backward_in_shards, ring_orders
from parlab.pipeline import gpipe, make_schedule, partition
from parlab.pipeline.executor import PipelineExecutor
from parlab.pipeline.grid import PipelineDataParallel
from parlab.runtime.mesh import axis_groups

IN, HIDDEN, OUT = 5, 12, 3
BATCH, M, STEPS, LR = 48, 4, 3, 0.1  # N_d = 1, 2, 4 shards of 48, 24, 12 samples; micro-batches of 12, 6, 3


def build_mlp(seed=0):
    """423 parameters; cut in two: stage 0 holds 228 (even), stage 1 holds 195 (odd: the ring
    cuts it into chunks of 98 and 97 for N_d = 2)."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN), nn.ReLU(),
                         nn.Linear(HIDDEN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, OUT))


def full_batch():
    generator = torch.Generator().manual_seed(1)
    return torch.randn(BATCH, IN, generator=generator), torch.randn(BATCH, OUT, generator=generator)


@functools.cache
def reference(pieces=1, order=None):
    """One process on the full batch: (gradients of step 1, parameters after STEPS steps).
    With ``pieces`` > 1 the grid's arithmetic (parlab.numerics): the batch in N_d x M
    micro-batches, their gradients summed in ``order``, divided by their number."""
    model = build_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    parts = list(zip(*(part.chunk(pieces) for part in full_batch())))
    for step in range(STEPS):
        backward_in_shards(lambda x, y: F.mse_loss(model(x), y), model.parameters(), parts, order)
        if step == 0:
            grads = {name: p.grad.clone() for name, p in model.named_parameters()}
        optimizer.step()
    return grads, {name: p.detach().clone() for name, p in model.named_parameters()}


def grid_arithmetic(pieces):
    """The yardstick's runs: ``reference`` in each ring order of the pieces."""
    return [reference(pieces, tuple(order)) for order in ring_orders(pieces)]


def assert_like_one_process(actual, which, pieces, label):
    """``actual`` (some parameters' gradients, which=0, or values, which=1) within the band."""
    expected = reference()[which]
    decomposed = [{n: run[which][n] for n in actual} for run in grid_arithmetic(pieces)]
    assert_equivalent(actual, {n: expected[n] for n in actual}, decomposed, label)


def grid_model(name, N_d, K, v=1):
    """This rank's (PipelineDataParallel, its parameters by model name). Replica d > 0
    starts from other weights: the grid must copy pipeline 0's. On the mesh, rank r N_d + d
    is stage r of pipeline d."""
    schedule = make_schedule(name, K, M, v)
    r, d = divmod(dist.get_rank(), N_d)
    model = build_mlp(seed=d * 100)
    stages = partition(model, K * v)
    mine = {s: stages[s] for s in schedule.stages_of(r)}
    grid = PipelineDataParallel(schedule, mine, F.mse_loss, N_d)
    held = {id(p) for stage in mine.values() for p in stage.parameters()}
    return grid, {n: p for n, p in model.named_parameters() if id(p) in held}


def train_on_grid(name, N_d, K, v):
    grid, named = grid_model(name, N_d, K, v)
    optimizer = torch.optim.SGD(named.values(), lr=LR)
    for step in range(STEPS):
        optimizer.zero_grad()
        losses = grid.step(*full_batch())
        if step == 0:
            grads, first_losses = {n: p.grad.clone() for n, p in named.items()}, losses
        optimizer.step()
    return grads, {n: p.detach().clone() for n, p in named.items()}, first_losses


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name, N_d, K, v", [("gpipe", 2, 2, 1), ("1f1b", 2, 2, 1), ("interleaved_1f1b", 2, 2, 2),
                                           ("gpipe", 4, 1, 1), ("1f1b", 1, 4, 1)])
def test_every_rank_trains_like_one_process_on_the_full_batch(name, N_d, K, v, cluster4):
    expected_grads, expected_params = reference()
    per_rank = cluster4.run(train_on_grid, name, N_d, K, v, timeout=60)
    for row in axis_groups("pp", dp=N_d, pp=K):  # each pipeline holds every parameter exactly once
        held = [n for rank in row for n in per_rank[rank][0]]
        assert sorted(held) == sorted(expected_grads)
    model, (x, y) = build_mlp(), full_batch()
    for rank, (grads, params, losses) in enumerate(per_rank):
        assert_like_one_process(grads, 0, N_d * M, f"rank {rank}: gradients")
        assert_like_one_process(params, 1, N_d * M, f"rank {rank}: parameters after {STEPS} steps")
        r, d = divmod(rank, N_d)
        if r == K - 1:  # the losses of replica d's own micro-batches
            shard = slice(d * BATCH // N_d, (d + 1) * BATCH // N_d)
            size = BATCH // N_d // M
            expected = [F.mse_loss(model(xm), ym) for xm, ym in zip(x[shard].split(size), y[shard].split(size))]
            assert_equivalent(losses, expected, [], f"rank {rank}: losses")  # the same forward: only the floor
        else:
            assert losses is None


def traced_grid_step():
    grid, _ = grid_model("gpipe", 2, 2)
    grid.step(*full_batch())


@pytest.mark.timeout(120)
def test_p2p_stays_in_a_pipeline_and_the_all_reduce_in_a_data_parallel_group(cluster4):
    N_d, K = 2, 2
    timeline = cluster4.trace(traced_grid_step, timeout=60)
    stage_numel = [sum(p.numel() for p in stage.parameters()) for stage in partition(build_mlp(), K)]
    assert stage_numel == [228, 195]  # stage 1's ring chunks are 98 and 97 elements: N_d = 2 ranks send all 195
    activation_bytes = M * (BATCH // N_d // M) * HIDDEN * 4  # M messages of a micro-batch of HIDDEN features
    rows, columns = axis_groups("pp", dp=N_d, pp=K), axis_groups("dp", dp=N_d, pp=K)
    assert rows == [[0, 2], [1, 3]] and columns == [[0, 1], [2, 3]]  # pipelines outermost: stage r is ranks r N_d + d
    for rank in range(N_d * K):
        r, d = divmod(rank, N_d)
        (span,) = timeline.select(rank=rank, name="all-reduce")
        assert span.stage == r
        ring_bytes = 2 * (N_d - 1) * stage_numel[r] * 4 // N_d
        for ops in (("send", "isend"), ("recv", "irecv")):
            events = [ev for ev in timeline.select(rank=rank, kind=trace.COMM) if ev.name in ops]
            inside = [ev for ev in events if span.start <= ev.start <= span.end]
            outside = [ev for ev in events if ev not in inside]
            assert {ev.peer for ev in inside} == set(columns[r]) - {rank}
            assert sum(ev.nbytes for ev in inside) == ring_bytes
            assert {ev.peer for ev in outside} == set(rows[d]) - {rank}
            assert sum(ev.nbytes for ev in outside) == activation_bytes
        assert timeline.bytes_sent()[rank] == activation_bytes + ring_bytes
        broadcasts = timeline.select(rank=rank, name="broadcast")  # pipeline 0's weights, at construction
        assert {ev.peer for ev in broadcasts} == {columns[r][0]}
        assert sum(ev.nbytes for ev in broadcasts) == stage_numel[r] * 4  # DDP's: each parameter as it is


def learner_mistakes():
    messages = []
    stage = partition(build_mlp(), 2)[dist.get_rank() // 2]
    try:
        PipelineDataParallel(gpipe(2, M), {dist.get_rank() // 2: stage}, F.mse_loss, 3)
    except ValueError as error:
        messages.append(str(error))
    grid, _ = grid_model("gpipe", 2, 2)
    try:
        grid.step(*(t[:20] for t in full_batch()))
    except ValueError as error:
        messages.append(str(error))
    return messages


@pytest.mark.timeout(120)
def test_a_world_that_is_not_n_d_times_k_and_a_batch_that_does_not_split_raise(cluster4):
    for world_error, batch_error in cluster4.run(learner_mistakes, timeout=60):
        assert "a mesh of pp = 2 x dp = 3 needs 6 ranks, but 4 are running" in world_error
        assert "choose sizes whose product is 4" in world_error
        assert "a batch of 20 samples does not split into N_d = 2 shards" in batch_error
        assert "multiple of N_d x M = 8" in batch_error


def test_the_mesh_s_pipelines_are_its_pp_groups_and_the_executor_checks_its_ranks():
    assert axis_groups("pp", dp=2, pp=2) == [[0, 2], [1, 3]]
    assert axis_groups("pp", dp=2, pp=3) == [[0, 2, 4], [1, 3, 5]]
    assert axis_groups("pp", dp=4) == [[0], [1], [2], [3]]
    model = build_mlp()
    with pytest.raises(ValueError, match=r"ranks=\[1\] must be K = 1 distinct global ranks"):
        PipelineExecutor(gpipe(1, 2), {0: model}, F.mse_loss, ranks=[1])
    with pytest.raises(ValueError, match=r"ranks=\[0, 0\] must be K = 2 distinct"):
        PipelineExecutor(gpipe(2, 2), {0: model}, F.mse_loss, ranks=[0, 0])
    x, y = full_batch()
    PipelineExecutor(gpipe(1, 4), {0: model}, F.mse_loss, ranks=[0]).step(x, y)
    assert_like_one_process({"0.weight": model[0].weight.grad}, 0, 4, "K = 1, M = 4")
