"""ZeRO stage 1 as a torch optimizer: each of the N_d ranks steps only its shard of the parameters.

    ddp = parlab.ddp.DDP(model)                                 # averages the gradients
    optimizer = ShardedOptimizer(model.parameters(), torch.optim.Adam, lr=1e-3)
    optimizer.zero_grad(); loss_fn(ddp(x_shard), y_shard).backward()
    ddp.finish_gradient_synchronization(); optimizer.step()    # step my shard, AG parameters

It does NOT average gradients: every ``p.grad`` must already hold the gradient averaged over
the N_d ranks (after DDP or your own all-reduce). Do not stack it on ``parlab.zero.ZeroDP``,
which averages and shards itself: the model states would be communicated twice.

Each param group's trainable parameters live in one padded flat buffer
(``parlab.flat.FlatLayout``), every parameter a view into it. The given optimizer class
steps one Parameter per group, the view of this rank's shard (rank r: shard r), so its state
holds kappa Psi / N_d bytes per rank; Adam, AdamW and SGD with momentum act elementwise, so
stepping the N_d shards equals stepping the whole model. After the step a ring all-gather of
each flat buffer (``parlab.collectives``, seen by the trace and the emulated link) gives
every rank the updated shards: (N_d - 1)/N_d x 4 x padded Psi bytes sent per rank and step.
"""

import torch

from parlab import _checks, collectives, p2p, trace
from parlab.flat import FlatLayout
from parlab.zero.stages import _place_in


class ShardedOptimizer(torch.optim.Optimizer):
    """``optimizer_class`` (a torch optimizer class, such as torch.optim.Adam, with
    ``**optimizer_kwargs``) over this rank's shard of ``params`` (parameters or param groups, as any
    torch optimizer takes), on the N_d ranks of ``group`` (default: all ranks).

    Frozen parameters (``requires_grad=False``) are left out. Construction broadcasts rank
    0's (of the group) parameter values, so the replicas start equal. ``param_groups`` holds
    the full parameters and the options (a learning-rate scheduler may change them; they
    reach the inner optimizer at each step); ``state`` is the inner optimizer's, keyed by the
    shards. ``state_dict()`` is this rank's shard of the state: each rank saves its own and
    loads it back on the same N_d and rank; ``full_state_dict()`` gathers the whole state,
    which ``load_full_state_dict`` loads on any N_d. Parameters cannot be added after
    construction.
    """

    def __init__(self, params, optimizer_class, group=None, **optimizer_kwargs):
        _checks.optimizer_class(optimizer_class)
        groups = list(params)
        if groups and not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        if not all(isinstance(g, dict) and "params" in g for g in groups):
            raise ValueError("params must be parameters or param groups (dicts with 'params'), not a mix: "
                             "pass model.parameters() or [{'params': [...], 'lr': ...}, ...].")
        groups = [{**g, "params": _as_list(g["params"])} for g in groups]  # the caller's dicts stay as they are
        for g in groups:
            if not all(map(torch.is_tensor, g["params"])):
                raise ValueError("a param group's 'params' must be tensors (parameters), not param groups: "
                                 "pass model.parameters() or [{'params': [...], 'lr': ...}, ...].")
            g["params"] = [p for p in g["params"] if p.requires_grad]
            kinds = {(p.dtype, p.device, p.is_floating_point()) for p in g["params"]}
            if len(kinds) > 1 or any(not floating for _, _, floating in kinds):
                raise ValueError("the trainable parameters of a param group must share one floating dtype and "
                                 "device; call model.float() first, or put them in separate param groups.")
        groups = [g for g in groups if g["params"]]
        if not groups:
            raise ValueError("ShardedOptimizer got no trainable parameters (requires_grad=True): "
                             "pass model.parameters().")
        self.group, self.rank, self.world_size = group, *_place_in(group)
        super().__init__(groups, dict(optimizer_kwargs))
        self.layouts, self.flat_params, shard_groups = [], [], []
        for g in self.param_groups:
            layout = FlatLayout([p.shape for p in g["params"]], self.world_size)
            flat = layout.flatten([p.detach() for p in g["params"]])
            p2p.broadcast_from_first([flat], group)  # the replicas start from rank 0's values
            with torch.no_grad():
                for p, view in zip(g["params"], layout.views(flat)):
                    p.data = view  # the parameter now lives in the flat buffer: the all-gather writes into it
            shard = torch.nn.Parameter(layout.shard(flat, self.rank))  # a view: the step writes in place
            self.layouts.append(layout)
            self.flat_params.append(flat)
            shard_groups.append({**_options(g), "params": [shard]})
        self.optimizer = optimizer_class(shard_groups)
        self.state = self.optimizer.state

    def add_param_group(self, param_group):
        if hasattr(self, "optimizer"):
            raise ValueError("ShardedOptimizer lays out its parameters once, at construction: pass every param "
                             "group to the constructor.")
        super().add_param_group(param_group)

    @torch.no_grad()
    def step(self, closure=None):
        """One optimizer step of the whole model, each rank stepping its own shard only.

        Every ``p.grad`` holds the gradient averaged over the N_d ranks (None: a parameter
        with no gradient this step counts as a zero gradient, as it is one slice of the
        shard; a param group with none is skipped). The shard's gradient is a copy of this
        rank's part of it; after the inner step, one ring all-gather per param group shares
        the updated shards."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for g, inner, layout in zip(self.param_groups, self.optimizer.param_groups, self.layouts):
            inner.update(_options(g))  # a scheduler may have changed our options
            if all(p.grad is None for p in g["params"]):
                inner["params"][0].grad = None  # as torch's optimizers, skip a group with no gradient
                continue
            grads = [torch.zeros_like(p) if p.grad is None else p.grad for p in g["params"]]
            inner["params"][0].grad = layout.shard(layout.flatten(grads), self.rank).clone()
        with trace.span("optimizer"):
            self.optimizer.step()
        with trace.span("all-gather parameters"):
            for flat in self.flat_params:
                collectives.ring_all_gather(flat, check=False, group=self.group)
        return loss

    def zero_grad(self, set_to_none=True):
        """Drop (or zero) the full parameters' gradients and the shards'."""
        super().zero_grad(set_to_none)
        self.optimizer.zero_grad(set_to_none)

    def state_dict(self):
        """This rank's shard of the optimizer state and the options of every param group,
        with N_d and r, to load back with ``load_state_dict`` on the same N_d and rank."""
        for g, inner in zip(self.param_groups, self.optimizer.param_groups):
            inner.update(_options(g))
        return {**self.optimizer.state_dict(), "world_size": self.world_size, "rank": self.rank,
                "shard_numels": [layout.shard_numel for layout in self.layouts]}

    def load_state_dict(self, state_dict):
        """Load this rank's ``state_dict()``, saved on the same N_d, rank and param groups."""
        mine = (self.world_size, self.rank, [layout.shard_numel for layout in self.layouts])
        saved = tuple(state_dict.get(key) for key in ("world_size", "rank", "shard_numels"))
        if saved != mine:
            raise ValueError(f"this state dict is the shard of (N_d, rank, shard sizes) = {saved}, this optimizer "
                             f"holds {mine}: load each rank's own state_dict() on the same world size and model.")
        inner = {key: value for key, value in state_dict.items() if key in ("state", "param_groups")}
        self.optimizer.load_state_dict(inner)
        for g, loaded in zip(self.param_groups, self.optimizer.param_groups):
            g.update(_options(loaded))


    def full_state_dict(self):
        """The whole optimizer state, gathered (every rank calls it; each gets the same):
        per param group, each state tensor of the shard's size as one tensor over all the
        group's parameters in their flat order (``numels`` elements, padding dropped), the
        scalars (Adam's step) as they are, and the groups' options. Loads on any N_d with
        ``load_full_state_dict``, as the model's own state dict does."""
        for g, inner in zip(self.param_groups, self.optimizer.param_groups):
            inner.update(_options(g))
        saved = self.optimizer.state_dict()
        state = {}
        for index, layout in enumerate(self.layouts):
            state[index] = {key: self._gathered(layout, value) if _is_sharded(value, layout) else value
                            for key, value in saved["state"].get(index, {}).items()}
        return {"state": state, "param_groups": [_options(g) for g in saved["param_groups"]],
                "numels": [layout.numel for layout in self.layouts]}

    def load_full_state_dict(self, state_dict):
        """Load a ``full_state_dict()`` saved on any N_d: each rank keeps its shard of it."""
        numels = [layout.numel for layout in self.layouts]
        if state_dict.get("numels") != numels:
            raise ValueError(f"this full state dict holds param groups of {state_dict.get('numels')} elements, this "
                             f"optimizer {numels}: load it into an optimizer over the same model and param groups.")
        state = {}
        for index, layout in enumerate(self.layouts):
            state[index] = {key: self._own_shard(layout, value) if _is_whole(value, layout) else value
                            for key, value in state_dict["state"].get(index, {}).items()}
        groups = [{**options, "params": [index]} for index, options in enumerate(state_dict["param_groups"])]
        self.optimizer.load_state_dict({"state": state, "param_groups": groups})
        for g, loaded in zip(self.param_groups, self.optimizer.param_groups):
            g.update(_options(loaded))

    def _gathered(self, layout, shard):
        flat = torch.zeros(layout.padded_numel, dtype=shard.dtype, device=shard.device)
        layout.shard(flat, self.rank).copy_(shard)
        collectives.ring_all_gather(flat, check=False, group=self.group)
        return flat[:layout.numel].clone()

    def _own_shard(self, layout, full):
        flat = torch.zeros(layout.padded_numel, dtype=full.dtype, device=self.flat_params[0].device)
        flat[:layout.numel] = full
        return layout.shard(flat, self.rank).clone()


def _is_sharded(value, layout):  # a state tensor per element of the shard (Adam's moments; not its step)
    return torch.is_tensor(value) and value.dim() == 1 and value.numel() == layout.shard_numel


def _is_whole(value, layout):  # the same, gathered over the whole param group
    return torch.is_tensor(value) and value.dim() == 1 and value.numel() == layout.numel


def _as_list(params):
    return [params] if torch.is_tensor(params) else list(params)


def _options(group):
    return {key: value for key, value in group.items() if key != "params"}
