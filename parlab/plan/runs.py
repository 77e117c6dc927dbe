"""What each rank runs for ``parlab.plan.measure``: the small GPT with its layers' compute
declared (``parlab.emulated.ComputeTime``), trained in the plan's layout on a mesh
(``parlab.mesh_training.MeshGPT``: data x tensor x pipeline, the plan's ZeRO stage,
micro-batches and recompute) on the same batches as every other rank.

``train_plan(layout, B, layer_seconds, steps)`` is the function ``run_plan`` ships to the ranks;
``layer_seconds = 0`` and no emulated link train in real time (the equivalence runs of the tests
and of ``parlab doctor --gpu``), on each rank's device (``runtime.device()``: a GPU where the
cluster places ranks on GPUs). ``parlab.gpt.train_in_one_process`` is the reference they are
compared with.
"""

import time
from contextlib import contextmanager, nullcontext

import torch
import torch.distributed as dist

from parlab import runtime, trace
from parlab.emulated import ComputeTime
from parlab.gpt import GPT, GPTConfig, batches
from parlab.mesh_training import MeshGPT
from parlab.runtime.mesh import Mesh

CONFIG = GPTConfig(L=4)
LR = 1e-3


def train_plan(layout, B, layer_seconds, steps):
    """One rank's part: build the GPT, train it ``steps`` + 1 steps with the layout's
    ``parlab.mesh_training.MeshGPT`` on a ``parlab.Mesh`` of the layout's (N_d, t, K), each
    layer's compute declared (``layer_seconds``: (forward, backward) of one layer and
    micro-batch, ``measure.declared_seconds``; 0 for none), on the same batches as every rank; return this
    rank's step times (the first, a warm-up that skips the declared compute, dropped), its
    model-state bytes in the last step, read when the gradients are synchronized, before the
    optimizer's step (all model states alive; Adam's step counters, 4 bytes per parameter
    tensor, left out), and the full batch's mean loss at every step (the same on every rank).
    On a GPU also ``peak_bytes``, the most memory the rank's process held at once
    (``torch.cuda.max_memory_allocated``); None on a CPU. ``numel`` and ``kept_whole``: the
    trainer's (``MeshGPT``: this rank's parameters, and those FSDP keeps whole). ``layout``: (N_d, t, K, zero, b, M,
    recompute), optionally with offload as an eighth."""
    N_d, t, K, zero, b, M, recompute, *offload = layout
    device = runtime.device()
    torch.manual_seed(0)
    gpt = GPT(CONFIG).to(device)
    on_gpu = device.type == "cuda"
    if on_gpu:
        torch.cuda.reset_peak_memory_stats(device)
    with Mesh(dp=N_d, tp=t, pp=K) as mesh:
        trainer = MeshGPT(gpt, mesh, zero, microbatches=M, recompute=recompute, layer_seconds=layer_seconds,
                          offload=bool(offload and offload[0]), lr=LR)
        declared = [m for m in trainer.model.modules() if isinstance(m, ComputeTime)]
        times, losses = [], []
        for i, batch in enumerate(batches(B, CONFIG.s, steps + 1)):
            tokens, targets = (part.to(device) for part in batch)
            dist.barrier()
            start = time.perf_counter()
            with _undeclared(declared) if i == 0 else nullcontext(), trace.span("step"):  # warm-up: no waiting
                loss_sum = trainer.step(tokens, targets)
            if on_gpu:
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - start)
            losses.append(torch.tensor(float(loss_sum), dtype=torch.float64, device=device))
        total = torch.stack(losses)
        dist.all_reduce(total)  # every sample's loss counted once, by the rank that owns it
    return {"times": times[1:], "state_bytes": trainer.state_bytes, "losses": (total / B).tolist(),
            "peak_bytes": torch.cuda.max_memory_allocated(device) if on_gpu else None,
            "numel": trainer.numel, "kept_whole": trainer.kept_whole}


@contextmanager
def _undeclared(declared):
    """The ``ComputeTime`` layers of ``declared`` take no time inside the block."""
    kept = [(m.forward_s, m.backward_s) for m in declared]
    for m in declared:
        m.forward_s = m.backward_s = 0.0
    try:
        yield
    finally:
        for m, (forward_s, backward_s) in zip(declared, kept):
            m.forward_s, m.backward_s = forward_s, backward_s

