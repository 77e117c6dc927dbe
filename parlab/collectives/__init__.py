"""Collectives from scratch: naive, ring, butterfly, tree and all-to-all, on traced point-to-point calls.

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

The all-to-all is the one that does not work in place: ``all_to_all(x, output_splits,
input_splits, group)`` returns the rows it received, as ``dist.all_to_all_single`` fills its
output; chunks may be uneven and empty, and it makes no check across ranks (each rank already
needs the sizes it will receive). Context and expert parallelism both trade through it.

Where each algorithm lives: ``ring.py`` (the ring's schedule, chunks and collectives, and the
consistency check), ``tree.py`` (naive all-reduce, tree broadcast and reduce), ``butterfly.py``,
``all_to_all.py`` (its ring-shift schedule and the exchange), and ``_common.py`` (the local
checks, the neighbour exchange, reductions, receive buffers).
"""

from parlab.collectives._common import COLLECTIVES, DTYPES, MAX_DIMS, OPS
from parlab.collectives.all_to_all import AllToAllStep, all_to_all, all_to_all_steps
from parlab.collectives.butterfly import butterfly_all_reduce
from parlab.collectives.ring import (
    METADATA_BYTES,
    RING_PHASES,
    RingStep,
    chunk_bounds,
    ring_all_gather,
    ring_all_reduce,
    ring_chunks,
    ring_contributions,
    ring_reduce_scatter,
    ring_steps,
)
from parlab.collectives.tree import naive_all_reduce, tree_broadcast, tree_reduce

__all__ = ["OPS", "DTYPES", "COLLECTIVES", "MAX_DIMS", "METADATA_BYTES", "RING_PHASES", "RingStep", "ring_steps",
           "naive_all_reduce", "ring_reduce_scatter", "ring_all_gather", "ring_all_reduce", "ring_contributions",
           "chunk_bounds", "ring_chunks", "butterfly_all_reduce", "tree_broadcast", "tree_reduce", "AllToAllStep",
           "all_to_all", "all_to_all_steps"]
