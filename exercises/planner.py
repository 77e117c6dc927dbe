# Generated from solutions/planner.py by `python -m parlab.course.exercises build`.
# Write your code where it raises NotImplementedError, then run `parlab grade planner`.
# parlab-generated sha256=e6155191319b93ca7efe9065fd12a01ecae00de14714e560334c0ad93b4a9b54
"""Exercise: the memory one GPU of a plan holds, and a script ready for torchrun.

Part 1, memory per GPU. A plan (``parlab.plan.Plan``) places N = N_d t K GPUs: N_d
data-parallel replicas (or shards, with ZeRO) of t-way tensor-parallel, K-stage pipelines,
each replica running M micro-batches of b samples per step, with activation recompute None
(every activation kept), "selective" (the attention scores recomputed) or "full" (the whole
layer). One GPU of it holds the model states of its slice of the model and the activations
its stage keeps for backward:

    model states   the ZeRO table (lecture 04) for the Psi / (t K) parameters of one GPU's
                   slice: t splits every layer, K splits the layers into stages, and the
                   stage (0 to 3) decides which of parameters, gradients and optimizer state
                   are split once more over the N_d data-parallel ranks
    activations    Korthikanti et al.'s bytes per layer (lecture 07), for the L / K layers of
                   one stage, times the micro-batches in flight (lecture 03): 1F1B's first
                   stage has run min(K, M) forwards before its first backward. With
                   recompute, a layer keeps less (only its input, with "full"), and the
                   layer being recomputed holds what its recompute rebuilds, for one
                   micro-batch

You compose two formulas the lectures already have; call them rather than write them again:

    parlab.memory.model_state_bytes(psi, stage, n_d, kappa, param_bytes, grad_bytes)
    parlab.memory.transformer_activation_bytes(s, b, h, a, layers, recompute, t, sequence_parallel)

(a ``parlab.memory.Precision`` unpacks into kappa, param_bytes, grad_bytes in that order).
The grader compares your bytes with the planner's (``parlab.plan.plan_memory``) for EXACT
equality, on many plans of the small GPT, a 7B and a 70B model: compute them as the
docstrings say, in that order, and the floating-point roundings agree too.

    from parlab.plan import Model, Plan
    plan = Plan(N_d=8, t=8, K=10, zero=1, b=1, M=96, recompute="full")
    memory_per_gpu(Model.llama2_70b(), plan) / 2**30      # GiB on each of the 640 GPUs

Part 2, launching for real. ``torchrun --standalone --nproc-per-node 2 planner.py`` starts
this file twice, each process with an environment saying where it stands in the job
(``parlab.train``'s docstring says what each variable means): RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT. ``torchrun_all_reduce`` joins the job's process
group from them, sums one integer over the processes and leaves; ``main`` (provided) prints
and writes what it returns. The grader runs this file under torchrun on 2 processes, with
integers too large for float32, and compares every process's sum with the sum one process
computes.

Stuck? ``parlab.hint("planner.memory_per_gpu")`` in a notebook (or ``parlab hint
planner.memory_per_gpu`` in a terminal) opens a hint, one level at a time. Grade your work
with ``parlab grade planner`` (or ``parlab.check("planner")`` in a notebook).
"""

import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist

from parlab.memory import MIXED_ADAM, model_state_bytes, transformer_activation_bytes


def model_state_bytes_per_gpu(model, plan, precision=MIXED_ADAM):
    """The model states one GPU of ``plan`` holds, as a ``parlab.memory.ModelState`` (params,
    grads, optimizer, in bytes).

    ``model``: a ``parlab.plan.Model`` (``model.psi`` parameters, Psi); ``plan``: a
    ``parlab.plan.Plan`` (``plan.N_d``, ``plan.t``, ``plan.K``, ``plan.zero``);
    ``precision``: a ``parlab.memory.Precision`` (kappa, param_bytes, grad_bytes).

    The ZeRO table of ``parlab.memory.model_state_bytes`` for the Psi / (t K) parameters of
    one GPU's slice of the model, on N_d data-parallel ranks at stage ``plan.zero``. E.g.
    mixed-precision Adam (2 + 2 + 12 bytes per parameter) at stage 1, t = 2, K = 4, N_d = 8:
    params 2 Psi / 8, grads 2 Psi / 8, optimizer 12 Psi / 64.
    """
    raise NotImplementedError("model_state_bytes_per_gpu is not implemented yet: the ZeRO table for one GPU's slice")


def activation_bytes_per_gpu(model, plan, sequence_parallel=True):
    """The activation bytes one GPU of ``plan`` keeps for backward at its peak, on the first
    pipeline stage (the one with the most micro-batches in flight).

    ``model``: a ``parlab.plan.Model`` (s, h, a, L); ``plan``: a ``parlab.plan.Plan`` (b,
    t, K, M, recompute); ``sequence_parallel``: whether the tensor-parallel ranks also split
    the sequence (Megatron's sequence parallelism).

    With A(kept) = ``transformer_activation_bytes(s, b, h, a, 1, kept, t, sequence_parallel)``,
    the bytes of ONE layer for one micro-batch, and kept = plan.recompute (None, "selective"
    or "full": the plan and the formula use the same words):

        recompute None       A(None) x L / K x min(K, M)
        recompute kept       A(kept) x L / K x min(K, M)  +  (A(None) - A(kept))

    multiplied in that order (L / K is a whole number: K divides L). min(K, M) is plan.M
    when M < K: a stage cannot hold more micro-batches than the step has. A(None) - A(kept)
    is what the recompute rebuilds of the one layer being recomputed, for one micro-batch
    (the part it kept is counted already).
    """
    raise NotImplementedError("activation_bytes_per_gpu is not implemented yet: a layer, x L / K, x the micro-batches in flight")


def memory_per_gpu(model, plan, precision=MIXED_ADAM, sequence_parallel=True):
    """Bytes one GPU of ``plan`` holds: its model states' total plus its activations, the
    planner's ``plan_memory(model, plan, precision, sequence_parallel).total``."""
    raise NotImplementedError("memory_per_gpu is not implemented yet: states plus activations")


def torchrun_all_reduce(value):
    """Run by every process torchrun starts: join the job, sum ``value`` (this process's
    integer) over all its processes, leave the job.

    1. Read RANK, WORLD_SIZE, LOCAL_RANK and LOCAL_WORLD_SIZE from the environment
       (``os.environ``; they are text).
    2. Backend and device: "nccl" on GPU cuda:LOCAL_RANK when this node has a GPU for each
       of its processes (``torch.cuda.device_count() >= LOCAL_WORLD_SIZE``; make that GPU
       the current one with ``torch.cuda.set_device``), else "gloo" on the CPU.
    3. ``dist.init_process_group(backend)``: with its default init_method "env://" it finds
       the others through MASTER_ADDR and MASTER_PORT and learns its place from RANK and
       WORLD_SIZE.
    4. One ``dist.all_reduce`` (a sum) of a tensor holding ``value`` on that device, exactly:
       the values may be too large for float32's 24 bits.
    5. ``dist.destroy_process_group()`` before returning.

    Returns ``{"rank": RANK, "world_size": WORLD_SIZE, "local_rank": LOCAL_RANK, "backend":
    the backend, "total": the sum as a Python int}``, the numbers as ints.
    """
    raise NotImplementedError("torchrun_all_reduce is not implemented yet: join, all-reduce, leave")


def main(argv=None):
    """Provided: ``torchrun --standalone --nproc-per-node N planner.py [--values V0,V1,...]
    [--out DIR]``. Process r contributes V_r (r + 1 by default), prints what
    ``torchrun_all_reduce`` returns and, with ``--out``, writes it to DIR/rank<r>.json with
    the environment torchrun gave and whether the process group was left."""
    parser = argparse.ArgumentParser(description="Sum one integer per process over a torchrun job.")
    parser.add_argument("--values", help="the integers of processes 0, 1, ..., comma-separated")
    parser.add_argument("--out", help="a directory to write each process's rank<r>.json into")
    args = parser.parse_args(argv)
    if "RANK" not in os.environ:
        raise ValueError("RANK is not set: run this file under torchrun, e.g. "
                         "torchrun --standalone --nproc-per-node 2 planner.py")
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    values = [int(v) for v in args.values.split(",")] if args.values else [r + 1 for r in range(world_size)]
    if len(values) != world_size:
        raise ValueError(f"--values gives {len(values)} integers for {world_size} processes: give one per process.")
    result = torchrun_all_reduce(values[rank])
    print(f"process {rank}: {result}", flush=True)
    if args.out:
        environment = {name: os.environ[name] for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
        record = {"result": result, "environment": environment, "group_left": not dist.is_initialized()}
        (Path(args.out) / f"rank{rank}.json").write_text(json.dumps(record, default=repr))


if __name__ == "__main__":
    main()
