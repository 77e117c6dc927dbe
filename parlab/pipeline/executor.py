"""Run a pipeline schedule on real ranks: each rank runs its list of actions in order,
sending activations forward and gradients backward with traced point-to-point messages.

    stages = partition(model, schedule.num_stages)                      # same model on every rank
    mine = {s: stages[s] for s in schedule.stages_of(dist.get_rank())}
    executor = PipelineExecutor(schedule, mine, nn.functional.mse_loss)
    losses = executor.step(inputs, targets)     # M losses on the rank of the last stage, else None
    optimizer.step()

The batch of B samples is cut into M micro-batches of B / M. The loss of the step is the
mean of the micro-batch losses, L = (1/M) sum_m loss_m, so each micro-batch's backward
starts from dL/dloss_m = 1/M and the gradients the stages accumulate are those of ONE
backward of the full-batch mean loss.

The work of one action is two small functions, the seam of the ``pipeline`` exercise:

    forward_step(executor, action)    F(s, m): input (the batch or a message), the stage, send
    backward_step(executor, action)   B(s, m): gradient (1/M or a message), backward, send

``PipelineExecutor(..., forward_step=f, backward_step=g)`` runs ``f`` and ``g`` instead. They
build on the executor's ``send``/``receive`` (where a message goes, its tag, local hand-off)
and ``run_forward``/``run_backward`` (the compute, with checkpointing and memory metering).
W(s, m) (``weight_step``) is only in schedules that split the backward: B then computes
the gradient of the stage input alone (``autograd.grad`` keeping the graph; nothing on
stage 0 unless its input requires grad) and W the gradients of the stage's parameters from
the same graph, which also runs again the parts of the backward that lead to them.

Messages: an activation (from F(s, m) to stage s + 1) and a gradient (from B(s, m) to
stage s - 1) are named by (kind, s, m), and their tag is unique per name, so messages never
mismatch whatever order a rank posts its receives in. Sends are isends, all waited at the
end of the step (so in a measured timeline an isend ends there: gloo reports a send as
complete only when it is waited on). A receiver allocates the buffer: a gradient has the shape of the output of
its own F, and an activation's shape and dtype come in a small header, sent once per stage
boundary and step before the first activation (so all micro-batches of a step must give
a stage output of one shape; the header is metadata and untraced, so the trace counts
exactly the activations and gradients of the schedule). Each rank posts the receive of its
next action before running the current one, when it knows the shape. Stages on the same
rank hand tensors over in memory.

Ranks: by default the schedule's rank r is global rank r and the world is the K ranks.
``ranks=`` runs the schedule on any K global ranks instead, schedule rank r on global rank
``ranks[r]`` (``parlab.pipeline.grid`` runs N_d pipelines side by side this way): only the
addresses of the messages change. Tags stay per (kind, stage, m): pipelines that run at the
same time use disjoint ranks, so their messages cannot meet.

Activation memory: ``peak_activation_bytes`` is measured in every step: the bytes of the
tensors autograd saves for backward (``saved_tensors_hooks``) plus the stage inputs and
outputs the executor keeps, each storage counted once, at its peak. Parameters and the
step's own inputs and targets are not activations and are not counted; neither are
gradients or buffers in flight.

Checkpointing (activation recomputation): with ``checkpoint="always"`` F runs without
a graph and keeps only the stage input; B first runs the forward again (with the random
state of F, so dropout draws the same mask) and then the backward. ``"except_last"`` is
torchgpipe's default: every micro-batch but the last is checkpointed. torchgpipe runs the
backwards in reverse, so the last micro-batch's backward comes first and recomputing it
would be wasted; parlab's GPipe, like torch's ScheduleGPipe, runs them in order 0..M-1, so
here the last micro-batch's activations stay held through the whole backward phase.
"""

import numbers
from contextlib import contextmanager
from types import SimpleNamespace

import torch
import torch.distributed as dist

from parlab import p2p, runtime, trace
from parlab._checks import whole_number
from parlab.emulated import SleepLayer
from parlab.pipeline.activations import ActivationMeter
from parlab.pipeline.schedule import Schedule
from parlab.pipeline.stages import partition

__all__ = ["PipelineExecutor", "SleepLayer", "partition", "sleep_pipeline_step", "forward_step",
           "backward_step", "weight_step"]

ACTIVATION, GRADIENT, HEADER = 0, 1, 2  # message kinds, part of the tag
CHECKPOINT = (None, "always", "except_last")
MAX_DIMS = 8  # activations of up to 8 dimensions
DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def forward_step(executor, action):
    """F(s, m): take the stage input (micro-batch m of the batch on stage 0, else the
    activation of F(s - 1, m)), run the stage (on the last stage: the stage and the loss),
    and send the output to stage s + 1 (on the last stage: keep the loss)."""
    stage, m = action.stage, action.microbatch
    x = executor.input_microbatches[m] if stage == 0 else executor.receive(ACTIVATION, stage - 1, m)
    with trace.span("forward", stage=stage, microbatch=m):
        output = executor.run_forward(stage, m, x)
    if stage == executor.last_stage:
        executor.losses[m] = output.detach()
    else:
        executor.send(ACTIVATION, stage, m, output)


def backward_step(executor, action):
    """B(s, m): take the gradient of the stage output (1/M for the last stage's loss, else
    the gradient of B(s + 1, m)), run the backward, and send the gradient of the stage
    input to stage s - 1."""
    stage, m = action.stage, action.microbatch
    if stage == executor.last_stage:
        grad = torch.full_like(executor.losses[m], 1 / executor.schedule.num_microbatches)
    else:
        grad = executor.receive(GRADIENT, stage + 1, m)
    with trace.span("backward", stage=stage, microbatch=m):
        grad_input = executor.run_backward(stage, m, grad)
    if stage > 0:
        executor.send(GRADIENT, stage, m, grad_input)


def weight_step(executor, action):
    """W(s, m): accumulate the gradients of stage s's parameters for micro-batch m."""
    with trace.span("weight", stage=action.stage, microbatch=action.microbatch):
        executor.run_weight(action.stage, action.microbatch)


class PipelineExecutor:
    """This rank's part of a pipeline: ``stages`` maps each of its global stage indices
    (``schedule.stages_of(rank)``) to its module; ``loss_fn(output, target)`` is the mean
    loss of a micro-batch; ``checkpoint`` is None, "always" or "except_last" (module
    docstring). Runs on the default process group of K = ``schedule.num_ranks`` ranks, or
    in one process without one when K = 1; with ``ranks`` (K distinct global ranks, this
    one among them) on those ranks of a larger world. ``self.rank`` is the schedule's rank
    r, ``self.ranks[r]`` its global rank."""

    def __init__(self, schedule, stages, loss_fn, checkpoint=None, forward_step=forward_step,
                 backward_step=backward_step, weight_step=weight_step, ranks=None):
        _check_parts(schedule, stages, loss_fn)
        K = schedule.num_ranks
        world = dist.get_world_size() if dist.is_initialized() else 1
        global_rank = dist.get_rank() if dist.is_initialized() else 0
        if ranks is None:
            if world != K:
                raise ValueError(f"the schedule is for K = {K} ranks but {world} are running: run it on "
                                 f"{K} ranks or make the schedule for {world}.")
            ranks = range(K)
        self.ranks = list(ranks)
        if (len(self.ranks) != K or len(set(self.ranks)) != K or global_rank not in self.ranks
                or not all(isinstance(r, numbers.Integral) and not isinstance(r, bool) and 0 <= r < world
                           for r in self.ranks)):
            raise ValueError(f"ranks={self.ranks} must be K = {K} distinct global ranks below the world size {world}, "
                             f"this rank ({global_rank}) among them: pass one global rank per schedule rank.")
        self.rank = self.ranks.index(global_rank)
        expected = schedule.stages_of(self.rank)
        if sorted(stages) != expected:
            raise ValueError(f"rank {self.rank} runs stages {expected} of this {schedule.name} schedule (stage s lives "
                             f"on rank s mod K) but was given stages {sorted(stages)}: pass exactly those.")
        if checkpoint not in CHECKPOINT:
            raise ValueError(f"checkpoint must be one of {CHECKPOINT}, got {checkpoint!r}.")
        self.schedule, self.stages, self.loss_fn, self.checkpoint = schedule, stages, loss_fn, checkpoint
        self.last_stage = schedule.num_stages - 1
        self.split_backward = schedule.has_weight_actions
        self.steps = {"F": forward_step, "B": backward_step, "W": weight_step}
        self.device = runtime.device()
        self.meter = ActivationMeter()
        self.peak_activation_bytes = 0

    def step(self, inputs=None, targets=None):
        """One training step (forward and backward of every micro-batch; no optimizer step).
        ``inputs`` are needed on the rank of stage 0, ``targets`` on the rank of the last
        stage, both batches of B samples with B a multiple of M. Returns the M micro-batch
        losses on the rank of the last stage, None elsewhere."""
        mine = self.stages.keys()
        self.input_microbatches = self._split(inputs, "inputs") if 0 in mine else None
        self.target_microbatches = self._split(targets, "targets") if self.last_stage in mine else None
        self.losses = [None] * self.schedule.num_microbatches
        self._state, self._local, self._sends, self._posted, self._headers = {}, {}, [], {}, {}
        self.meter.start([p for module in self.stages.values() for p in module.parameters()]
                         + [t for t in (inputs, targets) if torch.is_tensor(t)])
        actions = self.schedule.actions[self.rank]
        for i, action in enumerate(actions):
            if i + 1 < len(actions):
                self._post_receive(actions[i + 1])
            self.steps[action.kind](self, action)
        p2p.wait_all(self._sends)
        self._sends, self._local = [], {}
        self.peak_activation_bytes = self.meter.peak
        return self.losses if self.last_stage in mine else None

    def _split(self, batch, name):
        M = self.schedule.num_microbatches
        if not torch.is_tensor(batch):
            raise ValueError(f"rank {self.rank} holds stage {0 if name == 'inputs' else self.last_stage}: pass the "
                             f"batch's {name} to step() as a tensor.")
        if len(batch) % M:
            raise ValueError(f"a batch of {len(batch)} {name} does not split into M = {M} equal micro-batches: "
                             f"use a batch size that is a multiple of {M}.")
        return batch.split(len(batch) // M)

    # --- compute ---------------------------------------------------------------------------

    def run_forward(self, stage, m, x):
        """The stage's output for input x (on the last stage: the micro-batch's loss), keeping
        what its backward needs: the graph and x, or only x when micro-batch m is
        checkpointed."""
        if stage > 0:
            x = x.detach().requires_grad_()  # a leaf: B reads the gradient of the stage input from it
        state = self._state[stage, m] = SimpleNamespace(input=self.meter.hold(x), output=None, grad=None)
        last_microbatch = m == self.schedule.num_microbatches - 1
        if self.checkpoint == "always" or (self.checkpoint == "except_last" and not last_microbatch):
            state.rng = _rng_state(self.device)
            with torch.no_grad():
                output = self._stage_forward(stage, m, x)
        else:
            with self.meter.saving():
                output = self._stage_forward(stage, m, x)
            state.output = self.meter.hold(output)
        state.output_like = torch.empty_like(output, device="meta")
        return output

    def run_backward(self, stage, m, grad):
        """Backpropagate ``grad`` (the gradient of the stage output) through the stage;
        returns the gradient of the stage input (None on stage 0). With a split backward
        only that gradient is computed and the graph is kept for W."""
        state = self._state[stage, m]
        x = state.input.tensor
        if state.output is None:  # checkpointed: recompute the forward, this time with a graph
            with _restored_rng(state.rng, self.device), self.meter.saving():
                state.output = self.meter.hold(self._stage_forward(stage, m, x))
        if not self.split_backward:
            torch.autograd.backward(state.output.tensor, grad)
            del self._state[stage, m]
            return x.grad if stage > 0 else None
        state.grad = grad
        if not x.requires_grad:
            return None
        return torch.autograd.grad(state.output.tensor, x, grad, retain_graph=True)[0]

    def run_weight(self, stage, m):
        """Accumulate the parameter gradients of stage s for micro-batch m from the graph that
        B kept, then free that graph."""
        state = self._state.pop((stage, m))
        parameters = [p for p in self.stages[stage].parameters() if p.requires_grad]
        if not parameters:
            return
        grads = torch.autograd.grad(state.output.tensor, parameters, state.grad, allow_unused=True)
        for p, g in zip(parameters, grads):
            if g is not None:
                p.grad = g if p.grad is None else p.grad.add_(g)

    def _stage_forward(self, stage, m, x):
        output = self.stages[stage](x)
        return self.loss_fn(output, self.target_microbatches[m]) if stage == self.last_stage else output

    # --- communication ---------------------------------------------------------------------

    def send(self, kind, stage, m, tensor):
        """Send the message (kind, stage, m) (ACTIVATION: to stage + 1; GRADIENT: to
        stage - 1) without waiting; to a stage on this rank it is handed over in memory."""
        destination = self.schedule.rank_of(stage + 1 if kind == ACTIVATION else stage - 1)
        tensor = tensor.detach()
        if destination == self.rank:
            self._local[kind, stage, m] = tensor
            return
        tensor = tensor.contiguous()
        if kind == ACTIVATION and stage not in self._headers:
            self._headers[stage] = header = _header(tensor, self._header_device())
            self._sends.append(dist.isend(header, self.ranks[destination], tag=self._tag(HEADER, stage, 0)))
        self._sends.append(p2p.isend(tensor, self.ranks[destination], tag=self._tag(kind, stage, m)))

    def receive(self, kind, stage, m):
        """The message (kind, stage, m) sent by ``stage`` (blocks until it has arrived)."""
        source = self.schedule.rank_of(stage)
        if source == self.rank:
            return self._local.pop((kind, stage, m))
        if (kind, stage, m) not in self._posted:
            if kind == ACTIVATION and stage not in self._headers:
                self._headers[stage] = torch.empty(2 + MAX_DIMS, dtype=torch.int64, device=self._header_device())
                dist.recv(self._headers[stage], self.ranks[source], tag=self._tag(HEADER, stage, 0))
            self._irecv(kind, stage, m)
        return self._posted.pop((kind, stage, m)).wait()

    def _post_receive(self, action):
        """Post now the receive that ``action`` (the next one) will need, when its shape is
        known: a message that arrives while this rank computes is taken in meanwhile."""
        stage, m = action.stage, action.microbatch
        if action.kind == "F" and stage > 0 and stage - 1 in self._headers:
            message = ACTIVATION, stage - 1, m
        elif action.kind == "B" and stage < self.last_stage and (stage, m) in self._state:
            message = GRADIENT, stage + 1, m
        else:
            return
        if self.schedule.rank_of(message[1]) != self.rank and message not in self._posted:
            self._irecv(*message)

    def _irecv(self, kind, stage, m):
        if kind == ACTIVATION:
            header = self._headers[stage].tolist()
            like = torch.empty(header[2:2 + header[1]], dtype=DTYPES[header[0]], device="meta")
        else:  # the gradient of the output of this rank's F(stage - 1, m)
            like = self._state[stage - 1, m].output_like
        # Not empty_like: from a meta tensor it imports sympy, seconds on a fresh rank.
        buffer = torch.empty(like.shape, dtype=like.dtype, device=self.device)
        source = self.ranks[self.schedule.rank_of(stage)]
        self._posted[kind, stage, m] = p2p.irecv(buffer, source, tag=self._tag(kind, stage, m))

    def _tag(self, kind, stage, m):
        return (kind * self.schedule.num_stages + stage) * self.schedule.num_microbatches + m

    def _header_device(self):
        return self.device if dist.get_backend() == "nccl" else torch.device("cpu")


def _check_parts(schedule, stages, loss_fn):
    if not isinstance(schedule, Schedule):
        raise ValueError(f"schedule must be a parlab.pipeline Schedule, got {type(schedule).__name__}: make one with "
                         f"make_schedule(name, K, M) or a generator such as one_f_one_b(K, M).")
    if not isinstance(stages, dict) or not all(isinstance(m, torch.nn.Module) for m in stages.values()):
        raise ValueError(f"stages must be a dict from this rank's global stage indices to their modules, got "
                         f"{type(stages).__name__}: pass {{s: stages[s] for s in schedule.stages_of(rank)}}.")
    if not callable(loss_fn):
        raise ValueError(f"loss_fn must be a function loss_fn(output, target) -> mean loss, got {loss_fn!r}: pass "
                         "e.g. torch.nn.functional.mse_loss.")


def _header(tensor, device):
    """[dtype index, number of dimensions, shape..., 0 padding] as MAX_DIMS + 2 int64s."""
    if tensor.dtype not in DTYPES or tensor.dim() > MAX_DIMS:
        raise ValueError(f"a stage output of dtype {tensor.dtype} and {tensor.dim()} dimensions cannot cross ranks: "
                         f"use one of {DTYPES} and at most {MAX_DIMS} dimensions.")
    shape = list(tensor.shape) + [0] * (MAX_DIMS - tensor.dim())
    return torch.tensor([DTYPES.index(tensor.dtype), tensor.dim(), *shape], dtype=torch.int64, device=device)


def _rng_state(device):
    return torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None


@contextmanager
def _restored_rng(state, device):
    """Run a recomputation with the random state its forward had, then continue the stream
    where it was."""
    cpu, cuda = state
    with torch.random.fork_rng(devices=[device] if cuda is not None else []):
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda, device)
        yield


def sleep_pipeline_step(schedule, t_f, t_b, t_w=0.0, activation_bytes=4, checkpoint=None):
    """Run one step of ``schedule`` on this rank with stages that only sleep (a
    ``SleepLayer`` each: t_f in F, t_b in B, t_w in W), so that a traced step shows the
    schedule's timeline with these per-stage times. Each micro-batch is one sample of
    ``activation_bytes`` bytes (fp32, so a multiple of 4): every activation and every
    gradient between stages is a message of that size, which an emulated link charges
    alpha + activation_bytes beta. ``checkpoint`` as for ``PipelineExecutor``: a checkpointed
    micro-batch's B sleeps t_f again (the recomputed forward), then t_b. Call it on every rank, e.g.
    ``cluster.trace(sleep_pipeline_step, schedule, 0.02, 0.02)``. Returns what
    ``PipelineExecutor.step`` returns."""
    if t_w and not schedule.has_weight_actions:
        raise ValueError(f"{schedule.name} has no W actions, so its B is the whole backward: add the weight-gradient "
                         f"time to t_b and leave t_w = 0.")
    whole_number("activation_bytes (the bytes of one micro-batch's activation)", activation_bytes,
                 "give the size of a message between stages in bytes, a multiple of 4 (fp32), e.g. 4096.")
    if activation_bytes % 4:
        raise ValueError(f"activation_bytes must be a multiple of 4 (the activations are fp32), got "
                         f"{activation_bytes}: use {4 * (activation_bytes // 4 + 1)}.")
    rank = dist.get_rank() if dist.is_initialized() else 0
    stages = {s: SleepLayer(t_f, t_b, t_w) for s in schedule.stages_of(rank)}
    M, device, features = schedule.num_microbatches, runtime.device(), activation_bytes // 4
    executor = PipelineExecutor(schedule, stages, torch.nn.functional.mse_loss, checkpoint)
    # the input requires grad so that stage 0's B takes t_b like every other stage's
    return executor.step(torch.zeros(M, features, device=device, requires_grad=True),
                         torch.zeros(M, features, device=device))
