"""DeepSpeed's memory estimators for ZeRO-2 and ZeRO-3, and how they differ from the paper's
model states (``parlab.memory.model_states``)."""

from typing import NamedTuple

from parlab._checks import whole_number
from parlab.memory._sizes import _check_sizes


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


def _ranks(gpus_per_node, nodes):
    whole_number("gpus_per_node", gpus_per_node, "give the GPUs (ranks) of one node as a count, e.g. 8.")
    whole_number("nodes", nodes, "give the number of machines as a count, e.g. 1.")
    return gpus_per_node * nodes
