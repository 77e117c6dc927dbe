"""ZeRO and FSDP from scratch: shard the model states of data parallelism over N_d ranks.

    stage 0   ZeroDP(model, torch.optim.Adam, stage=0)   every rank holds everything (DDP)
    stage 1   ZeroDP(..., stage=1)     optimizer state sharded             P_os
    stage 2   ZeroDP(..., stage=2)     + gradients sharded                 P_os+g
    stage 3   FSDP(model, torch.optim.Adam, strategy="FULL_SHARD")        P_os+g+p

Every engine is called like the model, and after ``loss.backward()`` takes its step with
``engine.step()``; ``engine.model_state_bytes()`` measures what the rank holds, to compare
with ``parlab.memory.model_state_bytes``. ``parlab.flat`` is the sharding they share;
``parlab.zero.buckets`` is stage 0's all-reduce and stage 2's reduce-scatter during backward,
on the rank's communication thread (FSDP, with ``prefetch``, unshards the next unit there
while one computes); ``ZeroDP(..., offload=True)`` keeps the optimizer's shard and state on
the host (ZeRO-Offload); ``FSDP.no_sync()`` accumulates gradients without communication; ``parlab.zero.checkpoint``
saves and loads full and sharded checkpoints; ``parlab.zero.formulas`` has the bytes stage 2
and offload hold. In ordinary torch code: ``ZeroDP(..., group=)`` works on a process group
(a grid's data-parallel axis); both engines take ``optimizer_class`` and
``**optimizer_kwargs``, or ``optimizer_class=None`` (your optimizer over ``[engine.shard]`` or
``fsdp.parameters()``) and ``finish_gradient_synchronization()``, as DDP;
``ShardedOptimizer(params, torch.optim.Adam, lr=...)`` is stage 1 as a torch optimizer, for
gradients averaged already (after DDP).
"""

import importlib

_PUBLIC = {
    "ZeroDP": "parlab.zero.stages",
    "FSDP": "parlab.zero.fsdp",
    "ShardedOptimizer": "parlab.zero.sharded_optimizer",
    "min_params": "parlab.zero.units",
    "init_by_unit": "parlab.zero.units",
}


def __getattr__(name):
    # Imported on first use: each engine is its own module, and a learner reading one
    # should not pay for importing the others.
    if name in _PUBLIC:
        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'parlab.zero' has no attribute {name!r}")


__all__ = list(_PUBLIC)
