"""One-shot runs: ``parlab.launch(fn, world_size)`` for scripts and tests.

Started by torchrun (RANK and WORLD_SIZE set), ``launch`` runs ``fn`` in this very process
on torch's process group: the same script then scales to many GPUs and nodes with torch's
own launcher. Otherwise it starts a Cluster, runs ``fn`` once and stops the cluster.
"""

import os

from parlab.runtime.cluster import Cluster


def under_torchrun():
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def launch(fn, world_size, *args, backend="auto", device="auto", timeout=None, start_timeout=120.0, link=None,
           devices=None, **kwargs):
    """Run ``fn(*args, **kwargs)`` on ``world_size`` ranks; return the results in rank order.

    ``timeout`` bounds the call and ``start_timeout`` the start of the ranks (seconds).

    Under torchrun, ``world_size`` is torchrun's (the argument is only used to spawn ranks
    locally) and the results of all ranks are gathered on every rank.
    """
    if under_torchrun():
        return _run_in_torchrun(fn, args, kwargs, backend)
    with Cluster(world_size, backend=backend, device=device, start_timeout=start_timeout, link=link,
                 devices=devices) as cluster:
        return cluster.run(fn, *args, timeout=timeout, **kwargs)


def _run_in_torchrun(fn, args, kwargs, backend):
    import torch
    import torch.distributed as dist

    from parlab.runtime.context import set_device

    created = not dist.is_initialized()
    if created:
        if backend == "auto":
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            set_device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}")
        dist.init_process_group(backend)
    try:
        result = fn(*args, **kwargs)
        results = [None] * dist.get_world_size()
        dist.all_gather_object(results, result)
        return results
    finally:
        if created:
            dist.destroy_process_group()
