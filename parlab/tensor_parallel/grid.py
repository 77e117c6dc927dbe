"""Data parallelism x tensor parallelism: N = N_d x t ranks form a ``parlab.Mesh(dp=N_d,
tp=t)``, N_d replicas of a model split over t ranks (as ``parlab.pipeline.grid`` does with
pipelines; ``parlab.mesh_training`` adds the third axis).

The lecture's 2 x 2 grid (N_d = 2 replicas, t = 2, N = 4 ranks):

                     TP rank 0        TP rank 1
    replica 0        rank 0  <--TP-->  rank 1         samples 0 .. B/2 - 1
                       |                 |
                   all-reduce        all-reduce
                       |                 |
    replica 1        rank 2  <--TP-->  rank 3         samples B/2 .. B - 1

Layout: the mesh's (``parlab.runtime.mesh``): the rows are tensor-parallel groups, the
columns data-parallel groups. Rank r of replica d is global rank d t + r. Tensor parallelism talks in
every layer, on the critical path, so its group gets neighbouring ranks: on real machines
those share a node and its fast links (Megatron-LM's order, tensor parallelism innermost).
The data-parallel all-reduce comes once per step and can cross the slower network.

One step: replica d runs forward and backward on its B/N_d samples with its row's
collectives; then (with sequence parallelism, after the row's sum of the replicated
parameters' gradients) each rank averages the gradients of its parameter shards over its
column: one ring all-reduce of one flat buffer (``parlab.ddp.DDP(variant="flat")`` over the
column, lecture 02's engine). Every rank then holds the full-batch gradient of its shard, as
one process would.

ZeRO stage 1 on the data axis (``optimizer_class``, lecture 04): the N_d ranks of a column
hold the same tensor-parallel shard, so they also split its optimizer state N_d ways. The
column runs ``parlab.zero.ZeroDP(..., stage=1, group=column)`` over its ``ParallelGPT``: the
all-reduce becomes its two halves, a reduce-scatter that leaves rank d the averaged gradient
of its 1/N_d of the flat buffer, the optimizer's step of that piece, and an all-gather that
brings every rank the whole updated buffer: the same bytes, 1/N_d of the optimizer state.
"""

import functools

import torch

from parlab import trace
from parlab.collectives import ring_all_reduce
from parlab.ddp import DDP
from parlab.runtime.mesh import Mesh
from parlab.tensor_parallel.model import ParallelGPT
from parlab.zero.stages import ZeroDP

__all__ = ["TensorDataParallel"]


class TensorDataParallel:
    """This rank's place in a grid of N_d = ``data_parallel_degree`` replicas of ``model``
    (a ``parlab.gpt.GPT``) split over t = N / N_d ranks each, a ``parlab.Mesh(dp=N_d, tp=t)``
    (module docstring). Every rank builds it, in the same order (its mesh creates the groups).
    The replicas start from replica 0's weights (the data-parallel engine's broadcast).

    Attributes: ``mesh``, ``replica`` (d), ``tensor_parallel_ranks`` (this row),
    ``data_parallel_ranks`` (this column), ``model`` (this rank's ``ParallelGPT``).

    ``optimizer_class``: an optimizer class (e.g. torch.optim.Adam, with ``optimizer_kwargs``)
    for ZeRO stage 1 along the column (module docstring); then ``step`` also takes the
    optimizer's step, ``zero`` is the column's ``parlab.zero.ZeroDP`` engine and
    ``optimizer`` (its optimizer) holds this rank's 1/N_d of the state; the module gradients
    are views into the engine's flat gradient, averaged only in this rank's shard after a step
    and zeroed at the next. Without it, ``zero`` and ``optimizer`` are None and ``step``
    leaves averaged gradients for any optimizer over ``model.parameters()``."""

    def __init__(self, model, data_parallel_degree, sequence_parallel=False, optimizer_class=None,
                 **optimizer_kwargs):
        N_d, world = data_parallel_degree, torch.distributed.get_world_size()
        if isinstance(N_d, bool) or not isinstance(N_d, int) or N_d < 1 or world % N_d:
            raise ValueError(f"a grid of N_d = {N_d!r} replicas needs a world of N_d x t ranks, but {world} are "
                             f"running: choose N_d that divides {world}.")
        self.mesh = Mesh(dp=N_d, tp=world // N_d)
        self.replica, self.data_parallel_degree = self.mesh.coordinate("dp"), N_d
        self.tensor_parallel_ranks, self.data_parallel_ranks = self.mesh.ranks("tp"), self.mesh.ranks("dp")
        self.tensor_parallel_group, self.data_parallel_group = self.mesh.group("tp"), self.mesh.group("dp")
        self.model = ParallelGPT(model, self.tensor_parallel_group, sequence_parallel)
        self.zero, self.optimizer = None, None
        if optimizer_class is None:
            average = functools.partial(ring_all_reduce, check=False, group=self.data_parallel_group)
            self.engine = DDP(self.model, variant="flat", all_reduce=average, broadcast_buffers=False,
                              group=self.data_parallel_group)
        else:  # the engine starts the column from its first rank's (replica 0's) values
            self.engine = self.zero = ZeroDP(self.model, optimizer_class, stage=1, group=self.data_parallel_group,
                                             **optimizer_kwargs)
            self.optimizer = self.zero.optimizer

    def step(self, tokens, targets):
        """Forward and backward of the whole batch (b sequences, b a multiple of N_d): this
        replica's b/N_d of them, then the gradients averaged over the column. Returns the
        replica's loss. No optimizer step, except with ZeRO (``optimizer_class``), where the
        column reduce-scatters the gradients, steps its shards and all-gathers them."""
        b = len(tokens)
        if b % self.data_parallel_degree:
            raise ValueError(f"a batch of {b} sequences does not split into N_d = {self.data_parallel_degree} equal "
                             f"shards: use a multiple of {self.data_parallel_degree}.")
        tokens, targets = tokens.tensor_split(self.data_parallel_degree)[self.replica], targets.tensor_split(
            self.data_parallel_degree)[self.replica]
        if self.zero is not None:
            self.zero.zero_grad()  # in place: the module gradients are views into the engine's flat buffer
        loss = self.model.loss(tokens, targets)
        loss.backward()
        self.model.reduce_sequence_parallel_gradients()
        if self.zero is None:
            with trace.span("data-parallel all-reduce"), torch.no_grad():
                self.engine.finish_gradient_synchronization()
            return loss.detach()
        # reduce-scatter: rank d of the column gets the averaged gradient of its shard
        with trace.span("data-parallel reduce-scatter"):
            self.zero.finish_gradient_synchronization()
        # the engine's step: its "optimizer" span steps this rank's 1/N_d (with its 1/N_d of the
        # optimizer state), its "all-gather parameters" span brings the column every shard
        with trace.span("data-parallel all-gather"):
            self.zero.step()
        return loss.detach()

    def close(self):
        """Destroy the mesh's groups."""
        self.mesh.close()
