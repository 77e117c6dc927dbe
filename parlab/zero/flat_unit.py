"""One FSDP unit on one rank and its collectives: the unit's Psi_u parameters as one flat
buffer (``parlab.flat.FlatLayout``), padded to a multiple of S and cut into S shards, of
which this rank keeps one. FSDP (``parlab.zero.fsdp``) calls, in torch's FSDP2 words:

    unit.unshard()                  all-gather the shards into the full flat buffer
    unit.set_views()                the module's parameters become views of that buffer
    unit.reshard()                  free the full buffer (its storage is resized to 0)
    unit.reduce_gradient(flat_g)    reduce-scatter the flat gradient, averaged over N_d,
                                    into the shard's .grad (+ all-reduce across replicas)

``shard_of`` and ``gather_full`` move whole tensors in and out of the shard layout, for
``FSDP.full_parameters`` and ``parlab.zero.checkpoint``. Which parameters a unit takes:
``parlab.zero.units``. Units gathered in fp8 take their scales from ``make_fp8_scales``: one
collective for all of them, before a forward.
"""

import torch
import torch.distributed as dist
from torch import nn

from parlab import fp8, p2p, trace
from parlab.collectives import ring_all_gather, ring_all_reduce, ring_reduce_scatter
from parlab.flat import FlatLayout
from parlab.zero.units import REPLICATED_NAME, SHARD_NAME

__all__ = ["FlatUnit", "make_fp8_scales"]


class FlatUnit:
    """One unit's flat parameter on this rank: ``shard``, the fp32 Parameter the optimizer
    steps (padded numel / S elements), and ``full``, the padded flat buffer in the compute
    dtype, whose storage is allocated only while the unit is unsharded (a leaf: the module's
    parameters are views of it, so its ``.grad`` is the unit's flat gradient).

    ``plan``: the unit's ``parlab.zero.units.UnitPlan``; ``index``: its place among the units
    (the trace's ``stage`` of its spans). ``groups``: ((shard group, S), (replicate group,
    N_d / S)). ``compute_dtype``: the dtype of ``full`` (bf16 or fp16 under mixed precision:
    the unit computes and reduces its gradient in it); ``shard_device``: the host under CPU
    offload, where the shard, its gradient and the optimizer state then live.

    Construction starts every replica from the first rank's values (one ``p2p.broadcast``
    of the unit's flat parameters over all N_d ranks), keeps this rank's shard, removes the
    module's own parameters (``module.named_parameters()`` lists the shard instead, as
    ``flat_shard``, or ``flat_replicated`` for a replicated unit) and drops the unit's full
    copy, so that a model built on the meta device never holds more than one unit.

    ``gather_dtype``: None, or torch.float8_e4m3fn to all-gather the parameters in fp8
    (``_gather_in_fp8``) with ``scales``, one per parameter, spread over its elements by
    ``make_fp8_scales``. The trace marks each ``unshard`` as an "all-gather" span and each
    ``reduce_gradient`` as a "reduce-scatter" ("all-reduce" when S = 1), with ``stage`` = the
    unit's index."""

    def __init__(self, plan, index, groups, device, compute_dtype, shard_device, replicated=False, gather_dtype=None):
        self.name, self.index, self.module, self.device = plan.name, index, plan.module, device
        self.gather_dtype = gather_dtype
        # (padded numel,) each: sigma_i and 1/sigma_i on parameter i's elements, for the fp8 gather
        self.scales = self.inverse_scales = None  # (set by make_fp8_scales, once per forward)
        self.names, self.slots, self.positions = plan.names, plan.slots, plan.positions
        (self.shard_group, S), (self.replicate_group, self.replicas) = groups
        self.layout = FlatLayout([p.shape for p in plan.parameters], S)
        # the group of all N_d ranks (None: the world, as under HYBRID_SHARD)
        everyone = self.replicate_group if S == 1 else self.shard_group if self.replicas == 1 else None
        self.rank = dist.get_rank(self.shard_group) % S  # the place in the shard group
        self.sync_gradients = True  # False inside FSDP.no_sync
        self.prefetched = None  # the handle of its all-gather started ahead on the communication thread
        flat = self.layout.flatten([p.detach() for p in plan.parameters], torch.float32, device)
        p2p.broadcast_from_first([flat], everyone)  # the replicas start from the first rank's values
        mine = self.layout.shard(flat, self.rank).to(shard_device, copy=True)
        self.shard = nn.Parameter(mine)
        if S == 1 and compute_dtype == torch.float32 and shard_device == device:
            self.full = mine.detach().requires_grad_()  # NO_SHARD in fp32: one storage, as DDP
        else:
            self.full = flat.to(compute_dtype).requires_grad_()
        for slots in self.slots:
            for module, attribute in slots:
                del module._parameters[attribute]
        # torch-style code looks for what is trained in module.named_parameters(): the shard
        self.module.register_parameter(REPLICATED_NAME if replicated else SHARD_NAME, self.shard)
        plan.parameters.clear()  # the unit's full copy goes now, before the next unit's
        self.set_views()
        self.reshard()

    def unshard(self):
        """Make the full buffer hold every rank's shard (a no-op if it does): all-gather within
        the shard group (a copy of the shard, cast to the compute dtype, when S = 1).

        The storage is refilled in place: autograd keeps the views that forward saved, and
        they point into it, so unsharding before backward makes them valid again (as torch's
        FSDP does)."""
        if self.is_unsharded:
            return
        full = self.full.data  # not .detach(): its writes would bump the version autograd checks
        full.untyped_storage().resize_(full.numel() * full.element_size())
        if self.gather_dtype is not None:
            self._gather_in_fp8(full)
        else:
            with trace.span("all-gather", stage=self.index), torch.no_grad():
                self.layout.shard(full, self.rank).copy_(self.shard)
                if self.layout.world_size > 1:
                    ring_all_gather(full, check=False, group=self.shard_group)
        self.is_unsharded = True

    @torch.no_grad()
    def _gather_in_fp8(self, full):
        """All-gather the unit in fp8 with its scales (torchao's float8 all-gather of FSDP2,
        torchao/float8/fsdp_utils.py: a tensorwise scale per parameter, from the amax of the
        whole parameter): parameter i's scale sigma_i = largest / amax_i (``make_fp8_scales``);
        each rank casts its shard x sigma to fp8, the ring moves 1 byte per element (half of
        bf16's), and every rank reads q / sigma_i into the full buffer in the compute dtype.
        Gradients are still reduce-scattered in the compute dtype. (torchao casts only its
        Float8Linear weights; here every parameter of the unit travels in fp8.)"""
        mine = self.shard.detach().to(self.device, torch.float32)
        with trace.span("all-gather", stage=self.index):
            wire = torch.empty(self.layout.padded_numel, dtype=torch.uint8, device=self.device)
            q, _ = fp8.to_fp8(mine, self.gather_dtype, self.layout.shard(self.scales, self.rank))
            self.layout.shard(wire, self.rank).copy_(q.view(torch.uint8))  # gloo moves bytes, not fp8
            if self.layout.world_size > 1:
                ring_all_gather(wire, check=False, group=self.shard_group)
            full.copy_(fp8.from_fp8(wire.view(self.gather_dtype), self.inverse_scales, full.dtype))

    def shard_amaxes(self):
        """(P,): max |x| of each of the unit's parameters over the part of it in this rank's
        shard (0 for a parameter that lies in other shards only)."""
        start, end = self.layout.shard_bounds(self.rank)
        mine = self.shard.detach().to(self.device, torch.float32)
        amaxes = torch.zeros(len(self.layout.shapes), device=self.device)
        for i, (offset, numel) in enumerate(zip(self.layout.offsets, self.layout.numels)):
            part = mine[max(offset, start) - start : min(offset + numel, end) - start]
            if part.numel():
                amaxes[i] = part.abs().max()
        return amaxes

    def set_fp8_scales(self, scales):
        """Take sigma_i (P,), one per parameter, for the unshards until the next call: spread
        over each parameter's elements (0 in the padding) here, once, rather than on every
        unshard, which would rebuild two padded buffers on each gather's critical path."""
        self.scales, self.inverse_scales = (
            self.layout.flatten([value.expand(shape) for value, shape in zip(values, self.layout.shapes)])
            for values in (scales, 1 / scales))

    def set_views(self):
        """Put views of the full buffer in the module's parameter slots (made in forward, so
        autograd routes their gradients into ``full.grad``)."""
        for view, slots in zip(self.layout.views(self.full), self.slots):
            for module, attribute in slots:
                setattr(module, attribute, view)

    def reshard(self):
        """Free the full parameters: the buffer keeps its shape, its storage goes (under
        NO_SHARD, S = 1, it stays: every rank holds everything)."""
        self.is_unsharded = False
        if self.layout.world_size > 1:
            self.full.untyped_storage().resize_(0)

    def reduce_gradient(self, flat_gradient):
        """Average the unit's flat gradient over the N_d ranks (reduce-scatter within the shard
        group, then all-reduce across the replicate group) and add this rank's part to the
        shard's .grad (the engine calls it when the gradient is complete, and frees it after)."""
        S = self.layout.world_size
        with trace.span("reduce-scatter" if S > 1 else "all-reduce", stage=self.index), torch.no_grad():
            if S > 1:
                ring_reduce_scatter(flat_gradient, op="avg", check=False, group=self.shard_group)
            mine = self.layout.shard(flat_gradient, self.rank)
            if self.replicas > 1:
                ring_all_reduce(mine, op="avg", check=False, group=self.replicate_group)
            # a copy unless it is the whole buffer: a view would keep the full gradient alive
            mine = mine.to(self.shard.device, self.shard.dtype, copy=S > 1)
            self.shard.grad = mine if self.shard.grad is None else self.shard.grad.add_(mine)

    def shard_of(self, tensors):
        """The unit's full tensors (its parameters, or one optimizer state of each) -> this
        rank's fp32 shard of them, on the shard's device."""
        flat = self.layout.flatten(tensors, torch.float32, self.device)
        return self.layout.shard(flat, self.rank).to(self.shard.device, copy=True)

    def gather_full(self, shard_like):
        """A shard-shaped tensor of this rank (the shard, its gradient, an optimizer state) ->
        the unit's full tensors, on every rank: views of a fresh padded flat buffer (the
        compute one is not touched), one per parameter."""
        flat = torch.zeros(self.layout.padded_numel, dtype=shard_like.dtype, device=self.device)
        self.layout.shard(flat, self.rank).copy_(shard_like.detach())
        if self.layout.world_size > 1:
            ring_all_gather(flat, check=False, group=self.shard_group)
        return self.layout.views(flat)


@torch.no_grad()
def make_fp8_scales(units):
    """Set the fp8 gather's scales of every unit of ``units`` that gathers in fp8, with ONE
    collective of all their shards' amaxes over the shard group: sigma_i = largest / amax_i
    for each parameter i of each unit (``parlab.fp8.scale_for``), amax_i the max over all S
    shards. torchao does the same once per step, right after the optimizer step
    (``torchao.float8.precompute_float8_dynamic_scale_for_fsdp``: "a single all-reduce to
    compute the scales for all float8 weights"); FSDP calls it at construction and at the
    start of each forward, so a forward's and its backward's unshards gather with the same
    scales. Made per unshard instead, the scales would cost 2 (S - 1) messages of a few bytes
    on every unshard's critical path: 2 (S - 1) x 2 x units messages per step.

    The max over the shards is an all-gather of every shard's amaxes, then a max on every
    rank: S - 1 messages of 4 P bytes (P parameters over all units) instead of the ring
    all-reduce's 2 (S - 1) of 4 P / S: the all-gather is the faster while 4 P (S - 2) / S
    bytes take less than alpha, P < alpha / (4 beta) x S / (S - 2) (1000 parameters at S = 4
    on a 100 us, 20 MB/s link). Traced as one "amax" span (an all-gather, then the max)."""
    units = [unit for unit in units if unit.gather_dtype is not None]
    if not units:
        return
    S, group = units[0].layout.world_size, units[0].shard_group  # every unit gathered in fp8 shards over it
    counts = [len(unit.layout.shapes) for unit in units]
    with trace.span("amax"):
        amaxes = torch.zeros(S, sum(counts), device=units[0].device)  # (S, P): row s, shard s's amaxes
        amaxes[units[0].rank] = torch.cat([unit.shard_amaxes() for unit in units])
        if S > 1:
            ring_all_gather(amaxes, check=False, group=group)  # row s is the ring's chunk s
        amaxes = amaxes.amax(dim=0)  # (P,): each parameter's amax over all S shards
    for unit, part in zip(units, amaxes.split(counts)):
        unit.set_fp8_scales(fp8.scale_for(part, unit.gather_dtype))  # (P,)
