"""ZeRO memory and step time: parlab's stages 0-3 beside torch's engines, or on an emulated link.

Real time (the default). Every engine trains its own copy of the same MLP (``depth`` Linear
layers of ``hidden`` x ``hidden`` with ReLU between them; 4.2 M parameters by default) with
fp32 Adam, one step at a time, in one run on one cluster per world size
(``parlab.bench.zero_engines.build_engine``):

    stage  parlab                        torch
    0      ZeroDP(stage=0)               DistributedDataParallel
    1      ZeroDP(stage=1)               DDP + ZeroRedundancyOptimizer
    2      ZeroDP(stage=2)               (none: torch has no ZeRO-2 engine of its own)
    3      FSDP("FULL_SHARD", per layer) fully_shard on every Linear and on the model

Model-state bytes are measured at rest (after a step) from the storages each rank holds and
shown beside the ZeRO paper's formula for fp32 Adam, ``model_state_bytes(Psi, stage, N_d,
*FP32_ADAM)`` (kappa = 8); a row reports its largest rank. torch's ZeroRedundancyOptimizer
shards whole parameters, so its ranks hold unequal parts. Step time: forward + backward +
``step``; the ranks start each step together (a barrier, not timed), a step's time is the
slowest rank's, and the engines take their steps in turn, so that a noisy neighbour slows
them all alike. ``median_s`` is over ``steps`` timed steps after ``WARMUP_STEPS``. Ratios,
parlab / torch's engine of the same stage, as in every bench: ``ratio["time"]`` (below 1,
parlab is faster) and ``ratio["bytes"]`` (below 1, parlab holds less).

Emulated (``--link LATENCY,BANDWIDTH``, e.g. ``--link 200us,25MB/s``): what each stage costs in
communication, parlab's stages only (torch's communication is its own, which no emulated link
shapes), and what FSDP's prefetch hides (``time_overlap``): ``parlab.bench.zero_link``, whose
names this module re-exports.
"""

import os
import statistics
import time

import torch
import torch.distributed as dist

from parlab import runtime
from parlab.bench import (
    check_arguments,
    format_seconds,
    format_table,
    link_argument,
    positive_int,
    positive_number,
    progress,
    ratio_header,
    synchronise,
    time_ratio,
)
from parlab.bench.zero_engines import build_engine, mlp, random_batch, rank_shard, take_step
from parlab.bench.zero_link import (
    LR,
    STAGE_RATIO,
    TARGET_RATIO,
    TARGET_TOLERANCE,
    bench_zero_link,
    format_link_report,
    overlap_model,
    stage_model,
    time_overlap,
    time_stages,
)
from parlab.memory import FP32_ADAM, STAGES, model_state_bytes
from parlab.units import MIB

__all__ = ["ENGINES", "REFERENCE", "STAGE_RATIO", "TARGET_RATIO", "TARGET_TOLERANCE", "add_arguments", "add_ratios",
           "bench_zero", "bench_zero_link", "format_link_report", "format_report", "measure_engines", "overlap_model",
           "run", "stage_model", "time_overlap", "time_stages"]

WARMUP_STEPS = 2  # the first step allocates the optimizer state
REFERENCE = "torch's engine of the same stage"
BYTES_RATIO = f"bytes ratio = bytes of parlab / bytes of {REFERENCE} (below 1: parlab holds less)"
ENGINES = [  # (implementation, stage, name), by stage
    ("parlab", 0, "ZeroDP stage 0"),
    ("torch", 0, "torch DDP"),
    ("parlab", 1, "ZeroDP stage 1"),
    ("torch", 1, "torch DDP + ZeroRedundancyOptimizer"),
    ("parlab", 2, "ZeroDP stage 2"),
    ("parlab", 3, "FSDP FULL_SHARD"),
    ("torch", 3, "torch fully_shard"),
]


def add_arguments(parser):
    count = dict(type=positive_int, metavar="N")
    parser.add_argument("--world-sizes", nargs="+", default=[2, 4], help="default: 2 4", **count)
    parser.add_argument("--stages", nargs="+", type=int, choices=STAGES, metavar="S",
                        help="real time: only the engines of these ZeRO stages, parlab's and torch's (default: all)")
    parser.add_argument("--steps", help="timed steps per engine (default 10; 5 with --link)", **count)
    parser.add_argument("--hidden", help="features of every Linear layer (default 1024; 512 with --link)", **count)
    parser.add_argument("--depth", default=4, help="Linear layers (default 4)", **count)
    parser.add_argument("--batch-size", help="samples per rank and step (default 64; 4 with --link)", **count)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="where the model lives (the CPU with --link)")
    parser.add_argument("--link", type=link_argument, metavar="LATENCY,BANDWIDTH",
                        help="measure parlab's stages under this emulated link instead, e.g. 200us,25MB/s")
    parser.add_argument("--compute-ms", type=positive_number, metavar="MS",
                        help="with --link: declared compute of a step, in ms (default 10)")


def run(args):
    if args.link is None:
        return bench_zero(args.world_sizes, args.steps or 10, args.hidden or 1024, args.depth, args.batch_size or 64,
                          args.device, args.stages)
    if args.stages is not None:
        raise ValueError("--stages picks the engines of the real-time comparison; --link measures every stage: "
                         "drop one of them.")
    if args.device != "cpu":
        raise ValueError("--link measures emulated time on CPU ranks: drop --device cuda.")
    return bench_zero_link(args.link, args.world_sizes, args.steps or 5, args.hidden or 512, args.depth,
                           args.batch_size or 4, 0.01 if args.compute_ms is None else args.compute_ms / 1e3)


def bench_zero(world_sizes=(2, 4), steps=10, hidden=1024, depth=4, batch_size=64, device="cpu", stages=None):
    """Measure every engine (of ``stages`` only, if given: e.g. [0], ZeroDP stage 0 beside
    torch's DDP) at every world size; returns a JSON-ready dict with one row per (world_size,
    engine): bytes (the largest rank's ModelState as a dict), formula (the same for the
    paper), median_s and seconds (slowest rank), and for parlab rows the ratios to torch's
    engine of the same stage (None where torch has none)."""
    check_arguments(device, world_sizes=world_sizes, steps=steps, hidden=hidden, depth=depth, batch_size=batch_size)
    if stages is not None and (not stages or any(stage not in STAGES for stage in stages)):
        raise ValueError(f"stages must list ZeRO stages among {list(STAGES)}, got {stages!r}: e.g. [0] for ZeroDP "
                         "stage 0 and torch's DDP.")
    engines = [engine for engine in ENGINES if stages is None or engine[1] in stages]
    sizes = [hidden] * (depth + 1)
    psi = sum(p.numel() for p in mlp(sizes).parameters())
    rows, backend = [], None
    for world_size in world_sizes:
        progress("zero", f"N={world_size}: starting {world_size} ranks ...")
        with runtime.Cluster(world_size, device=device) as cluster:
            progress("zero", f"N={world_size}: {WARMUP_STEPS} + {steps} steps of {len(engines)} engines ...")
            measured = cluster.run(measure_engines, [name for *_, name in engines], steps, sizes, batch_size)
        backend = measured[0]["backend"]
        for index, (implementation, stage, name) in enumerate(engines):
            per_rank = [rank_result["bytes"][index] for rank_result in measured]
            seconds = measured[0]["seconds"][index]
            rows.append({
                "world_size": world_size, "implementation": implementation, "stage": stage, "engine": name,
                "bytes": max(per_rank, key=lambda state: state["total"]),
                "per_rank_total": [s["total"] for s in per_rank],
                "formula": _as_dict(model_state_bytes(psi, stage, world_size, *FP32_ADAM)),
                "median_s": statistics.median(seconds), "seconds": seconds,
            })
    add_ratios(rows)
    return {
        "bench": "zero", "device": device, "backend": backend, "torch_version": torch.__version__,
        "cpu_count": os.cpu_count(), "parameters": psi, "hidden": hidden, "depth": depth,
        "batch_size": batch_size, "steps": steps, "ratio_means": f"{ratio_header(REFERENCE)}; {BYTES_RATIO}",
        "rows": rows,
    }


def add_ratios(rows):
    """Give every parlab row ``ratio`` = {"time": its median / torch's, "bytes": its total
    bytes / torch's} against torch's row of the same world size and stage (None where torch
    has no engine of that stage)."""
    for row in rows:
        if row["implementation"] == "parlab":
            torch_row = next((r for r in rows if r["implementation"] == "torch" and r["world_size"] == row["world_size"]
                              and r["stage"] == row["stage"]), None)
            row["ratio"] = None if torch_row is None else {
                "time": time_ratio(row["median_s"], torch_row["median_s"]),
                "bytes": row["bytes"]["total"] / torch_row["bytes"]["total"],
            }
    return rows


def measure_engines(names, steps, sizes, batch_size):
    """On every rank: {"seconds": [[step time, ...] per engine], "bytes": [ModelState dict
    per engine], "backend"}; step times are the slowest rank's (the same on every rank)."""
    device = runtime.device()
    engines = [build_engine(name, mlp(sizes).to(device), LR) for name in names]
    batch = random_batch(batch_size * dist.get_world_size(), sizes[0], sizes[-1])
    inputs, targets = (part.to(device) for part in rank_shard(batch))
    seconds = [[] for _ in names]
    for step in range(WARMUP_STEPS + steps):
        for index, engine in enumerate(engines):
            synchronise(device)
            dist.barrier()
            start = time.perf_counter()
            take_step(engine, inputs, targets)
            synchronise(device)
            if step >= WARMUP_STEPS:
                seconds[index].append(time.perf_counter() - start)
    per_step = torch.tensor(seconds, dtype=torch.float64)
    dist.all_reduce(per_step, op=dist.ReduceOp.MAX)  # the slowest rank's time of each step
    return {"seconds": per_step.tolist(), "bytes": [_as_dict(engine.model_state_bytes()) for engine in engines],
            "backend": dist.get_backend()}


def _as_dict(state):
    return {"params": state.params, "grads": state.grads, "optimizer": state.optimizer, "total": state.total}


def format_report(result):
    if "link" in result:
        return format_link_report(result)
    rows = []
    for row in result["rows"]:
        ratio = row.get("ratio")
        rows.append([
            row["engine"], row["world_size"], row["stage"],
            *(f"{row['bytes'][field] / MIB:.2f}" for field in ("params", "grads", "optimizer", "total")),
            f"{row['formula']['total'] / MIB:.2f}", f"{row['bytes']['total'] / row['formula']['total']:.3f}",
            format_seconds(row["median_s"]),
            "" if ratio is None else f"{ratio['bytes']:.2f}x", "" if ratio is None else f"{ratio['time']:.2f}x",
        ])
    table = format_table(
        ["engine", "N", "stage", "params", "grads", "optimizer", "total MiB", "formula", "/ formula",
         "median step", "bytes / torch", "time / torch"],
        rows,
    )
    return (
        f"parlab bench zero: model-state MiB per rank (largest rank, at rest) and step time (forward, "
        f"backward, step; median of {result['steps']} steps, slowest rank) of an MLP of {result['depth']} x "
        f"{result['hidden']} ({result['parameters'] / 1e6:.2f} M parameters), fp32 Adam, batch "
        f"{result['batch_size']} per rank; formula: the ZeRO paper's (4 + 4 + kappa) Psi split by stage, kappa = 8; "
        f"{result['backend']} on {result['device']}, torch {result['torch_version']}, "
        f"{result['cpu_count']} CPU cores\n{ratio_header(REFERENCE)}; {BYTES_RATIO}\n\n{table}"
    )


