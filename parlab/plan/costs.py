"""What a plan costs: its memory per GPU (``plan_memory``) and its step time (``plan_time``),
each term from the lecture that owns its formula (symbols: the glossary's; a plan's degrees
N_d x t x K x cp x ep, ZeRO stage, micro-batch b, M micro-batches per replica, recompute,
offload).

Lecture 09's axes, in every term below: a rank holds s / cp of each sequence's tokens, and a
mixture of experts' ``expert_psi`` parameters are split ep ways. The model states come in two
parts (``state_parts``): the dense Psi - expert_psi split t K ways, sharded by ZeRO over the
D = N_d cp ep ranks that hold the same slice, and the experts' expert_psi split ep t K ways,
over D = N_d cp (Megatron-LM's expert data-parallel group).

Memory per GPU (``plan_memory``), each term from the lecture that owns it:

    model states   parlab.memory.model_state_bytes(Psi / (t K), zero, N_d, kappa, ...)   lecture 04
                   (N_d -> S for HYBRID_SHARD, stage 3 sharded within a node's group of S)
                   with offload (ZeRO-Offload, stages 1 and 2): the device part of
                   parlab.zero.formulas.offload_state_bytes (parameters, stage 1's
                   gradients); the host keeps the shard's master copy, gradient and
                   optimizer state (``Memory.host``), and a node's host memory holds its GPUs'
    activations    transformer_activation_bytes(s / cp, b, h, a, 1, recompute, t, sequence_parallel)
                   x L / K layers x min(K, M) micro-batches in flight           lectures 07, 03
                   (1F1B's first stage holds K), with recompute None (every activation kept,
                   attention scores too), "selective" (the attention scores recomputed, as
                   Korthikanti et al. 2022 do; flash attention never stores them either) or
                   "full" (only each layer's input kept); with recompute, plus what it rebuilds
                   of the one layer being recomputed, A(None) - A(recompute), for one micro-batch;
                   with cp > 1 the attention scores' term is one (s/cp) x (s/cp) block's,
                   what a step of ring attention holds

Step time (``plan_time``), in seconds:

    compute   6 Psi B s FLOPs / (N peak efficiency), Psi the parameters a token passes through
              (``Model.active_psi``: with experts, k of E); full recompute: 8 Psi B s (a second
              forward); selective: 6 Psi B s + 4 B s^2 h L (the attention scores' two matrix
              products again, Q K^T and scores x V, 2 s^2 h FLOPs each per layer and sample:
              Korthikanti et al. 2022, Appendix A, whose Eq. 8 sums them to 1 + s/3h where the
              two products it lists give 1 + 2s/9h)
    tensor    ((4 + 2 full) L / K + e) M ring all-reduces of b (s/cp) h 16-bit values on t
              ranks: 2 in forward, 2 in backward per layer (Megatron's f and g), 2 more when
              the whole forward is recomputed (selective recompute stays inside a rank's
              heads and sends nothing); e = 2 (1 on a stage of a pipeline: the first or the
              last) for the embedding's g and the head's f; with sequence parallelism the
              all-gather and reduce-scatter that replace each all-reduce move the same bytes
    pipeline  2 M messages of b (s/cp) h / t 16-bit values (without sequence parallelism
              not divided by t) per stage: an activation forward and its gradient back, one
              Link.time each
    context   what sticks out of ring attention (lecture 09) in each of the L / K layers of a
              stage, for each of its M micro-batches. A transfer moves a rank's K and V (or
              their gradients) for its a / t heads, 2 b (s/cp)(h/t) 16-bit values, in tau =
              one Link.time (``parlab.context_parallel.bytes_per_rank``'s bytes), over
              ``intra`` where t cp divides a node. It hides behind a block's attention, f =
              2 b (s/cp)^2 (h/t) FLOPs / (peak efficiency) forward (Q K^T and scores x V, 4 b
              (s/cp)^2 h/t, halved by the causal mask, balanced by the zig-zag split), twice
              that backward (four products). Forward: cp - 1 transfers, one per block,
              (cp - 1) max(0, tau - f); backward: 2 cp - 1 transfers (K/V again, then dK/dV)
              behind cp blocks, max(0, (2 cp - 1) tau - 2 cp f); full recompute adds the
              forward's again. The attention's FLOPs themselves are left out of compute
              (below), so this term is the time ring attention adds to them
    experts   in each MoE layer (every layer), each micro-batch: dispatch and combine forward
              and their gradients backward, 4 all-to-alls (6 with full recompute) over ep
              ranks, each rank sending T k h 16-bit values (ep - 1) / ep of its T = b s / cp
              tokens (b s / (cp t) with sequence parallelism) to the other ranks' experts,
              balanced (``parlab.experts.balanced_all_to_all_bytes``), in ep - 1 messages:
              (ep - 1) alpha + bytes beta each, over ``intra`` where t cp ep divides a node;
              not hidden
    bubble    (compute + tensor + pipeline + context + experts) x f / (1 - f), f = bubble_formula(K, M) of
              lecture 03: the busy time stretched by the idle share of 1F1B
    data      ring_communication_seconds of each part's gradients on its D ranks (lecture 04),
              per step for stages 0 and 1; stage 2 reduce-scatters every micro-batch's
              gradients (M + 1 collectives, not 2), stage 3 also gathers the parameters for
              every micro-batch's forward and backward (3 M, not 3): the ZeRO paper's counts
              are for one micro-batch per step; HYBRID_SHARD (stage 3 in a group of S ranks
              of a node, ``Plan.shard_group``): per micro-batch stage 3's three collectives
              on S ranks over ``intra`` and the gradient shard's all-reduce over the N_d / S
              groups over ``inter``
    offload   with offload: the gradient shard to the host and the parameter shard back
              over ``hardware.host`` (parlab.zero.formulas.offload_bytes_per_step, each one
              Link.time), and the host's optimizer step over the shard's Psi / (t K N_d)
              parameters at ``hardware.host_update_rate``; not overlapped (ZeRO-Offload can
              hide part of it behind backward: an upper bound)

Overlap assumed for the data axis: its collectives run behind backward where the technique
starts them during backward. Stages 0 and 1 (bucketed all-reduce) hide behind the last
micro-batch's backward; stage 2 behind every micro-batch's backward (each reduce-scatters
its own); stage 3 behind all compute (prefetched gathers). Only what sticks out is added,
and at least the last bucket's collective (``bucket_bytes`` of the first layers' gradients,
ready when backward ends) at stages 0 to 2.
Tensor and pipeline messages sit on the critical path and are never hidden.

Offload: ZeRO-Offload as ``parlab.zero.ZeroDP(..., offload=True)`` runs it, in the plan's
precision: the host's shard holds kappa Psi / (t K N_d) bytes of optimizer state (the fp32
master copy among them with mixed precision) and the shard's parameters and gradient.

Left out: the embedding and output layers' activations and their uneven stages (Psi is split
evenly over K stages), the logits, stage 3's gathered layer, buffers and fragmentation,
stage 3's offload (ZeRO-Infinity), interleaved schedules (Narayanan et al. §2.2.2: the bubble
over v model chunks per GPU for v times the pipeline messages), the attention scores' own FLOPs
(4 B s^2 h L a pass, Eq. 3's s / 6h term: only the pass selective recompute adds is
counted); activations are the paper's 16-bit values and 1-byte masks whatever ``precision``
says of the model states; a mixture of experts' k copies of a token's MLP activations (counted
once), its router, its dropped tokens and uneven loads (every expert gets T k / E tokens).
"""

import math
from typing import NamedTuple

from parlab.alpha_beta import cost_model
from parlab.experts import balanced_all_to_all_bytes
from parlab.memory import (
    MIXED_ADAM,
    STAGES,
    ModelState,
    model_state_bytes,
    ring_communication_seconds,
    transformer_activation_bytes,
)
from parlab.pipeline import bubble_formula
from parlab.zero.formulas import offload_bytes_per_step, offload_state_bytes

ACTIVATION_BYTES = 2  # 16-bit activations, as Korthikanti et al. count them
BUCKET_BYTES = 25 * 2**20  # the gradients' bucket, torch DDP's bucket_cap_mb = 25


class Memory(NamedTuple):
    """Bytes one GPU holds: its model states (a ``parlab.memory.ModelState``) and activations;
    with offload, ``host`` is the ``ModelState`` its share of the host memory holds (else None)."""

    states: ModelState
    activations: float
    host: ModelState | None = None

    @property
    def total(self):
        return self.states.total + self.activations


class StepTime(NamedTuple):
    """Seconds of one optimizer step, by where they go (the module docstring's terms); ``data``
    is the data axis's time not hidden behind backward, ``offload`` the host's part, ``context``
    and ``experts`` the context- and expert-parallel axes' messages."""

    compute: float
    tensor: float
    pipeline: float
    bubble: float
    data: float
    offload: float = 0.0
    context: float = 0.0
    experts: float = 0.0

    @property
    def total(self):
        return sum(self)


def plan_memory(model, plan, precision=MIXED_ADAM, sequence_parallel=True):
    """``Memory`` of one GPU of ``plan`` (a ``Plan``; its estimates are not read), by the
    module docstring's formula, e.g. ``plan_memory(model, Plan(8, 1, 1, zero=1, b=4, M=2,
    recompute=None))``."""
    N_d, t, K, zero, b, M, recompute = _layout(model, plan)
    host = None
    if plan.offload:
        parts = [offload_state_bytes(_padded(numel, D), D, zero, precision.kappa, _offload_element_bytes(precision))
                 for numel, D in state_parts(model, plan)]
        states, host = _summed([device for device, _ in parts]), _summed([host for _, host in parts])
    else:  # HYBRID_SHARD shards over its group of S, replicated N_d / S times
        states = _summed([model_state_bytes(numel, zero, plan.shard_group or D, *precision)
                          for numel, D in state_parts(model, plan)])

    def layer(kept):  # one layer, one micro-batch
        return transformer_activation_bytes(model.s // plan.cp, b, model.h, model.a, 1, kept, t, sequence_parallel)

    activations = layer(recompute) * (model.L // K) * min(K, M)
    if recompute:  # the layer being recomputed holds what its recompute rebuilds
        activations += layer(None) - layer(recompute)
    return Memory(states, activations, host)


def plan_time(model, batch, hardware, plan, precision=MIXED_ADAM, efficiency=0.5, sequence_parallel=True,
              activation_bytes=ACTIVATION_BYTES, overlapped=STAGES, bucket_bytes=BUCKET_BYTES):
    """``StepTime`` of one step of ``plan`` (a ``Plan``; its estimates are not read), by the
    module docstring's formula. ``activation_bytes``: bytes of one activation value in the
    tensor and pipeline messages (2: 16-bit). ``overlapped``: the ZeRO stages whose data-axis
    communication runs behind backward (module docstring, "Overlap"); an engine that
    communicates after backward, on the critical path, is costed with ``overlapped=()``.
    ``bucket_bytes``: the gradients' last bucket, whose collective backward cannot hide."""
    N_d, t, K, zero, b, M, recompute = _layout(model, plan)
    N, s, h, psi = hardware.gpus, model.s, model.h, model.active_psi
    flops = {None: 6 * psi * batch.B * s, "full": 8 * psi * batch.B * s,
             "selective": 6 * psi * batch.B * s + 4 * batch.B * s * s * h * model.L}[recompute]
    compute = flops / (N * hardware.peak_flops * efficiency)
    forward = 2 * psi * batch.B * s / (N * hardware.peak_flops * efficiency)
    s = s // plan.cp  # the tokens of a sequence on one rank
    tensor = 0.0
    if t > 1:
        link = hardware.intra if hardware.within_node(t) else hardware.inter
        ends = 2 if K == 1 else 1  # the embedding's and the head's collectives, on the first and last stage
        all_reduces = ((6 if recompute == "full" else 4) * (model.L // K) + ends) * M
        tensor = all_reduces * cost_model("ring", b * s * h * activation_bytes, t, link.latency, 1 / link.bandwidth)
    pipeline = 0.0
    if K > 1:
        link = hardware.intra if hardware.within_node(N) else hardware.inter
        pipeline = 2 * M * link.time(b * s * h * activation_bytes / (t if sequence_parallel else 1))
    context = _context_seconds(model, hardware, plan, activation_bytes, efficiency)
    experts = _experts_seconds(model, hardware, plan, sequence_parallel, activation_bytes)
    busy = compute + tensor + pipeline + context + experts
    idle = bubble_formula(K, M)
    data = _exposed_data_seconds(model, hardware, precision, plan, compute, compute - forward, zero in overlapped,
                                 bucket_bytes)
    return StepTime(compute, tensor, pipeline, busy * idle / (1 - idle), data,
                    _offload_seconds(model, hardware, precision, plan) if plan.offload else 0.0, context, experts)


def state_parts(model, plan):
    """The parameters a GPU of ``plan`` holds a slice of, as (numel of the slice, D) pairs, D
    the ranks that hold the same slice and share it by ZeRO (module docstring): the dense
    parameters, and (with experts) the experts'."""
    dense = ((model.psi - model.expert_psi) / (plan.t * plan.K), plan.N_d * plan.cp * plan.ep)
    if not model.expert_psi:
        return [dense]
    return [dense, (model.expert_psi / (plan.ep * plan.t * plan.K), plan.N_d * plan.cp)]


def _context_seconds(model, hardware, plan, activation_bytes, efficiency):
    """Ring attention's transfers not hidden behind its blocks, in a stage's layers, for the
    step (module docstring)."""
    cp, t, n = plan.cp, plan.t, model.s // plan.cp
    if cp == 1:
        return 0.0
    link = hardware.intra if hardware.within_node(t * cp) else hardware.inter
    tau = link.time(2 * plan.b * n * (model.h // t) * activation_bytes)  # K and V of a rank's a / t heads
    f = 2 * plan.b * n * n * (model.h // t) / (hardware.peak_flops * efficiency)  # a causal block's forward
    forward = (cp - 1) * max(0.0, tau - f)
    backward = max(0.0, (2 * cp - 1) * tau - 2 * cp * f)
    per_layer = forward * (2 if plan.recompute == "full" else 1) + backward
    return (model.L // plan.K) * plan.M * per_layer


def _experts_seconds(model, hardware, plan, sequence_parallel, activation_bytes):
    """The MoE layers' all-to-alls in a stage's layers, for the step (module docstring)."""
    t, cp, ep = plan.t, plan.cp, plan.ep
    if ep == 1:
        return 0.0
    link = hardware.intra if hardware.within_node(t * cp * ep) else hardware.inter
    tokens = plan.b * model.s / (cp * (t if sequence_parallel else 1))
    sent = balanced_all_to_all_bytes(tokens, model.k, model.h, ep, activation_bytes)
    all_to_alls = 6 if plan.recompute == "full" else 4
    return (model.L // plan.K) * plan.M * all_to_alls * ((ep - 1) * link.latency + sent / link.bandwidth)


def _exposed_data_seconds(model, hardware, precision, plan, compute, backward, overlaps, bucket_bytes):
    """The data axis's seconds not hidden: ``backward`` is backward's share of ``compute``,
    its recomputed forward included."""
    N_d, t, K, zero, M = plan.N_d, plan.t, plan.K, plan.zero, plan.M
    parts = [(numel, D) for numel, D in state_parts(model, plan) if D > 1]
    if not parts:
        return 0.0
    if plan.shard_group:
        seconds = M * _hybrid_micro_batch_seconds(model.psi / (t * K), N_d, plan.shard_group, precision, hardware)
    else:
        link = hardware.intra if hardware.within_node(plan.ranks // K) else hardware.inter
        one_micro_batch = sum(ring_communication_seconds([_padded(numel, D)], D, precision.grad_bytes, zero,
                                                         link.latency, link.bandwidth) for numel, D in parts)
        seconds = one_micro_batch * {0: 1, 1: 1, 2: (M + 1) / 2, 3: M}[zero]
    if not overlaps:
        return seconds
    hidden_behind = {0: backward / M, 1: backward / M, 2: backward, 3: compute}[zero]
    return max(seconds - hidden_behind, _last_bucket_seconds(model, hardware, precision, plan, bucket_bytes))


def _last_bucket_seconds(model, hardware, precision, plan, bucket_bytes):
    """The collective of the last bucket (the first layers' gradients, which backward produces
    last): it starts when backward ends, so nothing hides it. An all-reduce at stages 0 and 1,
    a reduce-scatter at stage 2; stage 3's gathers and reduce-scatters are left hidden."""
    dense, D = state_parts(model, plan)[0]
    if plan.zero == 3 or plan.shard_group or D == 1:
        return 0.0
    link = hardware.intra if hardware.within_node(plan.ranks // plan.K) else hardware.inter
    numel = min(bucket_bytes / precision.grad_bytes, dense)
    all_reduce = ring_communication_seconds([_padded(numel, D)], D, precision.grad_bytes, 0, link.latency,
                                            link.bandwidth)
    return all_reduce / 2 if plan.zero == 2 else all_reduce


def _hybrid_micro_batch_seconds(psi, N_d, S, precision, hardware):
    """HYBRID_SHARD, one micro-batch: stage 3's three collectives in the node's group of S,
    then the gradient shard all-reduced over the N_d / S groups across nodes."""
    padded = _padded(psi, S)
    inside = ring_communication_seconds([padded], S, precision.grad_bytes, 3, hardware.intra.latency,
                                        hardware.intra.bandwidth)
    replicas = N_d // S
    across = ring_communication_seconds([_padded(padded // S, replicas)], replicas, precision.grad_bytes, 0,
                                        hardware.inter.latency, hardware.inter.bandwidth) if replicas > 1 else 0.0
    return inside + across


def _offload_seconds(model, hardware, precision, plan):
    seconds = 0.0
    for numel, D in state_parts(model, plan):
        shard = _padded(numel, D) // D
        moved = offload_bytes_per_step(shard * D, D, _offload_element_bytes(precision))
        seconds += sum(hardware.host.time(nbytes) for nbytes in moved.values()) + shard / hardware.host_update_rate
    return seconds


def _summed(states):
    """One ``ModelState``: the sum of ``states``, field by field."""
    return type(states[0])(*(sum(values) for values in zip(*states)))


def _padded(numel, N_d):
    """A flat buffer of ``numel`` elements padded to N_d equal shards."""
    return math.ceil(numel / N_d) * N_d


def _offload_element_bytes(precision):
    if precision.param_bytes != precision.grad_bytes:
        raise ValueError(f"offload moves parameters and gradients of one element size; {precision} has "
                         f"{precision.param_bytes}-byte parameters and {precision.grad_bytes}-byte gradients: "
                         "use a precision with equal sizes (MIXED_ADAM, FP32_ADAM).")
    return precision.param_bytes


def _layout(model, plan):
    if model.L % plan.K:
        raise ValueError(f"K = {plan.K} does not divide the L = {model.L} layers into equal stages: "
                         "pick a divisor of L.")
    if plan.M is None:
        raise ValueError("the plan has no M (it cannot be built): give M = B / (N_d b) micro-batches.")
    return plan.N_d, plan.t, plan.K, plan.zero, plan.b, plan.M, plan.recompute
