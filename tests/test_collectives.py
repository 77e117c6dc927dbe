"""parlab.collectives on real ranks: the same numbers as torch.distributed, exact traffic
counted from the trace, clear errors for mistakes, and the ring's schedule as data."""

import math

import pytest
import torch
import torch.distributed as dist

import parlab
from parlab import collectives
from parlab.collectives import (
    METADATA_BYTES,
    butterfly_all_reduce,
    naive_all_reduce,
    ring_all_reduce,
    ring_contributions,
    ring_reduce_scatter,
    ring_steps,
    tree_broadcast,
    tree_reduce,
)
from parlab.numerics import assert_equivalent, ring_orders

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
        # Floats are multiples of 1/8 below 500 in size: every sum of up to 4 of them is exact in
        # fp32 whatever the order, and "avg" divides that exact sum once, so results must be equal.
        x = torch.randint(-4000, 4000, shape, generator=generator)
        x = x / 8 if dtype.is_floating_point else x
        broadcast = x.clone()
        dist.broadcast(broadcast, root)
        checks = [("tree_broadcast", tree_broadcast(x.clone(), root=root), broadcast)]
        for op in ("sum", "avg", "max", "min"):
            if op == "avg" and not dtype.is_floating_point:
                continue
            expected, expected_at_root = torch_reduce(x, op), torch_reduce(x, op, root)
            reduced_at_root = tree_reduce(x.clone(), root=root, op=op)
            checks += [
                (f"naive_all_reduce root={case % N} {op}", naive_all_reduce(x.clone(), op, root=case % N), expected),
                (f"ring_all_reduce {op}", ring_all_reduce(x.clone(), op), expected),
                (f"butterfly_all_reduce {op}", butterfly_all_reduce(x.clone(), op), expected),
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
    return got.shape == expected.shape and got.dtype == expected.dtype and torch.equal(got, expected)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_every_collective_equals_torch_distributed(world_size, request):
    assert run_on(world_size, request, compare_with_torch) == [[]] * world_size


def ring_with_torch_op():
    by_name, by_enum = torch.arange(6.0) * dist.get_rank(), torch.arange(6.0) * dist.get_rank()
    ring_all_reduce(by_name, "max")
    ring_all_reduce(by_enum, dist.ReduceOp.MAX)
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
def test_ring_all_reduce_sends_every_chunk_but_the_owned_ones(world_size, numel, request):
    N, D = world_size, 4 * numel
    timeline = request.getfixturevalue(f"cluster{N}").trace(collective_on_ones, "ring_all_reduce", numel)
    # Rank r forwards every chunk but r (its own after the reduce-scatter) and every chunk
    # but (r + 1) mod N (the one it receives last in the all-gather).
    sizes = chunk_sizes(numel, N)
    expected = [4 * (2 * numel - sizes[r] - sizes[(r + 1) % N]) for r in range(N)]
    assert timeline.bytes_sent() == expected
    assert timeline.bytes_received() == [expected[(r - 1) % N] for r in range(N)]  # from rank r - 1
    if numel % N == 0:
        assert expected == [2 * (N - 1) * D // N] * N
    assert [len(sends(timeline, r)) for r in range(N)] == [2 * (N - 1)] * N


@pytest.mark.timeout(30)
def test_naive_all_reduce_traffic_concentrates_on_the_root(cluster4):
    N, D, root = 4, 4 * 1003, 1
    timeline = cluster4.trace(collective_on_ones, "naive_all_reduce", 1003, root=root)
    expected = [(N - 1) * D if r == root else D for r in range(N)]
    assert timeline.bytes_sent() == expected
    assert timeline.bytes_received() == expected
    assert [len(sends(timeline, r)) for r in range(N)] == [N - 1 if r == root else 1 for r in range(N)]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("world_size", [2, 4])
def test_butterfly_halves_then_doubles_in_log2_N_rounds_each(world_size, request):
    N, D = world_size, 4 * 1024
    timeline = request.getfixturevalue(f"cluster{N}").trace(collective_on_ones, "butterfly_all_reduce", 1024)
    halving = [D // 2**k for k in range(1, int(math.log2(N)) + 1)]  # D/2, D/4, ..., D/N
    for rank in range(N):
        assert [ev.nbytes for ev in sends(timeline, rank)] == halving + halving[::-1]
    assert timeline.bytes_sent() == [2 * (N - 1) * D // N] * N


@pytest.mark.timeout(30)
def test_butterfly_folds_the_extra_rank_when_N_is_not_a_power_of_two(cluster3):
    D = 4 * 1024
    timeline = cluster3.trace(collective_on_ones, "butterfly_all_reduce", 1024)
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
    checked = cluster4.trace(collective_on_ones, "ring_all_reduce", numel, check=True)
    assert checked.bytes_sent() == [2 * (N - 1) * 4 * numel // N + (N - 1) * METADATA_BYTES] * N
    assert [len(sends(checked, r)) for r in range(N)] == [3 * (N - 1)] * N


@pytest.mark.timeout(10)
def test_chunk_bounds_cut_as_tensor_split_does():
    assert collectives.chunk_bounds(10, 4) == [(0, 3), (3, 6), (6, 8), (8, 10)]
    for numel, N in [(0, 3), (2, 4), (1003, 8)]:
        ends = torch.tensor([t.numel() for t in torch.arange(numel).tensor_split(N)]).cumsum(0).tolist()
        assert collectives.chunk_bounds(numel, N) == list(zip([0, *ends[:-1]], ends)), (numel, N)
    with pytest.raises(ValueError, match=r"N \(the number of chunks\) must be a whole number >= 1, got 0"):
        collectives.chunk_bounds(10, 0)


# --- the ring's schedule as data ------------------------------------------------------------


@pytest.mark.timeout(10)
def test_ring_steps_match_the_hand_computed_schedule_at_3_ranks():
    steps = ring_steps(3)
    assert [(step.phase, step.j, step.action) for step in steps] == [
        ("reduce-scatter", 0, "reduce"), ("reduce-scatter", 1, "reduce"),
        ("all-gather", 0, "copy"), ("all-gather", 1, "copy"),
    ]
    assert [(step.send, step.receive) for step in steps] == [
        ((2, 0, 1), (1, 2, 0)), ((1, 2, 0), (0, 1, 2)),  # reduce-scatter: rank r starts with chunk r - 1
        ((0, 1, 2), (2, 0, 1)), ((2, 0, 1), (1, 2, 0)),  # all-gather: rank r starts with its own chunk r
    ]
    assert ring_steps(3, "all-gather") == steps[2:]
    assert ring_steps(1) == []
    with pytest.raises(ValueError, match="'reduce-scatter' or 'all-gather'"):
        ring_steps(3, "all-reduce")


@pytest.mark.timeout(10)
@pytest.mark.parametrize("N", range(2, 9))
def test_every_ring_step_receives_what_the_left_neighbour_sends(N):
    for step in ring_steps(N):
        assert step.receive == tuple(step.send[(r - 1) % N] for r in range(N))
        assert sorted(step.send) == list(range(N))  # each chunk moves once per step
    for phase, never_sent in (("reduce-scatter", 0), ("all-gather", 1)):
        for r in range(N):  # every chunk but r, resp. (r + 1) mod N, leaves rank r once
            sent = [step.send[r] for step in ring_steps(N, phase)]
            assert sorted(sent) == sorted(c for c in range(N) if c != (r + never_sent) % N)


def counts(held):
    return [[len(ranks) for ranks in row] for row in held]


@pytest.mark.timeout(10)
def test_ring_contributions_match_a_hand_worked_ring_of_3():
    assert ring_contributions(3, 0) == [[{0}] * 3, [{1}] * 3, [{2}] * 3]
    assert ring_contributions(3, 1) == [[{0}, {0, 2}, {0}], [{1}, {1}, {0, 1}], [{1, 2}, {2}, {2}]]
    assert counts(ring_contributions(3, 2)) == [[3, 2, 1], [1, 3, 2], [2, 1, 3]]  # owned: chunk r
    assert counts(ring_contributions(3, 3)) == [[3, 2, 3], [3, 3, 2], [2, 3, 3]]
    assert counts(ring_contributions(3, 4)) == [[3] * 3] * 3
    with pytest.raises(ValueError, match="between 0 and 2"):
        ring_contributions(3, 5)


@pytest.mark.timeout(10)
@pytest.mark.parametrize("N", range(1, 9))
def test_after_the_reduce_scatter_rank_r_owns_chunk_r_and_after_the_all_gather_everyone_has_all(N):
    everybody = set(range(N))
    owned = ring_contributions(N, N - 1)
    assert all(owned[r][r] == everybody for r in range(N))
    assert sum(ranks == everybody for row in owned for ranks in row) == N  # nobody else is complete
    assert all(ranks == everybody for row in ring_contributions(N, 2 * (N - 1)) for ranks in row)


def reduce_scatter_of_rank_bits(numel):
    """Rank r contributes 2**r to every element: after a sum, the bits of a value say which
    ranks are summed in it. Returns each chunk's set of ranks, as ``ring_contributions``."""
    rank, N = dist.get_rank(), dist.get_world_size()
    x = torch.full((numel,), 2**rank, dtype=torch.int64)
    ring_reduce_scatter(x, check=False)
    return [{k for k in range(N) if int(chunk[0]) >> k & 1} for chunk in x.tensor_split(N)]


@pytest.mark.timeout(30)
def test_ring_contributions_and_steps_match_a_real_traced_reduce_scatter(cluster4):
    N, numel = 4, 4 * 5 + 1  # chunk 0 is one element longer: its sends stand out by size
    timeline = cluster4.trace(reduce_scatter_of_rank_bits, numel)
    assert timeline.results == ring_contributions(N, N - 1)
    sizes = chunk_sizes(numel, N)
    for r in range(N):
        expected = [8 * sizes[step.send[r]] for step in ring_steps(N, "reduce-scatter")]  # int64
        assert [ev.nbytes for ev in sends(timeline, r)] == expected
        assert [ev.peer for ev in sends(timeline, r)] == [(r + 1) % N] * (N - 1)


def owned_chunk_and_torchs_reduce_scatter(numel):
    """This rank's owned chunk after parlab's ring reduce-scatter, the index it returns, and
    this rank's output of torch.distributed's own reduce-scatter of the same tensor."""
    rank, N = dist.get_rank(), dist.get_world_size()
    x = torch.randint(-1000, 1000, (numel,), generator=torch.Generator().manual_seed(rank)).float()
    # torch 2.13 renamed reduce_scatter_tensor to reduce_scatter_single (same semantics)
    reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    torchs = torch.empty(numel // N)
    reduce_scatter_single(torchs, x.clone())
    owned = ring_reduce_scatter(x, check=False)
    return owned, x.tensor_split(N)[owned], torchs


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_rank_r_owns_chunk_r_as_torch_distributed_reduce_scatter_gives_it(world_size, request):
    # Before, the ring left rank r with chunk (r + 1) mod N: a different layout from torch's.
    N = world_size
    results = request.getfixturevalue(f"cluster{N}").run(owned_chunk_and_torchs_reduce_scatter, 5 * N, timeout=30)
    for rank, (owned, ours, torchs) in enumerate(results):
        assert owned == rank
        assert torch.equal(ours, torchs), rank  # integers below 2**24: every order of the sum is exact


# uneven explicit parts, as ZeRO stage 2 cuts a bucket where the ranks' shards cut it: part 0
# after part 1 in memory, an empty part, a gap no part covers
EXPLICIT_PARTS = {2: [(5, 11), (0, 5)], 3: [(4, 4), (0, 4), (6, 11)], 4: [(0, 3), (3, 3), (3, 10), (10, 11)]}


def reduce_scatter_explicit_parts(parts):
    x = torch.randn(11, generator=torch.Generator().manual_seed(dist.get_rank()), dtype=torch.float32)
    before = x.clone()
    with parlab.trace.span("reduce-scatter"):
        owned = ring_reduce_scatter(x, op="avg", check=False, parts=parts)
    return owned, x, before


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_a_reduce_scatter_over_explicit_uneven_parts_averages_each_part_on_its_rank(world_size, request):
    N, parts = world_size, EXPLICIT_PARTS[world_size]
    timeline = request.getfixturevalue(f"cluster{N}").trace(reduce_scatter_explicit_parts, parts, timeout=30)
    inputs = [before for _, _, before in timeline.results]
    average = torch.stack(inputs).sum(0) / N  # one process, ranks added in order
    for rank, (owned, after, before) in enumerate(timeline.results):
        start, end = parts[rank]
        assert owned == rank
        # the ring's own order for part r (from rank r + 1 round to rank r): the same additions
        in_ring_order = inputs[(rank + 1) % N].clone()
        for k in range(2, N + 1):
            in_ring_order += inputs[(rank + k) % N]
        assert torch.equal(after[start:end], in_ring_order[start:end] / N), rank
        decomposed = [torch.stack([inputs[i] for i in order]).sum(0) / N for order in ring_orders(N)]
        assert_equivalent(after[start:end], average[start:end], [d[start:end] for d in decomposed])
        covered = torch.zeros(11, dtype=torch.bool)
        for lo, hi in parts:
            covered[lo:hi] = True
        assert torch.equal(after[~covered], before[~covered])  # the gap is untouched
        sent = sum(ev.nbytes for ev in timeline.select(rank=rank, kind="comm") if ev.name in ("send", "isend"))
        assert sent == 4 * sum(hi - lo for q, (lo, hi) in enumerate(parts) if q != rank), rank
        sends = [ev for ev in timeline.select(rank=rank, kind="comm") if ev.name in ("send", "isend")]
        assert all(ev.nbytes for ev in sends)  # an empty part is never sent


@pytest.mark.timeout(30)
def test_explicit_parts_must_cut_the_tensor_once_per_rank(cluster2):
    for parts, words in (([(0, 5)], "for 2 ranks"), ([(0, 5), (5, 12)], "0 <= start <= end <= numel = 11"),
                         ([(0, 5), "ab"], "must be \\(start, end\\) pairs")):
        with pytest.raises(parlab.RankError, match=words):
            cluster2.run(reduce_scatter_explicit_parts, parts, timeout=30)


# --- mistakes a learner can make -----------------------------------------------------------


def ring_all_reduce_of(shapes, dtypes, ops):
    rank = dist.get_rank()
    ring_all_reduce(torch.ones(shapes[rank], dtype=dtypes[rank]), ops[rank])


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
        cluster2.run(ring_all_reduce_of, shapes, dtypes, ops, timeout=20)
    assert error.value.ranks == [0, 1]
    for traceback in error.value.failures.values():
        assert "ValueError: ring_all_reduce needs the same call on every rank" in traceback
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
    for all_reduce in (naive_all_reduce, ring_all_reduce, butterfly_all_reduce):
        with pytest.raises(ValueError) as error:
            all_reduce(tensor, op)
        assert words in str(error.value)
