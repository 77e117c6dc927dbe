"""Collectives from scratch: naive, ring, butterfly and tree, on traced point-to-point calls.

Each collective works in place on the default process group, like ``dist.all_reduce``, on
a contiguous tensor of any shape and length (it works on the flat view), and talks only
through ``parlab.p2p``, so ``cluster.trace`` counts its traffic exactly. Symbols (the
glossary's): N ranks, r a rank, j a step of a ring phase, D bytes in the tensor, alpha seconds
per message, beta seconds per byte (the times in the docstrings are those of
``parlab.alpha_beta.cost_model``).

Subgroups: the three ring collectives take ``group=`` (from ``dist.new_group(ranks)``) and are
then called by the group's members only; the ring goes round the group's ranks, N is the
group's size and r a rank's place in it (FSDP's HYBRID_SHARD shards its parameters within
one group and averages gradients across another).

Chunks: ring and butterfly cut the flat tensor into chunks as even as possible; the first
``numel % N`` of the N chunks are one element longer (as ``torch.tensor_split``;
``chunk_bounds`` and ``ring_chunks``). After ``ring_reduce_scatter`` rank r owns the reduced
chunk r, as ``torch.distributed.reduce_scatter`` gives rank r chunk r; ``ring_all_gather``
starts from there. Both run the ring's schedule as data, ``ring_steps(N)``.

Ops: "sum", "avg", "max", "min" or the matching ``dist.ReduceOp``; "avg" sums, then divides
by N once, so it needs a floating-point tensor.

The consistency check: a rank passing another shape, dtype, op or root would make the
others hang or reduce garbage. With ``check=True`` (the default) a call first ring
all-gathers one small record per rank (collective, op, root, dtype, shape) and raises the
same ValueError on every rank if they differ: N - 1 extra sends of ``METADATA_BYTES`` per
rank. Pass ``check=False`` on every rank to see the algorithm's own traffic alone.
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist

from parlab import p2p
from parlab._checks import rank as check_rank
from parlab._checks import whole_number

OPS = ("sum", "avg", "max", "min")
DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16,
          torch.int8, torch.uint8, torch.int32, torch.int64)
COLLECTIVES = ("naive_allreduce", "ring_reduce_scatter", "ring_all_gather", "ring_allreduce",
               "butterfly_allreduce", "tree_broadcast", "tree_reduce")
MAX_DIMS = 8
_RECORD = 5 + MAX_DIMS  # collective, op, root, dtype, ndim, then the shape padded with zeros
METADATA_BYTES = 8 * _RECORD  # one int64 record per rank
_REDUCE_OPS = {dist.ReduceOp.SUM: "sum", dist.ReduceOp.AVG: "avg", dist.ReduceOp.MAX: "max", dist.ReduceOp.MIN: "min"}


def naive_allreduce(tensor, op="sum", root=0, check=True):
    """All-reduce through one rank: every rank sends its tensor to ``root``, the root reduces
    the N tensors and sends the result back to every rank. Returns ``tensor``, now reduced.

    Traffic: each other rank sends D and receives D; the root receives (N - 1) D and sends
    (N - 1) D, one message at a time: time 2 (N - 1) (alpha + D beta).
    """
    flat, op = _prepare("naive_allreduce", tensor, op, root, check)
    rank, N = dist.get_rank(), dist.get_world_size()
    if rank != root:
        p2p.send(flat, root)
        p2p.recv(flat, root)
        return tensor
    others = [peer for peer in range(N) if peer != root]
    incoming = _scratch(flat, flat.numel())
    for peer in others:
        _reduce(op, flat, p2p.recv(incoming, peer))
    _average(op, flat, N)
    for peer in others:
        p2p.send(flat, peer)
    return tensor


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
    right, left = _global(group, rank + 1), _global(group, rank - 1)
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
    right, left = _global(group, rank + 1), _global(group, rank - 1)
    for step in ring_steps(N, "all-gather"):
        _exchange(chunks[step.send[rank]], right, chunks[step.receive[rank]], left)
    return tensor


def ring_allreduce(tensor, op="sum", check=True, group=None):
    """Ring all-reduce = ring reduce-scatter, then ring all-gather. Returns ``tensor``.

    Each rank sends 2 (N - 1) messages of one chunk each, 2 (N - 1)/N D bytes when N
    divides numel: time 2 (N - 1) alpha + 2 (N - 1)/N D beta, whatever N is.
    """
    flat, op = _prepare("ring_allreduce", tensor, op, None, check, group)
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


def butterfly_allreduce(tensor, op="sum", check=True):
    """Butterfly all-reduce: recursive halving (a reduce-scatter), then recursive doubling
    (an all-gather), log2 N rounds each. Returns ``tensor``.

    Halving: in the round at distance d = N/2, N/4, ..., 1, rank r and its partner r XOR d
    split the chunks they are responsible for in two; each keeps one half, sends the other
    and reduces the partner's copy of the kept half into its own. Rank r ends owning chunk r
    of N. Doubling replays the rounds backwards (d = 1, 2, ..., N/2), swapping owned halves.
    Time 2 log2(N) alpha + 2 (N - 1)/N D beta.

    N not a power of two: with P the largest power of two below N, rank P + i first folds
    its tensor into rank i, ranks 0..P-1 run the butterfly, and rank i sends the result back
    (unfold): 2 log2(P) alpha + 2 (P - 1)/P D beta + 2 (alpha + D beta).
    """
    flat, op = _prepare("butterfly_allreduce", tensor, op, None, check)
    rank, N = dist.get_rank(), dist.get_world_size()
    P = 1 << (N.bit_length() - 1)
    if rank >= P:  # an extra rank: fold into rank - P, wait for the unfold
        p2p.send(flat, rank - P)
        p2p.recv(flat, rank - P)
        return tensor
    if rank + P < N:
        _reduce(op, flat, p2p.recv(_scratch(flat, flat.numel()), rank + P))

    bounds = chunk_bounds(flat.numel(), P)
    incoming = _scratch(flat, bounds[P // 2][0])  # the first half is the largest
    lo, hi = 0, P  # the chunks [lo, hi) this rank is responsible for
    distance = P // 2
    while distance >= 1:  # recursive halving
        partner, mid = rank ^ distance, (lo + hi) // 2
        keep, give = ((mid, hi), (lo, mid)) if rank & distance else ((lo, mid), (mid, hi))
        kept = _span(flat, bounds, *keep)
        buffer = incoming[: kept.numel()]
        _exchange(_span(flat, bounds, *give), partner, buffer, partner)
        _reduce(op, kept, buffer)
        (lo, hi), distance = keep, distance // 2
    _average(op, _span(flat, bounds, lo, hi), N)

    distance = 1
    while distance < P:  # recursive doubling: the partner owns the sibling range
        partner, width = rank ^ distance, hi - lo
        sibling = (lo - width, lo) if rank & distance else (hi, hi + width)
        _exchange(_span(flat, bounds, lo, hi), partner, _span(flat, bounds, *sibling), partner)
        lo, hi, distance = min(lo, sibling[0]), max(hi, sibling[1]), distance * 2

    if rank + P < N:
        p2p.send(flat, rank + P)
    return tensor


def tree_broadcast(tensor, root=0, check=True):
    """Binomial-tree broadcast of ``root``'s tensor, in ceil(log2 N) rounds. Returns ``tensor``.

    Number the ranks by distance from the root, v = (r - root) mod N. In the round with
    m = 1, 2, 4, ... the m ranks v < m that hold the data send it to v + m: the number of
    ranks holding it doubles each round. Time ceil(log2 N) (alpha + D beta).
    """
    flat, _ = _prepare("tree_broadcast", tensor, None, root, check)
    rank, N = dist.get_rank(), dist.get_world_size()
    v = (rank - root) % N
    m = 1
    while m < N:
        if v < m and v + m < N:
            p2p.send(flat, (rank + m) % N)
        elif m <= v < 2 * m:
            p2p.recv(flat, (rank - m) % N)
        m *= 2
    return tensor


def tree_reduce(tensor, root=0, op="sum", check=True):
    """Binomial-tree reduce to ``root``, in ceil(log2 N) rounds: the broadcast run backwards.

    With v = (r - root) mod N, in the round with m = 1, 2, 4, ... a rank whose bit m is
    set sends its partial result to v - m and is done; the others receive from v + m (if
    it exists) and reduce. Only the root's tensor holds the result afterwards (like
    ``dist.reduce``); other ranks are left with partial results. Returns ``tensor``.
    """
    flat, op = _prepare("tree_reduce", tensor, op, root, check)
    rank, N = dist.get_rank(), dist.get_world_size()
    v = (rank - root) % N
    incoming = _scratch(flat, flat.numel())
    m = 1
    while m < N:
        if v & m:
            p2p.send(flat, (rank - m) % N)
            return tensor
        if v + m < N:
            _reduce(op, flat, p2p.recv(incoming, (rank + m) % N))
        m *= 2
    _average(op, flat, N)
    return tensor


def _global(group, group_rank):
    """The global rank (what p2p addresses) of ``group``'s rank ``group_rank`` mod its size."""
    group_rank %= dist.get_world_size(group)
    return group_rank if group is None else dist.get_global_rank(group, group_rank)


def _exchange(outgoing, dst, incoming, src):
    """Send ``outgoing`` to ``dst`` while receiving ``incoming`` from ``src``. Starting the
    send with isend lets both directions overlap, and no ring deadlocks with every rank
    sending first. An empty ``outgoing`` or ``incoming`` is skipped: its peer has it empty
    too (it is the same chunk)."""
    request = p2p.isend(outgoing, dst) if outgoing.numel() else None
    if incoming.numel():
        p2p.recv(incoming, src)
    if request is not None:
        request.wait()


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


_scratch_buffers = {}


def _scratch(like, numel):
    """A receive buffer of ``numel`` elements of ``like``'s dtype and device, reused from call
    to call (one per dtype and device, as large as the largest message so far): allocating
    and first touching fresh megabytes on every call costs about as much as moving them."""
    key = (like.dtype, like.device)
    buffer = _scratch_buffers.get(key)
    if buffer is None or buffer.numel() < numel:
        buffer = _scratch_buffers[key] = torch.empty(numel, dtype=like.dtype, device=like.device)
    return buffer[:numel]


def _reduce(op, accumulator, incoming):
    """accumulator <- accumulator (op) incoming, in place ("avg" sums; see ``_average``)."""
    if op == "max":
        torch.maximum(accumulator, incoming, out=accumulator)
    elif op == "min":
        torch.minimum(accumulator, incoming, out=accumulator)
    else:
        accumulator.add_(incoming)


def _average(op, reduced, N):
    if op == "avg":
        reduced.div_(N)


def _span(flat, bounds, lo, hi):
    """The chunks lo..hi-1 of ``flat`` (``bounds`` from ``chunk_bounds``), as one view."""
    return flat[bounds[lo][0] : bounds[hi - 1][1]]


def _prepare(collective, tensor, op, root, check, group=None):
    """Check the call (locally, then across ranks if ``check``); return the flat view and op name."""
    if not torch.is_tensor(tensor):
        raise ValueError(f"{collective} works in place on a torch tensor, got {type(tensor).__name__}: pass one, "
                         "e.g. torch.tensor(values, dtype=torch.float32).")
    if not tensor.is_contiguous():
        raise ValueError(f"{collective} works in place on a contiguous tensor; call .contiguous() on it first.")
    if tensor.dtype not in DTYPES:
        raise ValueError(f"{collective} supports the dtypes {[str(d) for d in DTYPES]}, not {tensor.dtype}.")
    if tensor.dim() > MAX_DIMS:
        raise ValueError(f"{collective} supports tensors of at most {MAX_DIMS} dimensions; reshape yours first.")
    if op is not None:
        op = _op_name(op, tensor)
    if root is not None:
        N = dist.get_world_size()
        check_rank("root", root, N, f"choose the rank that holds (or receives) the result, 0 to {N - 1}.")
    if check:
        _check_same_call(collective, tensor, op, root, group)
    return tensor.view(-1), op


def _op_name(op, tensor):
    name = _REDUCE_OPS.get(op, op) if not isinstance(op, str) else op.lower()
    if name not in OPS:
        raise ValueError(f"unknown op {op!r}; use one of {', '.join(map(repr, OPS))} or the matching dist.ReduceOp.")
    if name == "avg" and not tensor.is_floating_point():
        raise ValueError(f"op='avg' divides by N and needs a float tensor, not {tensor.dtype}; "
                         "convert it with .float().")
    return name


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
