"""Flat parameters: a group of tensors as one padded 1-D buffer cut into N_d equal shards.

The sharding helper of ZeRO and FSDP (``parlab.zero``) and of ZeRO's optimizer
(``parlab.zero.ShardedOptimizer``). The parameters of a unit (a layer, a block,
the whole model) are laid end to end in one flat buffer of Psi_u elements, padded with
zeros to a multiple of N_d, and cut into N_d shards of ceil(Psi_u / N_d) elements each.
The padding makes every shard the same size, so one ring reduce-scatter or all-gather moves
the whole buffer, and each rank keeps exactly one shard of the parameters, gradients and
optimizer state: Psi_u / N_d elements (plus at most N_d - 1 elements of padding per unit).

Rank r owns shard r, as ``torch.distributed.reduce_scatter`` gives rank r chunk r: after
``ring_reduce_scatter`` (``parlab.collectives``) rank r holds the fully reduced chunk r, and
``ring_all_gather`` starts from exactly that.

    layout = FlatLayout([p.shape for p in unit.parameters()], N_d)
    flat = layout.flatten([p.detach() for p in unit.parameters()])   # padded, 1-D
    mine = layout.shard(flat, rank)                                   # a view, Psi_u / N_d
    reduce_scatter(flat_grad, layout, rank)  # -> view of this rank's averaged gradient shard
    all_gather(flat, layout)                 # every rank's shard into every rank's flat
"""

import math

import torch

from parlab import collectives
from parlab._checks import rank as check_rank
from parlab._checks import whole_number


class FlatLayout:
    """Where each tensor of a group lives in the flat buffer, and where each shard begins.

    ``shapes``: the tensors' shapes, in order. ``world_size``: N_d. Attributes: ``numel``
    (Psi_u, the real elements), ``padded_numel`` (a multiple of N_d), ``shard_numel``
    (padded_numel / N_d) and ``offsets`` (start of each tensor in the flat buffer).
    """

    def __init__(self, shapes, world_size):
        whole_number("world_size (N_d, the number of shards)", world_size,
                     "pass the number of ranks that share the buffer, e.g. dist.get_world_size().")
        try:
            self.shapes = [torch.Size(shape) for shape in shapes]
        except TypeError:
            raise ValueError(f"shapes must be a list of tensor shapes, got {shapes!r}: pass "
                             "[p.shape for p in parameters].") from None
        self.world_size = world_size
        self.numels = [shape.numel() for shape in self.shapes]
        self.offsets = [sum(self.numels[:i]) for i in range(len(self.numels))]
        self.numel = sum(self.numels)
        self.shard_numel = max(1, math.ceil(self.numel / world_size))
        self.padded_numel = self.shard_numel * world_size

    def __repr__(self):
        return (f"FlatLayout({len(self.shapes)} tensors, {self.numel} elements, "
                f"{self.world_size} shards of {self.shard_numel})")

    def shard_bounds(self, rank):
        """(start, end) of rank ``rank``'s shard, shard ``rank``, in the padded flat buffer."""
        check_rank("rank", rank, self.world_size, f"this layout has {self.world_size} shards, one per rank.")
        start = rank * self.shard_numel
        return start, start + self.shard_numel

    def flatten(self, tensors, dtype=None, device=None):
        """A new padded flat buffer holding ``tensors`` end to end, zeros in the padding."""
        tensors = list(tensors)
        if [t.shape for t in tensors] != self.shapes:
            raise ValueError("flatten needs tensors with the layout's shapes, in the layout's order.")
        like = tensors[0] if tensors else torch.empty(0)
        flat = torch.zeros(self.padded_numel, dtype=dtype or like.dtype, device=device or like.device)
        for view, tensor in zip(self.views(flat), tensors):
            view.copy_(tensor)
        return flat

    def views(self, flat):
        """Views of ``flat`` shaped like the layout's tensors (the padding is not in any)."""
        self._check(flat, self.padded_numel, "a padded flat buffer")
        return [flat[o : o + n].view(shape) for o, n, shape in zip(self.offsets, self.numels, self.shapes)]

    def shard(self, flat, rank):
        """The view of ``flat`` that is rank ``rank``'s shard."""
        self._check(flat, self.padded_numel, "a padded flat buffer")
        start, end = self.shard_bounds(rank)
        return flat[start:end]

    def _check(self, flat, numel, what):
        if flat.dim() != 1 or flat.numel() != numel:
            raise ValueError(f"expected {what} of {numel} elements, got a tensor of shape {tuple(flat.shape)}.")


def reduce_scatter(flat, layout, rank, op="avg"):
    """Ring reduce-scatter of a padded flat buffer, in place: returns the view of this rank's
    shard, now the average (or ``op``) over the N_d ranks. The other shards of ``flat`` hold
    partial sums afterwards; callers free or ignore them. Each rank sends (N_d - 1) shards."""
    collectives.ring_reduce_scatter(flat, op=op, check=False)
    return layout.shard(flat, rank)


def all_gather(flat, layout):
    """Ring all-gather of a padded flat buffer whose own shard (``layout.shard(flat, rank)``)
    is up to date on every rank: afterwards every rank's ``flat`` holds all N_d shards.
    Each rank sends (N_d - 1) shards. Returns ``flat``."""
    layout._check(flat, layout.padded_numel, "a padded flat buffer")
    return collectives.ring_all_gather(flat, check=False)
