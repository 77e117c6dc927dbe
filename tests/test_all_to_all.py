"""parlab.collectives.all_to_all on real ranks: uneven and empty chunks give what
``dist.all_to_all_single`` gives, on all 4 ranks, on groups of 2 whose group ranks differ
from the global ones ([0, 2] and [1, 3]) and on a group of one; each rank's traced bytes are
the chunks it sends, one message per non-empty chunk in the ring-shift order; under an
emulated link those messages queue on their ports (lower bounds the sleeps guarantee, not
timings); and what a rank can see is wrong is refused with a sentence."""

import pytest
import torch
import torch.distributed as dist

import parlab
from parlab.collectives import all_to_all, all_to_all_steps

# rows[i][j]: rows that rank i sends rank j, uneven, with empty chunks, a rank keeping none
# (rows[0][0] = 0) and a rank sending nothing (rank 3).
ROWS_4 = [[0, 2, 3, 1], [4, 1, 0, 2], [1, 0, 2, 5], [0, 0, 0, 0]]
ROWS_2 = [[2, 0], [3, 1]]
PAIRS = [[0, 2], [1, 3]]
WIDTH = 3  # elements in a row
LINK = parlab.Link(latency=2e-3, bandwidth=50e6)  # slow enough that every bound is far above the noise
NBYTES = 100_000  # one chunk: 25,000 float32, 2 ms + 2 ms on LINK


def test_each_step_of_the_schedule_is_a_permutation_and_every_pair_meets_once():
    for N in range(1, 9):
        steps = all_to_all_steps(N)
        assert [step.j for step in steps] == list(range(1, N))
        for step in steps:
            assert sorted(step.send_to) == list(range(N))  # each rank receives one message a step
            assert all(step.receive_from[step.send_to[r]] == r for r in range(N))
        pairs = [(r, step.send_to[r]) for step in steps for r in range(N)]
        assert sorted(pairs) == [(r, d) for r in range(N) for d in range(N) if d != r]
    with pytest.raises(ValueError, match="N \\(the number of ranks\\) must be a whole number >= 1, got 0"):
        all_to_all_steps(0)


def chunks_of(rank, rows, dtype):
    """Rank ``rank``'s input for ``rows``: its chunk for rank j is rows[rank][j] rows whose
    values name the sender, the receiver and the row."""
    parts = [torch.arange(n * WIDTH).reshape(n, WIDTH) + 1000 * rank + 100 * j for j, n in enumerate(rows[rank])]
    return torch.cat(parts).to(dtype)


def same_as_torch(rows, r, group, dtype):
    x = chunks_of(r, rows, dtype)
    output_splits, input_splits = [row[r] for row in rows], rows[r]
    expected = x.new_empty((sum(output_splits), WIDTH))
    dist.all_to_all_single(expected, x, output_splits, input_splits, group=group)
    got = all_to_all(x, output_splits, input_splits, group)
    return torch.equal(got, expected) and got.dtype == dtype


def against_torch():
    """On every rank: the world with ROWS_4, its pair with ROWS_2, a group of its own, and
    equal chunks without splits; each equal to torch's all_to_all_single."""
    rank = dist.get_rank()
    pairs = [dist.new_group(ranks) for ranks in PAIRS]  # every rank makes every group, in one order
    alone = [dist.new_group([r]) for r in range(4)]
    pair = pairs[rank % 2]
    results = {dtype: [same_as_torch(ROWS_4, rank, None, dtype),
                       same_as_torch(ROWS_2, dist.get_rank(pair), pair, dtype),
                       same_as_torch([[3]], 0, alone[rank], dtype)]
                for dtype in (torch.float32, torch.int64, torch.bfloat16)}
    x = torch.arange(8 * 2).reshape(8, 2) + 100 * rank
    expected = torch.empty_like(x)
    dist.all_to_all_single(expected, x)
    results["even"] = torch.equal(all_to_all(x), expected)
    return results


@pytest.mark.timeout(120)
def test_uneven_and_empty_chunks_equal_torch_s_all_to_all_single(cluster4):
    for rank, results in enumerate(cluster4.run(against_torch, timeout=60)):
        assert results.pop("even"), f"rank {rank}: equal chunks"
        for dtype, (world, pair, alone) in results.items():
            assert world and pair and alone, f"rank {rank}, {dtype}: world {world}, pair {pair}, alone {alone}"


def uneven_exchange(rows, pairs, ops):
    rank = dist.get_rank()
    group = None
    if pairs:
        group = [dist.new_group(ranks) for ranks in PAIRS][rank % 2]
    r = dist.get_rank(group)
    all_to_all(chunks_of(r, rows, torch.float32), [row[r] for row in rows], rows[r], group, ops=ops)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("pairs", [False, True], ids=["world", "pairs"])
def test_each_rank_sends_its_chunks_bytes_once_in_ring_shift_order(cluster4, pairs):
    rows = ROWS_2 if pairs else ROWS_4
    timeline = cluster4.trace(uneven_exchange, rows, pairs, ("isend", "irecv"), timeout=60)
    row_bytes = WIDTH * 4
    for rank in range(4):
        members = PAIRS[rank % 2] if pairs else list(range(4))
        r, N = members.index(rank), len(members)
        sends, receives = timeline.select(rank=rank, name="isend"), timeline.select(rank=rank, name="irecv")
        shift_order = [(r + j) % N for j in range(1, N) if rows[r][(r + j) % N]]  # empty chunks never leave
        assert [members.index(ev.peer) for ev in sends] == shift_order
        assert [ev.nbytes for ev in sends] == [rows[r][j] * row_bytes for j in shift_order]
        assert sorted((members.index(ev.peer), ev.nbytes) for ev in receives) == sorted(
            (i, rows[i][r] * row_bytes) for i in range(N) if i != r and rows[i][r])
        assert timeline.bytes_sent()[rank] == sum(n for j, n in enumerate(rows[r]) if j != r) * row_bytes
    assert sum(timeline.bytes_sent()) == sum(timeline.bytes_received())


@pytest.mark.timeout(120)
def test_named_messages_count_apart_from_the_p2p_ones(cluster4):
    ops = ("all_to_all send", "all_to_all recv")  # as parlab.experts names them
    timeline = cluster4.trace(uneven_exchange, ROWS_4, False, ops, timeout=60)
    assert timeline.bytes_sent() == [0] * 4
    for rank in range(4):
        sent = sum(ev.nbytes for ev in timeline.select(rank=rank, name=ops[0]))
        assert sent == sum(n for j, n in enumerate(ROWS_4[rank]) if j != rank) * WIDTH * 4


def equal_chunks():
    x = torch.full((4, NBYTES // 4), float(dist.get_rank()))
    return all_to_all(x)[:, 0]


@pytest.mark.timeout(120)
def test_on_an_emulated_link_each_rank_s_messages_queue_on_its_ports(cluster4):
    with cluster4.emulate(link=LINK):
        timeline = cluster4.trace(equal_chunks, timeout=60)
    message = LINK.time(NBYTES)
    first_anywhere = min(timeline.select(rank=rank, name="isend")[0].start for rank in range(4))
    for rank in range(4):
        assert torch.equal(timeline.results[rank], torch.arange(4.0))
        sends, receives = timeline.select(rank=rank, name="isend"), timeline.select(rank=rank, name="irecv")
        assert [ev.peer for ev in sends] == [(rank + j) % 4 for j in (1, 2, 3)]
        assert all(ev.nbytes == NBYTES for ev in sends + receives) and len(receives) == 3
        first = sends[0].start
        # the k-th send leaves when the (k-1)-th has left its port: done no earlier than k message times
        for k, send in enumerate(sends, start=1):
            assert send.end - first >= k * message, f"rank {rank}, send {k}"
        # the third message into a rank left its sender's port after two others
        assert max(ev.end for ev in receives) - first_anywhere >= 3 * message
    assert timeline.duration >= 3 * message and "emulated: link" in timeline.regime


def with_own(rows, rank):
    """Splits of one row for every other rank and ``rows`` for ``rank`` itself."""
    return [rows if j == rank else 1 for j in range(4)]


def mistakes():
    """Each bad call's ValueError message, by name (each rank checks its own call alone)."""
    rank = dist.get_rank()
    x = torch.zeros(6, 2)
    outsider = [dist.new_group(ranks) for ranks in ([0, 1], [2, 3])][0]
    attempts = {
        "not a tensor": lambda: all_to_all([1.0, 2.0]),
        "0-d": lambda: all_to_all(torch.tensor(1.0)),
        "uneven": lambda: all_to_all(x),
        "one list": lambda: all_to_all(x, input_splits=[3, 1, 1, 1]),
        "length": lambda: all_to_all(x, [1, 1, 1], [1, 1, 4]),
        "negative": lambda: all_to_all(x, [1, 1, 1, 3], [-1, 2, 2, 3]),
        "not whole": lambda: all_to_all(x, [1, 1, 1, 3], [1.0, 1, 1, 3]),
        "sum": lambda: all_to_all(x, [1, 1, 1, 1], [1, 1, 1, 1]),
        "kept": lambda: all_to_all(x, with_own(2, rank), with_own(3, rank)),
    }
    if rank >= 2:
        attempts["outside"] = lambda: all_to_all(x, group=outsider)
    messages = {}
    for name, attempt in attempts.items():
        try:
            attempt()
        except ValueError as error:
            messages[name] = str(error)
    return messages


@pytest.mark.timeout(120)
def test_bad_calls_are_refused_with_a_sentence_that_says_what_to_change(cluster4):
    for rank, messages in enumerate(cluster4.run(mistakes, timeout=60)):
        assert "all_to_all sends the rows (dim 0) of a tensor, got list" in messages["not a tensor"]
        assert "got a 0-dimensional tensor (1.0)" in messages["0-d"]
        assert "cuts the 6 rows of x into N = 4 equal chunks: make x.shape[0] a multiple of 4" in messages["uneven"]
        assert "needs both input_splits and output_splits, got no output_splits" in messages["one list"]
        assert "exchange the counts first" in messages["one list"]
        assert "output_splits must list N = 4 row counts, one per rank of the group, got [1, 1, 1]" in (
            messages["length"])
        assert "input_splits[0] must be a whole number >= 0, got -1" in messages["negative"]
        assert "input_splits[0] must be a whole number >= 0, got 1.0" in messages["not whole"]
        assert "input_splits [1, 1, 1, 1] add up to 4 rows, but x has 6" in messages["sum"]
        assert (f"input_splits[{rank}] = 3 must equal output_splits[{rank}] = 2: the rows it sends itself are the "
                "rows it gets") in messages["kept"]
        if rank >= 2:
            assert f"global rank {rank} is not in the group it passed" in messages["outside"]
        assert len(messages) == (10 if rank >= 2 else 9)  # every attempt refused
