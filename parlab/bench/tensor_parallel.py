"""Tensor parallelism: tokens/s of the small GPT's layers, parlab's against torch's parallelize_module.

On each t of ``--world-sizes`` (one cluster of t ranks, one tensor-parallel group), the L
transformer layers of ``parlab.gpt`` (hidden ``--hidden``, ``--heads`` heads, sequence
``--seq``, ``--batch-size`` sequences per step, dropout 0) train on random hidden states
(b, s, h) with the loss mean(y^2), forward + backward + an SGD step at a time, split four ways:

    variant                  parlab                               torch
    TP                       ParallelBlock (f, g on parlab's      parallelize_module: query/key/value
                             ring)                                ColwiseParallel, proj RowwiseParallel,
                                                                  fc1 Colwise, fc2 Rowwise
    TP + SP                  ParallelBlock(sequence_parallel)     the same with SequenceParallel on the
                                                                  LayerNorms, PrepareModuleInput
                                                                  (Shard(1) -> Replicate) on attention and
                                                                  MLP, Rowwise(output_layouts=Shard(1))

The embedding and the head are left out: they are the same in every variant and small next
to the layers. With t = 1 both are the one-process layers. The engines take their steps in
turn (a barrier before each, not timed); a step's time is the slowest rank's; ``median_s``
over ``--steps`` after ``WARMUP_STEPS``; tokens/s = b s / median. ``ratio`` = parlab's
median / torch's (below 1, parlab is faster). torch's parallel layers talk through
torch.distributed (gloo or NCCL), parlab's through its own ring on point-to-point messages:
on a CPU the difference is mostly the ring's 2 (t - 1) messages per all-reduce against
gloo's own algorithm. MFU, on a GPU with ``--peak-tflops``: model FLOPs (3 x the forward's
24 b s h^2 + 4 b s^2 h per layer) per second over t x the peak.

Lecture 07's measurements live here too: ``collectives_by_phase`` counts parlab's
tensor-parallel collectives in a trace, ``time_layers`` times the layers' steps on a cluster
in its regime (real or emulated link).
"""

import copy
import os
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

from parlab import runtime, trace
from parlab.bench import (
    check_arguments,
    format_seconds,
    format_table,
    positive_int,
    positive_number,
    progress,
    ratio_header,
    synchronise,
    time_ratio,
)
from parlab.gpt import Block, GPTConfig
from parlab.runtime.process import waited_for_a_cpu_s
from parlab.tensor_parallel.model import ParallelBlock

WARMUP_STEPS = 2
LR = 1e-3
REFERENCE = "torch's parallelize_module, same variant"
VARIANTS = [("parlab", "TP"), ("torch", "TP"), ("parlab", "TP + SP"), ("torch", "TP + SP")]


def add_arguments(parser):
    count = dict(type=positive_int, metavar="N")
    parser.add_argument("--world-sizes", nargs="+", default=[1, 2, 4], help="values of t (default: 1 2 4)", **count)
    parser.add_argument("--steps", default=10, help="timed steps per variant (default 10)", **count)
    parser.add_argument("--hidden", default=128, help="h (default 128)", **count)
    parser.add_argument("--heads", default=4, help="a (default 4)", **count)
    parser.add_argument("--seq", default=64, help="s (default 64)", **count)
    parser.add_argument("--layers", default=2, help="L (default 2)", **count)
    parser.add_argument("--batch-size", default=8, help="b, sequences per step (default 8)", **count)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where the layers live")
    parser.add_argument("--peak-tflops", type=positive_number, metavar="TFLOPS",
                        help="on a GPU: its peak in the layers' dtype (fp32), for MFU")


def run(args):
    return bench_tensor_parallel(args.world_sizes, args.steps, GPTConfig(s=args.seq, h=args.hidden, a=args.heads,
                                                                         L=args.layers), args.batch_size,
                                 args.device, args.peak_tflops)


def bench_tensor_parallel(world_sizes=(1, 2, 4), steps=10, config=None, batch_size=8, device="cpu",
                          peak_tflops=None):
    """Measure every variant at every t (``config``: a ``GPTConfig``, default the lectures'
    GPT); returns a JSON-ready dict with one row per (t, implementation, variant): median_s,
    seconds, tokens_per_s, mfu (None off a GPU or without a peak) and, for parlab's rows,
    ``ratio`` to torch's row of the same t and variant."""
    config = config or GPTConfig()
    check_arguments(device, world_sizes=world_sizes, steps=steps, batch_size=batch_size)
    for t in world_sizes:
        if config.a % t or config.s % t:
            raise ValueError(f"t = {t} must divide the heads a = {config.a} and the sequence s = {config.s}: "
                             "choose other --world-sizes.")
    if peak_tflops is not None and device != "cuda":
        raise ValueError("MFU is measured on a GPU: drop --peak-tflops, or run with --device cuda.")
    rows, backend = [], None
    for t in world_sizes:
        variants = VARIANTS if t > 1 else VARIANTS[:2]
        progress("tensor_parallel", f"t={t}: starting {t} ranks, {WARMUP_STEPS} + {steps} steps of "
                                    f"{len(variants)} variants ...")
        with runtime.Cluster(t, device=device) as cluster:
            measured = cluster.run(measure_variants, variants, steps, config, batch_size)[0]
        backend = measured["backend"]
        for (implementation, variant), seconds in zip(variants, measured["seconds"]):
            median = statistics.median(seconds)
            rows.append({"t": t, "implementation": implementation, "variant": variant, "seconds": seconds,
                         "median_s": median, "tokens_per_s": batch_size * config.s / median,
                         "mfu": mfu(config, batch_size, median, t, peak_tflops)})
    add_ratios(rows)
    return {"bench": "tensor_parallel", "device": device, "backend": backend, "torch_version": torch.__version__,
            "cpu_count": os.cpu_count(), "config": {"s": config.s, "h": config.h, "a": config.a, "L": config.L},
            "batch_size": batch_size, "steps": steps, "ratio_means": ratio_header(REFERENCE), "rows": rows}


def add_ratios(rows):
    """Give every parlab row ``ratio`` = its median / torch's row of the same t and variant."""
    for row in rows:
        if row["implementation"] == "parlab":
            theirs = next(r for r in rows if r["implementation"] == "torch" and (r["t"], r["variant"]) == (
                row["t"], row["variant"]))
            row["ratio"] = time_ratio(row["median_s"], theirs["median_s"])
    return rows


def model_flops(config, batch_size):
    """FLOPs of one training step of the L layers: 3 x (24 b s h^2 + 4 b s^2 h) per layer."""
    b, s, h = batch_size, config.s, config.h
    return 3 * config.L * (24 * b * s * h * h + 4 * b * s * s * h)


def mfu(config, batch_size, seconds, t, peak_tflops):
    """Model FLOPs utilisation of a step of ``seconds`` on t GPUs of ``peak_tflops`` (None without one)."""
    if peak_tflops is None:
        return None
    return model_flops(config, batch_size) / seconds / (t * peak_tflops * 1e12)


def measure_variants(variants, steps, config, batch_size):
    """On every rank: {"seconds": [[step time, ...] per variant] (the slowest rank's), "backend"}."""
    device = runtime.device()
    torch.manual_seed(0)
    layers = [Block(config) for _ in range(config.L)]
    x = torch.randn(batch_size, config.s, config.h, generator=torch.Generator().manual_seed(1)).to(device)
    engines = [build(implementation, variant, layers, device) for implementation, variant in variants]
    t, r = dist.get_world_size(), dist.get_rank()
    inputs = [x.chunk(t, 1)[r].contiguous() if variant == "TP + SP" else x for _, variant in variants]
    seconds = [[] for _ in variants]
    for step in range(WARMUP_STEPS + steps):
        for index, (model, optimizer) in enumerate(engines):
            synchronise(device)
            dist.barrier()
            start = time.perf_counter()
            optimizer.zero_grad()
            model(inputs[index]).pow(2).mean().backward()
            optimizer.step()
            synchronise(device)
            if step >= WARMUP_STEPS:
                seconds[index].append(time.perf_counter() - start)
    per_step = torch.tensor(seconds, dtype=torch.float64)
    dist.all_reduce(per_step, op=dist.ReduceOp.MAX)
    return {"seconds": per_step.tolist(), "backend": dist.get_backend()}


def build(implementation, variant, layers, device):
    """(model, SGD optimizer) of one variant, from copies of the one-process ``layers``."""
    sequence_parallel = variant == "TP + SP"
    blocks = [copy.deepcopy(block).to(device) for block in layers]
    if implementation == "parlab":
        model = nn.Sequential(*(ParallelBlock(block, None, sequence_parallel) for block in blocks))
    else:
        model = nn.Sequential(*blocks)
        if dist.get_world_size() > 1:
            model = torch_parallelize(model, sequence_parallel, device)
    return model, torch.optim.SGD(model.parameters(), lr=LR)


def torch_parallelize(model, sequence_parallel, device):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    mesh = init_device_mesh(torch.device(device).type, (dist.get_world_size(),))
    plan = {}
    for i in range(len(model)):
        plan |= {f"{i}.attention.{name}": ColwiseParallel() for name in ("query", "key", "value")}
        plan[f"{i}.mlp.fc1"] = ColwiseParallel()
        if sequence_parallel:
            plan |= {f"{i}.norm1": SequenceParallel(), f"{i}.norm2": SequenceParallel(),
                     f"{i}.attention": PrepareModuleInput(input_layouts=(Shard(1),),
                                                          desired_input_layouts=(Replicate(),)),
                     f"{i}.mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                     f"{i}.attention.proj": RowwiseParallel(output_layouts=Shard(1)),
                     f"{i}.mlp.fc2": RowwiseParallel(output_layouts=Shard(1))}
        else:
            plan |= {f"{i}.attention.proj": RowwiseParallel(), f"{i}.mlp.fc2": RowwiseParallel()}
    return parallelize_module(model, mesh, plan)


# --- the lecture's measurements: collectives counted and timed from the trace -----------------

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter")


def collectives_by_phase(timeline, rank):
    """{(phase, collective): [bytes ``rank`` sent in each call]} of a traced call whose steps
    mark "forward" and "backward" spans (the first of each) around parlab's tensor-parallel
    collectives (spans "all-reduce", "all-gather", "reduce-scatter")."""
    phases = {p: timeline.select(rank=rank, name=p)[0] for p in ("forward", "backward")}
    sends = [ev for ev in timeline.select(rank=rank, kind="comm") if ev.name in ("send", "isend")]
    found = {}
    for name in COLLECTIVES:
        for span in timeline.select(rank=rank, name=name):
            phase = next((p for p, outer in phases.items() if outer.start <= span.start <= outer.end), None)
            if phase is not None:
                sent = sum(ev.nbytes for ev in sends if span.start <= ev.start <= span.end)
                found.setdefault((phase, name), []).append(sent)
    return found


def train_layers(config, batch_size, steps, sequence_parallel=False):
    """On every rank of a tensor-parallel group (all ranks): ``steps`` training steps (SGD) of
    the small GPT's L layers split by ``ParallelBlock`` on random hidden states (b, s, h),
    each marked with spans "step", "forward" and "backward"."""
    torch.manual_seed(0)
    model = nn.Sequential(*(ParallelBlock(Block(config), None, sequence_parallel) for _ in range(config.L)))
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    t, r = dist.get_world_size(), dist.get_rank()
    x = torch.randn(batch_size, config.s, config.h, generator=torch.Generator().manual_seed(1))
    x = x.chunk(t, 1)[r].contiguous() if sequence_parallel else x
    for _ in range(steps):
        with trace.span("step"):
            optimizer.zero_grad()
            with trace.span("forward"):
                loss = model(x).pow(2).mean()
            with trace.span("backward"):
                loss.backward()
            optimizer.step()


def time_layers(cluster, config, batch_size, steps=3, sequence_parallel=False):
    """Times of ``train_layers`` on ``cluster`` in its current regime (one warm-up step, then
    ``steps``): {"step_s": [each step, first rank's start to last rank's end],
    "all_reduce_s": [each all-reduce of the timed steps], "cpu_wait_per_all_reduce_s", "timeline":
    the last step}.

    An all-reduce's time is its shortest span over the ranks: the rank that reaches it last
    waits for no one, so its span is the collective itself; the others' spans also hold the
    time they waited for it (their compute ran ahead on a shared CPU). The time the ranks
    were ready to run while every CPU was busy (another rank's threads, other programs:
    ``runtime.process.waited_for_a_cpu_s``), all together, is also given per all-reduce of
    the run: an upper bound on what such waits added to an all-reduce on average, since some
    of them fell in the compute."""
    check_arguments(batch_size=batch_size, steps=steps)
    waited = -sum(map(waited_for_a_cpu_s, cluster.pids))
    timeline = cluster.trace(train_layers, config, batch_size, 1 + steps, sequence_parallel)
    waited += sum(map(waited_for_a_cpu_s, cluster.pids))
    windows = [timeline.window("step", i) for i in range(1, 1 + steps)]
    all_reduces = []
    for w in windows:
        per_rank = [w.select(rank=rank, name="all-reduce") for rank in range(w.world_size)]
        all_reduces += [min(ev.duration for ev in same) for same in zip(*per_rank)]
    in_the_run = len(all_reduces) * (1 + steps) // steps  # the warm-up step's too
    return {"step_s": [w.duration for w in windows], "all_reduce_s": all_reduces,
            "cpu_wait_per_all_reduce_s": waited / max(1, in_the_run), "timeline": windows[-1]}


def format_report(result):
    config = result["config"]
    rows = [[f"{row['implementation']} {row['variant']}", row["t"], format_seconds(row["median_s"]),
             f"{row['tokens_per_s']:,.0f}", "" if row["mfu"] is None else f"{row['mfu']:.1%}",
             f"{row['ratio']:.2f}x" if "ratio" in row else ""] for row in result["rows"]]
    table = format_table(["engine", "t", "median step", "tokens/s", "MFU", "time / torch"], rows)
    return (
        f"parlab bench tensor_parallel: training step (forward, backward, SGD) of the small GPT's "
        f"{config['L']} layers (h = {config['h']}, a = {config['a']}, s = {config['s']}, b = {result['batch_size']}, "
        f"fp32; median of {result['steps']} steps, slowest rank); {result['backend']} on {result['device']}, torch "
        f"{result['torch_version']}, {result['cpu_count']} CPU cores\n{ratio_header(REFERENCE)}\n\n{table}"
    )
