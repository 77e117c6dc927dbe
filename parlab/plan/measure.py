"""The planner checked against runs: plans of the small GPT trained by parlab's engines on a
``parlab.Cluster`` whose link and devices are emulated, their step time and model-state bytes
put beside ``plan_time`` and ``plan_memory``.

The emulated cluster (``emulated_hardware(N)``, 4 or 8 ranks): one node of N ranks joined by one ``Link``
(``LINK``: 100 us + bytes / 10 MB/s, every port alike, so a plan's layout on the ranks does not
change its links), each rank a device of ``HARDWARE_FLOPS`` / N FLOP/s (0.25 GFLOP/s on 4
ranks, 0.125 on 8: the same 5 s of compute a step on either cluster) whose compute is declared: a
``parlab.emulated.ComputeTime`` in front of every transformer layer sleeps 2 (Psi / L) b s / t
seconds / peak forward and twice that backward (and the forward again when it is recomputed),
so L layers of M micro-batches take the planner's 6 Psi B s / (N peak) (8 with recompute).
The CPU's own work (the ranks' real arithmetic and Python's messages, 0.1 to 0.4 s a step on
2 quiet shared cores, 0.6 s beside another busy program) adds to it: the declared device is
slow (5 s of compute a step) so that it stays a small share. The warm-up step skips the
declared compute (``runs.train_plan``). The model is ``CONFIG``, the GPT of lecture 07 with
L = 4 layers (Psi = 817,920), trained with Adam in fp32 (``FP32_ADAM``, 4-byte activations in
the messages). ``parlab.plan.runs`` is the ranks' side.

What runs each plan: ``parlab.mesh_training.MeshGPT`` on a ``parlab.Mesh(dp=N_d, tp=t,
pp=K)``, any plan the planner builds (``runnable``): tensor-parallel stages with sequence
parallelism, 1F1B over K stages, the data axis's engine by ZeRO stage, M micro-batches,
recompute None, "selective" or "full", ZeRO-Offload. The overlap the prediction assumes for
it (``plan_time``'s ``overlapped``) is what parlab's engines do, not DeepSpeed's or Megatron's:

    ZeRO   engine on the data axis                       behind backward
    0      parlab.ddp.DDP, a bucket per layer, no_sync   all but the last bucket, when K = 1
                                                         (a pipeline all-reduces after its schedule)
    1      parlab.zero.ZeroDP(stage=1)                   no (reduce-scatter after backward)
    2      parlab.zero.ZeroDP(stage=2), one bucket       yes: each micro-batch's reduce-scatter on the
                                                         communication thread, behind the next ones'
                                                         compute; the last one's is the floor. Not
                                                         costed: the parameters' all-gather after the
                                                         optimizer's step (a little of the step)
    3      parlab.zero.FSDP, a unit per layer            yes: the next unit's all-gather prefetched,
                                                         reduce-scatters behind the next unit's backward

Measured per plan: the step time (each step's slowest rank; the median of ``steps`` after one
warm-up step) and each rank's model states when the gradients are synchronized, before the
optimizer's step (``parlab.memory.measure_model_state``; the largest over ranks). The
prediction's states are exact for data parallelism at stages 1 to 3 (a flat buffer of Psi padded to N_d, views as
gradients); DDP keeps a second copy of the gradients in its buckets (4 Psi more; torch's
``gradient_as_bucket_view`` avoids it); tensor and pipeline plans keep the replicated and the
first and last stages' embedding parameters, which the planner's Psi / (t K) spreads evenly.
"""

import statistics
from contextlib import contextmanager
from dataclasses import replace
from typing import NamedTuple

from parlab._checks import whole_number
from parlab.ddp import assign_buckets
from parlab.gpt import GPT
from parlab.memory import FP32_ADAM
from parlab.mesh_training import DDP_BUCKET_MB
from parlab.plan.costs import Memory, StepTime, plan_memory, plan_time
from parlab.plan.inputs import Batch, Hardware, Model
from parlab.plan.planner import Plan, plans
from parlab.plan.runs import CONFIG, train_plan
from parlab.runtime import Cluster as Ranks
from parlab.runtime import Link
from parlab.units import GIB, MIB

LINK = Link(latency=100e-6, bandwidth=10e6)
HARDWARE_FLOPS = 1e9  # the whole cluster's declared peak: each of N ranks declares 1 / N of it
BATCH = Batch(16, b=(2, 4, 8, 16))
# (N_d, t, K, ZeRO, b, recompute), N = N_d t K ranks: every engine of the table, with and without
# accumulation and recompute, on one axis and on two (4 ranks), then on three (8 ranks)
LAYOUTS = ((4, 1, 1, 0, 4, None), (4, 1, 1, 0, 2, None), (4, 1, 1, 0, 4, "full"), (4, 1, 1, 1, 4, None),
           (4, 1, 1, 2, 2, None), (4, 1, 1, 3, 4, None), (1, 4, 1, 0, 16, None), (2, 2, 1, 0, 8, None),
           (2, 2, 1, 0, 8, "full"), (1, 4, 1, 0, 16, "full"), (1, 1, 4, 0, 2, None), (2, 1, 2, 0, 2, None),
           (2, 2, 1, 1, 4, None), (2, 2, 1, 3, 8, "selective"), (1, 2, 2, 0, 4, None), (2, 1, 2, 1, 2, "full"),
           (2, 2, 2, 0, 2, None), (2, 2, 2, 1, 2, "full"), (2, 2, 2, 2, 4, None), (2, 2, 2, 3, 2, "selective"),
           (4, 2, 1, 1, 4, None), (2, 1, 4, 0, 2, None))
RANKS = (4, 8)  # the emulated clusters' sizes


class Measured(NamedTuple):
    """A ``plan`` run: the planner's ``predicted_memory`` (``Memory``) and ``predicted_time``
    (``StepTime``) beside the measured ``state_bytes`` (the largest rank's model states) and
    ``step_seconds`` (the median step of the slowest rank)."""

    plan: Plan
    predicted_memory: Memory
    predicted_time: StepTime
    state_bytes: int
    step_seconds: float

    @property
    def time_ratio(self):
        """Measured over predicted step time."""
        return self.step_seconds / self.predicted_time.total

    @property
    def state_ratio(self):
        """Measured over predicted model-state bytes."""
        return self.state_bytes / self.predicted_memory.states.total


def emulated_hardware(ranks=4):
    """The planner's view of the emulated cluster (module docstring): 1 node of ``ranks`` ranks."""
    if ranks not in RANKS:
        raise ValueError(f"the emulated clusters have {' or '.join(map(str, RANKS))} ranks, not {ranks!r}: pick one.")
    return Hardware(ranks, 1, memory=GIB, peak_flops=HARDWARE_FLOPS / ranks, intra=LINK, inter=LINK,
                    name=f"emulated: 1 node x {ranks} ranks")


def model():
    """The planner's ``Model`` of ``CONFIG`` (Psi counted from the module)."""
    return Model.small_gpt(CONFIG)


def runnable(plan):
    """None if ``run_plan`` can run ``plan``, else the sentence saying why not: only what the
    mesh does not build (HYBRID_SHARD's second data axis) or the planner rejects."""
    if plan.shard_group:
        return ("HYBRID_SHARD shards within a node and replicates across nodes: the emulated cluster is one node, "
                "so run the plan without shard_group.")
    if plan.rejected:
        return f"the planner rejects it: {' '.join(plan.reasons)}"
    return None


def overlapped(plan):
    """The ZeRO stages whose data-axis communication the plan's engine hides behind compute
    (module table): DDP's buckets when no pipeline schedule runs between the backwards,
    ZeroDP's stage-2 reduce-scatters and FSDP's prefetched gathers always."""
    return ((0,) if plan.K == 1 else ()) + (2, 3)


def predicted_plans(batch=BATCH, hardware=None, layouts=LAYOUTS):
    """The planner's ``Plan`` for each layout (module ``LAYOUTS``: (N_d, t, K, ZeRO, b,
    recompute)), its estimates as ``predict`` costs the run, on ``hardware`` (default: the
    emulated cluster of the layout's N_d t K ranks)."""
    every = {}
    for ranks in sorted({hardware.gpus} if hardware else RANKS):
        on = hardware or emulated_hardware(ranks)
        every.update({(p.N_d, p.t, p.K, p.zero, p.b, p.recompute): (p, on)
                      for p in plans(model(), batch, on, FP32_ADAM, efficiency=1.0, max_bubble=1.0, reserve=0,
                                     offload=(False,), hybrid=False) if not p.rejected})  # what the engines run
    chosen = []
    for layout in layouts:
        if layout not in every:
            sizes = hardware.gpus if hardware else " or ".join(map(str, RANKS))
            raise ValueError(f"{layout} is not a plan of {sizes} ranks for B = {batch.B}: give (N_d, t, K, "
                             "ZeRO, b, recompute) with N_d t K = the ranks, b dividing B / N_d and M >= K.")
        plan, on = every[layout]
        chosen.append(replace(plan, time=predict(plan, batch, on)[1]))
    return chosen


def predict(plan, batch=BATCH, hardware=None):
    """(``Memory``, ``StepTime``) of ``plan`` as the run is costed: fp32 Adam (``FP32_ADAM``),
    efficiency 1 (the declared compute is the peak's), 4-byte activations in the messages, the
    overlap of the plan's engine (``overlapped``) and DDP's last bucket (``last_bucket_bytes``)."""
    gpt, hardware = model(), hardware or emulated_hardware(plan.ranks)
    seconds = plan_time(gpt, batch, hardware, plan, FP32_ADAM, efficiency=1.0, activation_bytes=4,
                        overlapped=overlapped(plan), bucket_bytes=last_bucket_bytes())
    return plan_memory(gpt, plan, FP32_ADAM), seconds


def last_bucket_bytes():
    """Bytes of the last bucket DDP all-reduces in the run (``runs.DDP_BUCKET_MB`` each, filled
    from the last parameter back: the first layer's and the embeddings' gradients)."""
    sizes = [p.numel() * p.element_size() for p in GPT(CONFIG).parameters()]
    return sum(sizes[i] for i in assign_buckets(sizes, DDP_BUCKET_MB * MIB)[-1])


def declared_seconds(plan, hardware=None):
    """(forward, backward): the declared time of one layer for one micro-batch on one rank of
    ``plan`` (module docstring): forward 2 (Psi / L) b s / t FLOPs at the cluster's peak, backward
    twice that, plus with selective recompute the attention scores' two products again,
    4 b s^2 h / t FLOPs (``plan_time``'s term). Full recompute's second forward is the layer's
    own forward run again (``MeshGPT`` checkpoints it with its declared time)."""
    gpt = model()
    peak = (hardware or emulated_hardware(plan.ranks)).peak_flops
    forward = 2 * (gpt.psi / gpt.L) * plan.b * gpt.s / (plan.t * peak)
    again = 4 * plan.b * gpt.s**2 * gpt.h / (plan.t * peak) if plan.recompute == "selective" else 0.0
    return forward, 2 * forward + again


def run_plan(plan, batch=BATCH, hardware=None, steps=3, runtime=None):
    """Train the small GPT ``steps`` + 1 steps with ``plan`` on ``runtime`` (a ``parlab.Cluster``
    of the plan's ranks; one is started and closed if None) with the emulated link, and return
    its ``Measured``."""
    return _run(plan, batch, hardware, steps, runtime, traced=False)[0]


def trace_plan(plan, batch=BATCH, hardware=None, steps=1, runtime=None):
    """``run_plan``, traced: (its ``Measured``, the ``parlab.trace.Timeline`` of the call, each
    step a "step" span: ``timeline.window("step")`` is the last)."""
    return _run(plan, batch, hardware, steps, runtime, traced=True)


def _run(plan, batch, hardware, steps, runtime, traced):
    if not isinstance(plan, Plan):
        raise ValueError(f"plan must be a parlab.plan.Plan, got {type(plan).__name__}: take one of "
                         "parlab.plan.measure.predicted_plans(), or build Plan(N_d, t, K, zero, b, M, recompute).")
    whole_number("steps", steps, "give the number of timed steps after the warm-up, e.g. steps=2.")
    reason = runnable(plan)
    if reason:
        raise ValueError(f"cannot run {plan}: {reason}")
    hardware = hardware or emulated_hardware(plan.ranks)
    if hardware.gpus != plan.ranks or (runtime is not None and runtime.world_size != hardware.gpus):
        raise ValueError(f"{plan} runs on N_d t K = {plan.ranks} ranks: give hardware (and a runtime) of that "
                         "many, or leave them out.")
    memory, seconds = predict(plan, batch, hardware)
    layer_seconds = declared_seconds(plan, hardware)
    layout = (plan.N_d, plan.t, plan.K, plan.zero, plan.b, plan.M, plan.recompute, plan.offload)
    timeline = None
    with _ranks(runtime, hardware) as ranks, ranks.emulate(link=hardware.intra):
        if traced:
            timeline = ranks.trace(train_plan, layout, batch.B, layer_seconds, steps)
            results = timeline.results
        else:
            results = ranks.run(train_plan, layout, batch.B, layer_seconds, steps)
    step_seconds = statistics.median(max(times) for times in zip(*(r["times"] for r in results)))
    return Measured(plan, memory, seconds, max(r["state_bytes"] for r in results), step_seconds), timeline


def check_plans(batch=BATCH, hardware=None, steps=3, runtime=None, layouts=LAYOUTS, desc="plans"):
    """``run_plan`` for the plan of each of ``layouts`` (by default the module's), one after
    another on one cluster of ranks per world size (``runtime`` for the plans of its size),
    with a progress bar; returns their ``Measured`` in the order of ``layouts``."""
    from parlab.runtime.progress import progress_bar

    chosen = predicted_plans(batch, hardware, layouts)
    measured = [None] * len(chosen)
    with progress_bar(len(chosen), desc, unit="plan") as bar:
        for size in sorted({plan.ranks for plan in chosen}):
            given = runtime if runtime is not None and runtime.world_size == size else None
            with _ranks(given, hardware or emulated_hardware(size)) as ranks:
                for i, plan in enumerate(chosen):
                    if plan.ranks == size:
                        measured[i] = run_plan(plan, batch, hardware, steps, ranks)
                        bar.update(1)
    return measured


@contextmanager
def _ranks(runtime, hardware):
    """``runtime``, or ranks started for the call and closed after it: gloo on CPUs, even
    beside a GPU (the emulated cluster declares its devices)."""
    if runtime is not None:
        yield runtime
        return
    with Ranks(hardware.gpus, backend="gloo", device="cpu") as ranks:
        yield ranks
