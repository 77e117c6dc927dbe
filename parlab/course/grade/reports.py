"""Grading for instructors: the results file an autograding platform reads, and a class's
submissions graded against their deadlines.

    parlab grade TOPIC --json                                 the results as JSON on stdout
    parlab grade TOPIC --impl DIR --results PATH              ... written to PATH
    parlab grade TOPIC --submissions DIR --reports OUT [--deadline WHEN] [--deadlines FILE] [--late-penalty P]

Results. ``results_json`` lays one grading run out as Gradescope's ``results.json`` (its
autograder specification: https://gradescope-autograders.readthedocs.io/en/latest/specs/):
``score`` (the points earned, after any late penalty), ``execution_time`` (seconds),
``output`` (a line on the whole submission) and ``tests``, one per task, each with ``name``
(the task), ``score``, ``max_score``, ``status`` ("passed" with full marks, else "failed"),
``output`` (why each failed test failed, and the hint command) and ``extra_data`` holding
every graded test (test, points, passed, reason). The top-level ``extra_data`` says what was
graded, the points earned and possible and, for a class, the submission's lateness. On
Gradescope, ``run_autograder`` runs ``parlab grade TOPIC --impl /autograder/submission
--results /autograder/results/results.json``.

A class. ``grade_submissions`` grades every submission in a folder: a subfolder per student
holding ``<topic>.py`` (the student is the folder's name), or a file ``<student>.py`` (that
student's ``<topic>.py``); names starting with "." or "_" and other files are skipped. Each
is graded as ``parlab grade`` grades one, in its own subprocess with every timeout: a run
that hangs or cannot start gives that student 0 points and the reason, and the next student
is graded. The students' code runs with your rights: grade untrusted work in a container.

Lateness, the rule. A submission's time is its file's modification time (copy with ``cp -p``
or unzip, which keep it). Its deadline is ``--deadline`` (ISO 8601 such as 2025-03-01T23:59,
local time unless it names a zone), or the student's line in the ``--deadlines`` file
(``student WHEN``, for extensions), which wins. A submission after its deadline is late by
whole days, rounded up (a minute late is a day late), and every report flags it; with
``--late-penalty P`` its points are multiplied by max(0, 1 - P x days): P = 0.1 takes a tenth
per day, all of it after ten days. The default, 0, flags late work without a penalty.

Reports, in the reports folder: ``<student>/results.json`` (the layout above),
``<student>/report.txt`` (the points table the student would see, under a line on
lateness) and ``summary.csv``, a row per student (``SUMMARY_COLUMNS``), which
``grade_submissions`` also returns.
"""

import csv
import json
import math
import shutil
import tempfile
import time
from datetime import datetime, timedelta
from pathlib import Path

from parlab.course.grade import (
    ROOT,
    TERMINAL_HINT,
    check_name,
    format_table,
    hint_pointer,
    reason_lines,
    run_grading,
    score,
)

SUMMARY_COLUMNS = ("student", "submitted", "deadline", "days_late", "earned", "possible", "score", "note")
_DAY = timedelta(days=1)


def results_json(results, graded, seconds, lateness=None, error=None):
    """The graded tests of ``run_grading`` (``graded``: what was graded, e.g. "collectives")
    as Gradescope's results.json, a dict; ``lateness`` is ``late_record``'s dict for a class,
    ``error`` the sentence of a run that could not finish (its tests are then missing)."""
    tasks = {}
    for test in results:
        tasks.setdefault(test["task"], []).append(test)
    tests = []
    for task, group in tasks.items():
        earned = score(group)
        reasons = [line.strip() for line in reason_lines(group)]
        tests.append({
            "name": task, "score": earned.earned, "max_score": earned.possible,
            "status": "passed" if earned.full_marks else "failed",
            "output": "\n".join(reasons) + hint_pointer(TERMINAL_HINT, task) if reasons
            else f"all {len(group)} tests passed",
            "extra_data": {"tests": [{key: test[key] for key in ("test", "points", "passed", "reason")}
                                     for test in group]},
        })
    total = score(results)
    factor = lateness["factor"] if lateness else 1.0
    output = f"{graded}: {total.earned:g} / {total.possible:g} points"
    if lateness:
        output += f"; {describe_lateness(lateness)}"
    if error:
        output += f"; grading did not finish: {error}"
    return {"score": round(total.earned * factor, 6), "execution_time": round(seconds), "output": output,
            "tests": tests,
            "extra_data": {"graded": graded, "earned": total.earned, "max_score": total.possible,
                           **({"lateness": lateness} if lateness else {})}}


def days_late(submitted, deadline):
    """Whole days from ``deadline`` to ``submitted``, rounded up: 0 on time (or when either
    is unknown), 1 from a second late to a day late, and so on."""
    if submitted is None or deadline is None or submitted <= deadline:
        return 0
    return math.ceil((submitted - deadline) / _DAY)


def late_record(submitted, deadline, penalty):
    """The lateness of a submission as JSON-ready data: submitted, deadline (ISO 8601 or
    None), days_late, penalty (the fraction taken per day) and factor, the points kept:
    max(0, 1 - penalty x days_late)."""
    days = days_late(submitted, deadline)
    return {"submitted": _iso(submitted), "deadline": _iso(deadline), "days_late": days,
            "penalty": penalty, "factor": max(0.0, 1.0 - penalty * days)}


def describe_lateness(lateness):
    """One line: "on time", "late by 2 days (points x 0.8)", "no deadline", "not submitted"."""
    if lateness["submitted"] is None:
        return "not submitted"
    if lateness["deadline"] is None:
        return "no deadline"
    days = lateness["days_late"]
    if not days:
        return "on time"
    kept = f" (points x {lateness['factor']:g})" if lateness["penalty"] else " (flagged, no penalty)"
    return f"late by {days} day{'s' if days > 1 else ''}{kept}"


def parse_time(text, what):
    """An ISO 8601 time from the command line or a deadlines file, as an aware datetime:
    local time unless ``text`` names a zone ("Z" is UTC). ``what`` says where it came from."""
    text = str(text).strip()
    try:  # Python 3.10 reads no "Z"
        when = datetime.fromisoformat(text[:-1] + "+00:00" if text.endswith("Z") else text)
    except ValueError:
        raise ValueError(f"{what}: {text!r} is not a time; write it in ISO 8601, such as 2025-03-01T23:59 "
                         "(local time) or 2025-03-01T23:59+01:00.") from None
    return when if when.tzinfo else when.astimezone()


def read_deadlines(path):
    """{student: deadline} from a file of ``student WHEN`` lines (``#`` starts a comment)."""
    deadlines = {}
    for number, line in enumerate(Path(path).read_text().splitlines(), start=1):
        fields = line.split("#", 1)[0].split()
        if not fields:
            continue
        if len(fields) != 2:
            raise ValueError(f"{path}, line {number}: write `student WHEN`, such as `alice 2025-03-03T23:59`, "
                             f"not {line.strip()!r}.")
        deadlines[fields[0]] = parse_time(fields[1], f"{path}, line {number}")
    return deadlines


def find_submissions(folder, topic):
    """{student: the file graded as their ``<topic>.py``} in ``folder``, by name: a
    subfolder's ``<topic>.py`` (which may be missing: graded as missing) or a file
    ``<student>.py``."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ValueError(f"there is no folder {str(folder)!r}: --submissions names the folder of the students' work.")
    found = {}
    for entry in sorted(folder.iterdir()):
        if entry.name.startswith((".", "_")) or not (entry.is_dir() or entry.suffix == ".py"):
            continue
        student = entry.name if entry.is_dir() else entry.stem
        if student in found:
            raise ValueError(f"{folder} holds both a folder and a file for {student!r}: keep one submission each.")
        found[student] = entry / f"{topic}.py" if entry.is_dir() else entry
    if not found:
        raise ValueError(f"{folder} holds no submission: put in a folder per student holding {topic}.py, "
                         "or a file <student>.py per student.")
    return found


def grade_submissions(name, folder, reports, deadline=None, deadlines=None, late_penalty=0.0, root=ROOT,
                      progress=print):
    """Grade topic ``name`` (or one task of it) for every submission in ``folder``
    (``find_submissions``), each against its deadline (``deadlines`` {student: datetime} wins
    over ``deadline``; None: no deadline) with ``late_penalty`` per day late; write the reports
    into ``reports`` and return the summary, a dict per student (``SUMMARY_COLUMNS``).
    ``progress`` gets a line as each student's grading starts and as each task finishes."""
    check_name(name, root)
    if name is None:
        raise ValueError("name the topic the submissions are for, e.g. parlab grade collectives --submissions DIR.")
    if not (isinstance(late_penalty, (int, float)) and 0 <= late_penalty <= 1):
        raise ValueError(f"the late penalty is the fraction of the points taken per day late, from 0 to 1 "
                         f"(0.1: a tenth a day); got {late_penalty!r}.")
    deadlines = deadlines or {}
    reports = Path(reports)
    students = {student: path for student, path in find_submissions(folder, name.partition(".")[0]).items()
                if path.parent.resolve() != reports.resolve()}  # the reports may be kept beside the work
    reports.mkdir(parents=True, exist_ok=True)
    summary = []
    for number, (student, path) in enumerate(students.items(), start=1):
        progress(f"{student} ({number} of {len(students)}): {path}")
        submitted = datetime.fromtimestamp(path.stat().st_mtime).astimezone() if path.is_file() else None
        lateness = late_record(submitted, deadlines.get(student, deadline), late_penalty)
        results, seconds, error = _grade_one(name, path, root, progress)
        document = results_json(results, name, seconds, lateness, error)
        (reports / student).mkdir(exist_ok=True)
        (reports / student / "results.json").write_text(json.dumps(document, indent=1) + "\n")
        table = format_table(results, f"{student}: {name}", path, TERMINAL_HINT)
        (reports / student / "report.txt").write_text(f"{document['output']}\n\n{table}\n")
        summary.append({"student": student, "submitted": lateness["submitted"], "deadline": lateness["deadline"],
                        "days_late": lateness["days_late"], "earned": document["extra_data"]["earned"],
                        "possible": document["extra_data"]["max_score"], "score": document["score"],
                        "note": describe_lateness(lateness) + (f"; grading did not finish: {error}" if error else "")})
    with open(reports / "summary.csv", "w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=SUMMARY_COLUMNS)
        writer.writeheader()
        writer.writerows(summary)
    return summary


def format_summary(summary, reports):
    """The summary as a table for people, a row per student, and where the reports are."""
    width = max(len("student"), *(len(row["student"]) for row in summary)) + 2
    lines = [f"{'student':<{width}}{'points':>12}  {'score':>8}  note"]
    lines += [f"{row['student']:<{width}}{row['earned']:>5g} / {row['possible']:<4g}  {row['score']:>8g}  {row['note']}"
              for row in summary]
    return "\n".join(lines + [f"reports: {reports}/<student>/results.json, report.txt; {reports}/summary.csv"])


def _grade_one(name, path, root, progress):
    """(graded tests, seconds, None) for the submission ``path``, or ([], seconds, why) when
    its grading run could not finish. A single file is graded from a folder of its own,
    under the topic's file name."""
    started = time.monotonic()
    graded_file = f"{name.partition('.')[0]}.py"
    with tempfile.TemporaryDirectory(prefix="parlab-submission-") as staging:
        impl = path.parent
        if path.name != graded_file:
            impl = Path(staging)
            shutil.copy2(path, impl / graded_file)
        try:
            results, error = run_grading(name, impl, root, progress=progress), None
        except RuntimeError as exc:  # the whole run timed out, or pytest could not start
            results, error = [], str(exc)
    return results, time.monotonic() - started, error


def _iso(when):
    return None if when is None else when.isoformat(timespec="seconds")
