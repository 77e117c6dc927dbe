"""parlab.collectives on real ranks: the same numbers as torch.distributed, exact traffic
counted from the trace, clear errors for mistakes, and the alpha-beta cost model."""

import math

import pytest
import torch
import torch.distributed as dist

import parlab
from parlab import collectives
from parlab.collectives import (
    METADATA_BYTES,
    butterfly_allreduce,
    cost_model,
    fit_alpha_beta,
    measure_p2p,
    naive_allreduce,
    ring_allreduce,
    tree_broadcast,
    tree_reduce,
)

SHAPES = [(1,), (5,), (1003,), (5, 3, 3)]  # lengths that mostly do not divide by N
TORCH_OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


@pytest.fixture(scope="module")
def cluster3():
    with parlab.Cluster(world_size=3, timeout=60) as cluster:
        yield cluster


def run_on(world_size, request, fn, *args):
    if world_size == 1:
        return parlab.launch(fn, 1, *args, timeout=60)
    return request.getfixturevalue(f"cluster{world_size}").run(fn, *args)


# --- numerical equivalence with torch.distributed -----------------------------------------


def compare_with_torch():
    """On every rank: each collective against torch's, for every op, shape and dtype.
    Returns the cases that differ (an empty list when all agree)."""
    rank, N = dist.get_rank(), dist.get_world_size()
    root = N - 1
    failures = []
    for case, (shape, dtype) in enumerate((s, d) for s in SHAPES for d in (torch.float32, torch.int64)):
        generator = torch.Generator().manual_seed(1000 * case + rank)
        if dtype.is_floating_point:
            x = torch.randn(shape, generator=generator)
        else:
            x = torch.randint(-1000, 1000, shape, generator=generator)
        broadcast = x.clone()
        dist.broadcast(broadcast, root)
        checks = [("tree_broadcast", tree_broadcast(x.clone(), root=root), broadcast)]
        for op in ("sum", "avg", "max", "min"):
            if op == "avg" and not dtype.is_floating_point:
                continue
            expected, expected_at_root = torch_reduce(x, op), torch_reduce(x, op, root)
            reduced_at_root = tree_reduce(x.clone(), root=root, op=op)
            checks += [
                (f"naive_allreduce root={case % N} {op}", naive_allreduce(x.clone(), op, root=case % N), expected),
                (f"ring_allreduce {op}", ring_allreduce(x.clone(), op), expected),
                (f"butterfly_allreduce {op}", butterfly_allreduce(x.clone(), op), expected),
                (f"tree_reduce {op}", reduced_at_root if rank == root else expected_at_root, expected_at_root),
            ]
        failures += [f"{name} {dtype} {shape}" for name, got, want in checks if not same(got, want)]
    return failures


def torch_reduce(x, op, root=None):
    """dist.all_reduce, or dist.reduce to ``root``, of a copy of ``x`` (avg: the sum over N)."""
    expected = x.clone()
    if root is None:
        dist.all_reduce(expected, TORCH_OPS[op])
    else:
        dist.reduce(expected, root, TORCH_OPS[op])
    return expected / dist.get_world_size() if op == "avg" else expected


def same(got, expected):
    if got.shape != expected.shape or got.dtype != expected.dtype:
        return False
    if got.dtype.is_floating_point:  # the ring sums in another order than gloo
        return torch.allclose(got, expected, rtol=1e-5, atol=1e-6)
    return torch.equal(got, expected)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_every_collective_equals_torch_distributed(world_size, request):
    assert run_on(world_size, request, compare_with_torch) == [[]] * world_size


def ring_with_torch_op():
    by_name, by_enum = torch.arange(6.0) * dist.get_rank(), torch.arange(6.0) * dist.get_rank()
    ring_allreduce(by_name, "max")
    ring_allreduce(by_enum, dist.ReduceOp.MAX)
    return torch.equal(by_name, by_enum)


@pytest.mark.timeout(30)
def test_ops_may_be_given_as_dist_reduce_op(cluster2):
    assert cluster2.run(ring_with_torch_op) == [True, True]


# --- exact traffic, counted from the trace -------------------------------------------------


def collective_on_ones(name, numel, check=False, **kwargs):
    getattr(collectives, name)(torch.ones(numel), check=check, **kwargs)


def sends(timeline, rank):
    return [ev for ev in timeline.select(rank=rank) if ev.name in ("send", "isend")]


def chunk_sizes(numel, N):
    return [numel // N + (1 if i < numel % N else 0) for i in range(N)]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("numel", [1003, 1200])
def test_ring_allreduce_sends_every_chunk_but_the_owned_ones(world_size, numel, request):
    N, D = world_size, 4 * numel
    timeline = request.getfixturevalue(f"cluster{N}").trace(collective_on_ones, "ring_allreduce", numel)
    # Rank r forwards every chunk but (r + 1) mod N (its own after the reduce-scatter)
    # and every chunk but (r + 2) mod N (the one it receives last in the all-gather).
    sizes = chunk_sizes(numel, N)
    expected = [4 * (2 * numel - sizes[(r + 1) % N] - sizes[(r + 2) % N]) for r in range(N)]
    assert timeline.bytes_sent() == expected
    assert timeline.bytes_received() == [expected[(r - 1) % N] for r in range(N)]  # from rank r - 1
    if numel % N == 0:
        assert expected == [2 * (N - 1) * D // N] * N
    assert [len(sends(timeline, r)) for r in range(N)] == [2 * (N - 1)] * N


@pytest.mark.timeout(30)
def test_naive_allreduce_traffic_concentrates_on_the_root(cluster4):
    N, D, root = 4, 4 * 1003, 1
    timeline = cluster4.trace(collective_on_ones, "naive_allreduce", 1003, root=root)
    expected = [(N - 1) * D if r == root else D for r in range(N)]
    assert timeline.bytes_sent() == expected
    assert timeline.bytes_received() == expected
    assert [len(sends(timeline, r)) for r in range(N)] == [N - 1 if r == root else 1 for r in range(N)]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("world_size", [2, 4])
def test_butterfly_halves_then_doubles_in_log2_N_rounds_each(world_size, request):
    N, D = world_size, 4 * 1024
    timeline = request.getfixturevalue(f"cluster{N}").trace(collective_on_ones, "butterfly_allreduce", 1024)
    halving = [D // 2**k for k in range(1, int(math.log2(N)) + 1)]  # D/2, D/4, ..., D/N
    for rank in range(N):
        assert [ev.nbytes for ev in sends(timeline, rank)] == halving + halving[::-1]
    assert timeline.bytes_sent() == [2 * (N - 1) * D // N] * N


@pytest.mark.timeout(30)
def test_butterfly_folds_the_extra_rank_when_N_is_not_a_power_of_two(cluster3):
    D = 4 * 1024
    timeline = cluster3.trace(collective_on_ones, "butterfly_allreduce", 1024)
    # P = 2: rank 2 folds D into rank 0, ranks 0 and 1 exchange D/2 twice, rank 0 unfolds D.
    assert timeline.bytes_sent() == [2 * D, D, D]
    assert timeline.bytes_received() == [2 * D, D, D]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("world_size", [3, 4])
def test_tree_broadcast_reaches_every_rank_in_ceil_log2_N_rounds(world_size, request):
    N, D, root = world_size, 4 * 100, 1
    timeline = request.getfixturevalue(f"cluster{N}").trace(collective_on_ones, "tree_broadcast", 100, root=root)
    parent = {ev.rank: ev.peer for ev in timeline.select(name="recv")}
    assert sorted(parent) == [r for r in range(N) if r != root]  # every other rank receives once

    def arrival_round(rank):
        # A rank sends one message per round, in order, from the round after it received.
        if rank == root:
            return 0
        children = [ev.peer for ev in sends(timeline, parent[rank])]
        return arrival_round(parent[rank]) + 1 + children.index(rank)

    assert max(arrival_round(r) for r in range(N)) == math.ceil(math.log2(N))
    assert len(sends(timeline, root)) == math.ceil(math.log2(N))
    assert sum(timeline.bytes_sent()) == (N - 1) * D


@pytest.mark.timeout(30)
def test_tree_reduce_gathers_into_the_root_in_ceil_log2_N_rounds(cluster4):
    N, D, root = 4, 4 * 100, 2
    timeline = cluster4.trace(collective_on_ones, "tree_reduce", 100, root=root)
    assert timeline.bytes_sent() == [0 if r == root else D for r in range(N)]
    assert len(timeline.select(rank=root, name="recv")) == math.ceil(math.log2(N))


@pytest.mark.timeout(30)
def test_the_consistency_check_costs_N_minus_1_small_messages(cluster4):
    N, numel = 4, 1200
    checked = cluster4.trace(collective_on_ones, "ring_allreduce", numel, check=True)
    assert checked.bytes_sent() == [2 * (N - 1) * 4 * numel // N + (N - 1) * METADATA_BYTES] * N
    assert [len(sends(checked, r)) for r in range(N)] == [3 * (N - 1)] * N


# --- mistakes a learner can make -----------------------------------------------------------


def ring_allreduce_of(shapes, dtypes, ops):
    rank = dist.get_rank()
    ring_allreduce(torch.ones(shapes[rank], dtype=dtypes[rank]), ops[rank])


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "shapes, dtypes, ops, words",
    [
        ([(5,), (6,)], [torch.float32] * 2, ["sum"] * 2, ["(5,)", "(6,)"]),
        ([(2, 3), (6,)], [torch.float32] * 2, ["sum"] * 2, ["(2, 3)", "(6,)"]),
        ([(4,), (4,)], [torch.float32, torch.int64], ["max"] * 2, ["torch.float32", "torch.int64"]),
        ([(4,), (4,)], [torch.float32] * 2, ["sum", "max"], ["op='sum'", "op='max'"]),
    ],
)
def test_ranks_that_disagree_all_raise_instead_of_hanging(cluster2, shapes, dtypes, ops, words):
    with pytest.raises(parlab.RankError) as error:
        cluster2.run(ring_allreduce_of, shapes, dtypes, ops, timeout=20)
    assert error.value.ranks == [0, 1]
    for traceback in error.value.failures.values():
        assert "ValueError: ring_allreduce needs the same call on every rank" in traceback
        assert all(word in traceback for word in words)


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    "tensor, op, words",
    [
        (torch.ones(4, 3).t(), "sum", "contiguous"),
        (torch.ones(4), "mean", "'sum', 'avg', 'max', 'min'"),
        (torch.ones(4, dtype=torch.int64), "avg", "float tensor"),
        (torch.ones(4, dtype=torch.int64), dist.ReduceOp.AVG, "float tensor"),
    ],
)
def test_local_mistakes_raise_value_error_before_any_communication(tensor, op, words):
    for allreduce in (naive_allreduce, ring_allreduce, butterfly_allreduce):
        with pytest.raises(ValueError) as error:
            allreduce(tensor, op)
        assert words in str(error.value)


# --- the alpha-beta cost model --------------------------------------------------------------


@pytest.mark.timeout(10)
def test_cost_model_matches_hand_computed_times():
    alpha, beta, D = 1e-5, 1e-9, 1e6  # 10 us per message, 1 GB/s, 1 MB
    assert cost_model("naive", D, 4, alpha, beta) == pytest.approx(6 * (1e-5 + 1e-3))
    assert cost_model("ring", D, 4, alpha, beta) == pytest.approx(6e-5 + 1.5e-3)
    assert cost_model("butterfly", D, 4, alpha, beta) == pytest.approx(4e-5 + 1.5e-3)
    assert cost_model("tree_broadcast", D, 4, alpha, beta) == pytest.approx(2 * (1e-5 + 1e-3))
    assert cost_model("ring", D, 3, alpha, beta) == pytest.approx(4e-5 + 4 / 3 * 1e-3)
    assert cost_model("butterfly", D, 3, alpha, beta) == pytest.approx(2e-5 + 1e-3 + 2 * (1e-5 + 1e-3))
    assert cost_model("tree_broadcast", D, 3, alpha, beta) == pytest.approx(2 * (1e-5 + 1e-3))
    assert [cost_model(a, D, 1, alpha, beta) for a in ("naive", "ring", "butterfly", "tree_broadcast")] == [0] * 4
    with pytest.raises(ValueError, match="'ring'"):
        cost_model("allreduce", D, 4, alpha, beta)


@pytest.mark.timeout(10)
def test_fit_alpha_beta_recovers_noiseless_parameters():
    alpha, beta = 2e-5, 3e-10
    sizes = [0, 1_000, 64_000, 1_000_000]
    alpha_fit, beta_fit = fit_alpha_beta(sizes, [alpha + D * beta for D in sizes])
    assert alpha_fit == pytest.approx(alpha, rel=1e-9)
    assert beta_fit == pytest.approx(beta, rel=1e-9)
    with pytest.raises(ValueError, match="two different sizes"):
        fit_alpha_beta([8, 8], [1e-5, 1e-5])


@pytest.mark.timeout(30)
def test_measure_p2p_returns_increasing_sizes_with_positive_times(cluster2):
    pairs, other = cluster2.run(measure_p2p, [1024, 8, 65536], repeats=3)
    assert other is None
    assert [size for size, _ in pairs] == [8, 1024, 65536]
    assert all(seconds > 0 for _, seconds in pairs)
