"""Pipeline and data parallelism together: N = N_d x K ranks form a grid of N_d replicas of
a K-stage pipeline (N_d, the data-parallel degree, as in lectures 02 and 04).

The lecture's 2 x 2 grid (N_d = 2 replicas, K = 2 stages, N = 4 ranks):

                       stage 0          stage 1
    pipeline 0        rank 0  --p2p-->  rank 1         samples 0 .. B/2 - 1
                        |                 |
                    all-reduce        all-reduce
                        |                 |
    pipeline 1        rank 2  --p2p-->  rank 3         samples B/2 .. B - 1

Layout: the rows are pipelines, the columns data-parallel groups. Schedule rank r of
pipeline i is global rank i K + r (``rank_grid(N_d, K)[i][r]``): pipeline i is ranks
i K .. i K + K - 1, and the data-parallel group of schedule rank r is {r, K + r, 2K + r, ...}.
Which dimension gets neighbouring ranks is a choice: pipeline messages are small (one
micro-batch's activation) but wait on the critical path, the all-reduce is large (the
stage's gradients) but comes once per step. Megatron-LM puts pipeline stages farthest
apart (across nodes) and keeps the bandwidth-hungry groups on a node; on one host it makes
no difference, and consecutive ranks per pipeline read most simply.

What each rank holds: the stages of its schedule rank (stage r for GPipe and 1F1B;
r, r + K, ... when interleaved), the same stages as the other members of its column.

What moves where in one step:
- inside a pipeline (a row), p2p: the activations and gradients of the schedule, for the
  replica's own shard of B / N_d samples, cut into M micro-batches of B / (N_d M);
- inside a data-parallel group (a column), after the pipeline's step: one ring all-reduce
  (average) per stage over one flat buffer of the stage's gradients, padded with zeros to
  a multiple of N_d, so each rank sends 2 (N_d - 1)/N_d x (padded stage bytes).

Each replica's gradient is that of the mean loss over its shard; their average over the
N_d replicas is the gradient of the mean loss over the whole batch of B samples, so every
rank ends the step with the gradient one process would compute on the full batch, and
equal replicas take equal optimizer steps.
"""

import torch
import torch.distributed as dist

from parlab import p2p, trace
from parlab._checks import whole_number
from parlab.collectives import ring_allreduce
from parlab.flat import FlatLayout
from parlab.pipeline.executor import PipelineExecutor

__all__ = ["PipelineDataParallel", "rank_grid"]


def rank_grid(N_d, K):
    """The global ranks as N_d rows (pipelines) of K columns (schedule ranks):
    ``rank_grid(N_d, K)[i][r] = i K + r``; column r is the data-parallel group of r."""
    whole_number("N_d (the number of pipelines)", N_d, "give the data-parallel degree as a count, such as N_d = 2.")
    whole_number("K (the number of ranks of a pipeline)", K, "give the pipeline depth as a count, such as K = 2.")
    return [[i * K + r for r in range(K)] for i in range(N_d)]


class PipelineDataParallel:
    """This rank's place in a grid of N_d = ``data_parallel_degree`` pipelines of K =
    ``schedule.num_ranks`` ranks each, on a world of exactly N_d x K ranks (module docstring).

    ``stages`` maps each global stage index of this rank's schedule rank to its module,
    ``loss_fn`` and ``checkpoint`` are as for ``PipelineExecutor``. Every rank must build
    it, in the same order as the other ranks (it creates the K data-parallel groups).
    Construction copies each stage's parameters from pipeline 0 to the other replicas (one
    broadcast of a flat buffer per stage in each column), so the replicas start equal.

    Attributes: ``replica`` (i), ``pipeline_ranks`` (this row), ``data_parallel_ranks``
    (this column), ``executor`` (the row's ``PipelineExecutor``).
    """

    def __init__(self, schedule, stages, loss_fn, data_parallel_degree, checkpoint=None):
        N_d, K = data_parallel_degree, schedule.num_ranks
        world = dist.get_world_size()
        if isinstance(N_d, bool) or not isinstance(N_d, int) or N_d < 1 or world != N_d * K:
            raise ValueError(f"a grid of N_d = {N_d!r} pipelines of K = {K} ranks needs N_d x K ranks, but {world} "
                             f"are running: choose N_d and K with N_d x K = {world}, or run on a world of that size.")
        grid = rank_grid(N_d, K)
        columns = [[row[r] for row in grid] for r in range(K)]
        groups = [dist.new_group(column) for column in columns]  # every rank creates every group, in one order
        self.replica, r = divmod(dist.get_rank(), K)
        self.pipeline_ranks, self.data_parallel_ranks = grid[self.replica], columns[r]
        self.group, self.data_parallel_degree = groups[r], N_d
        self.executor = PipelineExecutor(schedule, stages, loss_fn, checkpoint, ranks=self.pipeline_ranks)
        self.stage_parameters = {s: [p for p in stage.parameters() if p.requires_grad] for s, stage in stages.items()}
        self.layouts = {s: FlatLayout([p.shape for p in ps], N_d) for s, ps in self.stage_parameters.items() if ps}
        self._copy_parameters_from_pipeline_0()

    def step(self, inputs=None, targets=None):
        """One training step on the whole batch of B samples (B a multiple of N_d M; inputs
        needed on the ranks of stage 0, targets on those of the last stage): pipeline i
        runs its schedule on samples i B/N_d .. (i + 1) B/N_d - 1, then each stage's gradients
        are averaged over its column. Returns the M micro-batch losses of the replica's
        shard on the ranks of the last stage, None elsewhere. No optimizer step."""
        losses = self.executor.step(self._shard(inputs), self._shard(targets))
        for s, layout in self.layouts.items():
            with trace.span("all-reduce", stage=s), torch.no_grad():
                grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.stage_parameters[s]]
                flat = layout.flatten(grads)
                ring_allreduce(flat, op="avg", check=False, group=self.group)  # a column builds one layout
                for p, averaged in zip(self.stage_parameters[s], layout.views(flat)):
                    p.grad = averaged  # a view of the flat buffer, as torch DDP's gradient_as_bucket_view
        return losses

    def _shard(self, batch):
        if not torch.is_tensor(batch):
            return batch  # the executor says which ranks need which tensor
        N_d, M = self.data_parallel_degree, self.executor.schedule.num_microbatches
        if len(batch) % (N_d * M):
            raise ValueError(f"a batch of {len(batch)} samples does not split into N_d = {N_d} shards of M = {M} "
                             f"equal micro-batches: use a batch size that is a multiple of N_d x M = {N_d * M}.")
        return batch.tensor_split(N_d)[self.replica]

    def _copy_parameters_from_pipeline_0(self):
        source = self.data_parallel_ranks[0]
        for s, layout in self.layouts.items():
            with torch.no_grad():
                flat = layout.flatten([p.detach() for p in self.stage_parameters[s]])
                p2p.broadcast(flat, src=source, group=self.group)
                for p, value in zip(self.stage_parameters[s], layout.views(flat)):
                    p.copy_(value)
