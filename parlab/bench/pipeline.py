"""Pipeline step time beside torch.distributed.pipelining, and measured bubbles beside the model's.

Two measurements on each K of ``--world-sizes``:

- step time, in real time: one pipeline step (forward and backward of the M =
  ``--microbatches`` micro-batches, no optimizer) of the same MLP (``depth`` Linear layers
  of ``width`` x ``width`` with ReLU between them, cut into K v stages by
  ``parlab.pipeline.partition``), run by parlab's ``PipelineExecutor`` and by torch's
  ``ScheduleGPipe`` / ``Schedule1F1B`` / ``ScheduleInterleaved1F1B`` (GPipe, 1F1B, and
  interleaved 1F1B with v = 2 chunks per rank where M is a multiple of K and the model has
  K v layers to spare). The ranks start each step together (a barrier, not timed), a step's
  time is the slowest rank's, and the two take their steps in turn so that a noisy
  neighbour slows both alike. ``ratio`` = parlab's median / torch's (below 1, parlab is
  faster: the convention of every bench). torch's pipelining sends through
  torch.distributed, which no emulated link shapes, so this comparison stays in real time.
- bubble, in the cluster's regime (``--link LATENCY,BANDWIDTH`` emulates a link, e.g.
  ``200us,100MB/s``; without it, real time): for each M of ``--bubble-microbatches`` and
  each schedule, ``repeats`` traced steps of stages that only sleep (emulated devices:
  ``sleep_ms`` per F and per B, ``sleep_ms / v`` per chunk when interleaved) sending
  activations of ``--activation-bytes``, each measured by
  ``parlab.pipeline.measure.measure_bubble``: the median measured bubble beside the closed
  form (K - 1) / (v M + K - 1) and the simulator's bubble with the link's time per message
  (t_comm = alpha + activation bytes x beta), and the allowance the yardstick of each step
  gives (twice what the machine adds per action along the critical path). With K = 4 the
  report ends with its target: the measured bubble within 0.03 of the closed form
  for M = 4, 8, 16, 32.
"""

import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from parlab import runtime
from parlab.bench import (
    byte_size,
    check_arguments,
    check_link,
    check_seconds,
    format_bytes,
    format_seconds,
    format_table,
    link_argument,
    positive_int,
    positive_number,
    progress_bar,
    ratio_header,
    synchronise,
    time_ratio,
)
from parlab.bench.ddp import build_mlp, mlp_parameters
from parlab.pipeline.executor import PipelineExecutor, partition, sleep_pipeline_step
from parlab.pipeline.measure import YARDSTICK_SHORTER, measure_bubble
from parlab.pipeline.schedule import interleaved_1f1b, make_schedule
from parlab.runtime.emulation import Regime

REFERENCE = "torch.distributed.pipelining"
SCHEDULES = {"gpipe": 1, "1f1b": 1, "interleaved_1f1b": 2}  # name -> v, chunks per rank
WARMUP_STEPS = 2  # torch infers the stage shapes in its first step; both allocate buffers
SEED = 0
DEFAULT_WORLD_SIZES = [2, 4]
LINK_WORLD_SIZES = [4]  # the report's target is stated for K = 4
BUBBLE_MICROBATCHES = [4, 8, 16, 32]
TARGET_K, TARGET_GAP = 4, 0.03  # the target: the measured bubble within 0.03 of the closed form at K = 4


def add_arguments(parser):
    count = dict(type=positive_int, metavar="N")
    parser.add_argument("--world-sizes", nargs="+", help=f"K, default: {' '.join(map(str, DEFAULT_WORLD_SIZES))}; "
                        f"with --link {' '.join(map(str, LINK_WORLD_SIZES))}", **count)
    parser.add_argument("--microbatches", default=8, help="M of the step-time comparison (default 8)", **count)
    parser.add_argument("--steps", default=10, help="timed steps per schedule and runner (default 10)", **count)
    parser.add_argument("--width", default=512, help="features of every Linear layer (default 512)", **count)
    parser.add_argument("--depth", default=8, help="Linear layers (default 8)", **count)
    parser.add_argument("--batch-size", default=64, help="samples per step, split into M (default 64)", **count)
    parser.add_argument("--link", type=link_argument, metavar="LATENCY,BANDWIDTH",
                        help="measure the bubbles on an emulated link, e.g. 200us,100MB/s (default: real time)")
    parser.add_argument("--bubble-microbatches", nargs="+", default=BUBBLE_MICROBATCHES,
                        help=f"M of the bubbles (default {' '.join(map(str, BUBBLE_MICROBATCHES))})", **count)
    parser.add_argument("--sleep-ms", type=positive_number, default=50.0, metavar="MS",
                        help="F and B time of a sleep stage for the bubble (default 50)")
    parser.add_argument("--activation-bytes", type=byte_size, default=4096, metavar="BYTES",
                        help="bytes of each activation and gradient between sleep stages, e.g. 4K (default 4K)")
    parser.add_argument("--repeats", default=3, help="traced sleep steps per schedule and M (default 3)", **count)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where the model lives")


def run(args):
    return bench_pipeline(args.world_sizes, args.microbatches, args.steps, args.width, args.depth, args.batch_size,
                          args.sleep_ms / 1e3, args.repeats, args.device, args.link, args.bubble_microbatches,
                          args.activation_bytes)


def bench_pipeline(world_sizes=None, microbatches=8, steps=10, width=512, depth=8, batch_size=64, sleep_s=0.05,
                   repeats=3, device="cpu", link=None, bubble_microbatches=BUBBLE_MICROBATCHES, activation_bytes=4096):
    """Step times (real time) and bubbles (on ``link``, a ``parlab.Link``, or in real time)
    of every valid schedule at every K; returns a JSON-ready dict with ``rows`` (one per
    (K, schedule): step times), ``bubble_rows`` (one per (K, M, schedule)) and the report's
    ``targets``. K defaults to 2 4, with a link to 4. Progress goes to stderr."""
    world_sizes = list(world_sizes or (LINK_WORLD_SIZES if link else DEFAULT_WORLD_SIZES))
    check_arguments(device, world_sizes=world_sizes, microbatches=microbatches, steps=steps, width=width, depth=depth,
                    batch_size=batch_size, repeats=repeats, bubble_microbatches=bubble_microbatches,
                    activation_bytes=activation_bytes)
    check_seconds("sleep_s", sleep_s)
    check_link(link)
    M = microbatches
    if batch_size % M:
        raise ValueError(f"a batch of {batch_size} samples does not split into M = {M} micro-batches: use a batch "
                         f"size that is a multiple of {M}.")
    if activation_bytes % 4:
        raise ValueError(f"activation_bytes must be a multiple of 4 (fp32), got {activation_bytes}.")
    rows, bubble_rows, backend = [], [], None
    bubbles = [(K, m, name) for K in world_sizes for m in bubble_microbatches for name in valid_schedules(K, m)]
    with progress_bar("pipeline", len(world_sizes) + len(bubbles), unit="measurement") as bar:
        for K in world_sizes:
            bar.set_postfix_str(f"K={K}: starting {K} ranks")
            with runtime.Cluster(K, device=device) as cluster:
                names = valid_schedules(K, M, depth)
                bar.set_postfix_str(f"K={K}: {WARMUP_STEPS} + {steps} steps of {', '.join(names)}, parlab and torch")
                measured = cluster.run(time_steps, names, M, steps, width, depth, batch_size)[0]
                backend = measured["backend"]
                rows += [{"world_size": K, "schedule": name, "v": SCHEDULES[name],
                          **step_times(**measured["seconds"][name])} for name in names]
                bar.update()
                with cluster.emulate(link=link):
                    cluster.run(sleep_pipeline_step, interleaved_1f1b(K, K, 2), 0.001, 0.001)  # every pair talks
                    for _, m, name in [b for b in bubbles if b[0] == K]:
                        bar.set_postfix_str(f"K={K}: bubble of {name}, M = {m}")
                        schedule = make_schedule(name, K, m, SCHEDULES[name])
                        t = sleep_s / SCHEDULES[name]
                        bubble_rows.append(bubble_row([measure_bubble(cluster, schedule, t, t, 0.0, activation_bytes,
                                                                      attempts=1) for _ in range(repeats)]))
                        bar.update()
    return {
        "bench": "pipeline", "device": device, "backend": backend, "torch_version": torch.__version__,
        "cpu_count": os.cpu_count(), "parameters": mlp_parameters(width, depth), "width": width, "depth": depth,
        "batch_size": batch_size, "microbatches": M, "steps": steps, "sleep_s": sleep_s, "repeats": repeats,
        "activation_bytes": activation_bytes, "ratio_means": ratio_header(REFERENCE),
        "link": None if link is None else {"latency_s": link.latency, "bandwidth_bytes_per_s": link.bandwidth},
        "regime": Regime(link).describe(), "rows": rows, "bubble_rows": bubble_rows, "targets": targets(bubble_rows),
    }


def bubble_row(measurements):
    """One row of the bubble table from the ``BubbleMeasurement``s of one (K, M, schedule):
    medians of the measured bubbles, steps and allowances; the model's numbers."""
    first = measurements[0]
    s = first.schedule
    bubbles = [m.measured for m in measurements]
    return {
        "world_size": s.num_ranks, "microbatches": s.num_microbatches, "schedule": s.name, "v": s.stages_per_rank,
        "bubble_measured": statistics.median(bubbles), "bubbles_measured": bubbles,
        "bubble_simulated": first.simulated, "bubble_formula": first.formula, "t_comm_s": first.t_comm,
        "bubble_allowed": statistics.median(m.bubble_tolerance for m in measurements),
        "step_measured_s": statistics.median(m.measured_step for m in measurements),
        "step_simulated_s": first.simulated_step,
        "overhead_s": statistics.median(m.overhead_s for m in measurements),
    }


def targets(bubble_rows):
    """The report's target, read from the bubble rows of K = 4 at M = 4, 8, 16, 32: per
    schedule, the farthest measured bubble from (K - 1) / (v M + K - 1) within 0.03. A list
    of {target, value, met}; a schedule not measured at all four M is left out."""
    found = []
    for name in SCHEDULES:
        rows = [r for r in bubble_rows if r["world_size"] == TARGET_K and r["schedule"] == name
                and r["microbatches"] in BUBBLE_MICROBATCHES]
        if sorted(r["microbatches"] for r in rows) != BUBBLE_MICROBATCHES:
            continue
        worst = max(rows, key=lambda r: abs(r["bubble_measured"] - r["bubble_formula"]))
        gap = abs(worst["bubble_measured"] - worst["bubble_formula"])
        found.append({"target": f"{name}: measured bubble within {TARGET_GAP} of (K-1)/(vM+K-1), K = {TARGET_K}, "
                                f"M = {', '.join(map(str, BUBBLE_MICROBATCHES))} (the farthest: M = "
                                f"{worst['microbatches']})", "value": gap, "met": gap <= TARGET_GAP})
    return found


def step_times(parlab, torch):
    """The step-time part of a row from both runners' step times (lists of seconds): their
    medians and ratio = parlab's median / torch's."""
    parlab_median, torch_median = statistics.median(parlab), statistics.median(torch)
    return {"parlab_median_s": parlab_median, "torch_median_s": torch_median,
            "ratio": time_ratio(parlab_median, torch_median), "parlab_seconds": parlab, "torch_seconds": torch}


def valid_schedules(K, M, depth=None):
    """The schedules of SCHEDULES that K ranks can run with M micro-batches (on an MLP of
    ``depth`` Linear layers, 2 depth - 1 layers with the ReLUs: one stage needs one; sleep
    stages need no layers)."""
    layers = 2 * depth - 1 if depth is not None else K * SCHEDULES["interleaved_1f1b"]
    runs = {"gpipe": True, "1f1b": M >= K,
            "interleaved_1f1b": M % K == 0 and layers >= K * SCHEDULES["interleaved_1f1b"]}
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
    """The step-time table (real time), then the bubble table and its target when the
    result has bubble rows."""
    table = format_table(
        ["K", "schedule", "parlab step", "torch step", "time / torch"],
        [
            [row["world_size"], row["schedule"] + (f" v={row['v']}" if row["v"] > 1 else ""),
             format_seconds(row["parlab_median_s"]), format_seconds(row["torch_median_s"]), f"{row['ratio']:.2f}x"]
            for row in result["rows"]
        ],
    )
    report = (
        f"parlab bench pipeline: step time (forward and backward of M = {result['microbatches']} micro-batches) "
        f"of an MLP of {result['depth']} x {result['width']} ({result['parameters'] / 1e6:.1f} M parameters), "
        f"batch {result['batch_size']}; median of {result['steps']} steps, slowest rank, real time. "
        f"{result['backend']} on {result['device']}, torch {result['torch_version']}, "
        f"{result['cpu_count']} CPU cores\n{ratio_header(REFERENCE)}\n\n{table}"
    )
    if result.get("bubble_rows"):
        report += "\n\n" + format_bubbles(result)
    return report


def format_bubbles(result):
    table = format_table(
        ["K", "M", "schedule", "bubble measured", "simulated", "(K-1)/(vM+K-1)", "measured - formula", "allowed",
         "step measured", "simulated"],
        [
            [row["world_size"], row["microbatches"], row["schedule"] + (f" v={row['v']}" if row["v"] > 1 else ""),
             f"{row['bubble_measured']:.3f}", f"{row['bubble_simulated']:.3f}", f"{row['bubble_formula']:.3f}",
             f"{row['bubble_measured'] - row['bubble_formula']:+.3f}", f"+-{row['bubble_allowed']:.3f}",
             format_seconds(row["step_measured_s"]), format_seconds(row["step_simulated_s"])]
            for row in result["bubble_rows"]
        ],
    )
    lines = [f"{'met' if t['met'] else 'NOT met':>7}  {t['value']:.3f}  {t['target']}" for t in result["targets"]]
    return (
        f"bubble: stages that sleep {result['sleep_s'] * 1e3:g} ms per F and B (divided by v per chunk), "
        f"activations of {format_bytes(result['activation_bytes'])}, {result['regime']}; median of "
        f"{result['repeats']} traced steps. simulated: the simulator with each message's link time; allowed: twice "
        f"what the yardstick step (stages {YARDSTICK_SHORTER}x shorter) adds beyond its simulation, as a "
        f"bubble\n\n{table}"
        + ("\n\ntarget: the measured bubble against the closed form\n" + "\n".join(lines) if lines else "")
    )
