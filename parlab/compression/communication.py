"""The wire of gradient compression: every message goes through parlab's ring collectives
(so through ``parlab.p2p``), so an emulated link charges it and the trace counts its bytes.

Two ways, by what the payload is (symbols: N ranks, d elements of the gradient, k the
compressor's budget, b bytes of an element):

    payload                                 collective        bytes each rank sends
    dense-shaped, same positions on every   ring all-reduce   2 (N - 1)/N L b for L elements
    rank (fp16, random-k with a shared                        (exact when N divides L;
    seed, int8 signs, PowerSGD's P and Q)                     ``costs.ring_all_reduce_sent``)
    a different message per rank (top-k's  ring all-gather   (N - 1) B for B bytes per rank
    (values, indices), QSGD's norm and
    levels)

A message of several tensors (fp32 values and int64 indices) is packed into one buffer of
bytes (``pack``), so it travels as one all-gather and its bytes are exactly the sum of its
parts: top-k sends (N - 1) k (4 + 8) bytes, against a dense ring's 2 (N - 1)/N 4 d (what
that costs, and where top-k stops paying: ``parlab.compression.costs``).

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
