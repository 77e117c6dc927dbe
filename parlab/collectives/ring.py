"""The ring: its schedule as data (``ring_steps``, replayed on paper by ``ring_contributions``),
the chunks it cuts (``chunk_bounds``, ``ring_chunks``), and the reduce-scatter, all-gather
and all-reduce that run it (``parlab.collectives`` describes the package: ops, subgroups,
the consistency check, which lives here because it is a ring all-gather of one record per rank).
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist

from parlab._checks import whole_number
from parlab.collectives._common import (
    COLLECTIVES,
    DTYPES,
    MAX_DIMS,
    OPS,
    _average,
    _check_locally,
    _exchange,
    _reduce,
    _scratch,
)
from parlab.p2p import global_rank

_RECORD = 5 + MAX_DIMS  # collective, op, root, dtype, ndim, then the shape padded with zeros
METADATA_BYTES = 8 * _RECORD  # one int64 record per rank


@dataclass(frozen=True)
class RingStep:
    """One step of a ring phase, for all N ranks at once: rank r sends its chunk ``send[r]``
    to rank (r + 1) mod N while it receives chunk ``receive[r]`` from rank (r - 1) mod N,
    which it reduces into its own copy (``action`` "reduce") or writes over it ("copy")."""

    phase: str  # "reduce-scatter" or "all-gather"
    j: int  # the step within its phase: 0 .. N - 2
    send: tuple
    receive: tuple
    action: str


RING_PHASES = ("reduce-scatter", "all-gather")


def ring_steps(N, phase=None):
    """The ring all-reduce schedule as data: the N - 1 steps of the reduce-scatter, then the
    N - 1 steps of the all-gather (only the steps of ``phase`` when it is given).

    Reduce-scatter step j: rank r sends chunk (r - j - 1) mod N, receives chunk (r - j - 2) mod N
    and reduces it, so chunk c starts at rank c + 1 and ends, after N - 1 hops, complete on rank
    c. All-gather step j: rank r sends chunk (r - j) mod N, receives chunk (r - j - 1) mod N and
    copies it: each rank first sends the chunk it owns, then forwards what it received. Either
    way rank r + 1 receives the chunk rank r sends. ``ring_reduce_scatter`` and
    ``ring_all_gather`` run these steps; ``ring_contributions`` replays them on paper.
    """
    whole_number("N (the number of ranks)", N, "give the ring's size as a count, such as N = 4.")
    if phase not in (None, *RING_PHASES):
        raise ValueError(f"phase must be None, 'reduce-scatter' or 'all-gather', got {phase!r}: pass one of them "
                         "(None: both phases).")

    def chunk_of_each_rank(offset):
        return tuple((r + offset) % N for r in range(N))

    steps = []
    if phase in (None, "reduce-scatter"):
        steps += [RingStep("reduce-scatter", j, chunk_of_each_rank(-j - 1), chunk_of_each_rank(-j - 2), "reduce")
                  for j in range(N - 1)]
    if phase in (None, "all-gather"):
        steps += [RingStep("all-gather", j, chunk_of_each_rank(-j), chunk_of_each_rank(-j - 1), "copy")
                  for j in range(N - 1)]
    return steps


def ring_reduce_scatter(tensor, op="sum", check=True, group=None, parts=None):
    """Ring reduce-scatter: the N - 1 "reduce-scatter" steps of ``ring_steps(N)``; at step j
    rank r sends chunk (r - j - 1) mod N to rank r + 1, receives chunk (r - j - 2) mod N from
    rank r - 1 and reduces it into its own copy.

    Returns r, the index of the chunk this rank now owns: chunk r of the flat tensor holds the
    reduction over all ranks (as chunk r of ``torch.distributed.reduce_scatter``); the other
    chunks hold partial results. Each rank sends every chunk but chunk r: (N - 1)/N D when N
    divides numel.

    ``parts``: the chunks' bounds [(start, end)] in the flat tensor, one per rank, of any
    sizes, the same on every rank (default: ``chunk_bounds``). An empty part is never sent
    (ZeRO stage 2 cuts a bucket of gradients where the ranks' shards cut it, and a bucket may
    miss a rank's shard).
    """
    flat, op = _prepare("ring_reduce_scatter", tensor, op, None, check, group)
    rank, N = dist.get_rank(group), dist.get_world_size(group)
    chunks = ring_chunks(flat, group) if parts is None else _parts(flat, parts, N)
    incoming = _scratch(flat, max(chunk.numel() for chunk in chunks))
    right, left = global_rank(group, rank + 1), global_rank(group, rank - 1)
    for step in ring_steps(N, "reduce-scatter"):
        sent, received = chunks[step.send[rank]], chunks[step.receive[rank]]
        buffer = incoming[: received.numel()]
        _exchange(sent, right, buffer, left)
        _reduce(op, received, buffer)
    _average(op, chunks[rank], N)
    return rank


def ring_all_gather(tensor, check=True, group=None):
    """Ring all-gather: starting from "rank r owns chunk r" (what ``ring_reduce_scatter``
    leaves), the N - 1 "all-gather" steps of ``ring_steps(N)``; at step j rank r sends chunk
    (r - j) mod N to rank r + 1 and receives chunk (r - j - 1) mod N from rank r - 1, straight
    into place. Afterwards every rank holds every rank's owned chunk. Returns ``tensor``.
    Each rank sends every chunk but (r + 1) mod N: (N - 1)/N D when N divides numel.
    """
    flat, _ = _prepare("ring_all_gather", tensor, None, None, check, group)
    rank, N = dist.get_rank(group), dist.get_world_size(group)
    chunks = ring_chunks(flat, group)
    right, left = global_rank(group, rank + 1), global_rank(group, rank - 1)
    for step in ring_steps(N, "all-gather"):
        _exchange(chunks[step.send[rank]], right, chunks[step.receive[rank]], left)
    return tensor


def ring_all_reduce(tensor, op="sum", check=True, group=None):
    """Ring all-reduce = ring reduce-scatter, then ring all-gather. Returns ``tensor``.

    Each rank sends 2 (N - 1) messages of one chunk each, 2 (N - 1)/N D bytes when N
    divides numel: time 2 (N - 1) alpha + 2 (N - 1)/N D beta, whatever N is.
    """
    flat, op = _prepare("ring_all_reduce", tensor, op, None, check, group)
    ring_reduce_scatter(flat, op, check=False, group=group)  # the owned chunk is already divided for "avg"
    ring_all_gather(flat, check=False, group=group)
    return tensor


def ring_contributions(N, step):
    """The state of a sum all-reduce by ring after the first ``step`` steps of
    ``ring_steps(N)``, 0 <= step <= 2 (N - 1), worked out without running it: an N x N list
    whose entry [r][c] is the frozenset of ranks whose chunk c is summed in rank r's chunk c.

    Before any step every rank holds only its own data: {r}. At each step every rank sends
    what it held before the step, so a "reduce" adds the sender's set to the receiver's and
    a "copy" replaces it. After the reduce-scatter (step N - 1) rank r's chunk r holds all N
    ranks; after the all-gather (step 2 (N - 1)) every chunk does.
    """
    steps = ring_steps(N)
    whole_number("step", step, f"count the steps taken so far, from 0 to 2 (N - 1) = {len(steps)}.", minimum=0)
    if step > len(steps):
        raise ValueError(f"step must be between 0 and 2 (N - 1) = {len(steps)}, got {step}.")
    held = [[frozenset([r])] * N for r in range(N)]
    for ring_step in steps[:step]:
        before, held = held, [list(row) for row in held]
        for r in range(N):
            chunk = ring_step.receive[r]
            arriving = before[(r - 1) % N][chunk]
            held[r][chunk] = held[r][chunk] | arriving if ring_step.action == "reduce" else arriving
    return held


def chunk_bounds(numel, N):
    """[(start, end)] of the N chunks of ``numel`` elements, as even as possible: numel // N
    each, one more for the first numel % N (``torch.tensor_split``'s cut; chunks are empty when
    numel < N). chunk_bounds(10, 4) == [(0, 3), (3, 6), (6, 8), (8, 10)]."""
    whole_number("N (the number of chunks)", N, "cut into one chunk per rank, N = the world size.")
    base, extra = divmod(numel, N)
    starts = [c * base + min(c, extra) for c in range(N + 1)]
    return list(zip(starts[:-1], starts[1:]))


def ring_chunks(tensor, group=None):
    """The N chunks (``chunk_bounds``) of ``tensor``'s flat view, N the size of ``group`` (the
    world by default), as views: writing into a chunk writes into ``tensor``."""
    if not tensor.is_contiguous():
        raise ValueError("ring collectives cut the flat view of a contiguous tensor: pass tensor.contiguous() "
                         "and copy the result back.")
    flat = tensor.view(-1)
    return [flat[start:end] for start, end in chunk_bounds(flat.numel(), dist.get_world_size(group))]


def _parts(flat, parts, N):
    """Views of ``flat`` for the explicit ``parts`` of ``ring_reduce_scatter``, checked."""
    fix = f"pass one (start, end) per rank, N = {N} of them, with 0 <= start <= end <= numel = {flat.numel()}."
    try:
        bounds = [(int(start), int(end)) for start, end in parts]
    except (TypeError, ValueError):
        raise ValueError(f"parts must be (start, end) pairs, got {parts!r}: {fix}") from None
    if len(bounds) != N or not all(0 <= start <= end <= flat.numel() for start, end in bounds):
        raise ValueError(f"parts {parts!r} do not cut a tensor of {flat.numel()} elements for {N} ranks: {fix}")
    return [flat[start:end] for start, end in bounds]


def _prepare(collective, tensor, op, root, check, group=None):
    """Check the call (locally, then across ranks if ``check``); return the flat view and op name."""
    op = _check_locally(collective, tensor, op, root)
    if check:
        _check_same_call(collective, tensor, op, root, group)
    return tensor.view(-1), op


def _check_same_call(collective, tensor, op, root, group=None):
    """Ring all-gather every rank's call record; raise the same ValueError on every rank if
    they differ. Rank r starts owning row r, as ``ring_all_gather`` expects."""
    rank, N = dist.get_rank(group), dist.get_world_size(group)
    records = torch.zeros(N, _RECORD, dtype=torch.int64, device=tensor.device)  # NCCL sends GPU tensors only
    records[rank, :5] = torch.tensor([
        COLLECTIVES.index(collective), -1 if op is None else OPS.index(op), -1 if root is None else root,
        DTYPES.index(tensor.dtype), tensor.dim(),
    ])
    records[rank, 5 : 5 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.int64)
    ring_all_gather(records, check=False, group=group)
    if bool((records == records[0]).all()):
        return
    calls = "; ".join(f"rank {r}: {_describe(records[r].tolist())}" for r in range(N))
    raise ValueError(
        f"{collective} needs the same call on every rank, but the ranks differ: {calls}. "
        "Pass a tensor of the same shape and dtype, with the same op and root, on every rank."
    )


def _describe(record):
    collective, op, root, dtype, ndim = record[:5]
    call = f"{COLLECTIVES[collective]}({DTYPES[dtype]} tensor of shape {tuple(record[5 : 5 + ndim])}"
    call += "" if op < 0 else f", op={OPS[op]!r}"
    return call + ("" if root < 0 else f", root={root}") + ")"
