"""A strategy planner (lecture 08): for a model, a batch and the hardware, every data x tensor x
pipeline plan with its ZeRO stage, micro-batch size and activation recompute, its memory per
GPU and its step time, from the formulas of the earlier lectures; ranked, and each rejected
plan with the sentence that rejects it.

    inputs.py    Model, Batch, Hardware and their presets (small GPT, 7B, 70B; DGX A100 nodes)
    planner.py   plans, best_plans, Plan: every plan, ranked, rejected ones with a reason
    costs.py     plan_memory, plan_time, Memory, StepTime: the formulas
    table.py     plan_table (a list of dicts) and format_table (text)
    measure.py   run_plan, trace_plan, check_plans: plans of the small GPT run on a mesh of
                 emulated ranks (parlab.mesh_training), beside the prediction

    from parlab.plan import Batch, Hardware, Model, best_plans
    best_plans(Model.llama2_70b(), Batch(B=1536, b=1), Hardware.dgx_a100(nodes=64))
"""

from parlab.plan.costs import Memory, StepTime, plan_memory, plan_time
from parlab.plan.inputs import Batch, Hardware, Model
from parlab.plan.measure import Measured, check_plans, emulated_hardware, run_plan, trace_plan
from parlab.plan.planner import Plan, best_plans, grids, plans
from parlab.plan.table import format_table, plan_label, plan_table

__all__ = ["Batch", "Hardware", "Measured", "Model", "Memory", "Plan", "StepTime", "best_plans", "check_plans",
           "emulated_hardware", "format_table", "grids", "run_plan", "trace_plan",
           "plan_label", "plan_memory", "plan_table", "plan_time", "plans"]
