"""Graded: ring reduce-scatter, ring all-gather and ring all-reduce (``collectives.py``).

Every rank fills its tensor with random integers (sums are exact in any order), at lengths
that N divides, that it does not, and that are shorter than N (empty chunks). Results are
compared with torch.distributed's own ``all_reduce``; traffic is counted exactly with
``cluster.trace``: a ring sends one chunk per message, never a whole tensor.
"""

import pytest
import torch
import torch.distributed as dist

# A correct ring takes milliseconds; a deadlocked one costs a test this long plus a restart
# of the cluster, which keeps grading a topic whose every task hangs under 30 s.
RUN_TIMEOUT_S = 3
WORLD_SIZES = [2, 3, 4]
# At 2 ranks a ring sends as many bytes as sending the whole tensor: traffic bites from 3.
TRAFFIC_WORLD_SIZES = [3, 4]
SENTINEL = -1000.0  # outside the random values: marks what an all-gather must overwrite


def lengths(N):
    """Tensor lengths at N ranks: shorter than N, a multiple of N, remainder 1 and N - 1."""
    return [N - 1, 4 * N, 5 * N + 1, 8 * N - 1]


def ranks(world_size):
    return f"{world_size} ranks"


@pytest.mark.task("ring_reduce_scatter")
class TestRingReduceScatter:
    @pytest.mark.points(1)
    @pytest.mark.parametrize("cluster", WORLD_SIZES, indirect=True, ids=ranks)
    def test_owned_chunk_holds_the_sum(self, cluster, impl):
        N = cluster.world_size
        for rank, before, after, expected in run_cases(cluster, reduce_on_rank, impl.ring_reduce_scatter):
            owned = rank
            start, end = chunk_bounds(before.numel(), N)[owned]
            where = f"{N} ranks, {before.numel()} elements: rank {rank}'s owned chunk {owned}"
            check(after[start:end], expected[start:end], before[start:end], where, offset=start)

    @pytest.mark.points(1)
    @pytest.mark.parametrize("cluster", TRAFFIC_WORLD_SIZES, indirect=True, ids=ranks)
    def test_sends_one_chunk_per_step(self, cluster, impl):
        check_ring_traffic(cluster, impl.ring_reduce_scatter, "reduce-scatter", reduce_scatter_sends)


@pytest.mark.task("ring_all_gather")
class TestRingAllGather:
    @pytest.mark.points(1)
    @pytest.mark.parametrize("cluster", WORLD_SIZES, indirect=True, ids=ranks)
    def test_every_rank_gets_every_chunk(self, cluster, impl):
        N = cluster.world_size
        for rank, before, after, expected in run_cases(cluster, all_gather_on_rank, impl.ring_all_gather):
            where = f"{N} ranks, {before.numel()} elements, each starting with its owned chunk: rank {rank}"
            check(after, expected, before, where)

    @pytest.mark.points(1)
    @pytest.mark.parametrize("cluster", TRAFFIC_WORLD_SIZES, indirect=True, ids=ranks)
    def test_sends_one_chunk_per_step(self, cluster, impl):
        check_ring_traffic(cluster, impl.ring_all_gather, "all-gather", all_gather_sends)


@pytest.mark.task("ring_all_reduce")
class TestRingAllreduce:
    @pytest.mark.points(1)
    @pytest.mark.parametrize("cluster", WORLD_SIZES, indirect=True, ids=ranks)
    def test_matches_dist_all_reduce(self, cluster, impl):
        N = cluster.world_size
        for rank, before, after, expected in run_cases(cluster, reduce_on_rank, impl.ring_all_reduce):
            check(after, expected, before, f"{N} ranks, {before.numel()} elements: rank {rank}")

    @pytest.mark.points(1)
    @pytest.mark.parametrize("cluster", TRAFFIC_WORLD_SIZES, indirect=True, ids=ranks)
    def test_sends_two_n_minus_one_chunks(self, cluster, impl):
        check_ring_traffic(cluster, impl.ring_all_reduce, "all-reduce", all_reduce_sends)


# --- On the ranks -------------------------------------------------------------------------


def random_tensor(numel, seed):
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(-100, 100, (numel,), generator=generator).float()


def reduce_on_rank(collective, numels):
    """[(input, input after ``collective``, dist.all_reduce of the input)] per length."""
    cases = []
    for case, numel in enumerate(numels):
        tensor = random_tensor(numel, seed=1000 * case + dist.get_rank())
        before, expected = tensor.clone(), tensor.clone()
        dist.all_reduce(expected)
        collective(tensor)
        cases.append((before, tensor, expected))
    return cases


def all_gather_on_rank(ring_all_gather, numels):
    """[(input, input after the all-gather, the tensor every rank should end with)] per
    length; the input holds the rank's owned chunk r and SENTINEL elsewhere."""
    rank, N = dist.get_rank(), dist.get_world_size()
    cases = []
    for case, numel in enumerate(numels):
        expected = random_tensor(numel, seed=case)
        start, end = chunk_bounds(numel, N)[rank]
        tensor = torch.full_like(expected, SENTINEL)
        tensor[start:end] = expected[start:end]
        before = tensor.clone()
        ring_all_gather(tensor)
        cases.append((before, tensor, expected))
    return cases


def run_on_rank(collective, numel):
    collective(random_tensor(numel, seed=dist.get_rank()))


# --- Checks in the parent -----------------------------------------------------------------


def run_cases(cluster, on_rank, collective):
    """Run ``on_rank(collective, lengths(N))`` on every rank: [(rank, input, input after the
    collective, expected)] for every rank and length."""
    results = cluster.run(on_rank, collective, lengths(cluster.world_size), timeout=RUN_TIMEOUT_S)
    return [(rank, *case) for rank, cases in enumerate(results) for case in cases]


def chunk_bounds(numel, N):
    """The chunk convention of the exercise, written independently of the learner's."""
    sizes = [numel // N + (1 if index < numel % N else 0) for index in range(N)]
    starts = [sum(sizes[:index]) for index in range(N)]
    return [(start, start + size) for start, size in zip(starts, sizes)]


def check(got, expected, before, where, offset=0):
    """Assert ``got`` equals ``expected`` element for element, naming the first difference."""
    shapes = tuple(got.shape), tuple(expected.shape)
    assert shapes[0] == shapes[1], f"{where}: the tensor has shape {shapes[0]}, expected {shapes[1]}"
    wrong = (got != expected).nonzero()
    if len(wrong) == 0:
        return
    index = int(wrong[0])
    hint = ""
    if torch.equal(got, before):
        hint = " (the tensor is unchanged: write the result into the tensor passed in, in place)"
    elif got[index] == before[index]:
        hint = " (it still holds its value from before the call)"
    assert False, (
        f"{where}: element {offset + index} is {got[index].item():g}, expected {expected[index].item():g}"
        f"{hint}; {len(wrong)} of {got.numel()} elements are wrong"
    )


def reduce_scatter_sends(rank, N):
    """The chunks rank sends in a ring reduce-scatter: (r - j - 1) mod N at step j."""
    return [(rank - j - 1) % N for j in range(N - 1)]


def all_gather_sends(rank, N):
    """The chunks rank sends in a ring all-gather: (r - j) mod N at step j."""
    return [(rank - j) % N for j in range(N - 1)]


def all_reduce_sends(rank, N):
    """The chunks rank sends in a ring all-reduce: the reduce-scatter's, then the all-gather's."""
    return reduce_scatter_sends(rank, N) + all_gather_sends(rank, N)


def check_ring_traffic(cluster, collective, name, sends):
    """Assert every rank sends, through parlab.p2p, one message per chunk that
    ``sends(rank, N)`` lists, of exactly that chunk's size."""
    N = cluster.world_size
    numel = 8 * N - 1
    timeline = cluster.trace(run_on_rank, collective, numel, timeout=RUN_TIMEOUT_S)
    sizes = [(end - start) * 4 for start, end in chunk_bounds(numel, N)]  # float32
    for rank in range(N):
        events = timeline.select(rank=rank, name="send") + timeline.select(rank=rank, name="isend")
        sent = sorted(event.nbytes for event in events)
        expected = sorted(sizes[chunk] for chunk in sends(rank, N))
        if sent == expected:
            continue
        ring = f"a ring {name} sends {len(expected)} messages of one chunk each, {sum(expected)} bytes"
        if not sent:
            why = "send through parlab.p2p (send/isend), whose bytes the grader counts, not torch.distributed"
        elif sum(sent) > sum(expected):
            why = (
                f"that is {sum(sent) / sum(expected):.1f}x the ring's bytes: exchanging whole tensors and "
                "combining them locally gives the right numbers, but a ring sends one chunk per message"
            )
        else:
            why = "each step sends exactly one chunk, as the docstring says"
        assert False, (
            f"{N} ranks, {numel} float32 elements: rank {rank} sent {len(sent)} messages, {sum(sent)} bytes; "
            f"{ring}; {why}"
        )
