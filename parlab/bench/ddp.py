"""DDP step time: parlab's naive, flat, overlapped and bucketed DDP beside torch's DistributedDataParallel.

Every variant trains its own copy of the same MLP (``depth`` Linear layers of ``width`` x
``width`` with ReLU between them; 4.2 M parameters by default) on the same data, one SGD step
at a time, in one run on one cluster. A step is forward + backward + gradient
synchronisation + ``optimizer.step()``; the ranks start each step together (a barrier, not
timed) and a step's time is the slowest rank's. The variants take their steps in turn, so
that a noisy neighbour on a shared machine slows them all alike.

Result (seconds): per world size and variant the median step time over ``steps`` timed
steps after ``WARMUP_STEPS`` unmeasured ones, and ``ratio`` = that median / torch DDP's
(below 1, parlab is faster: the convention of every bench). ``bucket_cap_mb`` is given to
parlab's "bucketed" and to torch.
"""

import os
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

from parlab import runtime
from parlab._checks import real_number
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
from parlab.ddp import DDP

VARIANTS = ["torch", "naive", "flat", "overlapped", "bucketed"]
REFERENCE = "torch DDP"
WARMUP_STEPS = 3  # first steps allocate gradients and buckets and open connections
SEED = 0


def add_arguments(parser):
    count = dict(type=positive_int, metavar="N")
    parser.add_argument("--world-sizes", nargs="+", default=[2, 4], help="default: 2 4", **count)
    parser.add_argument("--steps", default=20, help="timed steps per variant (default 20)", **count)
    parser.add_argument("--width", default=1024, help="features of every Linear layer (default 1024)", **count)
    parser.add_argument("--depth", default=4, help="Linear layers (default 4)", **count)
    parser.add_argument("--batch-size", default=64, help="samples per rank and step (default 64)", **count)
    parser.add_argument(
        "--bucket-cap-mb", type=positive_number, default=25.0, metavar="MB",
        help="bucket size in MiB (default 25, as torch)",
    )
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where the model lives")


def run(args):
    return bench_ddp(
        args.world_sizes, args.steps, args.width, args.depth, args.batch_size, args.bucket_cap_mb, args.device
    )


def bench_ddp(world_sizes=(2, 4), steps=20, width=1024, depth=4, batch_size=64, bucket_cap_mb=25.0, device="cpu"):
    """Time a training step of every variant at every world size; returns a JSON-ready dict
    with one row per (world_size, variant): median_s (slowest rank), ratio to torch DDP,
    and the step times. Progress goes to stderr."""
    check_arguments(device, world_sizes=world_sizes, steps=steps, width=width, depth=depth, batch_size=batch_size)
    real_number("bucket_cap_mb", bucket_cap_mb, "give the size of a bucket in MiB; 25 is torch's default.", above=True)
    rows, backend = [], None
    for world_size in world_sizes:
        progress("ddp", f"N={world_size}: starting {world_size} ranks ...")
        with runtime.Cluster(world_size, device=device) as cluster:
            progress("ddp", f"N={world_size}: {WARMUP_STEPS} + {steps} steps of {', '.join(VARIANTS)} ...")
            measured = cluster.run(time_steps, steps, width, depth, batch_size, bucket_cap_mb)[0]
        backend = measured["backend"]
        rows.extend(variant_rows(world_size, measured["seconds"]))
    return {
        "bench": "ddp",
        "device": device,
        "backend": backend,
        "torch_version": torch.__version__,
        "cpu_count": os.cpu_count(),
        "parameters": mlp_parameters(width, depth),
        "width": width,
        "depth": depth,
        "batch_size": batch_size,
        "bucket_cap_mb": bucket_cap_mb,
        "steps": steps,
        "ratio_means": ratio_header(REFERENCE),
        "rows": rows,
    }


def variant_rows(world_size, seconds):
    """One row per variant from its step times ({variant: [seconds, ...]}): the median and
    ratio = that median / torch DDP's median."""
    torch_median = statistics.median(seconds["torch"])
    return [
        {"world_size": world_size, "variant": variant, "median_s": statistics.median(seconds[variant]),
         "ratio": time_ratio(statistics.median(seconds[variant]), torch_median), "seconds": seconds[variant]}
        for variant in VARIANTS
    ]


def mlp_parameters(width, depth):
    """Parameters of the benchmark MLP: depth layers of width x width weights plus biases."""
    return depth * (width * width + width)


def build_mlp(width, depth):
    layers = []
    for index in range(depth):
        layers.append(nn.Linear(width, width))
        if index < depth - 1:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def time_steps(steps, width, depth, batch_size, bucket_cap_mb):
    """On every rank: {"seconds": {variant: [step time, ...]}, "backend": ...}, each step
    time the slowest rank's (the same on every rank)."""
    device = runtime.device()
    trainers = {}
    for variant in VARIANTS:
        torch.manual_seed(SEED)  # the same model for every variant
        model = build_mlp(width, depth).to(device)
        if variant == "torch":
            ids = [device] if device.type == "cuda" else None
            wrapped = nn.parallel.DistributedDataParallel(model, device_ids=ids, bucket_cap_mb=bucket_cap_mb)
        else:
            wrapped = DDP(model, variant, bucket_cap_mb=bucket_cap_mb)
        trainers[variant] = (wrapped, torch.optim.SGD(model.parameters(), lr=1e-3))
    generator = torch.Generator().manual_seed(SEED + dist.get_rank())  # this rank's shard
    inputs = torch.randn(batch_size, width, generator=generator).to(device)
    targets = torch.randn(batch_size, width, generator=generator).to(device)

    seconds = {variant: [] for variant in VARIANTS}
    for step in range(WARMUP_STEPS + steps):
        for variant, (wrapped, optimizer) in trainers.items():
            synchronise(device)
            dist.barrier()
            start = time.perf_counter()
            optimizer.zero_grad()
            nn.functional.mse_loss(wrapped(inputs), targets).backward()
            if variant != "torch":
                wrapped.finish_gradient_synchronization()
            optimizer.step()
            synchronise(device)
            if step >= WARMUP_STEPS:
                seconds[variant].append(time.perf_counter() - start)
    per_step = torch.tensor([seconds[variant] for variant in VARIANTS], dtype=torch.float64)
    dist.all_reduce(per_step, op=dist.ReduceOp.MAX)  # the slowest rank's time of each step
    return {
        "seconds": {variant: per_step[index].tolist() for index, variant in enumerate(VARIANTS)},
        "backend": dist.get_backend(),
    }


def format_report(result):
    table = format_table(
        ["N", "variant", "median step", "time / torch DDP"],
        [
            [row["world_size"], row["variant"], format_seconds(row["median_s"]), f"{row['ratio']:.2f}x"]
            for row in result["rows"]
        ],
    )
    return (
        f"parlab bench ddp: step time (forward, backward, sync, SGD) of an MLP of {result['depth']} x "
        f"{result['width']} ({result['parameters'] / 1e6:.1f} M parameters, "
        f"{result['parameters'] * 4 / 2**20:.1f} MiB of fp32 gradients), batch {result['batch_size']} per rank, "
        f"bucket_cap_mb={result['bucket_cap_mb']:g}; median of {result['steps']} steps, slowest rank; "
        f"{result['backend']} on {result['device']}, torch {result['torch_version']}, "
        f"{result['cpu_count']} CPU cores\n{ratio_header(REFERENCE)}\n\n{table}"
    )

