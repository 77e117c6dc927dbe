"""Every plan for a model on a cluster, its memory per GPU and step time, ranked.

A plan places the N GPUs (the world size) on a grid N_d x t x K = N (data x tensor x
pipeline), with tensor parallelism innermost (consecutive ranks), then data, then pipeline,
as Megatron-LM orders them: a tensor group spans t consecutive ranks, a data group t N_d, a
pipeline t N_d K. Lecture 09's two axes sit between them, in ``parlab.Mesh``'s order (tp, cp,
ep, dp, pp from the innermost): with context parallelism over cp ranks and expert parallelism
over ep ranks, N_d t K cp ep = N, a context group spans t cp ranks, an expert group t cp ep,
a data group t cp ep N_d. Both are tried only where asked (``cp``) or where the model has
experts (``ep``: every divisor of E by default). The batch splits over the N_d ep ranks of
the data and expert axes (each reads its own sequences), every sequence over the cp ranks.
A group whose span divides the GPUs of a node lies inside one node and talks over the
``intra`` link; otherwise its slowest hop is the ``inter`` link. The rest of a plan: the ZeRO
stage of the data axis (0 to 3), the micro-batch size b (M = B / (N_d b) micro-batches per
replica, one after another on a stage) and activation recompute: None (every activation kept,
the attention scores too), "selective" (the attention scores recomputed in backward, Korthikanti
et al. 2022; the memory of flash attention, which never stores them) or "full" (each layer's
forward run again, only its input kept), the words of ``parlab.memory.transformer_activation_bytes``.

The planner asks M >= K of a pipeline: fewer micro-batches than stages leave stages idle for
most of the step. That is this planner's rule, not 1F1B's: Megatron-LM's non-interleaved 1F1B
runs M < K with a warm-up of min(K - rank - 1, M) forwards and a larger bubble
(``megatron/core/pipeline_parallel/schedules.py``, ``forward_backward_pipelining_without_interleaving``).

What a plan costs, memory per GPU and step time, is ``parlab.plan.costs``'s (its docstring
has the formulas). ZeRO-Offload (stages 1 and 2) is a further choice of a plan: ``offload``.

A plan must fit in the GPU's memory less a reserve (``reserve``, 10% by default): what the
formula leaves out still takes memory on a real GPU (the CUDA context, about 0.5 to 1 GiB;
communication buffers, e.g. NCCL's and ZeRO's buckets; the caching allocator's
fragmentation; the logits), so a plan at 79 of 80 GiB would not run.

Host memory: with offload, the host states of a node's GPUs must fit in its
``hardware.host_memory`` (no reserve there: a rough figure already).
"""

from dataclasses import dataclass

from parlab._checks import real_number, whole_number
from parlab.memory import MIXED_ADAM, RECOMPUTE, STAGES, Precision, check_recompute, check_stage
from parlab.pipeline import bubble_formula
from parlab.plan.costs import Memory, StepTime, plan_memory, plan_time
from parlab.plan.inputs import Batch, Hardware, Model
from parlab.units import GIB

RESERVE = 0.1  # the share of a GPU's memory no plan may use (module docstring)


@dataclass(frozen=True)
class Plan:
    """One placement: degrees ``N_d``, ``t``, ``K``, ZeRO stage ``zero``, micro-batch ``b`` and
    ``M`` micro-batches per replica, ``recompute`` (None, "selective" or "full"); its ``memory``
    and ``time`` (None
    when the plan cannot be built), the ``reasons`` it is rejected, as sentences, and
    ``offload`` (ZeRO-Offload of the optimizer's shard to the host, stages 1 and 2) and
    ``shard_group`` (S: stage 3 as FSDP's HYBRID_SHARD, sharded within the data ranks of a
    node and replicated across nodes; None: sharded over all N_d); ``cp`` and ``ep``: the
    context- and expert-parallel degrees of lecture 09 (1: the axis is not used)."""

    N_d: int
    t: int
    K: int
    zero: int
    b: int
    M: int | None
    recompute: str | None
    memory: Memory | None = None
    time: StepTime | None = None
    reasons: tuple = ()
    offload: bool = False
    shard_group: int | None = None
    cp: int = 1
    ep: int = 1

    def __post_init__(self):
        check_recompute(self.recompute)

    @property
    def ranks(self):
        """The ranks the plan runs on: N_d t K cp ep."""
        return self.N_d * self.t * self.K * self.cp * self.ep

    @property
    def rejected(self):
        return bool(self.reasons)

    def __str__(self):
        axes = "".join(f" {axis}={degree}" for axis, degree in (("cp", self.cp), ("ep", self.ep)) if degree > 1)
        layout = (f"N_d={self.N_d} t={self.t} K={self.K}{axes} ZeRO-{self.zero} b={self.b} M={self.M} "
                  f"recompute {self.recompute or 'off'}" + (" offload" if self.offload else "")
                  + (f" HYBRID_SHARD S={self.shard_group}" if self.shard_group else ""))
        if self.memory is None:
            return f"{layout}: {' '.join(self.reasons)}"
        estimate = f"{self.memory.total / GIB:.1f} GiB, {self.time.total:.3g} s"
        return f"{layout}: {estimate}" + (f" (rejected: {' '.join(self.reasons)})" if self.reasons else "")


def plans(model, batch, hardware, precision=MIXED_ADAM, efficiency=0.5, sequence_parallel=True, max_bubble=0.5,
          tensor_across_nodes=False, zero_stages=STAGES, reserve=RESERVE, offload=(False, True), hybrid=True,
          recompute=RECOMPUTE, cp=(1,), ep=None):
    """Every plan over N_d x t x K x cp x ep = N, each ZeRO stage of ``zero_stages``, each micro-batch
    size of ``batch``, each of ``recompute``, (at stages 1 and 2) each of ``offload`` and (at stage
    3, with ``hybrid``, where the data group spans nodes) HYBRID_SHARD within a node: the
    accepted ones first, fastest first (then least memory), then the rejected ones in the
    order they were enumerated. A plan is rejected when it cannot be built (t does not divide
    a, K does not divide L, B does not split, M < K: the planner's rule, module docstring; cp
    does not cut s into 2 cp chunks, ep does not divide E), when
    its tensor group spans nodes
    (unless ``tensor_across_nodes``), when it does not fit in the GPU's memory less
    ``reserve`` (a share of it kept free, module docstring) or its host states in the node's
    host memory, or when its bubble is above ``max_bubble``. ``efficiency``: the share of
    peak FLOP/s that compute reaches. ``cp``: the context-parallel degrees to try (1: none);
    ``ep``: the expert-parallel degrees (None: every divisor of the model's E)."""
    _check_inputs(model, batch, hardware, efficiency, max_bubble)
    cp, ep = _degrees("cp", cp, (1,)), _degrees("ep", ep, tuple(_divisors(model.E)))
    real_number("reserve", reserve, "give the share of GPU memory to keep free, e.g. 0.1 (0 keeps none).")
    if reserve >= 1:
        raise ValueError(f"reserve is a share of the GPU's memory below 1, got {reserve!r}: e.g. 0.1.")
    if not isinstance(precision, Precision):
        raise ValueError(f"precision must be a parlab.memory.Precision, got {precision!r}: e.g. "
                         "parlab.memory.MIXED_ADAM (kappa = 12, 2-byte parameters and gradients) or FP32_ADAM.")
    for stage in zero_stages:
        check_stage(stage)
    for kind in recompute:
        if kind not in RECOMPUTE:
            raise ValueError(f"recompute lists the kinds to try, each one of {RECOMPUTE}; got {kind!r}.")
    N = hardware.gpus
    every = [_assess(model, batch, hardware, precision, efficiency, sequence_parallel, max_bubble, tensor_across_nodes,
                     reserve, N_d, t, K, zero, b, kind, host, S, c, e)
             for c in cp for e in ep if N % (c * e) == 0
             for N_d, t, K in grids(N // (c * e)) for zero in zero_stages
             for b in batch.micro_batch_sizes for kind in recompute
             for host in (offload if zero in (1, 2) else (False,))
             for S in (None, *_hybrid_groups(hardware, N_d, t, zero, hybrid and c * e == 1))]
    accepted = sorted((p for p in every if not p.rejected), key=lambda p: (p.time.total, p.memory.total))
    return accepted + [p for p in every if p.rejected]


def best_plans(model, batch, hardware, n=3, **options):
    """The ``n`` fastest accepted plans (``plans``' options)."""
    return [p for p in plans(model, batch, hardware, **options) if not p.rejected][:n]


def grids(N):
    """Every (N_d, t, K) with N_d t K = N, in increasing t, then K."""
    return [(N // (t * K), t, K) for t in _divisors(N) for K in _divisors(N // t)]


def _assess(model, batch, hardware, precision, efficiency, sequence_parallel, max_bubble, tensor_across_nodes,
            reserve, N_d, t, K, zero, b, recompute, offload, shard_group, cp=1, ep=1):
    """The ``Plan`` with its estimates and the sentences that reject it."""
    readers = f"N_d = {N_d} replicas" if ep == 1 else f"N_d ep = {N_d} x {ep} ranks"
    built = [reason for failed, reason in (
        (model.a % t, f"t = {t} does not divide the a = {model.a} heads: each rank takes a / t whole heads."),
        (model.L % K, f"K = {K} does not divide the L = {model.L} layers into equal stages."),
        (batch.B % (N_d * ep * b), f"B = {batch.B} does not split into {readers} of micro-batches of b = {b}."),
        (cp > 1 and model.s % (2 * cp), f"cp = {cp} does not cut s = {model.s} into the 2 cp equal chunks of the "
                                        "zig-zag split."),
        (model.E % ep, f"ep = {ep} does not divide the E = {model.E} experts: each rank holds E / ep of them."),
    ) if failed]
    M = batch.B // (N_d * ep * b) if not built else None
    if not built and M < K:
        built.append(f"M = {M} micro-batches cannot fill K = {K} stages (this planner asks M >= K; 1F1B would "
                     "run with a larger bubble): lower b or N_d.")
    axes = {"offload": offload, "shard_group": shard_group, "cp": cp, "ep": ep}
    if built:
        return Plan(N_d, t, K, zero, b, M, recompute, reasons=tuple(built), **axes)
    layout = Plan(N_d, t, K, zero, b, M, recompute, **axes)
    memory = plan_memory(model, layout, precision, sequence_parallel)
    time = plan_time(model, batch, hardware, layout, precision, efficiency, sequence_parallel)
    reasons = []
    if not tensor_across_nodes and not hardware.within_node(t):
        reasons.append(f"t = {t} spans nodes: its all-reduces would cross the inter-node link "
                       f"(nodes of {hardware.gpus_per_node} GPUs).")
    usable = hardware.memory * (1 - reserve)
    if memory.total > usable:
        kept = f" ({reserve:.0%} of {hardware.memory / GIB:.1f} GiB kept free)" if reserve else ""
        reasons.append(f"does not fit: needs {memory.total / GIB:.1f} GiB of {usable / GIB:.1f} GiB{kept}.")
    if memory.host is not None and memory.host.total * hardware.gpus_per_node > hardware.host_memory:
        reasons.append(f"the host states do not fit: {hardware.gpus_per_node} GPUs x "
                       f"{memory.host.total / GIB:.1f} GiB on a node of {hardware.host_memory / GIB:.0f} GiB.")
    if bubble_formula(K, M) > max_bubble:
        reasons.append(f"bubble {bubble_formula(K, M):.0%} above {max_bubble:.0%}: raise M (a smaller b) or lower K.")
    return Plan(N_d, t, K, zero, b, M, recompute, memory, time, tuple(reasons), **axes)


def _hybrid_groups(hardware, N_d, t, zero, hybrid):
    """HYBRID_SHARD's S for this data axis: the data ranks of one node (t consecutive ranks per
    replica, so gpus_per_node / t of them), where stage 3's data group spans nodes and S > 1."""
    S = hardware.gpus_per_node // t if hardware.within_node(t) else 1
    spans_nodes = not hardware.within_node(t * N_d)
    return (S,) if hybrid and zero == 3 and spans_nodes and S > 1 and N_d % S == 0 else ()


def _divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]


def _degrees(axis, degrees, default):
    """The degrees of ``axis`` to try: ``degrees`` as a tuple of whole numbers (None: ``default``)."""
    if degrees is None:
        return default
    if isinstance(degrees, int):
        degrees = (degrees,)
    fix = f"give the degrees to try as a tuple, e.g. {axis}=(1, 2, 4)."
    if not isinstance(degrees, tuple) or not degrees:
        raise ValueError(f"{axis} must be a tuple of degrees to try, got {degrees!r}: {fix}")
    return tuple(whole_number(f"each {axis} degree", degree, fix) for degree in degrees)


def _check_inputs(model, batch, hardware, efficiency, max_bubble):
    for name, value, kind in (("model", model, Model), ("batch", batch, Batch), ("hardware", hardware, Hardware)):
        if not isinstance(value, kind):
            raise ValueError(f"{name} must be a parlab.plan.{kind.__name__}, got {type(value).__name__}: "
                             f"build one, e.g. parlab.plan.{kind.__name__}(...) or one of its presets.")
    real_number("efficiency", efficiency, "give the share of peak FLOP/s compute reaches, e.g. 0.5.", above=True)
    if efficiency > 1:
        raise ValueError(f"efficiency is a share of the peak, at most 1, got {efficiency!r}: e.g. 0.5.")
    real_number("max_bubble", max_bubble, "give the largest idle share of a pipeline step to accept, e.g. 0.5.")
