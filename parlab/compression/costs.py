"""The cost model of compressed communication: the bytes each rank sends and the alpha-beta
seconds of the collectives a compressor makes in one step (its ``collectives(x, shapes)``: a
list of ("all-reduce", numel, element bytes) and ("all-gather", message bytes)), and where
top-k stops paying.

Symbols: N ranks, d elements of the gradient, k top-k's budget, b bytes of an element, alpha
a link's latency and beta its seconds per byte (lecture 01). A ring all-reduce of L elements
sends 2 (N - 1)/N L b bytes per rank (exact when N divides L), an all-gather of B bytes per
rank (N - 1) B. So top-k's (values, indices), (N - 1) k (4 + 8) bytes, beat a dense ring's
2 (N - 1)/N 4 d only when k < 2 d / (3 N) with int64 indices, and k < d / N with int32 ones
(``topk_pays``).
"""

from parlab import collectives


def ring_all_reduce_sent(numel, element_bytes, N):
    """Bytes each rank r sends in a ring all-reduce of ``numel`` elements, as a list over r:
    every chunk but its own in the reduce-scatter, every chunk but (r + 1) mod N in the
    all-gather (``collectives.chunk_bounds``). 2 (N - 1)/N numel b when N divides numel."""
    sizes = [end - start for start, end in collectives.chunk_bounds(numel, N)]
    return [(2 * numel - sizes[r] - sizes[(r + 1) % N]) * element_bytes for r in range(N)]


def all_gather_sent(message_bytes, N):
    """Bytes each rank sends in a ring all-gather of a ``message_bytes`` message per rank."""
    return [(N - 1) * message_bytes] * N


def sent(collectives_of_a_step, N):
    """Bytes each rank sends in ``collectives_of_a_step``, a list of ("all-reduce", numel,
    element_bytes) and ("all-gather", message_bytes) (what a compressor's ``collectives(x)``
    returns), per rank."""
    total = [0] * N
    for collective in collectives_of_a_step:
        per_rank = (ring_all_reduce_sent(*collective[1:], N) if collective[0] == "all-reduce"
                    else all_gather_sent(collective[1], N))
        total = [a + b for a, b in zip(total, per_rank)]
    return total


def seconds(collectives_of_a_step, N, latency, bandwidth):
    """The alpha-beta time of ``collectives_of_a_step`` (as for ``sent``) on a link of
    ``latency`` seconds per message and ``bandwidth`` bytes per second, one after the other: a
    ring all-reduce of L elements of b bytes takes 2 (N - 1) steps of alpha + ceil(L / N) b beta
    (a step lasts as long as its largest chunk), an all-gather of B bytes per rank N - 1 steps
    of alpha + B beta."""
    total = 0.0
    for collective in collectives_of_a_step:
        if collective[0] == "all-reduce":
            _, numel, element_bytes = collective
            total += 2 * (N - 1) * (latency + -(-numel // N) * element_bytes / bandwidth)
        else:
            total += (N - 1) * (latency + collective[1] / bandwidth)
    return total if N > 1 else 0.0


def topk_pays(k, d, N, index_bytes=8):
    """Whether top-k's all-gather, (N - 1) k (4 + index_bytes), sends fewer bytes than a dense
    fp32 ring all-reduce of d elements, 2 (N - 1)/N 4 d: k < 8 d / (N (4 + index_bytes)),
    i.e. k < 2 d / (3 N) with int64 indices and k < d / N with int32 ones."""
    return (N - 1) * k * (4 + index_bytes) < 2 * (N - 1) * 4 * d / N
