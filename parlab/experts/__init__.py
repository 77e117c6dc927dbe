"""Mixture of experts and expert parallelism, from scratch on torch.distributed.

- ``routing``: the router's top-k choice with a capacity per expert (``route``), Switch
  Transformer's load-balancing loss, and where each (token, choice) row goes and comes back;
- ``moe``: ``MoE``, a mixture of E MLP experts in one process (the reference);
- ``parallel``: ``ExpertParallelMoE``, the experts split over the ep ranks of a group, its
  ``dispatch`` / ``combine`` all-to-alls (differentiable) and their bytes;
- ``gpt``: ``MoEGPT``, the small GPT with MoE layers in place of its MLPs;
- ``training``: ``ExpertDataParallel``, an ``MoEGPT`` trained on a mesh's ep and dp axes.
"""

from parlab.experts.gpt import GPTLayerMoE, MoEGPT
from parlab.experts.moe import MoE, run_experts
from parlab.experts.parallel import (
    AllToAll,
    Dispatch,
    ExpertParallelMoE,
    all_to_all,
    all_to_all_bytes,
    balanced_all_to_all_bytes,
    combine,
    dispatch,
    experts_per_rank,
    traced_all_to_all_bytes,
)
from parlab.experts.routing import (
    Routing,
    combine_choices,
    dispatch_order,
    expert_capacity,
    load_balancing_loss,
    route,
)
from parlab.experts.training import ExpertDataParallel

__all__ = ["AllToAll", "Dispatch", "ExpertDataParallel", "ExpertParallelMoE", "GPTLayerMoE", "MoE", "MoEGPT",
           "Routing", "all_to_all", "all_to_all_bytes", "balanced_all_to_all_bytes", "combine", "combine_choices",
           "dispatch", "dispatch_order", "expert_capacity", "experts_per_rank", "load_balancing_loss", "route",
           "run_experts", "traced_all_to_all_bytes"]
