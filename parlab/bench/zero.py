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
communication. On each world size, parlab's stages 0, 1, 2 (ZeroDP) and 3 (FSDP FULL_SHARD,
a unit per Linear) train the MLP (``--hidden`` 512 by default here), taking their steps in
turn, with a declared compute of ``--compute-ms`` per step (emulated: the CPU is released),
small beside the communication, under that link, then the same in real time. Per stage: the median step (from the first
rank's start to the last rank's end), the bytes each rank sent in a step (counted in the
trace) beside ``ring_traffic_bytes``, and the alpha-beta model, compute +
``ring_communication_seconds``. Ratios here are time of stage s / time of stage 0: measured,
modelled, and of the traffic (``communication_volume``: 1, 1, 1, 1.5). Issue 12's target:
stage 3 over stage 0 within 15% of 1.5. torch's engines have no rows there: their
communication is torch's own, which no emulated link shapes.
"""

import os
import statistics
import time

import torch
import torch.distributed as dist

from parlab import runtime
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
    synchronise,
    time_ratio,
)
from parlab.bench.zero_engines import (
    STAGE_ENGINES,
    build_engine,
    mlp,
    padded_numels,
    random_batch,
    rank_shard,
    take_step,
)
from parlab.memory import (
    FP32_ADAM,
    STAGES,
    communication_volume,
    model_state_bytes,
    ring_communication_seconds,
    ring_traffic_bytes,
)
from parlab.runtime.emulation import Link

WARMUP_STEPS = 2  # the first step allocates the optimizer state
LR = 1e-4
MIB = 2**20
REFERENCE = "torch's engine of the same stage"
BYTES_RATIO = f"bytes ratio = bytes of parlab / bytes of {REFERENCE} (below 1: parlab holds less)"
STAGE_RATIO = "ratios = time of stage s / time of stage 0, measured, modelled and of the bytes sent"
ENGINES = [  # (implementation, stage, name), by stage
    ("parlab", 0, "ZeroDP stage 0"),
    ("torch", 0, "torch DDP"),
    ("parlab", 1, "ZeroDP stage 1"),
    ("torch", 1, "torch DDP + ZeroRedundancyOptimizer"),
    ("parlab", 2, "ZeroDP stage 2"),
    ("parlab", 3, "FSDP FULL_SHARD"),
    ("torch", 3, "torch fully_shard"),
]
TARGET_RATIO, TARGET_TOLERANCE = 1.5, 0.15


def add_arguments(parser):
    count = dict(type=positive_int, metavar="N")
    parser.add_argument("--world-sizes", nargs="+", default=[2, 4], help="default: 2 4", **count)
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
                          args.device)
    if args.device != "cpu":
        raise ValueError("--link measures emulated time on CPU ranks: drop --device cuda.")
    return bench_zero_link(args.link, args.world_sizes, args.steps or 5, args.hidden or 512, args.depth,
                           args.batch_size or 4, 0.01 if args.compute_ms is None else args.compute_ms / 1e3)


# --- real time: parlab beside torch ---------------------------------------------------------


def bench_zero(world_sizes=(2, 4), steps=10, hidden=1024, depth=4, batch_size=64, device="cpu"):
    """Measure every engine at every world size; returns a JSON-ready dict with one row per
    (world_size, engine): bytes (the largest rank's ModelState as a dict), formula (the
    same for the paper), median_s and seconds (slowest rank), and for parlab rows the
    ratios to torch's engine of the same stage (None where torch has none)."""
    check_arguments(device, world_sizes=world_sizes, steps=steps, hidden=hidden, depth=depth, batch_size=batch_size)
    sizes = [hidden] * (depth + 1)
    psi = sum(p.numel() for p in mlp(sizes).parameters())
    rows, backend = [], None
    for world_size in world_sizes:
        progress("zero", f"N={world_size}: starting {world_size} ranks ...")
        with runtime.Cluster(world_size, device=device) as cluster:
            progress("zero", f"N={world_size}: {WARMUP_STEPS} + {steps} steps of {len(ENGINES)} engines ...")
            measured = cluster.run(measure_engines, [name for *_, name in ENGINES], steps, sizes, batch_size)
        backend = measured[0]["backend"]
        for index, (implementation, stage, name) in enumerate(ENGINES):
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


# --- emulated: the stages on a bandwidth-bound link ------------------------------------------


def time_stages(cluster, stages=STAGES, hidden=512, depth=4, batch_size=4, steps=3, compute_s=0.0):
    """Step times of parlab's ZeRO ``stages`` (``STAGE_ENGINES``) on ``cluster``, in its
    current regime (inside ``with cluster.emulate(link=...):`` for an emulated link). An
    engine per stage trains the MLP of ``depth`` Linear layers of ``hidden`` x ``hidden`` with
    fp32 Adam, ``batch_size`` samples per rank, ``compute_s`` of declared compute per step; the
    engines take their steps in turn (so that a noisy neighbour slows them all alike), one to
    warm up and ``steps`` timed ones each. Returns one dict per stage: ``stage``, ``engine``,
    ``seconds`` (each step from the first rank's start to the last rank's end), ``median_s``,
    ``timeline`` (its last step's events, ``Timeline.window``), ``sent`` (bytes each rank sent
    in it) and ``padded_numels`` (the flat buffers a step moves, for
    ``ring_communication_seconds``)."""
    check_arguments(hidden=hidden, depth=depth, batch_size=batch_size, steps=steps)
    if compute_s:
        check_seconds("compute_s", compute_s)
    for stage in stages:
        if stage not in STAGES:
            raise ValueError(f"stages must be ZeRO stages 0 to 3, got {stage!r}.")
    names = [STAGE_ENGINES[stage] for stage in stages]
    timeline = cluster.trace(_train_in_turn, names, hidden, depth, batch_size, 1 + steps, compute_s)
    rows = []
    for index, (stage, name) in enumerate(zip(stages, names)):
        windows = [timeline.window("step", step * len(names) + index) for step in range(1, 1 + steps)]
        seconds = [window.duration for window in windows]
        rows.append({"stage": stage, "engine": name, "seconds": seconds, "median_s": statistics.median(seconds),
                     "timeline": windows[-1], "sent": windows[-1].bytes_sent(),
                     "padded_numels": timeline.results[0][index]})
    return rows


def _train_in_turn(names, hidden, depth, batch_size, steps, compute_s):
    engines = [build_engine(name, mlp([hidden] * (depth + 1)), LR) for name in names]
    inputs, targets = rank_shard(random_batch(batch_size * dist.get_world_size(), hidden, hidden))
    for _ in range(steps):
        for engine in engines:
            dist.barrier()  # the ranks start each step together
            take_step(engine, inputs, targets, compute_s)
    return [padded_numels(engine) for engine in engines]


def stage_model(row, world_size, link, compute_s):
    """The alpha-beta step time of a ``time_stages`` row on ``link``: the declared compute
    plus ``ring_communication_seconds`` of its flat buffers (fp32)."""
    return compute_s + ring_communication_seconds(row["padded_numels"], world_size, 4, row["stage"], link.latency,
                                                  link.bandwidth)


def bench_zero_link(link, world_sizes=(2, 4), steps=5, hidden=512, depth=4, batch_size=4, compute_s=0.01):
    """Time parlab's stages 0 to 3 under the emulated ``link`` and in real time at every world
    size; returns a JSON-ready dict with one row per (world_size, stage) and issue 12's target
    (stage 3 / stage 0 within ``TARGET_TOLERANCE`` of 1.5) per world size."""
    check_link(link)
    if link is None:
        raise ValueError("bench_zero_link measures an emulated link: pass one, e.g. "
                         "parlab.Link(latency=200e-6, bandwidth=25e6).")
    check_arguments(world_sizes=world_sizes, steps=steps, hidden=hidden, depth=depth, batch_size=batch_size)
    check_seconds("compute_s", compute_s)
    rows, targets = [], []
    for world_size in world_sizes:
        progress("zero", f"N={world_size}: starting {world_size} ranks ...")
        with runtime.Cluster(world_size, device="cpu") as cluster:
            progress("zero", f"N={world_size}: stages 0-3 under a link of {link.describe()}, then in real time ...")
            with cluster.emulate(link=link):
                emulated = time_stages(cluster, STAGES, hidden, depth, batch_size, steps, compute_s)
            real = time_stages(cluster, STAGES, hidden, depth, batch_size, steps, compute_s)
        first, first_real = emulated[0], real[0]
        base_model = stage_model(first, world_size, link, compute_s)
        for row, real_row in zip(emulated, real):
            model_s = stage_model(row, world_size, link, compute_s)
            rows.append({
                "world_size": world_size, "stage": row["stage"], "engine": row["engine"],
                "median_s": row["median_s"], "seconds": row["seconds"], "model_s": model_s,
                "measured_over_model": row["median_s"] / model_s,
                "sent": row["sent"], "sent_formula": ring_traffic_bytes(sum(row["padded_numels"]), world_size, 4,
                                                                        row["stage"]),
                "over_stage_0": row["median_s"] / first["median_s"], "model_over_stage_0": model_s / base_model,
                "traffic_over_stage_0": communication_volume(1, row["stage"]) / communication_volume(1, 0),
                "real_median_s": real_row["median_s"],
                "real_over_stage_0": real_row["median_s"] / first_real["median_s"],
            })
        value = rows[-1]["over_stage_0"]
        targets.append({"target": f"N = {world_size}: stage 3 / stage 0 within {TARGET_TOLERANCE:.0%} of "
                                  f"{TARGET_RATIO}", "value": value,
                        "met": abs(value / TARGET_RATIO - 1) <= TARGET_TOLERANCE})
    return {
        "bench": "zero", "regime": f"emulated: link {link.describe()}", "torch_version": torch.__version__,
        "cpu_count": os.cpu_count(), "link": {"latency": link.latency, "bandwidth": link.bandwidth},
        "parameters": depth * (hidden * hidden + hidden), "hidden": hidden, "depth": depth,
        "batch_size": batch_size, "steps": steps, "compute_s": compute_s, "ratio_means": STAGE_RATIO,
        "rows": rows, "targets": targets,
    }


# --- reports -----------------------------------------------------------------------------------


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


def format_link_report(result):
    link = Link(**result["link"])
    table = format_table(
        ["N", "stage", "engine", "sent / rank", "formula", "median step", "model", "/ model", "/ stage 0",
         "model / stage 0", "bytes / stage 0", "real step", "real / stage 0"],
        [[row["world_size"], row["stage"], row["engine"], f"{max(row['sent']):,}", f"{row['sent_formula']:,.0f}",
          format_seconds(row["median_s"]), format_seconds(row["model_s"]), f"{row['measured_over_model']:.2f}",
          f"{row['over_stage_0']:.2f}", f"{row['model_over_stage_0']:.2f}", f"{row['traffic_over_stage_0']:.2f}",
          format_seconds(row["real_median_s"]), f"{row['real_over_stage_0']:.2f}"] for row in result["rows"]],
    )
    lines = [f"{'met' if t['met'] else 'NOT met':>7}  {t['value']:.3f}  {t['target']}" for t in result["targets"]]
    return (
        f"parlab bench zero --link: step time of parlab's ZeRO stages (forward, backward, "
        f"{result['compute_s'] * 1e3:g} ms of declared compute, step; median of {result['steps']} steps, first "
        f"rank's start to last rank's end) "
        f"of an MLP of {result['depth']} x {result['hidden']} ({result['parameters'] / 1e6:.2f} M parameters), fp32 "
        f"Adam, batch {result['batch_size']} per rank; emulated: link {link.describe()}, and the same steps in real "
        f"time; model = compute + alpha-beta time of the ring collectives "
        f"(parlab.memory.ring_communication_seconds); torch {result['torch_version']}, {result['cpu_count']} CPU "
        f"cores\n{STAGE_RATIO}\n\n{table}\n\nissue 12's target:\n" + "\n".join(lines)
    )
