"""FSDP units: which parameters of a model travel together as one flat parameter, and how a
model built on the meta device is materialised one unit at a time. (What a unit does on a
rank, unshard, reshard and reduce its gradient, is ``parlab.zero.flat_unit.FlatUnit``.)

A wrap policy picks unit modules; each unit's parameters become one flat parameter that FSDP
unshards (all-gathers) just before the unit's forward and reshards (frees) after it. The
model itself is always the root unit and takes every parameter that no other unit took.

    wrap_policy=None            every direct child of the model that holds parameters (the
                                blocks of an nn.Sequential or of a transformer's layer list)
    wrap_policy="per_layer"     every module with parameters of its own (each nn.Linear, ...)
    wrap_policy=min_params(n)   bottom-up, the smallest subtrees holding at least n parameters
                                not already in a smaller unit (torch's size-based policy)
    wrap_policy=fn              every module m (not the model) with fn(m) true

Smaller units lower the peak (one unit's full parameters at a time) and raise the number
of collectives (3 per unit per step, each paying the latency alpha).

A parameter used by several modules (tied weights) belongs to the innermost unit that
contains all its uses, so it stays unsharded for as long as any of them may run. A unit left
without parameters is dropped. ``split_replicated`` takes the parameters FSDP keeps whole
(``FSDP(replicate=fn)``) out of each unit into a unit of their own on the same module.
"""

from dataclasses import dataclass, field

import torch
from torch import nn

from parlab import _checks

SHARD_NAME = "flat_shard"  # each unit's module registers its shard under this name
REPLICATED_NAME = "flat_replicated"  # and its replicated parameters (FSDP(..., replicate=fn)) under this one


@dataclass(frozen=True)
class min_params:  # noqa: N801 - used like a function: wrap_policy=min_params(10_000)
    """Wrap policy: a module becomes a unit when its subtree holds at least ``n`` parameters
    (elements) not already in a unit below it."""

    n: int

    def __post_init__(self):
        _checks.whole_number("min_params' n", self.n, "a unit needs n >= 1 parameters (elements): give the "
                             "fewest a unit may hold, e.g. min_params(10_000).")


@dataclass
class UnitPlan:
    """One unit: its module (``name`` is its qualified name, "" for the root), its parameters
    (``names`` as ``model.named_parameters()`` gives them, in order), for each parameter the
    (module, attribute) slots that hold it (several for a tied parameter) and its place in
    ``model.parameters()`` (``positions``: where a plain model's optimizer numbers it)."""

    name: str
    module: nn.Module
    names: list = field(default_factory=list)
    parameters: list = field(default_factory=list)
    slots: list = field(default_factory=list)
    positions: list = field(default_factory=list)

    @property
    def holders(self):
        """The modules that hold this unit's parameters, each once, in order."""
        return list({id(m): m for slots in self.slots for m, _ in slots}.values())


def plan_units(model, wrap_policy=None):
    """The units of ``model`` under ``wrap_policy``: a list of ``UnitPlan``, the root first,
    then the other units in module order; only units that own parameters."""
    _checks.module("model", model, "pass the model whose parameters the units share out.")
    decide = _policy(wrap_policy)
    chosen = set()

    def visit(module, depth):  # the parameters of module's subtree that are in no unit yet
        free = {id(p): p for p in module.parameters(recurse=False)}
        for child in module.children():
            free.update(visit(child, depth + 1))
        if depth > 0 and free and decide(module, sum(p.numel() for p in free.values()), depth == 1):
            chosen.add(id(module))
            return {}
        return free

    visit(model, 0)
    plans = [UnitPlan("", model)] + [UnitPlan(name, m) for name, m in model.named_modules()
                                     if id(m) in chosen and m is not model]
    # id(parameter) -> (parameter, its names, its {(id(module), attribute): (module, attribute)}),
    # in the order of model.parameters() (each parameter where its first name comes)
    uses = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        module_name, _, attribute = name.rpartition(".")
        module = model.get_submodule(module_name)
        _, names, slots = uses.setdefault(id(p), (p, [], {}))
        names.append(name)
        slots[(id(module), attribute)] = (module, attribute)  # a shared module holds it once
    for position, (p, names, slots) in enumerate(uses.values()):
        inside_all = [plan for plan in plans if all(_inside(name, plan.name) for name in names)]
        owner = max(inside_all, key=lambda plan: len(plan.name))  # the innermost
        owner.names.append(names[0])
        owner.parameters.append(p)
        owner.slots.append(list(slots.values()))
        owner.positions.append(position)
    return [plan for plan in plans if plan.parameters]


def split_replicated(plans, replicate):
    """[(plan, replicated)]: each unit's plan, and after it a plan on the same module of the
    parameters ``replicate(name, parameter)`` picks (each only if it has parameters).

    FSDP keeps a replicated unit whole on every rank whatever the strategy (NO_SHARD over
    all N_d ranks): its gradient is all-reduced (averaged) during backward and every rank's
    optimizer steps it alike; its module registers it as the Parameter ``flat_replicated``.
    E.g. ``replicate=lambda name, p: p.ndim == 1`` keeps norms and biases whole."""
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
        for name, p, slots, position in zip(plan.names, plan.parameters, plan.slots, plan.positions):
            part = parts[bool(replicate(name, p))]
            part.names.append(name)
            part.parameters.append(p)
            part.slots.append(slots)
            part.positions.append(position)
        split += [(part, replicated) for replicated, part in parts.items() if part.parameters]
    return split


def materialize_unit(plan, index, device, init_fn=None, seed=0):
    """Give the unit's parameters (and its holders' buffers) real storage on ``device`` and
    initialise them: for each holder module, ``init_fn(module)`` or ``module.reset_parameters()``,
    with the random generator seeded ``seed + index`` (``index``: the unit's place in
    ``plan_units``), so a unit's values do not depend on the other units. A tied parameter gets
    one storage, put in all its slots. Used by FSDP's deferred init and by ``init_by_unit``."""
    if init_fn is not None and not callable(init_fn):
        raise ValueError(f"init_fn must be a function init_fn(module) that initialises one module in place, got "
                         f"{init_fn!r}: pass the function itself, or None for module.reset_parameters().")
    _checks.whole_number("the seed (init_seed)", seed, "give a whole number >= 0, the same on every rank.", minimum=0)
    for i, (p, slots) in enumerate(zip(plan.parameters, plan.slots)):
        real = nn.Parameter(torch.empty_like(p, device=device), requires_grad=p.requires_grad)
        for module, attribute in slots:
            module._parameters[attribute] = real
        plan.parameters[i] = real
    devices = [device] if torch.device(device).type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed + index)
        for module in plan.holders:
            for name, buffer in module.named_buffers(recurse=False):
                module._buffers[name] = torch.empty_like(buffer, device=device)
            (init_fn or _reset_parameters)(module)


def init_by_unit(model, wrap_policy=None, init_fn=None, seed=0):
    """Initialise an ordinary (materialised) ``model`` in place exactly as
    ``FSDP(model on the meta device, wrap_policy=..., init_fn=..., init_seed=seed)`` does:
    the single-process reference a learner compares an FSDP run with. The parameters are
    replaced by new ones: build the optimizer afterwards."""
    _checks.module("model", model, "pass the ordinary model to initialise as FSDP would.")
    device = next(model.parameters()).device
    with torch.no_grad():
        for index, plan in enumerate(plan_units(model, wrap_policy)):
            materialize_unit(plan, index, device, init_fn, seed)
    return model


def _reset_parameters(module):
    if not hasattr(module, "reset_parameters"):
        raise ValueError(
            f"{type(module).__name__} has no reset_parameters() to initialise it after materialising; "
            "pass init_fn=fn, with fn(module) initialising the parameters of one module in place."
        )
    module.reset_parameters()


def _inside(parameter_name, unit_name):
    return unit_name == "" or parameter_name.startswith(unit_name + ".")


def _policy(wrap_policy):
    """The policy as decide(module, free parameters, is a direct child) -> bool."""
    if wrap_policy is None:
        return lambda module, free, top: top
    if wrap_policy == "per_layer":
        return lambda module, free, top: any(True for _ in module.parameters(recurse=False))
    if isinstance(wrap_policy, min_params):
        return lambda module, free, top: free >= wrap_policy.n
    if callable(wrap_policy) and not isinstance(wrap_policy, str):
        return lambda module, free, top: bool(wrap_policy(module))
    raise ValueError(
        f"unknown wrap_policy {wrap_policy!r}: use None (the model's direct children), 'per_layer', "
        "min_params(n) or a function module -> bool."
    )
