"""The planner against runs: step time and model-state bytes of the small GPT's plans, predicted and measured.

Each plan of ``--plans`` (indices into ``parlab.plan.measure.LAYOUTS``, default all: every
engine, with and without accumulation and recompute, on one, two and three axes) runs
``--steps`` steps after a warm-up on the emulated cluster of ``parlab.plan.measure`` (4 or 8
ranks, its link and declared compute), one cluster per size. Each row gives the planner's
step time and its terms, the measured median (each step's slowest rank), ``ratio`` =
measured / predicted (the one convention: parlab's run over the reference, here the
planner's prediction; below 1 the run beat the prediction), and the model-state bytes,
predicted and measured. The run's own CPU work (the ranks' real arithmetic and Python's
messages, about 0.1 to 0.4 s a step on 2 shared cores, more with 8 ranks) comes on top of the
declared time: it is why ratios sit a little above 1 here, and why the declared device is slow.
"""

import os

import torch

from parlab.bench import check_arguments, format_seconds, format_table, positive_int, progress, ratio_header
from parlab.plan import measure, plan_label

REFERENCE = "the planner's prediction (parlab.plan.plan_time, the run's engines' overlap)"


def add_arguments(parser):
    parser.add_argument("--steps", type=positive_int, default=2, help="timed steps per plan (default 2)")
    parser.add_argument("--plans", type=int, nargs="+", metavar="I", choices=range(len(measure.LAYOUTS)),
                        help=f"indices into parlab.plan.measure.LAYOUTS (default: all {len(measure.LAYOUTS)})")


def run(args):
    return bench_plan(args.steps, args.plans)


def bench_plan(steps=2, plans=None):
    """Run the plans of ``measure.LAYOUTS`` (all, or the indices ``plans``) and return the
    JSON-ready result: one row per plan."""
    check_arguments(steps=steps)
    layouts = measure.LAYOUTS if plans is None else [measure.LAYOUTS[i] for i in plans]
    progress("plan", f"{len(layouts)} plans on the emulated clusters of 4 and 8 ranks, {steps} steps each")
    rows = [plan_row(m) for m in measure.check_plans(steps=steps, layouts=layouts, desc="parlab bench plan")]
    return {"torch_version": torch.__version__, "cpu_count": os.cpu_count(), "steps": steps,
            "cluster": "emulated: 1 node x 4 or 8 ranks", "link": measure.LINK.describe(),
            "cluster_flops": measure.HARDWARE_FLOPS, "batch": measure.BATCH.B, "psi": measure.model().psi,
            "ratio_means": ratio_header(REFERENCE), "rows": rows}


def plan_row(m):
    """One row of the result from a ``parlab.plan.Measured``."""
    p, t = m.plan, m.predicted_time
    return {"plan": plan_label(p, long=True), "ranks": p.ranks,
            "predicted_s": t.total, "terms": t._asdict(), "measured_s": m.step_seconds, "ratio": m.time_ratio,
            "predicted_state_bytes": m.predicted_memory.states.total, "measured_state_bytes": m.state_bytes,
            "state_ratio": m.state_ratio}


def format_report(result):
    headers = ["plan (N_d x t x K)", "ranks", "predicted", "compute", "tensor", "pipeline", "bubble", "data",
               "measured", "ratio", "states predicted", "measured", "ratio"]
    rows = [[row["plan"], row["ranks"], format_seconds(row["predicted_s"]),
             *(_seconds(row["terms"][term]) for term in ("compute", "tensor", "pipeline", "bubble", "data")),
             format_seconds(row["measured_s"]), f"{row['ratio']:.3f}", f"{row['predicted_state_bytes']:,.0f}",
             f"{row['measured_state_bytes']:,}", f"{row['state_ratio']:.4f}"] for row in result["rows"]]
    return (f"parlab bench plan: {result['cluster']}, link {result['link']}, {result['cluster_flops']:.3g} FLOP/s "
            f"declared per cluster (1/N per rank); small GPT (Psi = {result['psi']:,}), B = {result['batch']}, "
            f"{result['steps']} steps per plan; torch {result['torch_version']}, {result['cpu_count']} CPU cores\n"
            f"{ratio_header(REFERENCE)}\n\n{format_table(headers, rows)}")


def _seconds(seconds):
    return format_seconds(seconds) if seconds else "-"  # a term the plan does not have
