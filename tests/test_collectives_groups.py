"""The ring collectives on subgroups (group=): a 2 x 2 grid of 4 ranks, rings within rows
[0, 1], [2, 3] and within columns [0, 2], [1, 3], as FSDP's HYBRID_SHARD uses them."""

import pytest
import torch
import torch.distributed as dist

import parlab
from parlab import trace
from parlab.collectives import ring_all_gather, ring_all_reduce, ring_reduce_scatter

ROWS, COLUMNS = [[0, 1], [2, 3]], [[0, 2], [1, 3]]


def grid_collectives(numel, check):
    """On every rank: sum all-reduce within its row, then reduce-scatter and all-gather
    within its column, each on a tensor of ``numel`` copies of (rank + 1)."""
    rank = dist.get_rank()
    groups = {tuple(ranks): dist.new_group(ranks) for ranks in ROWS + COLUMNS}  # every rank makes every group
    row, column = (groups[tuple(g)] for g in (ROWS[rank // 2], COLUMNS[rank % 2]))
    with trace.span("row"):
        summed = ring_all_reduce(torch.full((numel,), rank + 1.0), check=check, group=row)
    x = torch.full((numel,), rank + 1.0)
    with trace.span("column"):
        owned = ring_reduce_scatter(x, op="avg", check=check, group=column)
        reduced = x.tensor_split(2)[owned].clone()
        ring_all_gather(x, check=check, group=column)
    return summed, owned, reduced, x


@pytest.mark.parametrize("check", [False, True])
def test_rings_within_rows_and_columns_reduce_the_group_only(check, cluster4):
    numel = 5  # chunks of 3 and 2 elements
    timeline = cluster4.trace(grid_collectives, numel, check, timeout=60)
    for rank, (summed, owned, reduced, gathered) in enumerate(timeline.results):
        row, column = ROWS[rank // 2], COLUMNS[rank % 2]
        # Small integers and their halves: exact in fp32, so the results are too.
        assert torch.equal(summed, torch.full((numel,), sum(r + 1.0 for r in row)))
        assert owned == column.index(rank)  # its place in the group: group rank r owns chunk r
        column_mean = sum(r + 1.0 for r in column) / 2
        assert torch.equal(reduced, torch.full_like(reduced, column_mean))
        assert torch.equal(gathered, torch.full((numel,), column_mean))
        for phase, partners in (("row", row), ("column", column)):
            span = timeline.select(rank=rank, name=phase)[0]
            sends = [ev for ev in timeline.select(rank=rank, name="isend") if span.start <= ev.start <= span.end]
            assert {ev.peer for ev in sends} == set(partners) - {rank}
            if not check:  # a ring of 2 sends one chunk per step: 1 + 1 (all-reduce), 1 + 1 (RS + AG)
                assert len(sends) == 2


def mismatched_call_in_group():
    rank = dist.get_rank()
    groups = [dist.new_group(ranks) for ranks in ROWS]
    row = groups[rank // 2]
    ring_all_reduce(torch.ones(3 if rank == 3 else 4), group=row)


def test_the_consistency_check_runs_within_the_group(cluster4):
    with pytest.raises(parlab.RankError, match="ranks differ"):
        cluster4.run(mismatched_call_in_group, timeout=60)
