"""Context parallelism: attention with the sequence split over the cp ranks of ``group``
(the world by default; on a mesh, its "cp" axis), every message inside that group.

Each rank holds its positions of the queries, keys and values as (b, a, s/cp, h/a), the
heads split out as torch's ``scaled_dot_product_attention`` takes them, and gets its
positions of the output. Three ways, with the elements each rank sends forward (``costs``):

    all_gather_attention   all-gather K and V, attend locally           2 (cp - 1) b s h / cp
    ring_attention         K/V blocks round the ring, merged online     2 (cp - 1) b s h / cp, beside compute
    ulysses_attention      all-to-all to a/cp heads of all s, and back  4 (cp - 1) b s h / cp^2

Which positions a rank holds is the split (``splits``): contiguous, or zig-zag, which gives
every rank the same causal work (``block_pairs``, ``load_imbalance``). Where each part lives:
``blocks.py`` (one block's attention and backward, ``merge_partial``), ``splits.py``
(positions, the plan ``block_task``, load balance), ``communication.py`` (all-gather and
all-to-all as autograd functions), one module per method, ``costs.py`` (bytes), and the small
GPT trained this way: ``gpt.py`` (``ContextParallelGPT``) and ``training.py``
(``ContextParallelTrainer`` on a mesh's cp x dp ranks, with tp: cp x tp x dp).
Symbols are the glossary's; cp is the context-parallel degree, the size of ``group``.
"""

from parlab.context_parallel.all_gather import all_gather_attention
from parlab.context_parallel.blocks import accumulate, attention_block, attention_block_backward, merge_partial
from parlab.context_parallel.communication import all_to_all, gather_blocks
from parlab.context_parallel.costs import METHODS, bytes_per_rank
from parlab.context_parallel.gpt import ContextParallelAttention, ContextParallelGPT
from parlab.context_parallel.ring import ring_attention
from parlab.context_parallel.splits import (
    SPLITS,
    BlockTask,
    block_pairs,
    block_task,
    contiguous_indices,
    load_imbalance,
    reassembly_order,
    ring_sources,
    sequence_indices,
    shard_sequence,
    unshard_sequence,
    zigzag_indices,
)
from parlab.context_parallel.training import ContextParallelTrainer
from parlab.context_parallel.ulysses import ulysses_attention

ATTENTION = {"all-gather": all_gather_attention, "ring": ring_attention, "ulysses": ulysses_attention}
"""The three methods by name (``METHODS``), each called as method(q, k, v, causal, split, group, scale)."""

__all__ = ["ATTENTION", "METHODS", "SPLITS", "BlockTask", "ContextParallelAttention", "ContextParallelGPT",
           "ContextParallelTrainer", "accumulate", "all_gather_attention", "all_to_all", "attention_block",
           "attention_block_backward", "block_pairs", "block_task", "bytes_per_rank", "contiguous_indices",
           "gather_blocks", "load_imbalance", "merge_partial", "reassembly_order", "ring_attention", "ring_sources",
           "sequence_indices", "shard_sequence", "ulysses_attention", "unshard_sequence", "zigzag_indices"]
