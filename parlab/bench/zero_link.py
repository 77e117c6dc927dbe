"""``parlab bench zero --link``: what each ZeRO stage costs in communication, on an emulated
link (``parlab.bench.zero`` runs it and re-exports its names).

With ``--link LATENCY,BANDWIDTH`` (e.g. ``--link 200us,25MB/s``), on each world size,
parlab's stages 0, 1, 2 (ZeroDP) and 3 (FSDP FULL_SHARD, a unit per Linear) train the MLP
(``--hidden`` 512 by default here), taking their steps in turn, with a declared compute of
``--compute-ms`` per step (emulated: the CPU is released), small beside the communication,
under that link, then the same in real time. Per stage: the median step (from the first
rank's start to the last rank's end), the bytes each rank sent in a step (counted in the
trace) beside ``ring_traffic_bytes``, and the alpha-beta model (``stage_model``): compute +
``ring_communication_seconds``, less the compute that runs beside stages 0 and 2's gradient
collective (launched during backward, on the communication thread). Ratios here are time of
stage s / time of stage 0: measured,
modelled, and of the traffic (``communication_volume``: 1, 1, 1, 1.5). The report's target:
stage 3 over stage 0 within 15% of 1.5. torch's engines have no rows there: their
communication is torch's own, which no emulated link shapes.

``time_overlap`` shows what the engines hide behind compute: FSDP with and without prefetch on
an MLP whose layers declare their compute time, beside ``overlap_model``.
"""

import os
import statistics

import torch
import torch.distributed as dist
from torch import nn

from parlab import runtime
from parlab.bench import check_arguments, check_link, check_seconds, format_seconds, format_table, progress
from parlab.bench.zero_engines import (
    SEED,
    STAGE_ENGINES,
    build_engine,
    mlp,
    padded_numels,
    random_batch,
    rank_shard,
    take_step,
)
from parlab.emulated import ComputeTime
from parlab.memory import STAGES, communication_volume, ring_communication_seconds, ring_traffic_bytes
from parlab.runtime.emulation import Link

LR = 1e-4  # small: the benches time the steps, they do not need them to train well
STAGE_RATIO = "ratios = time of stage s / time of stage 0, measured, modelled and of the bytes sent"
TARGET_RATIO, TARGET_TOLERANCE = 1.5, 0.15


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
    plus ``ring_communication_seconds`` of its flat buffers (fp32), the collectives one after
    another, less the compute hidden behind the gradients' collective: stages 0 and 2 launch
    it during backward on the communication thread (stage 0 the all-reduce, both halves of
    the communication; stage 2 the reduce-scatter, one half), so the compute declared after
    backward runs beside it: min(compute, that collective) comes off."""
    communication = ring_communication_seconds(row["padded_numels"], world_size, 4, row["stage"], link.latency,
                                               link.bandwidth)
    beside_compute = {0: communication, 2: communication / 2}.get(row["stage"], 0.0)
    return compute_s + communication - min(compute_s, beside_compute)


def time_overlap(cluster, hidden=256, depth=4, batch_size=4, layer_s=0.025, steps=3):
    """Step times of FSDP FULL_SHARD (a unit per Linear) with ``prefetch=False`` and with
    prefetch on ``cluster``, in its current regime, on an MLP of ``depth`` Linear layers of
    ``hidden`` x ``hidden``, each after a ``ComputeTime(layer_s, 2 layer_s)`` (declared forward
    and backward: each unit's compute; the input wants its gradient, so the first layer's
    backward is paid too). The engines take their steps in turn, one to warm up and ``steps``
    timed ones each. Returns one dict per engine: ``engine``, ``prefetch``, ``seconds``,
    ``median_s``, ``timeline`` (its last step) and ``padded_numels`` (its units'), for
    ``overlap_model``."""
    check_arguments(hidden=hidden, depth=depth, batch_size=batch_size, steps=steps)
    check_seconds("layer_s", layer_s)
    timeline = cluster.trace(_overlap_in_turn, hidden, depth, batch_size, layer_s, 1 + steps)
    rows = []
    for index, prefetch in enumerate((False, True)):
        windows = [timeline.window("step", step * 2 + index) for step in range(1, 1 + steps)]
        seconds = [window.duration for window in windows]
        rows.append({"engine": f"FSDP FULL_SHARD, prefetch={prefetch}", "prefetch": prefetch, "seconds": seconds,
                     "median_s": statistics.median(seconds), "timeline": windows[-1],
                     "padded_numels": timeline.results[0][index]})
    return rows


def _overlap_in_turn(hidden, depth, batch_size, layer_s, steps):
    engines = []
    for prefetch in (False, True):
        torch.manual_seed(SEED)
        model = nn.Sequential(*[module for _ in range(depth)
                                for module in (ComputeTime(layer_s, 2 * layer_s), nn.Linear(hidden, hidden))])
        engines.append(build_engine("FSDP FULL_SHARD", model, LR, prefetch=prefetch))
    inputs, targets = rank_shard(random_batch(batch_size * dist.get_world_size(), hidden, hidden))
    inputs.requires_grad_()
    for _ in range(steps):
        for engine in engines:
            dist.barrier()  # the ranks start each step together
            take_step(engine, inputs, targets)
    return [padded_numels(engine) for engine in engines]


def overlap_model(row, world_size, link, layer_s):
    """The alpha-beta step time of a ``time_overlap`` row on ``link``: the declared compute,
    3 ``layer_s`` per layer, plus the collectives on the critical path, each of unit u taking
    t_u = ``ring_communication_seconds`` of its buffer / 3 (one collective of the three).
    Without prefetch, all of them: every unit waits for its gathers and its reduce-scatter,
    3 sum t_u. With prefetch, a unit's compute hides the next unit's gather (and in backward
    the last unit's reduce-scatter as well), so only the first gather of forward and the first
    of backward are left: t_first + t_last. (When a unit's collectives outlast its compute,
    t_u > layer_s, the communication sets the pace instead and more is left.)"""
    collectives = [ring_communication_seconds([numel], world_size, 4, 3, link.latency, link.bandwidth) / 3
                   for numel in row["padded_numels"]]
    waited = collectives[0] + collectives[-1] if row["prefetch"] else 3 * sum(collectives)
    return 3 * layer_s * len(collectives) + waited


def bench_zero_link(link, world_sizes=(2, 4), steps=5, hidden=512, depth=4, batch_size=4, compute_s=0.01):
    """Time parlab's stages 0 to 3 under the emulated ``link`` and in real time at every world
    size; returns a JSON-ready dict with one row per (world_size, stage) and the report's target
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
        f"(parlab.memory.ring_communication_seconds), less the compute that stages 0 and 2 run beside their "
        f"gradients' collective (stage_model); torch {result['torch_version']}, {result['cpu_count']} CPU "
        f"cores\n{STAGE_RATIO}\n\n{table}\n\ntarget: stage 3's time over stage 0's, against its traffic's 1.5\n"
        + "\n".join(lines)
    )
