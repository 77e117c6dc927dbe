"""FSDP (ZeRO stage 3) from scratch: every rank keeps 1/N_d of the parameters, gradients and
optimizer state, and gathers a unit's full parameters only while that unit computes.

    engine = FSDP(model, torch.optim.Adam, strategy="FULL_SHARD", wrap_policy="per_layer", lr=1e-3)
    loss_fn(engine(x_shard), y_shard).backward()   # all-gathers and reduce-scatters run in here,
                                                   # the next unit's beside this unit's compute
    engine.step()                                  # the optimizer on this rank's shards
    engine.zero_grad()

The model is cut into units by a wrap policy (``parlab.zero.units``); the Psi_u parameters of
a unit become one flat parameter (``FlatLayout``), padded to a multiple of N_d and cut into
N_d shards. Rank r keeps shard r as an fp32 ``nn.Parameter``: the optimizer
(the torch class given, over the shards) steps it, and since Adam, AdamW and SGD with
momentum are elementwise, that equals the same optimizer on the full parameters.

The flow of one step, unit by unit (FULL_SHARD; ``FlatUnit``, below the engine, is one unit
on one rank: ``gather``, ``free``, ``reduce_gradient``):

    forward   pre-hook:   all-gather the unit's shards into its full flat buffer; the module's
                          parameters become views of that buffer
              post-hook:  free the full buffer (its storage is resized to 0)
    backward  hook on the unit's outputs (fires when their gradient is ready, just before
              the unit's backward): all-gather the full buffer again
              hook when the full buffer's gradient is accumulated (all of the unit's
              parameter views feed it, so it fires once, after the last of them):
              reduce-scatter the flat gradient (averaged over N_d), keep this rank's shard as
              the shard Parameter's .grad, free the full buffer and its gradient
    step      the optimizer on the shards; the next forward gathers the new values

Prefetch (``prefetch=True``, the default; torch's ``forward_prefetch`` and ``backward_prefetch=
BACKWARD_PRE``). Done as above, every collective would stand on the critical path: a unit
waits for its all-gather, and the next unit's backward for the last one's reduce-scatter.
With prefetch, the collectives run on the rank's communication thread (``parlab.background``:
one at a time, in the order started, the same on every rank), and each unit's pre-hook starts
the all-gather of the unit that computes next before waiting for its own: in forward the next
unit in the order the units entered the last forward (module order before the first), in
backward the next in the reverse of the order they returned from forward. So the next unit's
parameters arrive while this unit computes. A unit's reduce-scatter runs there too, while the
next unit's backward computes; its full gradient is freed when it has been waited for: when
the next unit's reduce-scatter starts, or when backward ends (a callback queued on autograd's
engine, as torch's FSDP does), so the shards' .grad are complete when ``backward()`` returns.
``prefetch=False`` runs every collective where it is needed, on the calling thread.

Autograd keeps the views that forward saved; they point into the full buffer's storage, so
refilling that storage before backward makes them valid again (as torch's FSDP does). The
root unit is freed after forward too, so every unit makes the same transfers. The trace marks
each unit's "all-gather" and "reduce-scatter" ("all-reduce" under NO_SHARD) as spans whose
``stage`` is the unit's index (with prefetch, on the communication thread: when they ran).

Memory at rest (after ``step``), fp32 with kappa bytes of optimizer state per parameter: the
shards, their gradients and the optimizer state, (4 + 4 + kappa) Psi / N_d bytes (ZeRO stage 3;
plus at most N_d - 1 padding elements per unit). While a unit computes, full parameters and
gradients of a few units are added, never the model's. Without prefetch: the unit's full
parameters (and in backward its full gradient), one unit at a time. With prefetch, at most
two units gathered at once: the one computing and the next, prefetched; in backward also two
units' full gradients: the one being computed and the last unit's, in its reduce-scatter. (A
unit whose forward encloses the others, such as a root unit holding parameters, stays
gathered through theirs, with or without prefetch: one more.)

Strategies (S: the ranks a unit is sharded over). Per unit and step, the ring transfers of
its flat parameter or gradient, each (S - 1)/S x padded numel x element bytes per rank:

    FULL_SHARD     S = N_d   free after forward, gather again for backward       AG, AG, RS
    SHARD_GRAD_OP  S = N_d   keep from forward until after backward               AG, RS
    NO_SHARD       S = 1     everything on every rank (stage 0's memory), the     all-reduce
                             gradients all-reduced over the N_d ranks, as DDP     (RS + AG)
    HYBRID_SHARD   S = shard_group_size (N_d / 2 by default): FULL_SHARD within groups of S
                   consecutive ranks, replicated across the N_d / S groups: after the
                   reduce-scatter in its group, the gradient shard is all-reduced across groups

mixed_precision=torch.bfloat16 (or float16): the gathered compute copy, the forward inputs and
the gradients are in that dtype, and gradients are reduced in it (torch's MixedPrecisionPolicy
with reduce_dtype = param_dtype: half the bytes on the wire); the shards the optimizer steps
and its state stay fp32 (master weights). cpu_offload=True keeps the shards, their gradients and
the optimizer state in CPU memory; each gather copies the shard to the device.

Construction: rank 0's initial parameters are broadcast unit by unit (``parlab.p2p.broadcast``
over all ranks), so every rank starts from them. A model built on the meta device is materialised one
unit at a time (``parlab.zero.units.materialize_unit``: seeded init_seed + unit index), sharded,
and its full copy dropped before the next: the peak is one unit, not the model; ``init_by_unit``
initialises an ordinary model the same way, for a reference. Buffers are broadcast from rank 0
and replicated, not sharded.

Gradient accumulation: a second backward before ``step`` reduce-scatters again and adds to the
shard gradients (communication every backward). Inside ``with engine.no_sync():`` a backward
does not reduce: each unit keeps its full flat gradient (padded Psi_u elements in the compute
dtype; autograd sums the micro-batches into it) and the first backward outside reduce-scatters
the sum once, as torch's ``no_sync`` (one reduction per step, the full gradients' memory while
accumulating). ``engine.close()`` destroys the process groups HYBRID_SHARD made.

Replicated parameters (``replicate=fn``, fn(name, parameter) -> bool, e.g. ``lambda name, p:
p.ndim == 1`` for norms and biases): a unit's parameters that fn picks form a unit of their own
on the same module, NO_SHARD over all N_d ranks whatever the strategy: whole on every rank, their
gradient ring all-reduced (averaged) during backward, stepped alike by every rank's optimizer;
that module registers them as the Parameter ``flat_replicated``. Limits: every trainable
parameter is sharded or replicated (frozen ones raise ValueError); a unit's parameters may be used
only inside that unit's forward (tied weights belong to the unit around all their uses).
Checkpoints (full and sharded state dicts, files): ``parlab.zero.checkpoint``.
"""

import functools
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map

from parlab import _checks, background, p2p, runtime, trace
from parlab.collectives import ring_all_gather, ring_all_reduce, ring_reduce_scatter
from parlab.flat import FlatLayout
from parlab.memory import measure_model_state
from parlab.zero.strategies import STRATEGIES, _process_groups, _shard_group_size  # noqa: F401 - STRATEGIES: imported from here by parlab.bench
from parlab.zero.units import UnitPlan, materialize_unit, plan_units

SHARD_NAME = "flat_shard"  # each unit's module registers its shard under this name
REPLICATED_NAME = "flat_replicated"  # and its replicated parameters (FSDP(..., replicate=fn)) under this one
LOW_PRECISION = (torch.bfloat16, torch.float16)


class FSDP(nn.Module):
    """Fully sharded data parallelism over the default process group (N_d ranks); see the
    module docstring for the flow.

    ``optimizer_class(shards, **opt_kwargs)`` is built over the fp32 shard Parameters (also
    ``engine.parameters()``): the model's own parameters are replaced by views of the unit's
    gathered buffer, and each unit's module registers its shard as the Parameter
    ``flat_shard`` (``model.named_parameters()`` lists e.g. ``0.flat_shard``, with its
    averaged gradient after backward). With
    ``optimizer_class=None`` the engine builds none: build yours over ``engine.parameters()``
    and call its ``step()`` after ``engine.finish_gradient_synchronization()``, as with DDP. ``strategy``
    and ``shard_group_size`` (HYBRID_SHARD only): the table above. ``wrap_policy``: see
    ``parlab.zero.units``. ``mixed_precision``: None, torch.bfloat16 or torch.float16.
    ``cpu_offload``: shards, gradients and optimizer state in CPU memory. ``init_fn(module)``
    initialises one module of a model built on the meta device (default
    ``module.reset_parameters()``), with the generator seeded ``init_seed`` + unit index.
    ``replicate(name, parameter)`` (optional): true for the parameters to keep whole on every
    rank (module docstring, "Replicated parameters"). ``group``: the N_d ranks to shard over
    (e.g. ``mesh.group("dp")`` of a ``parlab.Mesh``; default: all ranks); only its members
    build the engine, every collective stays inside it (not with HYBRID_SHARD, which makes
    its own groups of the world). ``prefetch`` (default True): gather the next unit while one
    computes and reduce-scatter in the background (module docstring, "Prefetch"); False: every
    collective when it is needed."""

    def __init__(self, model, optimizer_class=None, strategy="FULL_SHARD", wrap_policy=None, mixed_precision=None,
                 cpu_offload=False, init_fn=None, init_seed=0, shard_group_size=None, replicate=None, group=None,
                 prefetch=True, **opt_kwargs):
        super().__init__()
        _checks.module("model", model, "pass the model to shard, built the same on every rank (or on the meta device).")
        if prefetch not in (True, False):
            raise ValueError(f"prefetch must be True (gather the next unit while this one computes, reduce-scatter "
                             f"in the background) or False (every collective when it is needed), got {prefetch!r}.")
        if optimizer_class is not None:
            _checks.optimizer_class(optimizer_class)
        elif opt_kwargs:
            raise ValueError(f"optimizer options {sorted(opt_kwargs)} need an optimizer_class: pass one, or drop "
                             "them and give them to the optimizer you build over engine.parameters().")
        if group is not None and strategy == "HYBRID_SHARD":
            raise ValueError("HYBRID_SHARD makes its shard and replicate groups from the whole world: drop group=, "
                             "or shard over the group with FULL_SHARD (a mesh with two data axes is hybrid sharding).")
        N = dist.get_world_size(group)
        if dist.get_rank(group) < 0:
            raise ValueError(f"global rank {dist.get_rank()} is not in the group it passed: build FSDP only on the "
                             "group's members (each rank passes the group it belongs to).")
        S = _shard_group_size(strategy, N, shard_group_size)
        if mixed_precision not in (None, *LOW_PRECISION):
            raise ValueError(f"mixed_precision must be None, torch.bfloat16 or torch.float16, got {mixed_precision!r}.")
        deferred = any(p.is_meta for p in model.parameters())
        if replicate is not None and deferred:
            raise ValueError("replicate= needs a materialised model (its units split after initialisation): build "
                             "the model on a real device, or drop replicate.")
        if init_fn is not None and not deferred:
            raise ValueError("init_fn initialises a model built on the meta device; this model is materialised "
                             "already: drop init_fn, or build the model under `with torch.device('meta'):`.")
        names = dict(model.named_parameters(remove_duplicate=False))
        # A plain model's state_dict and optimizer name and number its parameters this way:
        self.parameter_aliases = {alias: next(n for n, q in names.items() if q is p) for alias, p in names.items()}
        self.parameter_index = {name: i for i, (name, _) in enumerate(model.named_parameters())}
        plans = _split_replicated(plan_units(model, wrap_policy), replicate)
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
                                       replicated))
        if any(buffer.is_meta for buffer in model.buffers()):
            raise ValueError("buffers of modules without parameters stay on the meta device: create them "
                             "on a real device, or give them to a module that has parameters.")
        first = 0 if group is None else dist.get_global_rank(group, 0)
        for buffer in model.buffers():
            p2p.broadcast(buffer, src=first, group=group)
        self.mixed_precision, self.prefetch = mixed_precision, prefetch
        self.shards = nn.ParameterList([unit.shard for unit in self.units])
        self.optimizer = None if optimizer_class is None else optimizer_class(list(self.shards), **opt_kwargs)
        # The unit each unit's forward (backward) is followed by, learned from the last forward: the
        # order its units entered (the reverse of the order they returned). Until then, module order.
        self.forward_next = dict(zip(self.units, self.units[1:]))
        self.backward_next, self.entered, self.returned = {}, None, None  # the last unit to enter, to return
        self.reductions = []  # ([flat gradient], handle) of the reduce-scatters in flight, oldest first
        for unit in self.units:
            unit.module.register_forward_pre_hook(functools.partial(self._before_forward, unit))
            unit.module.register_forward_hook(functools.partial(self._after_forward, unit))
            unit.full.register_post_accumulate_grad_hook(functools.partial(self._gradient_ready, unit))

    def extra_repr(self):
        return f"strategy={self.strategy!r}, units={[unit.name or '(root)' for unit in self.units]}"

    def forward(self, *args, **kwargs):
        if self.mixed_precision is not None:
            args, kwargs = tree_map(self._cast_input, (args, kwargs))
        self.entered = self.returned = None  # a new forward: its order is learned afresh
        with trace.span("forward"):
            output = self.module(*args, **kwargs)
        for unit in self.units:  # prefetched for a forward that did not run it (its order changed)
            if unit.prefetched is not None:
                self._gathered(unit)
                unit.free()
        return output

    def _cast_input(self, value):
        if torch.is_tensor(value) and value.is_floating_point():
            return value.to(self.mixed_precision)
        return value

    def _before_forward(self, unit, module, args):
        if self.entered is not None:
            self.forward_next[self.entered] = unit
        self.entered = unit
        self._gather(unit, then=self.forward_next.get(unit))
        unit.set_views()

    def _after_forward(self, unit, module, args, output):
        self.backward_next[unit], self.returned = self.returned, unit
        if not torch.is_grad_enabled():
            unit.free()  # no backward will come for it
        elif self.reshard_after_forward:
            unit.free()
            for tensor in tree_leaves(output):
                if torch.is_tensor(tensor) and tensor.requires_grad:
                    tensor.register_hook(lambda grad: self._gather(unit, then=self.backward_next.get(unit)))

    def _gather(self, unit, then=None):
        """Make ``unit`` gathered before it computes. With ``prefetch``: start its all-gather on
        the communication thread (unless prefetched already), start the all-gather of ``then``,
        the unit that computes next, and wait for the first only; ``then`` gathers while ``unit``
        computes. Without: all-gather ``unit`` now, here."""
        if not self.prefetch:
            unit.gather()
            return
        if unit.prefetched is None and not unit.gathered:
            unit.prefetched = background.start(unit.gather)
        if then is not None and then.prefetched is None and not then.gathered:
            then.prefetched = background.start(then.gather)
        self._gathered(unit)

    def _gathered(self, unit):
        if unit.prefetched is not None:
            unit.prefetched.wait()
            unit.prefetched = None

    def _gradient_ready(self, unit, full):
        """Post-accumulate-grad hook of the unit's full buffer: its flat gradient is complete
        (inside ``no_sync``, kept for the next backward). Free the full parameters and
        reduce-scatter the gradient (``FlatUnit.reduce_gradient``): with ``prefetch`` on the
        communication thread, while the next unit's backward computes, waiting for the
        previous unit's reduce-scatter meanwhile (its full gradient is freed then)."""
        if not unit.sync_gradients:
            unit.free()
            return
        flat_gradient, full.grad = [full.grad], None
        unit.free()
        if not self.prefetch:
            unit.reduce_gradient(flat_gradient.pop())
            return
        if not self.reductions:  # the first of this backward: wait for them all when it ends, as torch's FSDP
            torch.autograd.Variable._execution_engine.queue_callback(self.finish_gradient_synchronization)
        self.reductions.append((flat_gradient, background.start(_reduce, unit, flat_gradient)))
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
                self._gathered(unit)
                unit.free()

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
        """Backward passes inside accumulate each unit's full gradient on this rank, with no
        reduction; the next backward outside reduce-scatters the sum (module docstring).
        With M micro-batches per step, divide each one's mean loss by M."""
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
        optimizer's state tensors."""
        return measure_model_state(
            [t for unit in self.units for t in (unit.shard, unit.full)],
            [g for unit in self.units for g in (unit.shard.grad, unit.full.grad)],
            [v for state in (self.optimizer.state.values() if self.optimizer else []) for v in state.values()
             if torch.is_tensor(v)],
        )

    def full_parameters(self):
        """{name: full fp32 parameter} (the master values), gathered on every rank."""
        self.finish_gradient_synchronization()  # its all-gathers run here: none may be in flight meanwhile
        return {name: view.clone() for unit in self.units
                for name, view in zip(unit.names, unit.layout.views(unit.gather_full(unit.shard.detach())))}


    def full_gradients(self):
        """{name: averaged gradient} of every parameter, gathered on every rank after backward
        (the shards' gradients, as ``full_parameters`` gathers the shards)."""
        self.finish_gradient_synchronization()
        if any(unit.shard.grad is None for unit in self.units):
            raise ValueError("full_gradients() needs this step's gradients: run forward and backward through the "
                             "engine first (outside no_sync), before zero_grad().")
        return {name: view.clone() for unit in self.units
                for name, view in zip(unit.names, unit.layout.views(unit.gather_full(unit.shard.grad.detach())))}


class FlatUnit:
    """One unit's flat parameter on this rank: ``shard``, the fp32 Parameter the optimizer
    steps (padded numel / S elements), and ``full``, the padded flat buffer in the compute
    dtype, whose storage is allocated only while the unit is gathered (a leaf: the module's
    parameters are views of it, so its ``.grad`` is the unit's flat gradient)."""

    def __init__(self, plan, index, groups, device, compute_dtype, shard_device, replicated=False):
        self.name, self.index, self.module, self.device = plan.name, index, plan.module, device
        self.names, self.slots = plan.names, plan.slots
        (self.shard_group, S), (self.replicate_group, self.replicas) = groups
        self.layout = FlatLayout([p.shape for p in plan.parameters], S)
        # the group of all N_d ranks (None: the world, as under HYBRID_SHARD)
        everyone = self.replicate_group if S == 1 else self.shard_group if self.replicas == 1 else None
        self.rank = dist.get_rank(self.shard_group) % S  # the place in the shard group
        self.sync_gradients = True  # False inside FSDP.no_sync
        self.prefetched = None  # the handle of its all-gather started ahead on the communication thread
        flat = self.layout.flatten([p.detach() for p in plan.parameters], torch.float32, device)
        first = 0 if everyone is None else dist.get_global_rank(everyone, 0)
        p2p.broadcast(flat, src=first, group=everyone)  # the replicas start from the first rank's values
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
        self.free()

    def gather(self):
        """Make the full buffer hold every rank's shard (a no-op if it does): all-gather within
        the shard group (a copy of the shard, cast to the compute dtype, when S = 1)."""
        if self.gathered:
            return
        with trace.span("all-gather", stage=self.index), torch.no_grad():
            full = self.full.data  # not .detach(): its writes would bump the version autograd checks
            full.untyped_storage().resize_(full.numel() * full.element_size())
            self.layout.shard(full, self.rank).copy_(self.shard)
            if self.layout.world_size > 1:
                ring_all_gather(full, check=False, group=self.shard_group)
        self.gathered = True

    def set_views(self):
        """Put views of the full buffer in the module's parameter slots (made in forward, so
        autograd routes their gradients into ``full.grad``)."""
        for view, slots in zip(self.layout.views(self.full), self.slots):
            for module, attribute in slots:
                setattr(module, attribute, view)

    def free(self):
        self.gathered = False
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
        """A shard-shaped tensor of this rank (the shard, an optimizer state) -> the padded flat
        of the whole unit, on every rank (a fresh buffer: the compute one is not touched)."""
        flat = torch.zeros(self.layout.padded_numel, dtype=shard_like.dtype, device=self.device)
        self.layout.shard(flat, self.rank).copy_(shard_like)
        if self.layout.world_size > 1:
            ring_all_gather(flat, check=False, group=self.shard_group)
        return flat


def _reduce(unit, flat_gradient):  # on the communication thread
    unit.reduce_gradient(flat_gradient[0])


def _split_replicated(plans, replicate):
    """[(plan, replicated)]: each unit's plan, and after it a plan on the same module of the
    parameters ``replicate(name, parameter)`` picks (each only if it has parameters)."""
    if replicate is None:
        return [(plan, False) for plan in plans]
    if not callable(replicate):
        raise ValueError(f"replicate must be a function (name, parameter) -> bool picking the parameters to keep "
                         f"whole on every rank, e.g. lambda name, p: p.ndim == 1; got {replicate!r}.")
    split = []
    for plan in plans:
        # the replicated unit is named as its Parameter (unit names key sharded checkpoints)
        parts = {False: UnitPlan(plan.name, plan.module),
                 True: UnitPlan(f"{plan.name}.{REPLICATED_NAME}".lstrip("."), plan.module)}
        for name, p, slots in zip(plan.names, plan.parameters, plan.slots):
            part = parts[bool(replicate(name, p))]
            part.names.append(name)
            part.parameters.append(p)
            part.slots.append(slots)
        split += [(part, replicated) for replicated, part in parts.items() if part.parameters]
    return split
