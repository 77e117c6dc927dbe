"""How compressed gradients travel: every message goes through parlab's ring collectives (so
through ``parlab.p2p``), so an emulated link charges it and the trace counts its bytes.

Two ways, by what the payload is (symbols: N ranks, d elements of the gradient, k the
compressor's budget, b bytes of an element):

    payload                                 collective        bytes each rank sends
    dense-shaped, same positions on every   ring all-reduce   2 (N - 1)/N L b for L elements
    rank (fp16, random-k with a shared                        (exact when N divides L;
    seed, int8 signs, PowerSGD's P and Q)                     ``ring_all_reduce_sent``)
    a different message per rank (top-k's  ring all-gather   (N - 1) B for B bytes per rank
    (values, indices), QSGD's norm and
    levels)

A message of several tensors (fp32 values and int64 indices) is packed into one buffer of
bytes (``pack``), so it travels as one all-gather and its bytes are exactly the sum of its
parts: top-k sends (N - 1) k (4 + 8) bytes, against a dense ring's 2 (N - 1)/N 4 d. Top-k
pays off only when k (4 + 8) < 2 (4 d) / N, i.e. k < 2 d / (3 N) with int64 indices, and
k < d / N with int32 ones (``topk_pays``).

On one axis of a ``parlab.Mesh`` (``group=mesh.group("dp")``) both travel inside the group:
N is the group's size and r a rank's place in it, and only the group's members call them.
"""

import torch

from parlab import _checks, collectives


def place_in(group=None):
    """(r, N): this rank's place in ``group`` and the group's size (``group=None``: every rank
    of the world). Only the group's members may call its collectives: a ValueError for others."""
    return _checks.place_in(group, "pass each rank the group it belongs to (e.g. mesh.group(\"dp\")), and call "
                                   "the compressor only on its members.")


def all_reduce_sum(tensor, group=None):
    """Sum ``tensor`` over the ranks of ``group`` (default: all) in place with parlab's ring
    all-reduce; returns it."""
    place_in(group)
    return collectives.ring_all_reduce(tensor, check=False, group=group)


def all_gather(message, group=None):
    """Every rank's 1-D ``message`` (the same length on every rank of ``group``, default: all):
    an (N, L) tensor whose row r is that of the group's rank r. A ring all-gather: each rank
    sends (N - 1) L elements."""
    rank, N = place_in(group)
    gathered = torch.empty(N, message.numel(), dtype=message.dtype, device=message.device)
    gathered[rank] = message  # rank r owns chunk r, as ring_all_gather expects
    collectives.ring_all_gather(gathered, check=False, group=group)
    return gathered


def pack(*tensors):
    """One flat uint8 buffer holding the bytes of ``tensors`` (contiguous, any dtypes), in order."""
    return torch.cat([t.contiguous().view(-1).view(torch.uint8) for t in tensors])


def unpack(buffer, layout):
    """The tensors that ``pack`` put into ``buffer`` (or each row of a gathered (N, B) buffer):
    ``layout`` is [(numel, dtype), ...] in packing order. Returns tensors shaped like
    ``buffer``'s leading dimensions + (numel,), copied out of it."""
    parts, start = [], 0
    for numel, dtype in layout:
        nbytes = numel * dtype.itemsize
        parts.append(buffer[..., start : start + nbytes].clone().view(dtype))  # a copy: aligned for dtype
        start += nbytes
    if start != buffer.shape[-1]:
        raise ValueError(f"the layout describes {start} bytes but the buffer holds {buffer.shape[-1]}.")
    return parts


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
