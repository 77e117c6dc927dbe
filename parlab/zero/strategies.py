"""FSDP's sharding strategies as process groups: over how many ranks S a unit is sharded
(``parlab.zero.fsdp``'s table of strategies), and the groups a rank shards and replicates in.

    FULL_SHARD, SHARD_GRAD_OP   S = N_d            one shard group: all ranks
    NO_SHARD                    S = 1              N_d replicas, the gradients all-reduced
    HYBRID_SHARD                S = shard_group_size (N_d / 2 by default): shard within groups
                                of S consecutive ranks, replicate across the N_d / S groups
"""

import torch.distributed as dist

from parlab import _checks

STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD")


def _shard_group_size(strategy, N, shard_group_size):
    if not isinstance(strategy, str) or strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {', '.join(map(repr, STRATEGIES))}; got {strategy!r}: pick one "
                         "(FULL_SHARD is ZeRO stage 3).")
    if shard_group_size is not None and strategy != "HYBRID_SHARD":
        raise ValueError(f"shard_group_size is for HYBRID_SHARD; {strategy} shards over "
                         f"{'1 rank' if strategy == 'NO_SHARD' else 'all ranks'}: drop the argument.")
    if strategy != "HYBRID_SHARD":
        return 1 if strategy == "NO_SHARD" else N
    if shard_group_size is None:
        if N % 2:
            raise ValueError(f"HYBRID_SHARD shards within groups of N_d / 2 ranks and replicates across 2, so it "
                             f"needs an even number of ranks, not {N}: use an even world size, pass "
                             f"shard_group_size=S with S dividing {N}, or use FULL_SHARD.")
        return N // 2
    _checks.whole_number("shard_group_size", shard_group_size, "give the number of ranks of one shard group.")
    if N % shard_group_size:
        raise ValueError(f"shard_group_size must divide the world size {N} (groups of equal size); "
                         f"got {shard_group_size}.")
    return shard_group_size


def _process_groups(N, S, group=None):
    """((shard group, S), (replicate group, N / S)) of this rank: ranks [g S, (g + 1) S) shard
    together, ranks i, i + S, i + 2 S, ... replicate. A group of all N ranks is ``group``
    (None: the default group); one of 1 rank is never used. Every rank creates every group,
    as dist.new_group requires (HYBRID_SHARD, over the world only)."""
    if S in (1, N):
        return (group, S), (group, N // S)
    rank = dist.get_rank()
    shard_groups = [dist.new_group(list(range(g * S, (g + 1) * S))) for g in range(N // S)]
    replicate_groups = [dist.new_group(list(range(i, N, S))) for i in range(S)]
    return (shard_groups[rank // S], S), (replicate_groups[rank % S], N // S)
