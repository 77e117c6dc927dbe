"""DistributedSampler from scratch: which samples each data-parallel rank reads.

Data parallelism splits every batch across the N_d ranks, so each rank must read a
different shard of the dataset, all of the same length (a rank with fewer samples would
reach the gradient all-reduce one step early and leave the others waiting). The recipe,
the same as ``torch.utils.data.distributed.DistributedSampler`` (same indices for the same
settings):

1. order: ``0 .. L-1``, or, with ``shuffle``, a permutation drawn from a generator seeded
   with ``seed + epoch``. Every rank draws the same permutation; ``set_epoch`` changes it.
2. even out: with ``drop_last`` cut the tail to a multiple of N_d; otherwise pad to the next
   multiple by wrapping around to the start (a few samples are then read twice per epoch).
3. deal: rank r takes positions r, r + N_d, r + 2 N_d, ... (strided, like dealing cards).

The shards never overlap (apart from the padding repeats) and their union is the dataset.
"""

import math
import numbers

import torch
import torch.distributed as dist

from parlab._checks import whole_number


class DistributedSampler(torch.utils.data.Sampler):
    """The indices of rank ``rank``'s shard of a dataset of length L, in reading order.

    ``dataset_or_len``: a dataset (anything with ``len``) or its length L.
    ``num_replicas`` (N_d) and ``rank`` default to the process group's world size and rank.
    Each rank reads ``num_samples`` indices per epoch:
    ceil(L / N_d), or floor(L / N_d) with ``drop_last``.
    """

    def __init__(self, dataset_or_len, num_replicas=None, rank=None, shuffle=True, seed=0, drop_last=False):
        if isinstance(dataset_or_len, numbers.Integral) or not hasattr(dataset_or_len, "__len__"):
            length = whole_number("dataset_or_len", dataset_or_len, "pass the dataset (anything with len) or its "
                                  "number of samples.", minimum=0)
        else:
            length = len(dataset_or_len)
        num_replicas = dist.get_world_size() if num_replicas is None else num_replicas
        rank = dist.get_rank() if rank is None else rank
        whole_number("num_replicas (N_d, the number of data-parallel ranks)", num_replicas,
                     "give the number of ranks that share the dataset, or leave it out to use the world size.")
        if isinstance(rank, bool) or not isinstance(rank, numbers.Integral) or not 0 <= rank < num_replicas:
            raise ValueError(f"rank must be between 0 and num_replicas - 1 = {num_replicas - 1}, got {rank!r}: pass "
                             "this rank's place among the num_replicas ranks, or leave it out to use dist.get_rank().")
        whole_number("seed", seed, "give a whole number >= 0; every rank must pass the same one.", minimum=0)
        self.length, self.num_replicas, self.rank = length, num_replicas, rank
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.epoch = 0
        self.num_samples = length // num_replicas if drop_last else math.ceil(length / num_replicas)
        self.total_size = self.num_samples * num_replicas

    def set_epoch(self, epoch):
        """Use the permutation of epoch ``epoch`` (call it on every rank before each epoch,
        or every epoch reads the samples in the same order)."""
        self.epoch = whole_number("epoch", epoch, "count epochs from 0, the same on every rank.", minimum=0)

    def __iter__(self):
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.length, generator=generator).tolist()
        else:
            order = list(range(self.length))
        # drop_last: total_size <= L cuts the tail; otherwise wrap around to pad.
        evened = [order[i % self.length] for i in range(self.total_size)]
        return iter(evened[self.rank :: self.num_replicas])

    def __len__(self):
        return self.num_samples
