"""The flat layout ZeRO and FSDP share: padding, shard ownership, and the ring round trip."""

import pytest
import torch
import torch.distributed as dist

from parlab.flat import FlatLayout, all_gather, reduce_scatter


def test_padding_and_shards():
    layout = FlatLayout([(3, 2), (5,)], 4)
    assert (layout.numel, layout.shard_numel, layout.padded_numel) == (11, 3, 12)
    assert [layout.shard_bounds(r) for r in range(4)] == [(0, 3), (3, 6), (6, 9), (9, 12)]  # rank r: shard r
    flat = layout.flatten([torch.ones(3, 2), torch.arange(5.0)])
    assert flat.tolist() == [1, 1, 1, 1, 1, 1, 0, 1, 2, 3, 4, 0]
    weight, bias = layout.views(flat)
    assert weight.shape == (3, 2) and bias.tolist() == [0, 1, 2, 3, 4]
    bias.add_(1)  # views write through to the flat buffer
    assert flat[6:11].tolist() == [1, 2, 3, 4, 5]


def test_every_shard_nonempty_even_for_tiny_groups():
    layout = FlatLayout([(1,)], 4)
    assert (layout.shard_numel, layout.padded_numel) == (1, 4)


def test_bad_input_says_what_to_change():
    layout = FlatLayout([(2,)], 2)
    with pytest.raises(ValueError, match="shapes"):
        layout.flatten([torch.ones(3)])
    with pytest.raises(ValueError, match="padded flat buffer of 2 elements"):
        layout.views(torch.ones(3))
    with pytest.raises(ValueError, match=r"world_size .* must be a whole number >= 1"):
        FlatLayout([(2,)], 0)


def _round_trip():
    rank, N = dist.get_rank(), dist.get_world_size()
    layout = FlatLayout([(3, 2), (5,)], N)
    grads = layout.flatten([torch.full((3, 2), float(rank)), torch.arange(5.0) * (rank + 1)])
    mine = reduce_scatter(grads, layout, rank).clone()
    gathered = torch.zeros(layout.padded_numel)
    layout.shard(gathered, rank).copy_(mine)
    return mine, all_gather(gathered, layout)


@pytest.mark.parametrize("world", ["cluster2", "cluster4"])
def test_reduce_scatter_then_all_gather_is_the_average(world, request):
    cluster = request.getfixturevalue(world)
    N = cluster.world_size
    layout = FlatLayout([(3, 2), (5,)], N)
    mean_rank = (N - 1) / 2
    expected = layout.flatten([torch.full((3, 2), mean_rank), torch.arange(5.0) * (mean_rank + 1)])
    for rank, (mine, gathered) in enumerate(cluster.run(_round_trip, timeout=60)):
        # Small integers: every sum of them, and its division by N = 2 or 4, is exact in fp32.
        assert torch.equal(mine, layout.shard(expected, rank))
        assert torch.equal(gathered, expected)
