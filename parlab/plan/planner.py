"""Every plan for a model on a cluster, its memory per GPU and step time, ranked.

A plan places the N GPUs (the world size) on a grid N_d x t x K = N (data x tensor x
pipeline), with tensor parallelism innermost (consecutive ranks), then data, then pipeline,
as Megatron-LM orders them: a tensor group spans t consecutive ranks, a data group t N_d, a
pipeline t N_d K.
A group whose span divides the GPUs of a node lies inside one node and talks over the
``intra`` link; otherwise its slowest hop is the ``inter`` link. The rest of a plan: the ZeRO
stage of the data axis (0 to 3), the micro-batch size b (M = B / (N_d b) micro-batches per
replica, one after another on a stage) and full activation recompute, on or off.

Memory per GPU (``plan_memory``), each term from the lecture that owns it:

    model states   parlab.memory.model_state_bytes(Psi / (t K), zero, N_d, kappa, ...)   lecture 04
    activations    korthikanti_bytes(s, b, h, a, t, sequence_parallel, recompute)        lecture 07
                   x L / K layers x min(K, M) micro-batches in flight                      lecture 03
                   (1F1B's first stage holds K; with recompute, plus one layer's full
                   activations while it is recomputed)

Step time (``plan_time``), in seconds:

    compute   6 Psi B s FLOPs (8 Psi B s with recompute: a second forward) / (N peak efficiency)
    tensor    (4 + 2 recompute) L / K M ring all-reduces of b s h 16-bit values on t ranks:
              2 in forward, 2 in backward per layer (Megatron's f and g), 2 more when the
              forward is recomputed; with sequence parallelism the all-gather and
              reduce-scatter that replace each all-reduce move the same bytes
    pipeline  2 M messages of b s h / t 16-bit values (b s h without sequence parallelism)
              per stage: an activation forward and its gradient back, one Link.time each
    bubble    (compute + tensor + pipeline) x f / (1 - f), f = bubble_formula(K, M) of
              lecture 03: the busy time stretched by the idle share of 1F1B
    data      ring_communication_seconds of Psi / (t K) gradients on N_d ranks (lecture 04),
              per step for stages 0 and 1; stage 2 reduce-scatters every micro-batch's
              gradients (M + 1 collectives, not 2), stage 3 also gathers the parameters for
              every micro-batch's forward and backward (3 M, not 3): the ZeRO paper's counts
              are for one micro-batch per step

Overlap assumed for the data axis: its collectives run behind backward where the technique
starts them during backward. Stages 0 and 1 (bucketed all-reduce) hide behind the last
micro-batch's backward; stage 2 behind every micro-batch's backward (each reduce-scatters
its own); stage 3 behind all compute (prefetched gathers). Only what sticks out is added.
Tensor and pipeline messages sit on the critical path and are never hidden.

A plan must fit in the GPU's memory less a reserve (``reserve``, 10% by default): what the
formula leaves out still takes memory on a real GPU (the CUDA context, about 0.5 to 1 GiB;
communication buffers, e.g. NCCL's and ZeRO's buckets; the caching allocator's
fragmentation; the logits), so a plan at 79 of 80 GiB would not run.

Left out: the embedding and output layers' activations and their uneven stages (Psi is split
evenly over K stages), the logits, stage 3's gathered layer, buffers and fragmentation,
offload, interleaved schedules; activations are the paper's 16-bit values and 1-byte masks
whatever ``precision`` says of the model states.
"""

import math
from dataclasses import dataclass
from typing import NamedTuple

from parlab._checks import real_number
from parlab.alpha_beta import cost_model
from parlab.memory import (
    MIXED_ADAM,
    STAGES,
    ModelState,
    Precision,
    check_stage,
    model_state_bytes,
    ring_communication_seconds,
    transformer_activation_bytes,
)
from parlab.pipeline import bubble_formula
from parlab.plan.inputs import GIB, Batch, Cluster, Model

ACTIVATION_BYTES = 2  # 16-bit activations, as Korthikanti et al. count them
RESERVE = 0.1  # the share of a GPU's memory no plan may use (module docstring)


class Memory(NamedTuple):
    """Bytes one GPU holds: its model states (a ``parlab.memory.ModelState``) and activations."""

    states: ModelState
    activations: float

    @property
    def total(self):
        return self.states.total + self.activations


class StepTime(NamedTuple):
    """Seconds of one optimizer step, by where they go (the module docstring's terms); ``data``
    is the data axis's time not hidden behind backward."""

    compute: float
    tensor: float
    pipeline: float
    bubble: float
    data: float

    @property
    def total(self):
        return sum(self)


@dataclass(frozen=True)
class Plan:
    """One placement: degrees ``N_d``, ``t``, ``K``, ZeRO stage ``zero``, micro-batch ``b`` and
    ``M`` micro-batches per replica, ``recompute`` on or off; its ``memory`` and ``time`` (None
    when the plan cannot be built), and the ``reasons`` it is rejected, as sentences."""

    N_d: int
    t: int
    K: int
    zero: int
    b: int
    M: int | None
    recompute: bool
    memory: Memory | None = None
    time: StepTime | None = None
    reasons: tuple = ()

    @property
    def rejected(self):
        return bool(self.reasons)

    def __str__(self):
        layout = (f"N_d={self.N_d} t={self.t} K={self.K} ZeRO-{self.zero} b={self.b} M={self.M} "
                  f"recompute {'on' if self.recompute else 'off'}")
        if self.memory is None:
            return f"{layout}: {' '.join(self.reasons)}"
        estimate = f"{self.memory.total / GIB:.1f} GiB, {self.time.total:.3g} s"
        return f"{layout}: {estimate}" + (f" (rejected: {' '.join(self.reasons)})" if self.reasons else "")


def plans(model, batch, cluster, precision=MIXED_ADAM, efficiency=0.5, sequence_parallel=True, max_bubble=0.5,
          tensor_across_nodes=False, zero_stages=STAGES, reserve=RESERVE):
    """Every plan over N_d x t x K = N, each ZeRO stage of ``zero_stages``, each micro-batch
    size of ``batch`` and recompute off/on: the accepted ones first, fastest first (then least
    memory), then the rejected ones in the order they were enumerated. A plan is rejected when it cannot be
    built (t does not divide a, K does not divide L, B does not split, M < K), when its
    tensor group spans nodes (unless ``tensor_across_nodes``), when it does not fit in the
    GPU's memory less ``reserve`` (a share of it kept free, module docstring), or when its
    bubble is above ``max_bubble``. ``efficiency``: the share of peak FLOP/s that compute
    reaches."""
    _check_inputs(model, batch, cluster, efficiency, max_bubble)
    real_number("reserve", reserve, "give the share of GPU memory to keep free, e.g. 0.1 (0 keeps none).")
    if reserve >= 1:
        raise ValueError(f"reserve is a share of the GPU's memory below 1, got {reserve!r}: e.g. 0.1.")
    if not isinstance(precision, Precision):
        raise ValueError(f"precision must be a parlab.memory.Precision, got {precision!r}: e.g. "
                         "parlab.memory.MIXED_ADAM (kappa = 12, 2-byte parameters and gradients) or FP32_ADAM.")
    for stage in zero_stages:
        check_stage(stage)
    every = [_assess(model, batch, cluster, precision, efficiency, sequence_parallel, max_bubble, tensor_across_nodes,
                     reserve, N_d, t, K, zero, b, recompute)
             for N_d, t, K in grids(cluster.gpus) for zero in zero_stages
             for b in batch.micro_batch_sizes for recompute in (False, True)]
    accepted = sorted((p for p in every if not p.rejected), key=lambda p: (p.time.total, p.memory.total))
    return accepted + [p for p in every if p.rejected]


def best_plans(model, batch, cluster, n=3, **options):
    """The ``n`` fastest accepted plans (``plans``' options)."""
    return [p for p in plans(model, batch, cluster, **options) if not p.rejected][:n]


def grids(N):
    """Every (N_d, t, K) with N_d t K = N, in increasing t, then K."""
    return [(N // (t * K), t, K) for t in _divisors(N) for K in _divisors(N // t)]


def plan_memory(model, plan, precision=MIXED_ADAM, sequence_parallel=True):
    """``Memory`` of one GPU of ``plan`` (a ``Plan``; its estimates are not read), by the
    module docstring's formula, e.g. ``plan_memory(model, Plan(8, 1, 1, zero=1, b=4, M=2,
    recompute=False))``."""
    N_d, t, K, zero, b, M, recompute = _layout(model, plan)
    states = model_state_bytes(model.psi / (t * K), zero, N_d, *precision)
    layer = transformer_activation_bytes(model.s, b, model.h, model.a, 1, "full" if recompute else None, t,
                                         sequence_parallel)
    activations = layer * (model.L // K) * min(K, M)
    if recompute:
        activations += transformer_activation_bytes(model.s, b, model.h, model.a, 1, None, t, sequence_parallel)
    return Memory(states, activations)


def plan_time(model, batch, cluster, plan, precision=MIXED_ADAM, efficiency=0.5, sequence_parallel=True,
              activation_bytes=ACTIVATION_BYTES, overlapped=STAGES):
    """``StepTime`` of one step of ``plan`` (a ``Plan``; its estimates are not read), by the
    module docstring's formula. ``activation_bytes``: bytes of one activation value in the
    tensor and pipeline messages (2: 16-bit). ``overlapped``: the ZeRO stages whose data-axis
    communication runs behind backward (module docstring, "Overlap"); an engine that
    communicates after backward, on the critical path, is costed with ``overlapped=()``."""
    N_d, t, K, zero, b, M, recompute = _layout(model, plan)
    N, s, h = cluster.gpus, model.s, model.h
    compute = (8 if recompute else 6) * model.psi * batch.B * s / (N * cluster.peak_flops * efficiency)
    tensor = 0.0
    if t > 1:
        link = cluster.intra if cluster.within_node(t) else cluster.inter
        all_reduces = (6 if recompute else 4) * (model.L // K) * M
        tensor = all_reduces * cost_model("ring", b * s * h * activation_bytes, t, link.latency, 1 / link.bandwidth)
    pipeline = 0.0
    if K > 1:
        link = cluster.intra if cluster.within_node(N) else cluster.inter
        pipeline = 2 * M * link.time(b * s * h * activation_bytes / (t if sequence_parallel else 1))
    busy = compute + tensor + pipeline
    idle = bubble_formula(K, M)
    return StepTime(compute, tensor, pipeline, busy * idle / (1 - idle), _exposed_data_seconds(
        model, cluster, precision, N_d, t, K, zero, M, compute, recompute, zero in overlapped))


def _exposed_data_seconds(model, cluster, precision, N_d, t, K, zero, M, compute, recompute, overlaps):
    if N_d == 1:
        return 0.0
    link = cluster.intra if cluster.within_node(t * N_d) else cluster.inter
    padded = math.ceil(model.psi / (t * K) / N_d) * N_d  # a flat buffer cut into N_d equal shards
    one_micro_batch = ring_communication_seconds([padded], N_d, precision.grad_bytes, zero, link.latency,
                                                 link.bandwidth)
    seconds = one_micro_batch * {0: 1, 1: 1, 2: (M + 1) / 2, 3: M}[zero]
    backward = compute * (6 / 8 if recompute else 4 / 6)  # backward's share, its re-forward included
    if not overlaps:
        return seconds
    hidden_behind = {0: backward / M, 1: backward / M, 2: backward, 3: compute}[zero]
    return max(0.0, seconds - hidden_behind)


def _assess(model, batch, cluster, precision, efficiency, sequence_parallel, max_bubble, tensor_across_nodes,
            reserve, N_d, t, K, zero, b, recompute):
    """The ``Plan`` with its estimates and the sentences that reject it."""
    built = [reason for failed, reason in (
        (model.a % t, f"t = {t} does not divide the a = {model.a} heads: each rank takes a / t whole heads."),
        (model.L % K, f"K = {K} does not divide the L = {model.L} layers into equal stages."),
        (batch.B % (N_d * b), f"B = {batch.B} does not split into N_d = {N_d} replicas of micro-batches of b = {b}."),
    ) if failed]
    M = batch.B // (N_d * b) if not built else None
    if not built and M < K:
        built.append(f"1F1B needs M >= K: M = {M} micro-batches cannot fill K = {K} stages; lower b or N_d.")
    if built:
        return Plan(N_d, t, K, zero, b, M, recompute, reasons=tuple(built))
    layout = Plan(N_d, t, K, zero, b, M, recompute)
    memory = plan_memory(model, layout, precision, sequence_parallel)
    time = plan_time(model, batch, cluster, layout, precision, efficiency, sequence_parallel)
    reasons = []
    if not tensor_across_nodes and not cluster.within_node(t):
        reasons.append(f"t = {t} spans nodes: its all-reduces would cross the inter-node link "
                       f"(nodes of {cluster.gpus_per_node} GPUs).")
    usable = cluster.memory * (1 - reserve)
    if memory.total > usable:
        kept = f" ({reserve:.0%} of {cluster.memory / GIB:.1f} GiB kept free)" if reserve else ""
        reasons.append(f"does not fit: needs {memory.total / GIB:.1f} GiB of {usable / GIB:.1f} GiB{kept}.")
    if bubble_formula(K, M) > max_bubble:
        reasons.append(f"bubble {bubble_formula(K, M):.0%} above {max_bubble:.0%}: raise M (a smaller b) or lower K.")
    return Plan(N_d, t, K, zero, b, M, recompute, memory, time, tuple(reasons))


def _layout(model, plan):
    if model.L % plan.K:
        raise ValueError(f"K = {plan.K} does not divide the L = {model.L} layers into equal stages: "
                         "pick a divisor of L.")
    if plan.M is None:
        raise ValueError("the plan has no M (it cannot be built): give M = B / (N_d b) micro-batches.")
    return plan.N_d, plan.t, plan.K, plan.zero, plan.b, plan.M, plan.recompute


def _divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]


def _check_inputs(model, batch, cluster, efficiency, max_bubble):
    for name, value, kind in (("model", model, Model), ("batch", batch, Batch), ("cluster", cluster, Cluster)):
        if not isinstance(value, kind):
            raise ValueError(f"{name} must be a parlab.plan.{kind.__name__}, got {type(value).__name__}: "
                             f"build one, e.g. parlab.plan.{kind.__name__}(...) or one of its presets.")
    real_number("efficiency", efficiency, "give the share of peak FLOP/s compute reaches, e.g. 0.5.", above=True)
    if efficiency > 1:
        raise ValueError(f"efficiency is a share of the peak, at most 1, got {efficiency!r}: e.g. 0.5.")
    real_number("max_bubble", max_bubble, "give the largest idle share of a pipeline step to accept, e.g. 0.5.")
