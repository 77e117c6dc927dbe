"""Training memory: what the ZeRO paper predicts each data-parallel rank holds, what a rank
really holds (measured from its tensors' storages), and the activations of a transformer.

    model_state_bytes(psi, stage, n_d, kappa, param_bytes, grad_bytes)  ZeRO paper, per device
    communication_volume(psi, stage), ring_traffic_bytes(...)       elements and bytes moved
    ring_communication_seconds(...)                                  their alpha-beta time
    deepspeed_zero2_estimate(...), deepspeed_zero3_estimate(...)    DeepSpeed's estimators
    transformer_activation_bytes(s, b, h, a, layers, recompute)     Korthikanti et al. 2022
    storage_bytes(tensors), measure_model_state(params, grads, opt) measured on this rank
    fits(state, device_bytes)                                       does it fit on one device?

What parlab's engines hold beyond the paper's table (stage 2's peak of gradient bytes during
backward, ZeRO-Offload's device/host split): ``parlab.zero.formulas``.

Model states, per parameter, in mixed-precision Adam: 2 bytes of 16-bit parameters, 2 bytes
of 16-bit gradients and kappa = 12 bytes of optimizer state (fp32 master parameters,
momentum and variance, 4 bytes each; the ZeRO paper writes K for kappa, and K counts
pipeline stages in this course). With Psi parameters on N_d data-parallel ranks, ZeRO
shards more of them at each stage (bytes per device):

    stage 0  baseline data parallelism   (2 + 2 + kappa) Psi
    stage 1  P_os                        2 Psi + 2 Psi + kappa Psi / N_d
    stage 2  P_os+g                      2 Psi + (2 + kappa) Psi / N_d
    stage 3  P_os+g+p                    (2 + 2 + kappa) Psi / N_d

7.5B parameters on N_d = 64: 120, 31.4, 16.6 and 1.9 GB (GB = 1e9 bytes).
"""

from typing import NamedTuple

from parlab._checks import real_number, refuse, whole_number

GB = 1e9  # the ZeRO paper's gigabyte
STAGES = (0, 1, 2, 3)


class ModelState(NamedTuple):
    """Model-state bytes held by one device: parameters, gradients, optimizer state."""

    params: float
    grads: float
    optimizer: float

    @property
    def total(self):
        return self.params + self.grads + self.optimizer


class Precision(NamedTuple):
    """Bytes per parameter of a training recipe: ``kappa`` of optimizer state, ``param_bytes``
    and ``grad_bytes`` of the parameters and gradients the model computes with. In the order
    of ``model_state_bytes``' arguments: ``model_state_bytes(psi, stage, n_d, *FP32_ADAM)``."""

    kappa: float
    param_bytes: float
    grad_bytes: float


# fp16/bf16 parameters and gradients; fp32 master parameters, momentum and variance.
MIXED_ADAM = Precision(kappa=12, param_bytes=2, grad_bytes=2)
# Everything in fp32, no master copy: the parameters are the master parameters, so kappa
# counts momentum and variance only. This is what a CPU run of torch.optim.Adam holds.
FP32_ADAM = Precision(kappa=8, param_bytes=4, grad_bytes=4)
# torch.optim.SGD(momentum > 0) in fp32: one momentum buffer.
FP32_SGD_MOMENTUM = Precision(kappa=4, param_bytes=4, grad_bytes=4)
PRECISIONS = {"mixed-precision Adam": MIXED_ADAM, "fp32 Adam": FP32_ADAM, "fp32 SGD with momentum": FP32_SGD_MOMENTUM}


def model_state_bytes(psi, stage, n_d, kappa=12, param_bytes=2, grad_bytes=2):
    """The ZeRO paper's model-state bytes of ONE device, as a ``ModelState``.

    ``psi``: Psi, the number of parameters; ``stage``: the ZeRO stage, 0 (plain data
    parallelism) to 3; ``n_d``: N_d, the data-parallel degree; ``kappa``: optimizer-state
    bytes per parameter (the paper's K); ``param_bytes``, ``grad_bytes``: bytes per parameter
    and per gradient.

        params    = param_bytes Psi     (/ N_d from stage 3)
        grads     = grad_bytes Psi      (/ N_d from stage 2)
        optimizer = kappa Psi           (/ N_d from stage 1)

    Buffers, fragmentation, activations and the gathered parameters of the layer being
    computed (stage 3) are not model states and are not counted.
    """
    _check_sizes(psi=psi, kappa=kappa, param_bytes=param_bytes, grad_bytes=grad_bytes)
    check_stage(stage)
    _check_ranks(n_d)
    return ModelState(
        params=param_bytes * psi / (n_d if stage >= 3 else 1),
        grads=grad_bytes * psi / (n_d if stage >= 2 else 1),
        optimizer=kappa * psi / (n_d if stage >= 1 else 1),
    )


def communication_volume(psi, stage):
    """Elements each rank moves per training step at ``stage``, the ZeRO paper's count.

    Stages 0 to 2 move 2 Psi: an all-reduce of the gradients is a reduce-scatter (Psi) and an
    all-gather (Psi); stages 1 and 2 keep the reduce-scatter and all-gather the updated
    parameters instead, so sharding the optimizer state and gradients is free. Stage 3 moves
    3 Psi: the parameters are all-gathered once for forward and once more for backward,
    and the gradients reduce-scattered.
    """
    _check_sizes(psi=psi)
    check_stage(stage)
    return 3 * psi if stage == 3 else 2 * psi


def ring_traffic_bytes(numel, n_d, element_bytes, stage):
    """Bytes each rank sends per step at ``stage`` with ring collectives, for ``numel``
    elements of ``element_bytes`` bytes on ``n_d`` ranks.

    A ring reduce-scatter or all-gather of D bytes makes each rank send N_d - 1 chunks of
    D / N_d bytes, (N_d - 1)/N_d D; the step makes 2 such collectives (3 at stage 3):

        (N_d - 1)/N_d x communication_volume(numel, stage) x element_bytes

    Exact for every rank when N_d divides numel; with uneven chunks it is the mean over ranks.
    """
    _check_ranks(n_d)
    _check_sizes(element_bytes=element_bytes)
    return (n_d - 1) * communication_volume(numel, stage) * element_bytes / n_d


def ring_communication_seconds(padded_numels, n_d, element_bytes, stage, latency, bandwidth):
    """Seconds one step's ring collectives take at ``stage`` in the alpha-beta model, one
    collective after another: ``padded_numels`` lists the flat buffers the step moves (one for
    ZeroDP, one per unit for FSDP; each padded to a multiple of N_d), ``latency`` is alpha (s)
    and ``bandwidth`` 1/beta (bytes/s). A buffer of P elements makes c collectives (2, or 3 at
    stage 3: ``communication_volume``), each N_d - 1 messages of one P / N_d chunk:

        sum over buffers of  c (N_d - 1) (alpha + P / N_d x element_bytes x beta)

    When alpha is small beside a chunk's time (a bandwidth-bound link), stage 3 takes 1.5 x
    the time of stages 0 to 2, as it moves 1.5 x the bytes; each unit's latency adds to that.
    """
    _check_ranks(n_d)
    _check_sizes(element_bytes=element_bytes, latency=latency)
    real_number("bandwidth", bandwidth, "give the link's bytes per second, e.g. 25e6.", above=True)
    collectives = communication_volume(1, stage)
    return sum(collectives * (n_d - 1) * (latency + _check_padded(numel, n_d) / n_d * element_bytes / bandwidth)
               for numel in padded_numels)


def _check_padded(numel, n_d):
    fix = "give each flat buffer's padded numel (FlatLayout.padded_numel), which N_d equal shards make up."
    whole_number("each of padded_numels", numel, fix)
    if numel % n_d:
        refuse("each of padded_numels", f"a multiple of n_d = {n_d}", numel, fix)
    return numel


class Estimate(NamedTuple):
    """A DeepSpeed memory estimate in bytes: on each GPU, and of host memory on each node."""

    per_gpu: float
    per_cpu: float


def deepspeed_zero2_estimate(psi, gpus_per_node=1, nodes=1, offload_optimizer=False, buffer_factor=1.5):
    """DeepSpeed's estimate of ZeRO-2 model states (``estimate_zero2_model_states_mem_needs``),
    mixed-precision Adam, N = nodes x gpus_per_node ranks:

        no offload         per GPU  2 Psi + 18 Psi / N
                           per CPU  4 Psi x gpus_per_node x buffer_factor
        offload_optimizer  per GPU  2 Psi
                           per CPU  max(4 N, 16) Psi x buffer_factor

    How it differs from the paper's P_os+g, 2 Psi + 14 Psi / N: the shard counts 18 bytes per
    parameter, not 2 + kappa = 14, because DeepSpeed also keeps an fp32 copy of its gradient
    shard (4) for the fp32 optimizer. The host term is not a model state: every process of a
    node first loads the whole fp32 model (4 Psi) before sharding it. With the optimizer
    offloaded, the GPU keeps only the 16-bit parameters and the host holds the optimizer's
    16 bytes per parameter. ``buffer_factor`` (1.5) is a margin on host memory only, for
    temporary and pinned buffers; the paper has no such factor.
    """
    _check_sizes(psi=psi, buffer_factor=buffer_factor)
    n = _ranks(gpus_per_node, nodes)
    if offload_optimizer:
        return Estimate(per_gpu=2 * psi, per_cpu=max(4 * n, 16) * psi * buffer_factor)
    return Estimate(per_gpu=2 * psi + 18 * psi / n, per_cpu=4 * psi * gpus_per_node * buffer_factor)


def deepspeed_zero3_estimate(psi, largest_layer_psi, gpus_per_node=1, nodes=1, offload_optimizer=False,
                             offload_params=False, zero_init=True, buffer_factor=1.5):
    """DeepSpeed's estimate of ZeRO-3 model states (``estimate_zero3_model_states_mem_needs``),
    mixed-precision Adam, N = nodes x gpus_per_node ranks, L = 4 x ``largest_layer_psi``:

        no offload              per GPU  L + 18 Psi / N
                                per CPU  4 x gpus_per_node x (largest_layer_psi if zero_init else Psi)
        offload_optimizer       per GPU  L + 2 Psi / N
                                per CPU  16 Psi / nodes              (zero_init)
                                         max(4 gpus_per_node, 16 / nodes) Psi
        offload_optimizer and   per GPU  L
          offload_params        per CPU  18 Psi / nodes              (zero_init)
                                         max(4 gpus_per_node, 18 / nodes) Psi

    every CPU term times ``buffer_factor`` (1.5, a margin for temporary and pinned buffers).

    How it differs from the paper's P_os+g+p, (2 + 2 + kappa) Psi / N_d = 16 Psi / N:
    - the largest-layer term L: while a layer computes, its 16-bit parameters are gathered
      whole and its 16-bit gradients are whole before the reduce-scatter (2 + 2 bytes per
      parameter of that layer). The paper counts only what is held at rest;
    - 18, not 16, bytes per parameter in the shard: the gradient shard is counted in fp32
      (4 bytes) rather than 16-bit (2);
    - the host: without ``zero_init`` (``deepspeed.zero.Init``) every process first builds
      the whole fp32 model (4 Psi); with it, the model is built already sharded and a
      process holds at most the largest layer. Offloaded shards live on the host of their
      node, 1/nodes of the model per node.
    Offloading the parameters but not the optimizer has no DeepSpeed estimate: ValueError.
    """
    _check_sizes(psi=psi, largest_layer_psi=largest_layer_psi, buffer_factor=buffer_factor)
    n = _ranks(gpus_per_node, nodes)
    largest_layer = 4 * largest_layer_psi
    if not offload_optimizer:
        if offload_params:
            raise ValueError("DeepSpeed estimates offload_params only with offload_optimizer=True as well.")
        loaded = largest_layer_psi if zero_init else psi
        return Estimate(per_gpu=largest_layer + 18 * psi / n, per_cpu=4 * gpus_per_node * loaded * buffer_factor)
    # Bytes per parameter on a node's host: fp32 master parameters, fp32 gradients, momentum,
    # variance (16) of the node's 1/nodes of the shards, plus their 16-bit parameters (2).
    host = (18 if offload_params else 16) / nodes
    if not zero_init:
        host = max(4 * gpus_per_node, host)
    return Estimate(per_gpu=largest_layer + (0 if offload_params else 2 * psi / n), per_cpu=host * psi * buffer_factor)


def transformer_activation_bytes(s, b, h, a, layers=1, recompute=None, t=1, sequence_parallel=False):
    """Activation bytes of ``layers`` transformer layers kept for backward, in 16-bit
    (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
    Models"): sequence length ``s``, micro-batch ``b``, hidden size ``h``, ``a`` attention
    heads, tensor-parallel degree ``t``. Per layer:

        recompute=None          s b h (34 + 5 a s / h)               no parallelism (t = 1)
                                s b h (10 + 24 / t + 5 a s / (h t))  tensor parallel
                                s b h (34 / t + 5 a s / (h t))       tensor + sequence parallel
        recompute="selective"   the same without the 5 a s / h attention term (the softmax,
                                its dropout mask and the attention over values are recomputed)
        recompute="full"        2 s b h                              only the layer's input;
                                2 s b h / t with sequence parallelism, whose input is itself
                                split along s (the paper's table writes 2 s b h for every t)

    The 34 s b h: the attention block's input, Q, K, V, the output projection's input and a
    dropout mask (11), the MLP (19), the two layer norms' inputs (4); the 5 a s^2 b: the
    softmax output, its dropout mask and the dropout output, a x s x s per sample each.
    Embeddings and the output layer are not counted.
    """
    _check_sizes(s=s, b=b, h=h, a=a, layers=layers)
    whole_number("t (the tensor-parallel degree)", t, "give the number of ranks a layer is split over, 1 for none.")
    if h % t or a % t:
        raise ValueError(f"t (the tensor-parallel degree) must divide h = {h} and a = {a}, got {t}: each of the t "
                         "ranks takes h / t of the hidden size and a / t of the heads; pick a t that divides both.")
    if recompute not in (None, "selective", "full"):
        raise ValueError(f'recompute must be None, "selective" or "full", got {recompute!r}.')
    if recompute == "full":
        return 2 * s * b * h * layers / (t if sequence_parallel else 1)
    linear = 34 / t if sequence_parallel else 10 + 24 / t
    attention = 0 if recompute == "selective" else 5 * a * s / (h * t)
    return s * b * h * (linear + attention) * layers


def fits(state, device_bytes=80 * GB):
    """Whether ``state`` (a ``ModelState`` or a number of bytes) fits in ``device_bytes``."""
    real_number("device_bytes", device_bytes, "give the device's memory in bytes, e.g. 80 * GB.")
    total = state.total if isinstance(state, ModelState) else real_number(
        "state", state, "pass a ModelState (from model_state_bytes) or a number of bytes.")
    return total <= device_bytes


def storage_bytes(tensors):
    """Bytes actually held by ``tensors``: the sum of ``nbytes`` of their unique untyped
    storages. A view counts its whole storage, once, however many views of it are given; a
    storage resized to 0 (a freed shard) counts 0; ``None`` entries are skipped. Works for
    tensors on any device (storages are told apart by device and data pointer)."""
    return _count_unique_storages(tensors, set())


def measure_model_state(params, grads, optimizer_state):
    """The ``ModelState`` of one rank measured from its tensors: each argument an iterable of
    tensors (``optimizer_state`` e.g. every tensor in ``optimizer.state.values()``).

    Categories are counted in the order params, grads, optimizer, and a storage already
    counted in an earlier category is not counted again: a gradient that is a view into the
    parameters' flat buffer adds nothing to ``grads``."""
    seen = set()
    return ModelState(
        params=_count_unique_storages(params, seen),
        grads=_count_unique_storages(grads, seen),
        optimizer=_count_unique_storages(optimizer_state, seen),
    )


def _count_unique_storages(tensors, seen):
    total = 0
    for tensor in tensors:
        if tensor is None:
            continue
        storage = tensor.untyped_storage()
        # An empty storage may have a null pointer shared with others: it counts 0 anyway.
        key = (str(tensor.device), storage.data_ptr())
        if storage.nbytes() == 0 or key in seen:
            continue
        seen.add(key)
        total += storage.nbytes()
    return total


def check_stage(stage):
    """Refuse anything but a ZeRO stage 0-3 with a ValueError saying so."""
    if isinstance(stage, bool) or stage not in STAGES:
        raise ValueError(f"stage must be a ZeRO stage 0, 1, 2 or 3 (0 is plain data parallelism), got {stage!r}: "
                         "pick one of them.")


def _check_ranks(n_d):
    whole_number("n_d (N_d, the data-parallel degree)", n_d, "give the number of data-parallel ranks, e.g. n_d=64.")


def _ranks(gpus_per_node, nodes):
    whole_number("gpus_per_node", gpus_per_node, "give the GPUs (ranks) of one node as a count, e.g. 8.")
    whole_number("nodes", nodes, "give the number of machines as a count, e.g. 1.")
    return gpus_per_node * nodes


_SIZES = {  # what each size means, for the sentence that refuses it
    "psi": "the number of parameters, e.g. 7.5e9",
    "largest_layer_psi": "the parameters of the largest layer",
    "kappa": "optimizer-state bytes per parameter, e.g. 12 for mixed-precision Adam",
    "param_bytes": "bytes per parameter, e.g. 2 in fp16",
    "grad_bytes": "bytes per gradient, e.g. 2 in fp16",
    "element_bytes": "bytes per element, e.g. 4 in fp32",
    "latency": "the link's seconds per message (alpha), e.g. 200e-6",
    "buffer_factor": "DeepSpeed's margin on host memory, 1.5 by default",
    "s": "the sequence length", "b": "the micro-batch size", "h": "the hidden size", "a": "the attention heads",
    "layers": "the number of transformer layers",
}


def _check_sizes(**sizes):
    for name, value in sizes.items():
        real_number(name, value, f"give {_SIZES[name]}.")
