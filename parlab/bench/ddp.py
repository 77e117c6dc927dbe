"""DDP step time: parlab's variants beside torch's DistributedDataParallel, and the overlap model.

Real time. Every variant (torch's DDP, parlab's naive, flat, overlapped and bucketed) trains
its own copy of the same MLP (``depth`` Linear layers of ``width`` x ``width`` with ReLU
between them; 4.2 M parameters by default) on the same data, one SGD step at a time, in one
run on one cluster. A step is forward + backward + gradient synchronisation +
``optimizer.step()``; the ranks start each step together (a barrier, not timed) and a step's
time is the slowest rank's. The variants take their steps in turn, so that a noisy
neighbour on a shared machine slows them all alike. Per world size and variant: the median
step time over ``steps`` timed steps after ``WARMUP_STEPS`` unmeasured ones, and ``ratio`` =
that median / torch DDP's (below 1, parlab is faster: the convention of every bench).
``bucket_cap_mb`` is given to parlab's "bucketed" and to torch.

Emulated (``--link LATENCY,BANDWIDTH``, e.g. ``--link 200us,100MB/s``). The same ranks then
run parlab's variants on emulated devices under that link: ``emulated_mlp``, ``depth``
bias-free Linear layers of ``width`` x ``width`` (a gradient of 4 width^2 bytes each), each
followed by a ``parlab.emulated.SleepLayer`` whose backward takes ``--backward-ms`` (by
default one layer's ring all-reduce on the link, where the bucket size matters most) and
whose forward half of that. DDP's all-reduce is then parlab's ring on each rank's
communication thread, which pays the link's time. Measured: naive, flat, overlapped, and
bucketed at each cap of a sweep (one layer's gradient, two layers', four, ..., all of them),
each beside the overlap model ``parlab.ddp.predict_step`` (the declared link, the
ring's cost per bucket, and the compute measured on the same ranks without communication):
``measured / model`` (the target is within 15%), and the ``saving`` over flat, measured
and predicted. torch's DDP has no row there: its communication is torch's own, which no
emulated link shapes.
"""

import functools
import os
import statistics

import torch
import torch.distributed as dist
from torch import nn

from parlab import runtime
from parlab._checks import real_number
from parlab.alpha_beta import cost_model
from parlab.bench import (
    check_arguments,
    check_link,
    check_seconds,
    format_seconds,
    format_table,
    link_argument,
    positive_int,
    positive_number,
    progress,
    ratio_header,
    time_ratio,
)
from parlab.bench.ddp_steps import (
    EMULATED_BATCH,
    SEED,
    emulated_batch,
    emulated_mlp,
    measure_compute,
    measure_ddp_steps,
    predicted_steps,
    slowest_rank,
    timed_step,
)
from parlab.ddp import DDP
from parlab.runtime.emulation import Link
from parlab.units import MIB

VARIANTS = ["torch", "naive", "flat", "overlapped", "bucketed"]
REFERENCE = "torch DDP"
WARMUP_STEPS = 3  # first steps allocate gradients and buckets and open connections


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
    parser.add_argument("--link", type=link_argument, metavar="LATENCY,BANDWIDTH",
                        help="also run the variants on emulated devices under this emulated link, beside the overlap "
                             "model, e.g. 200us,100MB/s")
    parser.add_argument("--backward-ms", type=positive_number, metavar="MS",
                        help="with --link: declared backward time of one emulated layer (default: one layer's ring "
                             "all-reduce on the link)")


def run(args):
    return bench_ddp(args.world_sizes, args.steps, args.width, args.depth, args.batch_size, args.bucket_cap_mb,
                     args.device, args.link, None if args.backward_ms is None else args.backward_ms / 1e3)


def bench_ddp(world_sizes=(2, 4), steps=20, width=1024, depth=4, batch_size=64, bucket_cap_mb=25.0, device="cpu",
              link=None, backward_s=None):
    """Time a training step of every variant at every world size; returns a JSON-ready dict
    with one row per (world_size, variant): median_s (slowest rank), ratio to torch DDP,
    and the step times. With ``link`` (a ``parlab.Link``), also ``emulated_rows``
    (``emulated_rows``' rows for each world size). Progress goes to stderr."""
    check_arguments(device, world_sizes=world_sizes, steps=steps, width=width, depth=depth, batch_size=batch_size)
    real_number("bucket_cap_mb", bucket_cap_mb, "give the size of a bucket in MiB; 25 is torch's default.", above=True)
    check_link(link)
    if backward_s is not None:
        check_seconds("backward_s", backward_s)
    rows, emulated, backend = [], [], None
    for world_size in world_sizes:
        progress("ddp", f"N={world_size}: starting {world_size} ranks ...")
        with runtime.Cluster(world_size, device=device) as cluster:
            progress("ddp", f"N={world_size}: {WARMUP_STEPS} + {steps} steps of {', '.join(VARIANTS)} ...")
            measured = cluster.run(time_steps, steps, width, depth, batch_size, bucket_cap_mb)[0]
            if link is not None:
                progress("ddp", f"N={world_size}: emulated devices under a link of {link.describe()} ...")
                with cluster.emulate(link=link):
                    emulated.extend(measure_emulated(cluster, link, width, depth, steps, backward_s))
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
        "link": None if link is None else {"latency": link.latency, "bandwidth": link.bandwidth},
        "emulated_rows": emulated,
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
            elapsed = timed_step(wrapped, optimizer, inputs, targets)
            if step >= WARMUP_STEPS:
                seconds[variant].append(elapsed)
    return {"seconds": dict(zip(VARIANTS, slowest_rank([seconds[variant] for variant in VARIANTS]))),
            "backend": dist.get_backend()}


def layer_caps_mb(width, depth):
    """The bucket caps of the emulated sweep, in MiB: one layer's gradient, two layers', four,
    ..., and all ``depth`` of them."""
    layers = [2**k for k in range(depth.bit_length()) if 2**k < depth] + [depth]
    return [count * 4 * width * width / MIB for count in layers]


def measure_emulated(cluster, link, width, depth, steps, backward_s=None):
    """On ``cluster`` (its links emulated by ``link``): the rows of ``emulated_rows`` for
    naive, flat, overlapped and bucketed at every cap of ``layer_caps_mb``."""
    N_d = cluster.world_size
    if backward_s is None:
        backward_s = cost_model("ring", 4 * width * width, N_d, link.latency, 1 / link.bandwidth)
    build = functools.partial(emulated_mlp, width, depth, backward_s)
    batch = functools.partial(emulated_batch, width)
    timing = measure_compute(cluster, build, batch)
    configs = ["naive", "flat", "overlapped"] + [("bucketed", cap) for cap in layer_caps_mb(width, depth)]
    rows = measure_ddp_steps(cluster, build, batch, configs, steps)
    predicted = predicted_steps(rows, build(), timing, N_d, link)
    return emulated_rows(N_d, rows, predicted, backward_s)


def emulated_rows(world_size, rows, predicted, backward_s):
    """The emulated table's rows from ``measure_ddp_steps``' rows and the model's step times
    (seconds, in the same order; one row must be "flat"): measured and model step, their
    ratio measured / model, and the saving over flat (flat's step - this one's), measured
    and predicted."""
    flat = next(index for index, row in enumerate(rows) if row["variant"] == "flat")
    return [
        {"world_size": world_size, "variant": row["variant"], "bucket_cap_mb": row["bucket_cap_mb"],
         "buckets": row["buckets"], "backward_s": backward_s, "median_s": row["median_s"], "model_s": model_s,
         "measured_over_model": row["median_s"] / model_s, "saving_s": rows[flat]["median_s"] - row["median_s"],
         "model_saving_s": predicted[flat] - model_s, "seconds": row["seconds"]}
        for row, model_s in zip(rows, predicted)
    ]


def format_report(result):
    table = format_table(
        ["N", "variant", "median step", "time / torch DDP"],
        [
            [row["world_size"], row["variant"], format_seconds(row["median_s"]), f"{row['ratio']:.2f}x"]
            for row in result["rows"]
        ],
    )
    report = (
        f"parlab bench ddp: step time (forward, backward, sync, SGD) of an MLP of {result['depth']} x "
        f"{result['width']} ({result['parameters'] / 1e6:.1f} M parameters, "
        f"{result['parameters'] * 4 / 2**20:.1f} MiB of fp32 gradients), batch {result['batch_size']} per rank, "
        f"bucket_cap_mb={result['bucket_cap_mb']:g}; median of {result['steps']} steps, slowest rank; "
        f"{result['backend']} on {result['device']}, torch {result['torch_version']}, "
        f"{result['cpu_count']} CPU cores\n{ratio_header(REFERENCE)}\n\n{table}"
    )
    if result.get("emulated_rows"):
        report += "\n\n" + format_emulated(result)
    return report


def format_emulated(result):
    """The emulated table: per world size and variant (bucketed per cap), measured beside the model."""
    link = Link(**result["link"])
    table = format_table(
        ["N", "variant", "cap", "buckets", "backward / layer", "measured", "model", "measured / model",
         "saving vs flat", "model saving"],
        [
            [row["world_size"], row["variant"],
             "" if row["bucket_cap_mb"] is None else f"{row['bucket_cap_mb']:g} MiB", row["buckets"],
             format_seconds(row["backward_s"]), format_seconds(row["median_s"]), format_seconds(row["model_s"]),
             f"{row['measured_over_model']:.2f}", _signed(row["saving_s"]), _signed(row["model_saving_s"])]
            for row in result["emulated_rows"]
        ],
    )
    return (
        f"emulated: link {link.describe()}; {result['depth']} bias-free Linear layers of {result['width']} x "
        f"{result['width']} ({4 * result['width'] ** 2 / MIB:g} MiB of gradient each), each with a declared backward "
        f"and half of it as forward, batch {EMULATED_BATCH} per rank; median of {result['steps']} steps, slowest "
        f"rank\nmodel = parlab.ddp.predict_step: ring all-reduce per bucket, 2 (N - 1) alpha + 2 (N - 1)/N "
        f"B beta, one at a time, overlapping backward; saving = flat's step - this one's\n\n{table}"
    )


def _signed(seconds):
    return ("-" if seconds < 0 else "") + format_seconds(abs(seconds))
