"""The planner's answer as a table: plain rows (a list of dicts, one per plan) and the same rows
as text, so a notebook, a test or a terminal reads them without pandas.

    rows = plan_table(plans(model, batch, hardware), n=5)
    print(format_table(rows))
    plan_label(plan)           # "8x1x1 Z1 rc": a plan in a few characters (rc: full recompute)

The columns of lecture 09's axes (cp, ep and their terms, context and experts) are left out
of the text where every row has cp = ep = 1: they would say only that the axes are unused.
"""

from parlab._checks import whole_number
from parlab.units import GIB

COLUMNS = ("N_d", "t", "K", "cp", "ep", "ZeRO", "S", "b", "M", "recompute", "offload", "GiB", "step (s)", "compute",
           "tensor", "pipeline", "context", "experts", "bubble", "data", "host", "verdict")
LECTURE_09 = {"cp": "cp", "ep": "ep", "context": "cp", "experts": "ep"}  # a column and the degree that uses it


def plan_label(plan, long=False):
    """A plan in a few characters, for a chart's point or a table's row: N_d x t x K and the
    ZeRO stage (cp2, ep4: the context- and expert-parallel degrees where above 1; S=:
    HYBRID_SHARD's shard group; rc: full recompute, sel: selective recompute; off: offload);
    ``long`` adds b and M."""
    axes = "".join(f" {axis}{degree}" for axis, degree in (("cp", plan.cp), ("ep", plan.ep)) if degree > 1)
    shard = f" S={plan.shard_group}" if plan.shard_group else ""
    micro = f" b={plan.b} M={plan.M}" if long else ""
    recompute = {None: "", "selective": " sel", "full": " rc"}[plan.recompute]
    return f"{plan.N_d}x{plan.t}x{plan.K}{axes} Z{plan.zero}{shard}{micro}{recompute}{' off' if plan.offload else ''}"


def plan_table(every, n=10, rejected=0):
    """Rows for the first ``n`` accepted plans of ``every`` (as ``plans`` ranks them) and the
    first ``rejected`` rejected ones: the plan's degrees, its memory per GPU in GiB, its step
    time and each term of it in seconds ("host": offload's), None where the plan cannot be
    built, and its verdict: "accepted" or its reasons."""
    whole_number("n", n, "give how many accepted plans to show, e.g. n=10.", minimum=0)
    whole_number("rejected", rejected, "give how many rejected plans to show, e.g. rejected=3.", minimum=0)
    shown = [p for p in every if not p.rejected][:n] + [p for p in every if p.rejected][:rejected]
    return [_row(p) for p in shown]


def format_table(rows):
    """``rows`` (from ``plan_table``) as fixed-width text, one line per plan under a header;
    the verdict, last, keeps its whole sentence."""
    columns = [column for column in COLUMNS
               if column not in LECTURE_09 or any(row[LECTURE_09[column]] > 1 for row in rows)]
    cells = [[_cell(row[column]) for column in columns] for row in rows]
    widths = [max([len(column)] + [len(line[i]) for line in cells]) for i, column in enumerate(columns[:-1])]
    lines = [columns] + cells
    return "\n".join("  ".join([*(c.rjust(w) for c, w in zip(line, widths)), line[-1]]) for line in lines)


def _row(plan):
    row = {"N_d": plan.N_d, "t": plan.t, "K": plan.K, "cp": plan.cp, "ep": plan.ep, "ZeRO": plan.zero,
           "S": plan.shard_group, "b": plan.b, "M": plan.M,
           "recompute": plan.recompute or "off", "offload": "on" if plan.offload else "off",
           "GiB": None if plan.memory is None else plan.memory.total / GIB,
           "step (s)": None if plan.time is None else plan.time.total}
    for term in ("compute", "tensor", "pipeline", "context", "experts", "bubble", "data"):
        row[term] = None if plan.time is None else getattr(plan.time, term)
    row["host"] = None if plan.time is None else plan.time.offload
    row["verdict"] = " ".join(plan.reasons) or "accepted"
    return row


def _cell(value):
    if value is None:
        return "-"
    return f"{value:.3g}" if isinstance(value, float) else str(value)
