"""Which positions of the sequence each rank holds, and which blocks of attention it computes.

    contiguous, cp = 4:   rank 0: [0 1]     rank 1: [2 3]     rank 2: [4 5]     rank 3: [6 7]
    zig-zag,    cp = 4:   rank 0: [0 .. 7]  rank 1: [1 .. 6]  rank 2: [2 .. 5]  rank 3: [3 4]
                          (the sequence cut into 2 cp chunks; rank r holds chunks r and 2 cp - 1 - r)

Causal attention lets position i see keys j <= i. With the contiguous split rank r's queries
need the keys of ranks 0 .. r only: r + 1 of the cp blocks of keys, so rank cp - 1 works
cp times as long as rank 0 and the slowest rank takes 2 cp / (cp + 1) times the mean. The
zig-zag split gives every rank one early and one late chunk, and the same work.

``block_task(r, src, cp, split, causal)`` says what rank r computes with the keys and values
of rank src (the plan, as data): ring attention, the all-gather method and ``block_pairs``
(the load-balance count) all read it.
"""

from dataclasses import dataclass

import torch

from parlab._checks import rank as check_rank
from parlab._checks import whole_number

SPLITS = ("contiguous", "zigzag")


def contiguous_indices(s, cp, rank):
    """Positions rank ``rank`` holds under the contiguous split: [r s/cp, (r + 1) s/cp)."""
    n = _check_length(s, cp, rank, "contiguous")
    return torch.arange(rank * n, (rank + 1) * n)


def zigzag_indices(s, cp, rank):
    """Positions rank ``rank`` holds under the zig-zag (head-tail) split: the sequence cut into
    2 cp chunks of s/(2 cp) positions, rank r holds chunk r, then chunk 2 cp - 1 - r.
    zigzag_indices(8, 2, 0) == tensor([0, 1, 6, 7])."""
    n = _check_length(s, cp, rank, "zigzag") // 2
    head, tail = rank, 2 * cp - 1 - rank
    return torch.cat([torch.arange(head * n, (head + 1) * n), torch.arange(tail * n, (tail + 1) * n)])


def sequence_indices(s, cp, rank, split="contiguous"):
    """Positions rank ``rank`` holds under ``split`` ("contiguous" or "zigzag"), increasing."""
    return (zigzag_indices if _check_split(split) == "zigzag" else contiguous_indices)(s, cp, rank)


def reassembly_order(s, cp, split="contiguous"):
    """The inverse permutation of the split: with ``shards`` the cp ranks' positions
    concatenated in rank order (what an all-gather gives), ``shards[..., order, :]`` is the
    sequence in order. For the contiguous split it is 0, 1, ..., s - 1."""
    held = torch.cat([sequence_indices(s, cp, r, split) for r in range(cp)])  # position held at each slot
    return torch.argsort(held)


def shard_sequence(x, cp, rank, split="contiguous", dim=2):
    """Rank ``rank``'s positions of the full sequence ``x`` along ``dim`` (default 2: the s of
    (b, a, s, h/a)), as a contiguous tensor."""
    return x.index_select(dim, sequence_indices(x.shape[dim], cp, rank, split).to(x.device)).contiguous()


def unshard_sequence(shards, split="contiguous", dim=2):
    """The full sequence from the cp ranks' ``shards`` (a list in rank order): the inverse of
    ``shard_sequence``."""
    cp = len(shards)
    held = torch.cat(list(shards), dim)
    return held.index_select(dim, reassembly_order(held.shape[dim], cp, split).to(held.device))


@dataclass(frozen=True)
class BlockTask:
    """What a rank computes with another rank's keys and values: the rows ``queries`` of its
    own queries against the rows ``keys`` of the block ("all", "first half" or "second half"
    of the rank's s/cp positions), with the causal mask inside (``masked``: the diagonal
    block, where both hold the same positions) or without it (every key is visible)."""

    queries: str
    keys: str
    masked: bool

    @property
    def area(self):
        """The fraction of the (s/cp) x (s/cp) block pair computed: 1, or 1/2 for a half."""
        return _fraction(self.queries) * _fraction(self.keys)

    def query_rows(self, n):
        return _rows(self.queries, n)

    def key_rows(self, n):
        return _rows(self.keys, n)


def block_task(r, src, cp, split="contiguous", causal=False):
    """What rank r computes with the keys and values that rank src holds (None: nothing, the
    block lies above the diagonal). Non-causal: everything. Causal:

    - src == r: the diagonal block, all against all with the causal mask (in either split a
      rank's positions increase with the row, so the mask is the lower triangle);
    - contiguous, src < r: all against all, unmasked; src > r: skipped;
    - zig-zag, src < r: all queries against the block's first half (chunk src, before both of
      rank r's chunks; its chunk 2 cp - 1 - src comes after both);
      src > r: rank r's second half (chunk 2 cp - 1 - r) against all the block (chunks src and
      2 cp - 1 - src both come before it; rank r's chunk r comes before both).
    """
    if not causal:
        return BlockTask("all", "all", False)
    if src == r:
        return BlockTask("all", "all", True)
    if _check_split(split) == "contiguous":
        return BlockTask("all", "all", False) if src < r else None
    return BlockTask("all", "first half", False) if src < r else BlockTask("second half", "all", False)


def ring_sources(r, cp):
    """The ranks whose keys and values rank r holds at steps 0 .. cp - 1 of the ring: its own,
    then each one received from rank r - 1: r, r - 1, ..., r + 1 (mod cp)."""
    return [(r - i) % cp for i in range(cp)]


def block_pairs(cp, split="contiguous", causal=True):
    """The work of each rank, in (s/cp) x (s/cp) block pairs (a half block counts 1/2, the
    diagonal block 1: it is computed whole, with the mask). Causal: contiguous rank r computes
    r + 1; zig-zag every rank (cp + 1)/2. Non-causal: cp each. A list indexed by rank."""
    cp = whole_number("cp (the context-parallel degree)", cp, "count the ranks that split the sequence.")
    return [sum(task.area for src in range(cp) if (task := block_task(r, src, cp, split, causal)) is not None)
            for r in range(cp)]


def load_imbalance(work):
    """The slowest rank's work over the mean (1.0: balanced); for the contiguous causal split
    of ``block_pairs`` it is cp / ((cp + 1)/2) = 2 cp / (cp + 1)."""
    return max(work) / (sum(work) / len(work))


def check_shards(q, k, v, cp, split):
    """(b, a, n, h/a) of this rank's shards ``q``, ``k``, ``v``, n = s/cp; a ValueError saying
    what to change where they are not three tensors of one shape that the split can hold."""
    _check_split(split)
    if not all(torch.is_tensor(x) and x.dim() == 4 for x in (q, k, v)):
        raise ValueError("q, k and v must be tensors of shape (b, a, s/cp, h/a): this rank's positions of the "
                         "queries, keys and values, heads split out (x.view(b, s/cp, a, h/a).transpose(1, 2)).")
    if not q.shape == k.shape == v.shape or not q.dtype == k.dtype == v.dtype:
        raise ValueError(f"q, k and v must have one shape and dtype (b, a, s/cp, h/a), got {tuple(q.shape)} "
                         f"{q.dtype}, {tuple(k.shape)} {k.dtype} and {tuple(v.shape)} {v.dtype}: pass this rank's "
                         "shard of each, cut by the same split.")
    if split == "zigzag" and q.shape[2] % 2:
        raise ValueError(f"the zig-zag split gives each rank two chunks of s/(2 cp) positions, but this rank holds "
                         f"{q.shape[2]}: choose s a multiple of 2 cp = {2 * cp}.")
    return tuple(q.shape)


def _check_split(split):
    if split not in SPLITS:
        raise ValueError(f"split must be 'contiguous' or 'zigzag', got {split!r}: pick one of them.")
    return split


def _check_length(s, cp, rank, split):
    """s/cp, the positions of one rank, if the split cuts s evenly."""
    cp = whole_number("cp (the context-parallel degree)", cp, "count the ranks that split the sequence.")
    check_rank("rank", rank, cp, f"pass a rank of the cp = {cp} ranks.")
    parts = 2 * cp if _check_split(split) == "zigzag" else cp
    if whole_number("s (the sequence length)", s, "count the positions of the whole sequence.") % parts:
        how = f"into 2 cp = {parts} chunks" if split == "zigzag" else f"over cp = {cp} ranks"
        raise ValueError(f"the {split} split cuts s = {s} positions {how} of equal length: choose s a "
                         f"multiple of {parts}.")
    return s // cp


def _fraction(part):
    return 1.0 if part == "all" else 0.5


def _rows(part, n):
    return {"all": slice(0, n), "first half": slice(0, n // 2), "second half": slice(n // 2, n)}[part]
