"""The small GPT trained on a ``parlab.Mesh`` in 3-D: tensor parallelism inside pipeline stages,
each stage inside a data-parallel engine over the ``dp`` axis, as Megatron-LM, picotron and
torchtitan compose them.

    mesh = parlab.Mesh(dp=2, pp=2, tp=2)                       # 8 ranks
    trainer = MeshGPT(GPT(config), mesh, zero=1, microbatches=2, lr=1e-3)
    loss_sum = trainer.step(tokens, targets)                   # the same batch on every rank

Who does what, wrapped from the inside out:

    tp   ``ParallelGPT(gpt, mesh.group("tp"), sequence_parallel, stage=(i_pp, pp))``: this
         rank's columns and rows of its stage's layers (lecture 07), with sequence parallelism
         when tp > 1 (``sequence_parallel=True``, the default);
    dp   the stage in one engine over ``mesh.group("dp")`` (lectures 02 and 04), by ZeRO stage:
         0 ``parlab.ddp.DDP`` (buckets; during backward when pp = 1), 1 and 2
         ``parlab.zero.ZeroDP``, 3 ``parlab.zero.FSDP`` (a unit per layer);
    pp   ``parlab.pipeline.PipelineExecutor`` running 1F1B (GPipe when M < pp, too few
         micro-batches to fill 1F1B's warm-up) over ``mesh.ranks("pp")`` (lecture 03), its
         stages the engines, when pp > 1; with pp = 1 the micro-batches run
         one after another (DDP's ``no_sync`` for all but the last).

One step on the whole batch of B sequences (every rank passes the same batch): replica i_dp
takes its B / dp sequences, the pipeline cuts them into ``microbatches`` (M) micro-batches of
B / (dp M); the ranks of a tp group see the same tokens. After the schedule the dp engine
averages the gradients over its group, and with sequence parallelism each rank's gradient of
the parameters the tp group keeps whole (norms, row biases, positions; each rank's covers its
s / tp positions) is summed over the tp group. Sum and average commute, so the sum runs on
what the engine leaves: DDP's whole gradients, ZeroDP's averaged shard (the ranks of a tp
group hold the same layout, so the same elements), FSDP's replicated units (those parameters
are kept whole on the data axis too, ``FSDP(replicate=...)``, a few KiB). The optimizer
(Adam by default) then steps what the engine holds.

``recompute``: None, "selective" (the attention core, ``recompute_attention``) or "full"
(every layer, ``recompute_layers``), the planner's ``Plan.recompute``. ``layer_seconds``:
a declared compute time per layer and micro-batch, forward (backward twice that) or a pair
(forward, backward), for the planner's checks (``parlab.emulated.ComputeTime`` in front of
every layer, recomputed with it).
"""

import dataclasses
from contextlib import nullcontext

import torch
import torch.distributed as dist

from parlab import trace
from parlab.collectives import ring_all_reduce
from parlab.ddp import DDP
from parlab.emulated import ComputeTime
from parlab.memory import check_recompute, measure_model_state
from parlab.pipeline import PipelineExecutor, gpipe, one_f_one_b
from parlab.runtime.mesh import AXES, Mesh, axis_groups
from parlab.tensor_parallel.layers import parallel_cross_entropy
from parlab.tensor_parallel.model import ParallelBlock, ParallelGPT
from parlab.zero import FSDP, ZeroDP
from parlab.zero.units import REPLICATED_NAME

__all__ = ["MeshGPT", "by_axis", "bytes_by_axis"]

DDP_BUCKET_MB = 1  # about a layer of the small GPT per bucket: backward hides all but the last


class MeshGPT:
    """This rank's part of ``gpt`` (a ``parlab.gpt.GPT``, the same on every rank) trained on
    ``mesh`` (a ``parlab.Mesh``; module docstring). ``zero``: the ZeRO stage on the data axis
    (0 to 3); ``microbatches``: M per replica and step; ``optimizer_class`` and
    ``**optimizer_kwargs``: the optimizer (Adam); ``offload``: ZeRO-Offload at stages 1 and 2.

    Attributes: ``model`` (this rank's ``ParallelGPT`` stage), ``engine`` (the data-parallel
    engine around it), ``optimizer``, ``numel`` (the parameters of this rank's stage and
    tensor shard, before the data axis shards them) and ``kept_whole`` (those of them FSDP
    keeps whole on the data axis: the tp group's replicated ones at ZeRO 3 with sequence
    parallelism, else 0)."""

    def __init__(self, gpt, mesh, zero=0, sequence_parallel=True, microbatches=1, recompute=None,
                 optimizer_class=torch.optim.Adam, layer_seconds=0.0, offload=False, **optimizer_kwargs):
        if not isinstance(mesh, Mesh):
            raise ValueError(f"mesh must be a parlab.Mesh, got {type(mesh).__name__}: build one on every rank, e.g. "
                             "parlab.Mesh(dp=2, pp=2, tp=2).")
        if mesh.size("cp") > 1 or mesh.size("ep") > 1:
            raise ValueError(f"MeshGPT trains on the dp, tp and pp axes; this mesh has cp = {mesh.size('cp')} and "
                             f"ep = {mesh.size('ep')}: build it with cp=1 and ep=1.")
        if zero not in (0, 1, 2, 3):
            raise ValueError(f"zero must be a ZeRO stage 0, 1, 2 or 3, got {zero!r}.")
        if offload and zero not in (1, 2):
            raise ValueError(f"offload moves the optimizer's shard to the host at ZeRO stages 1 and 2, not {zero}: "
                             "pick one of them, or offload=False.")
        check_recompute(recompute)
        if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
            raise ValueError(f"microbatches must be a whole number >= 1, got {microbatches!r}.")
        self.mesh, self.zero, self.M = mesh, zero, microbatches
        self.state_bytes, self.gradients = None, None
        self.dp, self.tp, self.pp = (mesh.size(axis) for axis in ("dp", "tp", "pp"))
        self.tp_group, dp_group = mesh.group("tp"), mesh.group("dp")
        self.sequence_parallel = sequence_parallel and self.tp > 1
        self.model = ParallelGPT(gpt, self.tp_group, self.sequence_parallel, recompute == "selective",
                                 recompute == "full", stage=(mesh.coordinate("pp"), self.pp))
        if layer_seconds:
            forward_s, backward_s = layer_seconds if isinstance(layer_seconds, tuple) else (layer_seconds,
                                                                                            2 * layer_seconds)
            for layer in self.model.layers:  # a module without parameters: the names stay the whole model's
                layer.declared = ComputeTime(forward_s, backward_s)
                layer.register_forward_pre_hook(lambda layer, args: (layer.declared(args[0]),))
        replicated = {id(p) for p in self.model.replicated_parameters()}
        self.numel = sum(p.numel() for p in self.model.parameters())  # this rank's parameters, before any sharding
        self.kept_whole = sum(p.numel() for p in self.model.parameters() if id(p) in replicated) \
            if zero == 3 and self.sequence_parallel else 0  # FSDP keeps them whole on the data axis too
        if zero == 0:
            self.engine = DDP(self.model, bucket_cap_mb=DDP_BUCKET_MB, broadcast_buffers=False, group=dp_group)
            self.optimizer = optimizer_class(self.model.parameters(), **optimizer_kwargs)
        elif zero == 3:
            names = {name for name, p in self.model.named_parameters() if id(p) in replicated}
            keep_whole = (lambda name, p: name in names) if self.sequence_parallel else None
            self.engine = FSDP(self.model, optimizer_class, wrap_policy=lambda m: isinstance(m, ParallelBlock),
                               replicate=keep_whole, group=dp_group, **optimizer_kwargs)
            self.optimizer = self.engine.optimizer
        else:
            self.engine = ZeroDP(self.model, optimizer_class, stage=zero, offload=offload, group=dp_group,
                                 **optimizer_kwargs)
            self.optimizer = self.engine.optimizer
            mask = [torch.full(p.shape, float(id(p) in replicated)) for p in self.engine.trainable]
            flat = self.engine.layout.flatten(mask)
            self._replicated_in_shard = self.engine.layout.shard(flat, self.engine.rank) > 0
        self.executor = None
        if self.pp > 1:
            schedule = (one_f_one_b if microbatches >= self.pp else gpipe)(self.pp, microbatches)
            self.executor = PipelineExecutor(schedule, {mesh.coordinate("pp"): self.engine}, self._loss,
                                             ranks=mesh.ranks("pp"))

    def step(self, tokens, targets, keep_gradients=False):
        """One training step on the batch (B sequences, B a multiple of dp x M): forward and
        backward of this replica's B / dp, the gradients synchronized (module docstring), the
        optimizer's step. Returns the sum of the losses of the sequences this rank owns (the
        last stage's first tp rank owns its replica's; 0 elsewhere). Read before the
        optimizer's step: ``state_bytes``, the rank's model-state bytes (``model_state_bytes``),
        and with ``keep_gradients`` ``gradients``, the averaged gradients of the parameters this
        rank holds, by the whole model's names (else None)."""
        B = len(tokens)
        if B % (self.dp * self.M):
            raise ValueError(f"a batch of {B} sequences does not split into dp = {self.dp} replicas of M = {self.M} "
                             f"micro-batches: use a multiple of {self.dp * self.M}.")
        i = self.mesh.coordinate("dp")
        tokens, targets = tokens.tensor_split(self.dp)[i], targets.tensor_split(self.dp)[i]
        self._zero_grad()
        losses = self._forward_backward(tokens, targets)
        self.engine.finish_gradient_synchronization()
        self._sum_sequence_parallel_gradients()
        self.state_bytes = self.model_state_bytes()
        self.gradients = self.engine.full_gradients() if keep_gradients else None
        if self.zero == 0:
            with trace.span("optimizer"):
                self.optimizer.step()
        else:
            self.engine.step()
        if losses is None or dist.get_rank(self.tp_group) != 0:
            return 0.0
        return sum(loss.item() for loss in losses) * len(tokens) / self.M

    def _forward_backward(self, tokens, targets):
        """The M micro-batches' forward and backward; their losses on the last stage, else None."""
        if self.executor is not None:
            with self.engine.no_sync() if self.zero == 0 else nullcontext():
                return self.executor.step(tokens, targets)
        losses = []
        for m, (x, y) in enumerate(zip(tokens.tensor_split(self.M), targets.tensor_split(self.M))):
            with self.engine.no_sync() if self.zero == 0 and m < self.M - 1 else nullcontext():
                loss = self._loss(self.engine(x), y)
                (loss / self.M).backward()
            losses.append(loss.detach())
        return losses

    def _loss(self, logits, targets):
        return parallel_cross_entropy(logits, targets, self.tp_group)

    def _zero_grad(self):
        if self.zero == 0:
            self.optimizer.zero_grad()
        else:
            self.engine.zero_grad()

    def _sum_sequence_parallel_gradients(self):
        """With sequence parallelism: sum over the tp group the gradients of the parameters it
        keeps whole, where the engine left them (module docstring)."""
        if not self.sequence_parallel:
            return
        if self.zero == 0:
            self.model.reduce_sequence_parallel_gradients()
            return
        with torch.no_grad(), trace.span("sequence-parallel gradients"):
            if self.zero == 3:
                for unit in self.engine.units:
                    if unit.shard is getattr(unit.module, REPLICATED_NAME, None):
                        ring_all_reduce(unit.shard.grad, check=False, group=self.tp_group)
                return
            grad = self.engine.shard.grad
            values = grad[self._replicated_in_shard]
            ring_all_reduce(values, check=False, group=self.tp_group)
            grad[self._replicated_in_shard] = values

    def model_state_bytes(self):
        """This rank's model-state bytes now (``parlab.memory.measure_model_state``), Adam's
        step counters (4 bytes per parameter tensor) left out as the planner leaves them."""
        if self.zero == 0:
            ddp = self.engine.model_state_bytes()  # the buckets' copies of the gradients included
            states = [v for state in self.optimizer.state.values() for v in state.values() if torch.is_tensor(v)]
            total = ddp.params + ddp.grads + measure_model_state([], [], states).total
        else:
            total = self.engine.model_state_bytes().total
        counters = sum(state["step"].nbytes for state in self.optimizer.state.values()
                       if torch.is_tensor(state.get("step")))
        return total - counters



def by_axis(timeline, dp=1, pp=1, tp=1, cp=1, ep=1):
    """A copy of ``timeline`` (a ``parlab.trace.Timeline`` of a run on a mesh of these sizes)
    whose messages are named by the axis they travel along, "tp", "cp", "ep", "dp" or "pp" (the mesh's
    group holding both the rank and its peer), so that a chart draws each axis in one colour;
    compute spans are left as they are, and so is a message with no peer (DDP's
    "all_reduce" record)."""
    place = _places(dp=dp, pp=pp, tp=tp, cp=cp, ep=ep)
    copy = trace.Timeline([], timeline.world_size, timeline.results, regime=timeline.regime)
    copy.events = [dataclasses.replace(ev, name=_axis_of(ev, place)) if ev.kind == trace.COMM and ev.peer is not None
                   else ev for ev in timeline.events]
    return copy


def bytes_by_axis(timeline, dp=1, pp=1, tp=1, cp=1, ep=1):
    """{axis: [bytes each rank sent along it]} of a run on a mesh of these sizes."""
    place = _places(dp=dp, pp=pp, tp=tp, cp=cp, ep=ep)
    sent = {axis: [0] * timeline.world_size for axis in AXES}
    for ev in timeline.events:
        if ev.kind == trace.COMM and ev.name in ("send", "isend") and ev.peer is not None:
            sent[_axis_of(ev, place)][ev.rank] += ev.nbytes
    return sent


def _places(**sizes):
    """{axis: {rank: the index of its group along the axis}}."""
    return {axis: {rank: index for index, group in enumerate(axis_groups(axis, **sizes)) for rank in group}
            for axis in AXES}


def _axis_of(ev, place):
    for axis in AXES:  # the one axis whose group holds both ends: the others' coordinates are equal
        if place[axis][ev.rank] == place[axis][ev.peer]:
            return axis
    raise ValueError(f"rank {ev.rank} and its peer {ev.peer} share no axis of the mesh: is it the run's mesh?")
