"""The GPU check: on a machine with CUDA, every engine trains like one process on the GPU,
and each lecture's bench runs on it. ``parlab doctor --gpu`` prints it; ``pytest -m gpu``
asserts it (tests/test_gpu.py). Planned to take a few minutes on one GPU.

1. Engines (``check_engines``): the small GPT of lectures 07 and 08 trained by each of
   ``parlab.plan.measure``'s plans (DDP with buckets and accumulation, ZeroDP stages 1 and 2,
   FSDP, tensor and sequence parallelism on a data x tensor grid, 1F1B pipelines on a data x
   pipeline grid, recompute) on 4 ranks placed on the GPUs, in real time. Each plan's loss at
   every step must lie within ``parlab.numerics``' band of one process on the same device. The
   band comes from the same run: the one-process reference computed as the ranks shard it. Where
   there are 4 GPUs the ranks use nccl, one GPU each. With fewer, the ranks share them and talk
   over gloo with host staging, the runtime's documented fallback (README, "GPUs and many nodes").
   Beside each plan: tokens/s, the peak memory of the busiest rank (``torch.cuda.max_memory_allocated``),
   and its model-state bytes measured against the planner's formula (``plan_memory``).
2. Benches (``BENCHES``): ``parlab bench`` of lectures 01-04 and 07 with ``--device cuda`` and small sizes.
   Lectures 05, 06 and 08 measure on emulated links and declared devices, which a GPU does not
   change; lecture 08's planner is checked by step 1.

On a CPU the same code runs with ``device="cpu"`` (tests/test_device_check.py), so the harness
is tested on every machine, and only the device differs on a GPU.
"""

import argparse
import statistics
from contextlib import nullcontext
from importlib import import_module

import torch

from parlab.gpt import batches, train_in_one_process
from parlab.numerics import max_abs_difference, ring_orders, rounding_band
from parlab.plan import measure, plan_memory, runs
from parlab.plan.table import plan_label
from parlab.runtime import Cluster
from parlab.units import MIB

STEPS = 2  # Adam steps after the first: three losses per plan
RANKS = 4  # the ranks of measure's plans
# (bench module, arguments): one bench per lecture that has one on a GPU, small enough to run in seconds.
BENCHES = [
    ("collectives", ["--world-sizes", "2", "4", "--sizes", "1M", "64M"]),
    ("ddp", ["--world-sizes", "2", "--steps", "10"]),
    ("pipeline", ["--world-sizes", "2", "--steps", "5"]),
    ("zero", ["--world-sizes", "2", "--steps", "5"]),
    ("tensor_parallel", ["--world-sizes", "1", "2", "--steps", "5"]),
]


def check_engines(device="cuda", layouts=measure.LAYOUTS, steps=STEPS, runtime=None):
    """Train the plan of each of ``layouts`` on ``RANKS`` ranks on ``device`` (on ``runtime``, a
    ``parlab.Cluster`` of 4 ranks, or one started here) and compare its losses with one process
    on ``device``. Returns one dict per plan: plan, difference, band, ok, tokens_per_s,
    peak_bytes (None off a GPU), state_bytes and formula_state_bytes."""
    batch = measure.BATCH
    data = batches(batch.B, runs.CONFIG.s, steps + 1)
    reference = train_in_one_process(runs.CONFIG, data, runs.LR, device=device)[0]
    decomposed = [train_in_one_process(runs.CONFIG, data, runs.LR, RANKS, tuple(order), device)[0]
                  for order in ring_orders(RANKS)]
    band, _, _ = rounding_band(reference, decomposed)
    rows = []
    with _ranks(runtime, device) as ranks:
        for plan in measure.predicted_plans(layouts=layouts):
            layout = (plan.N_d, plan.t, plan.K, plan.zero, plan.b, plan.M, plan.recompute)
            results = ranks.run(runs.train_plan, layout, batch.B, 0.0, steps)
            losses = [torch.tensor(result["losses"]) for result in results]
            difference = max_abs_difference(losses[0], reference)
            same_everywhere = all(torch.equal(losses[0], other) for other in losses[1:])
            step_s = statistics.median(max(times) for times in zip(*(r["times"] for r in results)))
            peaks = [r["peak_bytes"] for r in results]
            rows.append({
                "plan": plan_label(plan, long=True), "difference": difference, "band": band,
                "ok": same_everywhere and difference <= band,
                "tokens_per_s": batch.B * runs.CONFIG.s / step_s,
                "peak_bytes": None if None in peaks else max(peaks),
                "state_bytes": max(r["state_bytes"] for r in results),
                "formula_state_bytes": plan_memory(measure.model(), plan, measure.FP32_ADAM).states.total,
            })
    return rows


def format_engines(rows, device):
    lines = [f"engines on {device}: the small GPT's loss at every step against one process on {device} "
             "(band: parlab.numerics, from the same run)",
             f"{'plan':<26} {'|loss - one process|':>20} {'band':>9}  {'tokens/s':>9} {'peak MiB':>9} "
             f"{'states MiB':>10} {'/ formula':>9}"]
    for row in rows:
        peak = "-" if row["peak_bytes"] is None else f"{row['peak_bytes'] / MIB:.1f}"
        states = row["state_bytes"]
        lines.append(f"{row['plan']:<26} {row['difference']:>20.2e} {row['band']:>9.2e}  {row['tokens_per_s']:>9,.0f} "
                     f"{peak:>9} {states / MIB:>10.2f} {states / row['formula_state_bytes']:>9.3f}"
                     + ("" if row["ok"] else "  <- differs from one process"))
    return "\n".join(lines)


def run_bench(name, argv, device="cuda"):
    """``parlab bench NAME ARGV --device DEVICE`` in this process; returns its report."""
    module = import_module(f"parlab.bench.{name}")
    parser = argparse.ArgumentParser(prog=f"parlab bench {name}")
    module.add_arguments(parser)
    return module.format_report(module.run(parser.parse_args([*argv, "--device", device])))


def run(device="cuda", benches=BENCHES, out=print):
    """The whole check: engines, then benches, each printed as it finishes. Returns 0 if every
    engine trains like one process and every bench ran, else 1; 2 without a GPU."""
    if device == "cuda" and not torch.cuda.is_available():
        out("parlab doctor --gpu: torch sees no CUDA GPU here, so there is nothing to check "
              "(torch.cuda.is_available() is False).")
        return 2
    rows = check_engines(device)
    out(format_engines(rows, device))
    failed = [row["plan"] for row in rows if not row["ok"]]
    for name, argv in benches:
        out(f"\n$ parlab bench {name} {' '.join(argv)} --device {device}")
        try:
            out(run_bench(name, argv, device))
        except Exception as error:  # a bench that fails is reported, and the others still run
            out(f"failed: {type(error).__name__}: {error}")
            failed.append(f"bench {name}")
    out(f"\n{'every check passed' if not failed else 'failed: ' + ', '.join(failed)}")
    return 1 if failed else 0


def _ranks(runtime, device):
    return nullcontext(runtime) if runtime is not None else Cluster(RANKS, device=device, timeout=300)
