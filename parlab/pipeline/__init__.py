"""Pipeline parallelism from scratch: K ranks each hold a slice (stage) of the model, and
M micro-batches flow through them in an order that a schedule fixes.

    schedule.py   the schedule IR (per-rank lists of actions "1B3"), its generators (naive,
                  GPipe, 1F1B, interleaved 1F1B, ZB-H1) and the validator
    simulate.py   the timed simulator, the bubble of a timeline and its closed forms
    stages.py     cutting a model into stages (partition) and a layer that only sleeps
    executor.py   running a schedule on real ranks (PipelineExecutor, sleep_pipeline_step)
    measure.py    a step measured on a cluster beside the simulator (measure_bubble, microbatch_sweep)
    grid.py       N_d pipelines side by side, each stage data-parallel (PipelineDataParallel)

    from parlab.pipeline import one_f_one_b, simulate
    simulate(one_f_one_b(4, 8), t_f=1, t_b=2).bubble_fraction      # 3 / 11
"""

import importlib

from parlab.pipeline.schedule import (
    SCHEDULES,
    Action,
    Schedule,
    dependencies,
    dependency_order,
    gpipe,
    interleaved_1f1b,
    make_schedule,
    naive,
    one_f_one_b,
    validate,
    zero_bubble_h1,
)
from parlab.pipeline.simulate import (
    Simulation,
    action_makespan,
    bubble_formula,
    bubble_fraction,
    bubble_ratio_playbook,
    simulate,
)

# Stages and the executor need torch; schedules and the simulator do not (they run and
# plot without it), so the torch-side names are imported on first use.
_WITH_TORCH = {
    "partition": "parlab.pipeline.stages",
    "SleepLayer": "parlab.emulated",
    "PipelineExecutor": "parlab.pipeline.executor",
    "sleep_pipeline_step": "parlab.pipeline.executor",
    "PipelineDataParallel": "parlab.pipeline.grid",
    "measure_bubble": "parlab.pipeline.measure",
    "microbatch_sweep": "parlab.pipeline.measure",
}


def __getattr__(name):
    if name in _WITH_TORCH:
        return getattr(importlib.import_module(_WITH_TORCH[name]), name)
    raise AttributeError(f"module 'parlab.pipeline' has no attribute {name!r}")


__all__ = [
    "SCHEDULES", "Action", "Schedule", "dependencies", "dependency_order", "gpipe", "interleaved_1f1b",
    "make_schedule", "naive", "one_f_one_b", "validate", "zero_bubble_h1",
    "Simulation", "action_makespan", "bubble_formula", "bubble_fraction", "bubble_ratio_playbook", "simulate",
    *_WITH_TORCH,
]
