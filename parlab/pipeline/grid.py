"""Pipeline and data parallelism together: N = N_d x K ranks form a ``parlab.Mesh(dp=N_d,
pp=K)``, N_d replicas of a K-stage pipeline (N_d, the data-parallel degree, as in lectures 02
and 04).

The lecture's 2 x 2 grid (N_d = 2 replicas, K = 2 stages, N = 4 ranks):

                       stage 0          stage 1
    pipeline 0        rank 0  --p2p-->  rank 2         samples 0 .. B/2 - 1
                        |                 |
                    all-reduce        all-reduce
                        |                 |
    pipeline 1        rank 1  --p2p-->  rank 3         samples B/2 .. B - 1

Layout: the mesh's, the one of every lecture from here on (``parlab.runtime.mesh``): pipeline
stages outermost, so stage r of pipeline i is global rank r N_d + i; pipeline i is
``mesh.ranks("pp")`` of its ranks, {i, N_d + i, 2 N_d + i, ...}, and the data-parallel group
of stage r is the N_d consecutive ranks r N_d .. r N_d + N_d - 1. Which dimension gets
neighbouring ranks is a choice: pipeline messages are small (one micro-batch's activation) but
wait on the critical path, the all-reduce is large (the stage's gradients) but comes once per
step. Megatron-LM puts pipeline stages farthest apart (across nodes) and keeps the
bandwidth-hungry groups on a node.

What each rank holds: the stages of its schedule rank (stage r for GPipe and 1F1B;
r, r + K, ... when interleaved), the same stages as the other members of its column.

What moves where in one step:
- inside a pipeline, p2p: the activations and gradients of the schedule, for the replica's
  own shard of B / N_d samples, cut into M micro-batches of B / (N_d M);
- inside a data-parallel group, after the pipeline's step: one ring all-reduce (average) per
  stage, of one flat buffer of the stage's gradients (``parlab.ddp.DDP(variant="flat")`` over
  the group, lecture 02's engine), so each rank sends 2 (N_d - 1)/N_d x (stage bytes) when
  N_d divides the stage's parameters.

Each replica's gradient is that of the mean loss over its shard; their average over the
N_d replicas is the gradient of the mean loss over the whole batch of B samples, so every
rank ends the step with the gradient one process would compute on the full batch, and
equal replicas take equal optimizer steps.
"""

import functools

import torch

from parlab import trace
from parlab.collectives import ring_all_reduce
from parlab.ddp import DDP
from parlab.pipeline.executor import PipelineExecutor
from parlab.runtime.mesh import Mesh

__all__ = ["PipelineDataParallel"]


class PipelineDataParallel:
    """This rank's place in a grid of N_d = ``data_parallel_degree`` pipelines of K =
    ``schedule.num_ranks`` ranks each, on a world of exactly N_d x K ranks (module docstring):
    its schedule rank is ``mesh.coordinate("pp")``, ``dist.get_rank() // N_d``.

    ``stages`` maps each global stage index of this rank's schedule rank to its module,
    ``loss_fn`` and ``checkpoint`` are as for ``PipelineExecutor``. Every rank must build
    it, in the same order as the other ranks (its mesh creates the groups). Construction copies
    each stage's parameters from pipeline 0 to the other replicas (the DDP engine's broadcast),
    so the replicas start equal.

    Attributes: ``mesh``, ``replica`` (i), ``pipeline_ranks`` (this pipeline),
    ``data_parallel_ranks`` (this column), ``executor`` (the pipeline's ``PipelineExecutor``).
    """

    def __init__(self, schedule, stages, loss_fn, data_parallel_degree, checkpoint=None):
        N_d = data_parallel_degree
        if isinstance(N_d, bool) or not isinstance(N_d, int) or N_d < 1:
            raise ValueError(f"N_d (the number of pipelines) must be a whole number >= 1, got {N_d!r}: give the "
                             "data-parallel degree as a count, such as N_d = 2.")
        self.mesh = Mesh(dp=N_d, pp=schedule.num_ranks)
        self.replica, self.data_parallel_degree = self.mesh.coordinate("dp"), N_d
        self.pipeline_ranks, self.data_parallel_ranks = self.mesh.ranks("pp"), self.mesh.ranks("dp")
        group = self.mesh.group("dp")
        average = functools.partial(ring_all_reduce, check=False, group=group)
        self.engines = {s: DDP(stage, variant="flat", all_reduce=average, broadcast_buffers=False, group=group)
                        for s, stage in stages.items() if any(p.requires_grad for p in stage.parameters())}
        self.executor = PipelineExecutor(schedule, stages, loss_fn, checkpoint, ranks=self.pipeline_ranks)

    def step(self, inputs=None, targets=None):
        """One training step on the whole batch of B samples (B a multiple of N_d M; inputs
        needed on the ranks of stage 0, targets on those of the last stage): pipeline i
        runs its schedule on samples i B/N_d .. (i + 1) B/N_d - 1, then each stage's gradients
        are averaged over its column. Returns the M micro-batch losses of the replica's
        shard on the ranks of the last stage, None elsewhere. No optimizer step."""
        losses = self.executor.step(self._shard(inputs), self._shard(targets))
        for s, engine in self.engines.items():
            with trace.span("all-reduce", stage=s), torch.no_grad():
                engine.finish_gradient_synchronization()
        return losses

    def close(self):
        """Destroy the mesh's groups."""
        self.mesh.close()

    def _shard(self, batch):
        if not torch.is_tensor(batch):
            return batch  # the executor says which ranks need which tensor
        N_d, M = self.data_parallel_degree, self.executor.schedule.num_microbatches
        if len(batch) % (N_d * M):
            raise ValueError(f"a batch of {len(batch)} samples does not split into N_d = {N_d} shards of M = {M} "
                             f"equal micro-batches: use a batch size that is a multiple of N_d x M = {N_d * M}.")
        return batch.tensor_split(N_d)[self.replica]
