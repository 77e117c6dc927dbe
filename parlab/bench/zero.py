"""ZeRO memory and step time: parlab's stages 0-3 beside torch's DDP, ZeroRedundancyOptimizer and fully_shard.

Every engine trains its own copy of the same MLP (``depth`` Linear layers of ``hidden`` x
``hidden`` with ReLU between them; 4.2 M parameters by default) with fp32 Adam, one step at
a time, in one run on one cluster per world size:

    stage  parlab                        torch
    0      ZeroDP(stage=0)               DistributedDataParallel
    1      ZeroDP(stage=1)               DDP + ZeroRedundancyOptimizer
    2      ZeroDP(stage=2)               (none: torch has no ZeRO-2 engine of its own)
    3      FSDP("FULL_SHARD", per layer) fully_shard on every Linear and on the model

Model-state bytes are measured at rest (after a step) from the storages each rank holds
(``parlab.memory.measure_model_state``: DTensors by their local shards, torch DDP with
``gradient_as_bucket_view`` so that its gradients are its buckets) and shown beside the ZeRO
paper's formula for fp32 Adam, ``model_state_bytes(Psi, stage, N_d, k=8, 4, 4)``; a row
reports its largest rank. torch's ZeroRedundancyOptimizer shards whole parameters, so its
ranks hold unequal parts.

Step time: forward + backward + ``step``; the ranks start each step together (a barrier,
not timed) and a step's time is the slowest rank's; the engines take their steps in turn,
so that a noisy neighbour slows them all alike. ``median_s`` is over ``steps`` timed steps
after ``WARMUP_STEPS``. Ratios, parlab / torch's engine of the same stage, as in every bench:
``ratio["time"]`` of the median step times (below 1, parlab is faster) and ``ratio["bytes"]``
of the model-state bytes (below 1, parlab holds less).
"""

import importlib.util
import os
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

from parlab import runtime
from parlab.bench import (
    check_arguments,
    format_seconds,
    format_table,
    positive_int,
    progress,
    ratio_header,
    synchronise,
    time_ratio,
)
from parlab.bench.ddp import build_mlp, mlp_parameters
from parlab.memory import FP32_ADAM, measure_model_state, model_state_bytes
from parlab.zero import ZeroDP

WARMUP_STEPS = 2  # the first step allocates the optimizer state
SEED, LR = 0, 1e-4
MIB = 2**20
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
    parser.add_argument("--steps", default=10, help="timed steps per engine (default 10)", **count)
    parser.add_argument("--hidden", default=1024, help="features of every Linear layer (default 1024)", **count)
    parser.add_argument("--depth", default=4, help="Linear layers (default 4)", **count)
    parser.add_argument("--batch-size", default=64, help="samples per rank and step (default 64)", **count)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where the model lives")


def run(args):
    return bench_zero(args.world_sizes, args.steps, args.hidden, args.depth, args.batch_size, args.device)


def bench_zero(world_sizes=(2, 4), steps=10, hidden=1024, depth=4, batch_size=64, device="cpu"):
    """Measure every engine at every world size; returns a JSON-ready dict with one row per
    (world_size, engine): bytes (the largest rank's ModelState as a dict), formula (the
    same for the paper), median_s and seconds (slowest rank), and for parlab rows the
    ratios to torch's engine of the same stage (None where torch has none)."""
    check_arguments(device, world_sizes=world_sizes, steps=steps, hidden=hidden, depth=depth, batch_size=batch_size)
    engines = available_engines()
    psi = mlp_parameters(hidden, depth)
    rows, backend = [], None
    for world_size in world_sizes:
        progress("zero", f"N={world_size}: starting {world_size} ranks ...")
        with runtime.Cluster(world_size, device=device) as cluster:
            progress("zero", f"N={world_size}: {WARMUP_STEPS} + {steps} steps of {len(engines)} engines ...")
            measured = cluster.run(measure_engines, engines, steps, hidden, depth, batch_size)
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


def available_engines():
    """ENGINES, without parlab's FSDP while parlab.zero.fsdp does not exist."""
    has_fsdp = importlib.util.find_spec("parlab.zero.fsdp") is not None
    return [engine for engine in ENGINES if has_fsdp or engine[:2] != ("parlab", 3)]


def build_engine(implementation, stage, hidden, depth, device):
    """(callable model, step(), zero_grad(), bytes() -> ModelState) of one engine."""
    torch.manual_seed(SEED)  # the same model for every engine
    model = build_mlp(hidden, depth).to(device)
    if implementation == "parlab" and stage < 3:
        engine = ZeroDP(model, torch.optim.Adam, stage=stage, lr=LR)
        return engine, engine.step, engine.zero_grad, engine.model_state_bytes
    if implementation == "parlab":
        from parlab.zero.fsdp import FSDP

        engine = FSDP(model, torch.optim.Adam, strategy="FULL_SHARD", wrap_policy="per_layer", lr=LR)
        return engine, engine.step, engine.zero_grad, engine.model_state_bytes
    if stage == 3:
        from torch.distributed.fsdp import fully_shard

        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        wrapped = fully_shard(model)
        optimizer = torch.optim.Adam(model.parameters(), lr=LR)
        state = optimizer.state
    else:
        ids = [device] if device.type == "cuda" else None
        wrapped = nn.parallel.DistributedDataParallel(model, device_ids=ids, gradient_as_bucket_view=True)
        if stage == 0:
            optimizer = torch.optim.Adam(model.parameters(), lr=LR)
            state = optimizer.state
        else:
            from torch.distributed.optim import ZeroRedundancyOptimizer

            optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=LR)
            state = optimizer.optim.state  # this rank's partition's optimizer

    def measured_bytes():
        params = list(model.parameters())
        states = [value for per_parameter in state.values() for value in per_parameter.values()]
        return measure_model_state(
            map(_local, params), [_local(p.grad) for p in params], [_local(s) for s in states if torch.is_tensor(s)]
        )

    return wrapped, optimizer.step, optimizer.zero_grad, measured_bytes


def _local(tensor):
    """A DTensor's shard on this rank (what it really holds); any other tensor as it is."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def measure_engines(engines, steps, hidden, depth, batch_size):
    """On every rank: {"seconds": [[step time, ...] per engine], "bytes": [ModelState dict
    per engine], "backend"}; step times are the slowest rank's (the same on every rank)."""
    device = runtime.device()
    built = [build_engine(implementation, stage, hidden, depth, device) for implementation, stage, _ in engines]
    generator = torch.Generator().manual_seed(SEED + dist.get_rank())  # this rank's shard
    inputs = torch.randn(batch_size, hidden, generator=generator).to(device)
    targets = torch.randn(batch_size, hidden, generator=generator).to(device)

    seconds = [[] for _ in engines]
    for step in range(WARMUP_STEPS + steps):
        for index, (model, take_step, zero_grad, _) in enumerate(built):
            synchronise(device)
            dist.barrier()
            start = time.perf_counter()
            zero_grad()
            nn.functional.mse_loss(model(inputs), targets).backward()
            take_step()
            synchronise(device)
            if step >= WARMUP_STEPS:
                seconds[index].append(time.perf_counter() - start)
    per_step = torch.tensor(seconds, dtype=torch.float64)
    dist.all_reduce(per_step, op=dist.ReduceOp.MAX)  # the slowest rank's time of each step
    return {
        "seconds": per_step.tolist(),
        "bytes": [_as_dict(measured_bytes()) for *_, measured_bytes in built],
        "backend": dist.get_backend(),
    }


def _as_dict(state):
    return {"params": state.params, "grads": state.grads, "optimizer": state.optimizer, "total": state.total}


def format_report(result):
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
        f"{result['batch_size']} per rank; formula: the ZeRO paper's (4 + 4 + 8) Psi split by stage; "
        f"{result['backend']} on {result['device']}, torch {result['torch_version']}, "
        f"{result['cpu_count']} CPU cores\n{ratio_header(REFERENCE)}; {BYTES_RATIO}\n\n{table}"
    )
