"""Pipeline step time beside torch.distributed.pipelining, and measured bubbles beside simulated ones.

For each K in ``--world-sizes`` and each schedule (GPipe, 1F1B, interleaved 1F1B with v = 2
chunks per rank where M is a multiple of K and the model has K v layers to spare):

- step time: one pipeline step (forward and backward of the M micro-batches, no optimizer)
  of the same MLP (``depth`` Linear layers of ``width`` x ``width`` with ReLU between them,
  cut into K v stages by ``parlab.pipeline.partition``), run by parlab's
  ``PipelineExecutor`` and by torch's ``ScheduleGPipe`` / ``Schedule1F1B`` /
  ``ScheduleInterleaved1F1B``. The ranks start each step together (a barrier, not timed),
  a step's time is the slowest rank's, and the two take their steps in turn so that a noisy
  neighbour slows both alike. ``ratio`` = parlab's median / torch's (below 1, parlab is
  faster: the convention of every bench).
- bubble: one step of ``sleep_pipeline_step`` (stages that sleep ``sleep_ms`` in F and in B,
  ``sleep_ms / v`` per chunk when interleaved) traced ``repeats`` times; the median of the
  measured ``bubble_fraction`` beside the simulator's for the same times and the closed
  form (K - 1) / (v M + K - 1).
"""

import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from parlab import runtime
from parlab.bench import (
    check_arguments,
    check_seconds,
    format_seconds,
    format_table,
    positive_int,
    positive_number,
    progress,
    ratio_header,
    synchronise,
    time_ratio,
)
from parlab.bench.ddp import build_mlp, mlp_parameters
from parlab.pipeline.executor import PipelineExecutor, partition, sleep_pipeline_step
from parlab.pipeline.schedule import make_schedule
from parlab.pipeline.simulate import bubble_formula, bubble_fraction, simulate

REFERENCE = "torch.distributed.pipelining"
SCHEDULES = {"gpipe": 1, "1f1b": 1, "interleaved_1f1b": 2}  # name -> v, chunks per rank
WARMUP_STEPS = 2  # torch infers the stage shapes in its first step; both allocate buffers
SEED = 0


def add_arguments(parser):
    count = dict(type=positive_int, metavar="N")
    parser.add_argument("--world-sizes", nargs="+", default=[2, 4], help="K, default: 2 4", **count)
    parser.add_argument("--microbatches", default=8, help="M (default 8)", **count)
    parser.add_argument("--steps", default=10, help="timed steps per schedule and runner (default 10)", **count)
    parser.add_argument("--width", default=512, help="features of every Linear layer (default 512)", **count)
    parser.add_argument("--depth", default=8, help="Linear layers (default 8)", **count)
    parser.add_argument("--batch-size", default=64, help="samples per step, split into M (default 64)", **count)
    parser.add_argument("--sleep-ms", type=positive_number, default=50.0, metavar="MS",
                        help="F and B time of a sleep stage for the bubble (default 50)")
    parser.add_argument("--repeats", default=3, help="traced sleep steps per schedule (default 3)", **count)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where the model lives")


def run(args):
    return bench_pipeline(args.world_sizes, args.microbatches, args.steps, args.width, args.depth, args.batch_size,
                          args.sleep_ms / 1e3, args.repeats, args.device)


def bench_pipeline(world_sizes=(2, 4), microbatches=8, steps=10, width=512, depth=8, batch_size=64, sleep_s=0.05,
                   repeats=3, device="cpu"):
    """Step times and bubbles of every valid schedule at every K; returns a JSON-ready dict
    with one row per (world_size, schedule). Progress goes to stderr."""
    check_arguments(device, world_sizes=world_sizes, microbatches=microbatches, steps=steps, width=width, depth=depth,
                    batch_size=batch_size, repeats=repeats)
    check_seconds("sleep_s", sleep_s)
    M = microbatches
    if batch_size % M:
        raise ValueError(f"a batch of {batch_size} samples does not split into M = {M} micro-batches: use a batch "
                         f"size that is a multiple of {M}.")
    rows, backend = [], None
    for K in world_sizes:
        names = valid_schedules(K, M, depth)
        progress("pipeline", f"K={K}: starting {K} ranks ...")
        with runtime.Cluster(K, device=device) as cluster:
            progress("pipeline", f"K={K}: {WARMUP_STEPS} + {steps} steps of {', '.join(names)}, parlab and torch ...")
            measured = cluster.run(time_steps, names, M, steps, width, depth, batch_size)[0]
            backend = measured["backend"]
            for name in names:
                v = SCHEDULES[name]
                schedule = make_schedule(name, K, M, v)
                progress("pipeline", f"K={K}: bubble of {name}, {repeats} traced sleep steps ...")
                bubbles = [bubble_fraction(cluster.trace(sleep_pipeline_step, schedule, sleep_s / v, sleep_s / v))
                           for _ in range(repeats)]
                rows.append({
                    "world_size": K, "schedule": name, "v": v, **step_times(**measured["seconds"][name]),
                    "bubble_measured": statistics.median(bubbles), "bubbles_measured": bubbles,
                    "bubble_simulated": float(simulate(schedule, sleep_s / v, sleep_s / v).bubble_fraction),
                    "bubble_formula": bubble_formula(K, M, v),
                })
    return {
        "bench": "pipeline", "device": device, "backend": backend, "torch_version": torch.__version__,
        "cpu_count": os.cpu_count(), "parameters": mlp_parameters(width, depth), "width": width, "depth": depth,
        "batch_size": batch_size, "microbatches": M, "steps": steps, "sleep_s": sleep_s, "repeats": repeats,
        "ratio_means": ratio_header(REFERENCE), "rows": rows,
    }


def step_times(parlab, torch):
    """The step-time part of a row from both runners' step times (lists of seconds): their
    medians and ratio = parlab's median / torch's."""
    parlab_median, torch_median = statistics.median(parlab), statistics.median(torch)
    return {"parlab_median_s": parlab_median, "torch_median_s": torch_median,
            "ratio": time_ratio(parlab_median, torch_median), "parlab_seconds": parlab, "torch_seconds": torch}


def valid_schedules(K, M, depth):
    """The schedules of SCHEDULES that K ranks can run with M micro-batches on an MLP of
    ``depth`` Linear layers (2 depth - 1 layers with the ReLUs: one stage needs one)."""
    runs = {"gpipe": True, "1f1b": M >= K,
            "interleaved_1f1b": M % K == 0 and 2 * depth - 1 >= K * SCHEDULES["interleaved_1f1b"]}
    return [name for name in SCHEDULES if runs[name]]


def time_steps(names, M, steps, width, depth, batch_size):
    """On every rank: {"seconds": {schedule: {"parlab": [...], "torch": [...]}}, "backend": ...},
    each step time the slowest rank's (the same on every rank)."""
    device, K = runtime.device(), dist.get_world_size()
    generator = torch.Generator().manual_seed(SEED)
    inputs = torch.randn(batch_size, width, generator=generator).to(device)
    targets = torch.randn(batch_size, width, generator=generator).to(device)
    runners = {}
    for name in names:
        schedule = make_schedule(name, K, M, SCHEDULES[name])
        runners[name, "parlab"] = _parlab_runner(schedule, width, depth, inputs, targets)
        runners[name, "torch"] = _torch_runner(schedule, width, depth, inputs, targets)
    seconds = {key: [] for key in runners}
    for step in range(WARMUP_STEPS + steps):
        for key, (modules, run_step) in runners.items():
            for module in modules:
                module.zero_grad()
            synchronise(device)
            dist.barrier()
            start = time.perf_counter()
            run_step()
            synchronise(device)
            if step >= WARMUP_STEPS:
                seconds[key].append(time.perf_counter() - start)
    per_step = torch.tensor([seconds[key] for key in runners], dtype=torch.float64)
    dist.all_reduce(per_step, op=dist.ReduceOp.MAX)  # the slowest rank's time of each step
    result = {name: {} for name in names}
    for index, (name, runner) in enumerate(runners):
        result[name][runner] = per_step[index].tolist()
    return {"seconds": result, "backend": dist.get_backend()}


def _my_stages(schedule, width, depth):
    torch.manual_seed(SEED)  # the same model on every rank and for both runners
    stages = partition(build_mlp(width, depth).to(runtime.device()), schedule.num_stages)
    return {s: stages[s] for s in schedule.stages_of(dist.get_rank())}


def _parlab_runner(schedule, width, depth, inputs, targets):
    stages = _my_stages(schedule, width, depth)
    executor = PipelineExecutor(schedule, stages, F.mse_loss)
    return list(stages.values()), lambda: executor.step(inputs, targets)


def _torch_runner(schedule, width, depth, inputs, targets):
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    stages = _my_stages(schedule, width, depth)
    pipeline_stages = [PipelineStage(module, s, schedule.num_stages, runtime.device()) for s, module in stages.items()]
    M = schedule.num_microbatches
    if schedule.name == "interleaved_1f1b":
        torch_schedule = ScheduleInterleaved1F1B(pipeline_stages, M, loss_fn=F.mse_loss)
    else:
        torch_class = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule.name]
        torch_schedule = torch_class(pipeline_stages[0], M, loss_fn=F.mse_loss)
    args = (inputs,) if 0 in stages else ()
    kwargs = dict(target=targets, losses=[]) if schedule.num_stages - 1 in stages else {}
    return list(stages.values()), lambda: torch_schedule.step(*args, **kwargs)


def format_report(result):
    table = format_table(
        ["K", "schedule", "parlab step", "torch step", "time / torch", "bubble measured", "simulated",
         "(K-1)/(vM+K-1)"],
        [
            [row["world_size"], row["schedule"] + (f" v={row['v']}" if row["v"] > 1 else ""),
             format_seconds(row["parlab_median_s"]), format_seconds(row["torch_median_s"]), f"{row['ratio']:.2f}x",
             f"{row['bubble_measured']:.3f}", f"{row['bubble_simulated']:.3f}", f"{row['bubble_formula']:.3f}"]
            for row in result["rows"]
        ],
    )
    return (
        f"parlab bench pipeline: step time (forward and backward of M = {result['microbatches']} micro-batches) "
        f"of an MLP of {result['depth']} x {result['width']} ({result['parameters'] / 1e6:.1f} M parameters), "
        f"batch {result['batch_size']}; median of {result['steps']} steps, slowest rank. Bubble: sleep stages of "
        f"{result['sleep_s'] * 1e3:g} ms per F and B (divided by v per chunk), median of {result['repeats']} traced "
        f"steps. {result['backend']} on {result['device']}, torch {result['torch_version']}, "
        f"{result['cpu_count']} CPU cores\n{ratio_header(REFERENCE)}\n\n{table}"
    )
