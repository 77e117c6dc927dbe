"""``parlab grade`` and ``parlab hint``, the grading commands (``parlab.cli`` registers them;
``python -m parlab.course.grade`` is ``parlab grade``, and keeps ``--hint TASK`` for ``parlab hint``).

    parlab grade [TOPIC[.TASK]] [--impl DIR]   grade exercises/<topic>.py (every topic when none is named)
    parlab grade TOPIC --json                  the same as JSON on stdout, progress and table on stderr
    parlab grade TOPIC --results PATH          the JSON written to PATH too (an autograder's results.json)
    parlab grade TOPIC --submissions DIR --reports OUT [--deadline WHEN] [--deadlines FILE] [--late-penalty P]
                                               a class: one report per student and a summary
    parlab hint TOPIC.TASK [--level L]         a hint for a task; without a task, the tasks

Exit codes: 0 with full marks (for a class: when every student was graded), 1 with points
missing, 2 when nothing could be graded (a misspelt name, a missing folder, a run that did
not finish), with a sentence on stderr. The JSON layout and the class's rules (deadlines,
lateness, reports): ``parlab.course.grade.reports``.
"""

import argparse
import json
import sys
import time
from pathlib import Path

from parlab.course.exercises import HINT_LEVELS, hint_tasks, hint_text
from parlab.course.grade import TERMINAL_HINT, check, grade_and_print, score
from parlab.course.grade.reports import format_summary, grade_submissions, parse_time, read_deadlines, results_json

GRADE_SUMMARY = "Grade your exercises: a points table, with why each lost point was lost."
HINT_SUMMARY = "Print one of the three hints of an exercise task: a nudge, the plan, a sketch close to the solution."
_CLASS_OPTIONS = ("reports", "deadline", "deadlines", "late_penalty")


def add_grade_arguments(parser):
    parser.add_argument("name", nargs="?", metavar="TOPIC[.TASK]",
                        help='a topic ("collectives") or one of its tasks ("collectives.ring_all_reduce"); '
                             "every topic when left out")
    parser.add_argument("--impl", metavar="DIR",
                        help="the folder whose <topic>.py is graded (default: exercises, yours)")
    parser.add_argument("--json", action="store_true",
                        help="print the result as JSON on stdout (Gradescope's results.json layout: points and "
                             "feedback per task); progress and the table go to stderr")
    parser.add_argument("--results", metavar="PATH",
                        help="also write that JSON to PATH, e.g. /autograder/results/results.json on Gradescope")
    group = parser.add_argument_group("grading a class (the rules: parlab.course.grade.reports)")
    group.add_argument("--submissions", metavar="DIR",
                       help="grade every submission in DIR: a folder per student holding <topic>.py, or a file "
                            "<student>.py per student")
    group.add_argument("--reports", metavar="OUT",
                       help="where each student's results.json and report.txt and the summary.csv go "
                            "(needed with --submissions)")
    group.add_argument("--deadline", metavar="WHEN",
                       help="everyone's deadline, ISO 8601 such as 2025-03-01T23:59 (local time unless a zone is "
                            "given); a submission's time is its file's modification time")
    group.add_argument("--deadlines", metavar="FILE",
                       help="a line 'student WHEN' for each student whose deadline differs (extensions); it wins "
                            "over --deadline")
    group.add_argument("--late-penalty", type=float, metavar="P",
                       help="the fraction of the points taken per day late (a day late from its first second), "
                            "0 to 1; default 0: late work is flagged, not penalised")


def run_grade(args):
    """``parlab grade`` with the parsed ``args``; returns the exit code."""
    try:
        if args.submissions is not None:
            return _grade_class(args)
        given = [f"--{option.replace('_', '-')}" for option in _CLASS_OPTIONS if getattr(args, option) is not None]
        if given:
            raise ValueError(f"{', '.join(given)} grade a class: give --submissions DIR too.")
        impl = args.impl or "exercises"
        if not (args.json or args.results):
            return 0 if check(args.name, impl, hint=TERMINAL_HINT).full_marks else 1
        return _grade_to_json(args.name, impl, args.json, args.results)
    except (ValueError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def _grade_to_json(name, impl, to_stdout, path):
    """Grade as ``check`` does, the table on stderr when the JSON goes to stdout; write the
    JSON to ``path`` too. A run that could not finish still writes its file, saying why."""
    started = time.monotonic()
    try:
        results, error = grade_and_print(name, impl, file=sys.stderr if to_stdout else sys.stdout), None
    except RuntimeError as exc:
        if path is None:
            raise
        results, error = [], str(exc)
    document = results_json(results, name or "all topics", time.monotonic() - started, error=error)
    text = json.dumps(document, indent=1)
    if path is not None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(text + "\n")
    if to_stdout:
        print(text)
    if error:
        raise RuntimeError(error)
    return 0 if score(results).full_marks else 1


def _grade_class(args):
    if args.results is not None or args.impl is not None:
        raise ValueError("with --submissions each student's folder or file is graded and their results.json goes "
                         "to --reports: leave out --impl and --results.")
    if args.reports is None:
        raise ValueError("--submissions needs --reports OUT: the folder where each student's report goes.")
    deadline = None if args.deadline is None else parse_time(args.deadline, "--deadline")
    deadlines = {} if args.deadlines is None else read_deadlines(args.deadlines)
    out = sys.stderr if args.json else sys.stdout
    summary = grade_submissions(args.name, args.submissions, args.reports, deadline, deadlines,
                                args.late_penalty or 0.0, progress=lambda line: print(line, file=out, flush=True))
    print(json.dumps(summary, indent=1) if args.json else format_summary(summary, args.reports))
    return 0


def add_hint_arguments(parser):
    parser.add_argument("task", nargs="?", metavar="TOPIC.TASK",
                        help='the task, such as "collectives.ring_reduce_scatter"; without one, the tasks')
    parser.add_argument("--level", type=int, default=1,
                        help=f"which hint, 1 to {len(HINT_LEVELS)}: {', '.join(HINT_LEVELS)} (default: 1)")


def run_hint(args):
    """``parlab hint``: hint ``args.level`` of ``args.task`` and the command for the next one,
    or every task that has hints."""
    if args.task is None:
        print("Tasks with hints (parlab hint TOPIC.TASK):\n" + "\n".join(f"    {task}" for task in hint_tasks()))
        return 0
    try:
        print(hint_text(args.task, args.level))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.level < len(HINT_LEVELS):
        print(f"\nNext, {HINT_LEVELS[args.level]}: {TERMINAL_HINT.format(task=args.task)} --level {args.level + 1}")
    return 0


def main(argv=None):
    """``python -m parlab.course.grade``: ``parlab grade``, and ``--hint TASK`` (a task, or a task of
    the topic named) for ``parlab hint TASK``."""
    parser = argparse.ArgumentParser(prog="python -m parlab.course.grade", description=GRADE_SUMMARY)
    add_grade_arguments(parser)
    parser.add_argument("--hint", metavar="TASK", help="print a hint for TASK instead of grading (as parlab hint)")
    parser.add_argument("--level", type=int, default=1, help=f"with --hint: which hint, 1 to {len(HINT_LEVELS)}")
    args = parser.parse_args(argv)
    if args.hint is None:
        return run_grade(args)
    task = args.hint if "." in args.hint or not args.name else f"{args.name}.{args.hint}"
    return run_hint(argparse.Namespace(task=task, level=args.level))
