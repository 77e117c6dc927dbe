"""FSDP (ZeRO stage 3) from scratch: every rank keeps 1/N_d of the parameters, gradients and
optimizer state, and unshards a unit (all-gathers its full parameters) only while it computes.

    engine = FSDP(model, torch.optim.Adam, strategy="FULL_SHARD", wrap_policy="per_layer", lr=1e-3)
    loss_fn(engine(x_shard), y_shard).backward()   # all-gathers and reduce-scatters run in here,
                                                   # the next unit's beside this unit's compute
    engine.step()                                  # the optimizer on this rank's shards
    engine.zero_grad()

One step, unit by unit (FULL_SHARD). A unit (``parlab.zero.units``) is one flat parameter cut
into N_d shards; ``parlab.zero.flat_unit.FlatUnit`` is one unit on one rank:

    forward   pre-hook:   unshard: all-gather the unit's shards into its full flat buffer;
                          the module's parameters become views of that buffer
              post-hook:  reshard: free the full buffer (its storage is resized to 0)
    backward  hook on the unit's outputs (fires just before the unit's backward): unshard again
              hook when the full buffer's gradient is accumulated (once, after the last view's):
              reshard, and reduce-scatter the flat gradient (averaged over N_d) into the
              shard Parameter's .grad; the full gradient is freed
    step      the optimizer on the shards; the next forward unshards the new values

Strategies: ``FSDP``; prefetch: ``FSDP._unshard``; memory: ``FSDP.model_state_bytes``;
gradient accumulation: ``FSDP.no_sync``; checkpoints: ``parlab.zero.checkpoint``.
"""

import functools
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map

from parlab import _checks, background, fp8, p2p, runtime, trace
from parlab._hooks import weak_hook
from parlab.memory import measure_model_state
from parlab.zero.flat_unit import FlatUnit, make_fp8_scales
from parlab.zero.strategies import _process_groups, _shard_group_size
from parlab.zero.units import materialize_unit, plan_units, split_replicated

__all__ = ["FSDP"]

LOW_PRECISION = (torch.bfloat16, torch.float16)


class FSDP(nn.Module):
    """Fully sharded data parallelism over the N_d ranks of ``group`` (default: all ranks, or
    e.g. ``mesh.group("dp")`` of a ``parlab.Mesh``: only its members build the engine, and
    every collective stays inside it); the flow of a step: the module docstring.

    ``optimizer_class(shards, **optimizer_kwargs)`` is built over the fp32 shard Parameters,
    ``engine.parameters()`` (each unit's module registers its shard as ``flat_shard``:
    ``FlatUnit``); Adam, AdamW and SGD with momentum are elementwise, so stepping the shards
    equals stepping the full parameters. With ``optimizer_class=None`` the engine builds none:
    build yours over ``engine.parameters()`` and call its ``step()`` after
    ``engine.finish_gradient_synchronization()``, as with DDP.

    ``strategy`` (S: the ranks a unit is sharded over). Per unit and step, the ring transfers
    of its flat parameter or gradient, each (S - 1)/S x padded numel x element bytes per rank:

        FULL_SHARD     S = N_d   reshard after forward, unshard again for backward    AG, AG, RS
        SHARD_GRAD_OP  S = N_d   stay unsharded from forward until after backward     AG, RS
        NO_SHARD       S = 1     everything on every rank (stage 0's memory), the     all-reduce
                                 gradients all-reduced over the N_d ranks, as DDP     (RS + AG)
        HYBRID_SHARD   S = shard_group_size (N_d / 2 by default): FULL_SHARD within groups of S
                       consecutive ranks, replicated across the N_d / S groups: after the
                       reduce-scatter in its group, the gradient shard is all-reduced across groups

    (torch's ``reshard_after_forward`` is True under FULL_SHARD and HYBRID_SHARD; HYBRID_SHARD
    makes its own groups of the world and takes no ``group``.) ``wrap_policy``: the units
    (``parlab.zero.units``). ``mixed_precision=torch.bfloat16`` (or float16): the unsharded
    compute copy, the forward inputs and the gradients are in that dtype, and gradients are
    reduced in it (torch's MixedPrecisionPolicy with reduce_dtype = param_dtype: half the bytes
    on the wire); the shards and the optimizer state stay fp32 (master weights).
    ``all_gather_dtype=torch.float8_e4m3fn``: the unshards gather the parameters in fp8, one
    byte per element, with a scale per parameter (torchao's float8 all-gather;
    ``FlatUnit._gather_in_fp8``), into the compute dtype; gradients are reduce-scattered in it.
    The scales of all units come from one exchange of amaxes at the start of each forward
    (``parlab.zero.flat_unit.make_fp8_scales``).
    ``cpu_offload=True``: the shards, their gradients and the optimizer state in CPU memory.
    ``init_fn``, ``init_seed``: a model built on the meta device (``__init__``). ``replicate(name,
    parameter)``: true for the parameters to keep whole on every rank (``split_replicated`` in
    ``parlab.zero.units``). ``prefetch`` (default True): unshard the next unit while one computes
    and reduce-scatter in the background (``_unshard``); False: every collective where it is
    needed. Every trainable parameter is sharded or replicated (frozen ones raise ValueError);
    a unit's parameters may be used only inside its forward (tied weights belong to the unit
    around all their uses)."""

    def __init__(self, model, optimizer_class=None, strategy="FULL_SHARD", wrap_policy=None, mixed_precision=None,
                 cpu_offload=False, init_fn=None, init_seed=0, shard_group_size=None, replicate=None, group=None,
                 prefetch=True, all_gather_dtype=None, **optimizer_kwargs):
        """Rank 0's initial parameters are broadcast unit by unit (``parlab.p2p.broadcast`` over
        the N_d ranks), so every rank starts from them. A model built on the meta device is
        materialised one unit at a time (``parlab.zero.units.materialize_unit``: ``init_fn(module)``,
        default ``module.reset_parameters()``, seeded ``init_seed`` + unit index), sharded, and
        its full copy dropped before the next: the peak is one unit, not the model
        (``parlab.zero.init_by_unit`` initialises an ordinary model the same way, for a
        reference). Buffers are broadcast from rank 0 and replicated, not sharded."""
        super().__init__()
        _checks.module("model", model, "pass the model to shard, built the same on every rank (or on the meta device).")
        if prefetch not in (True, False):
            raise ValueError(f"prefetch must be True (unshard the next unit while this one computes, reduce-scatter "
                             f"in the background) or False (every collective when it is needed), got {prefetch!r}.")
        if optimizer_class is not None:
            _checks.optimizer_class(optimizer_class)
        elif optimizer_kwargs:
            raise ValueError(f"optimizer options {sorted(optimizer_kwargs)} need an optimizer_class: pass one, or drop "
                             "them and give them to the optimizer you build over engine.parameters().")
        if group is not None and strategy == "HYBRID_SHARD":
            raise ValueError("HYBRID_SHARD makes its shard and replicate groups from the whole world: drop group=, "
                             "or shard over the group with FULL_SHARD (a mesh with two data axes is hybrid sharding).")
        _, N = _checks.place_in(group, "build FSDP only on the group's members (each rank passes the group it "
                                       "belongs to).")
        S = _shard_group_size(strategy, N, shard_group_size)
        if mixed_precision not in (None, *LOW_PRECISION):
            raise ValueError(f"mixed_precision must be None, torch.bfloat16 or torch.float16, got {mixed_precision!r}.")
        if all_gather_dtype not in (None, *fp8.FORMATS) or (all_gather_dtype and S == 1):
            raise ValueError(f"all_gather_dtype must be None or an fp8 dtype (torch.float8_e4m3fn for parameters) with "
                             f"a strategy that all-gathers (not NO_SHARD), got {all_gather_dtype!r} with {strategy}.")
        deferred = any(p.is_meta for p in model.parameters())
        if replicate is not None and deferred:
            raise ValueError("replicate= needs a materialised model (its units split after initialisation): build "
                             "the model on a real device, or drop replicate.")
        if init_fn is not None and not deferred:
            raise ValueError("init_fn initialises a model built on the meta device; this model is materialised "
                             "already: drop init_fn, or build the model under `with torch.device('meta'):`.")
        plans = split_replicated(plan_units(model, wrap_policy), replicate)
        if not plans or any(not p.requires_grad for plan, _ in plans for p in plan.parameters):
            raise ValueError("FSDP shards trainable parameters: the model needs some, and none frozen "
                             "(requires_grad=False); unfreeze them or keep frozen ones out of the model.")
        self.strategy, self.world_size, self.shard_group_size = strategy, N, S
        self.reshard_after_forward = strategy in ("FULL_SHARD", "HYBRID_SHARD")
        self.module = model
        device = runtime.device() if deferred else next(model.parameters()).device
        groups = _process_groups(N, S, group)  # (shard group, replicate group)
        self.process_groups = [group for group, _ in groups if group is not None]  # made here: close() ends them
        self.units = []
        for index, (plan, replicated) in enumerate(plans):
            if deferred:
                with torch.no_grad():
                    materialize_unit(plan, index, device, init_fn, init_seed)
            self.units.append(FlatUnit(plan, index, ((group, 1), (group, N)) if replicated else groups, device,
                                       mixed_precision or torch.float32, torch.device("cpu") if cpu_offload else device,
                                       replicated, None if replicated else all_gather_dtype))
        make_fp8_scales(self.units)  # for unshards before the first forward (it makes them afresh)
        if any(buffer.is_meta for buffer in model.buffers()):
            raise ValueError("buffers of modules without parameters stay on the meta device: create them "
                             "on a real device, or give them to a module that has parameters.")
        p2p.broadcast_from_first(list(model.buffers()), group)
        self.mixed_precision, self.prefetch = mixed_precision, prefetch
        self.shards = nn.ParameterList([unit.shard for unit in self.units])
        self.optimizer = None if optimizer_class is None else optimizer_class(list(self.shards), **optimizer_kwargs)
        # The unit each unit's forward (backward) is followed by, learned from the last forward: the
        # order its units entered (the reverse of the order they returned). Until then, module order.
        self.forward_next = dict(zip(self.units, self.units[1:]))
        self.backward_next, self.entered, self.returned = {}, None, None  # the last unit to enter, to return
        self.reductions = []  # ([flat gradient], handle) of the reduce-scatters in flight, oldest first
        for unit in self.units:
            unit.module.register_forward_pre_hook(functools.partial(self._before_forward, unit))
            unit.module.register_forward_hook(functools.partial(self._after_forward, unit))
            unit.full.register_post_accumulate_grad_hook(weak_hook(self._gradient_ready, unit))

    def extra_repr(self):
        return f"strategy={self.strategy!r}, units={[unit.name or '(root)' for unit in self.units]}"

    def forward(self, *args, **kwargs):
        if self.mixed_precision is not None:
            args, kwargs = tree_map(self._cast_input, (args, kwargs))
        self.entered = self.returned = None  # a new forward: its order is learned afresh
        make_fp8_scales(self.units)  # one collective for every unit's fp8 scales, off the unshards' path
        with trace.span("forward"):
            output = self.module(*args, **kwargs)
        for unit in self.units:  # prefetched for a forward that did not run it (its order changed)
            if unit.prefetched is not None:
                self._wait_for_unshard(unit)
                unit.reshard()
        return output

    def _cast_input(self, value):
        if torch.is_tensor(value) and value.is_floating_point():
            return value.to(self.mixed_precision)
        return value

    def _before_forward(self, unit, module, args):
        if self.entered is not None:
            self.forward_next[self.entered] = unit
        self.entered = unit
        self._unshard(unit, then=self.forward_next.get(unit))
        unit.set_views()

    def _after_forward(self, unit, module, args, output):
        self.backward_next[unit], self.returned = self.returned, unit
        if not torch.is_grad_enabled():
            unit.reshard()  # no backward will come for it
        elif self.reshard_after_forward:  # the root unit too: every unit makes the same transfers
            unit.reshard()
            for tensor in tree_leaves(output):
                if torch.is_tensor(tensor) and tensor.requires_grad:
                    tensor.register_hook(weak_hook(self._unshard_for_backward, unit))

    def _unshard_for_backward(self, unit, grad):  # a hook on the unit's output: its gradient arrives
        self._unshard(unit, then=self.backward_next.get(unit))

    def _unshard(self, unit, then=None):
        """Make ``unit`` unsharded before it computes. Without ``prefetch`` it is all-gathered
        now, on the calling thread: every collective stands on the critical path. With it
        (torch's ``forward_prefetch`` and ``backward_prefetch=BACKWARD_PRE``), on the rank's
        communication thread (``parlab.background``: one at a time, in the order started, the
        same on every rank): start ``unit``'s all-gather unless it was prefetched, start the one
        of ``then``, the unit that computes next, and wait for the first only, so ``then``'s
        parameters arrive while ``unit`` computes. ``then``: in forward the next unit in the
        order the units entered the last forward (module order before the first), in backward
        the next in the reverse of the order they returned from forward."""
        if not self.prefetch:
            unit.unshard()
            return
        if unit.prefetched is None and not unit.is_unsharded:
            unit.prefetched = background.start(unit.unshard)
        if then is not None and then.prefetched is None and not then.is_unsharded:
            then.prefetched = background.start(then.unshard)
        self._wait_for_unshard(unit)

    def _wait_for_unshard(self, unit):
        if unit.prefetched is not None:
            unit.prefetched.wait()
            unit.prefetched = None

    def _gradient_ready(self, unit, full):
        """Post-accumulate-grad hook of the unit's full buffer (all its parameter views feed it:
        it fires once, after the last): the flat gradient is complete (inside ``no_sync``, kept
        for the next backward). Reshard the unit and reduce-scatter the gradient. With
        ``prefetch`` on the communication thread, while the next unit's backward computes; the
        full gradient is freed once waited for: when the next unit's reduce-scatter starts, or
        when backward ends (a callback queued on autograd's engine, as torch's FSDP does)."""
        if not unit.sync_gradients:
            unit.reshard()
            return
        flat_gradient, full.grad = [full.grad], None
        unit.reshard()
        if not self.prefetch:
            unit.reduce_gradient(flat_gradient.pop())
            return
        if not self.reductions:  # the first of this backward: wait for them all when it ends, as torch's FSDP
            torch.autograd.Variable._execution_engine.queue_callback(self.finish_gradient_synchronization)
        # the list, not the tensor, goes to the thread: clearing it frees the full gradient
        self.reductions.append((flat_gradient, background.start(lambda: unit.reduce_gradient(flat_gradient[0]))))
        self._wait_for_reductions(keep=1)

    def _wait_for_reductions(self, keep=0):
        """Wait for the reduce-scatters in flight, oldest first, until ``keep`` are left."""
        while len(self.reductions) > keep:
            flat_gradient, handle = self.reductions.pop(0)
            handle.wait()
            flat_gradient.clear()  # freed here, when waited for: until then it is alive

    def finish_gradient_synchronization(self):
        """DDP's and ZeroDP's call after backward, before the optimizer step: wait for the
        reduce-scatters still in flight (each unit's was started during backward, as soon as
        its gradient was complete; inside ``no_sync`` no unit reduces, and the next backward
        outside does). Afterwards every shard's ``.grad`` holds its averaged gradient."""
        self._wait_for_reductions()
        for unit in self.units:  # prefetched for a backward that did not run it
            if unit.prefetched is not None:
                self._wait_for_unshard(unit)
                unit.reshard()

    def step(self):
        """The optimizer step on this rank's shards (their gradients were reduced during
        backward: ``finish_gradient_synchronization`` waits for the last of them first)."""
        if self.optimizer is None:
            raise ValueError("this FSDP was built without an optimizer (optimizer_class=None): call step() on the "
                             "optimizer you built over engine.parameters().")
        self.finish_gradient_synchronization()
        with trace.span("optimizer"):
            self.optimizer.step()

    def zero_grad(self):
        self.finish_gradient_synchronization()  # no reduce-scatter may add to a gradient dropped here
        for shard in self.shards:
            shard.grad = None

    @contextmanager
    def no_sync(self):
        """Backward passes inside accumulate each unit's full gradient (padded Psi_u elements in
        the compute dtype) with no reduction; the first backward outside reduce-scatters the
        sum once, as torch's ``no_sync`` (without it, each backward before ``step`` reduces and
        adds to the shard gradients). With M micro-batches per step, divide each loss by M."""
        for unit in self.units:
            unit.sync_gradients = False
        try:
            yield
        finally:
            for unit in self.units:
                unit.sync_gradients = True

    def close(self):
        """Destroy the process groups this engine made (HYBRID_SHARD's shard and replicate
        groups; the other strategies use the default group and make none). Safe to call
        twice; the engine cannot take another step after it."""
        self.finish_gradient_synchronization()
        for group in self.process_groups:
            dist.destroy_process_group(group)
        self.process_groups = []

    def model_state_bytes(self):
        """This rank's model states, measured (``parlab.memory.measure_model_state``): params
        = the shards plus any full buffer still allocated (none at rest, except NO_SHARD),
        grads = the shard gradients and any full gradient kept by ``no_sync``, optimizer = the
        optimizer's state tensors. At rest (after ``step``), in fp32 with kappa bytes of
        optimizer state per parameter: (4 + 4 + kappa) Psi / N_d bytes (ZeRO stage 3; plus at
        most N_d - 1 padding elements per unit). While a unit computes, a few units' full
        parameters and gradients are added, never the model's: without prefetch one unit's;
        with prefetch two units unsharded (the one computing and the next) and in backward two
        full gradients (the one computing and the last unit's, in its reduce-scatter). A unit
        whose forward encloses the others (a root unit with parameters) stays unsharded
        through theirs: one more."""
        return measure_model_state(
            [t for unit in self.units for t in (unit.shard, unit.full)],
            [g for unit in self.units for g in (unit.shard.grad, unit.full.grad)],
            [v for state in (self.optimizer.state.values() if self.optimizer else []) for v in state.values()
             if torch.is_tensor(v)],
        )

    def full_parameters(self):
        """{name: full fp32 parameter} (the master values), gathered on every rank."""
        self.finish_gradient_synchronization()  # its all-gathers run here: none may be in flight meanwhile
        return {name: full.clone() for unit in self.units
                for name, full in zip(unit.names, unit.gather_full(unit.shard))}

    def full_gradients(self):
        """{name: averaged gradient} of every parameter, gathered on every rank after backward
        (the shards' gradients, as ``full_parameters`` gathers the shards)."""
        self.finish_gradient_synchronization()
        if any(unit.shard.grad is None for unit in self.units):
            raise ValueError("full_gradients() needs this step's gradients: run forward and backward through the "
                             "engine first (outside no_sync), before zero_grad().")
        return {name: full.clone() for unit in self.units
                for name, full in zip(unit.names, unit.gather_full(unit.shard.grad))}

