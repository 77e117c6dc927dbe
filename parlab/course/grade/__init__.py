"""Grade exercises: run the grading tests in a subprocess and print a points table.

    parlab grade [TOPIC[.TASK]] [--impl DIR]      every topic when none is named
    parlab hint TOPIC.TASK [--level L]            a hint for a task, one level at a time
    parlab.check("collectives.ring_all_reduce")    grading from a notebook cell (parlab.hint for hints)

``--impl`` is the directory whose ``<topic>.py`` is graded: ``exercises`` (yours, the
default) or ``solutions``. The table has one row per task, points earned out of points
possible, and under it one line per failed test saying why, which ends with where to get a
hint for that task (``parlab.course.exercises.hint``). The exit code is 0 only with full marks.
``python -m parlab.course.grade`` is the same command (``parlab.course.grade.command``); what instructors
use (``--json``, the results file of an autograding platform, a class's submissions with
deadlines) is in ``parlab.course.grade.reports``.

The tests run in a subprocess (pytest with ``parlab.course.grading_plugin``), so a deadlocked or
crashing exercise never takes the notebook kernel down with it; every graded test has a
timeout, and a task whose first test hangs, raises NotImplementedError or sends a message of
the wrong size fails the rest at once. A misspelt topic or task is refused, naming the
closest one, before anything starts. A line on stdout (never stderr: a notebook shows stderr
as an error) reports each task as it finishes.
"""

import ast
import json
import os
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

from parlab.course.exercises import ROOT, refuse_name
from parlab.runtime.process import start_module

# The whole run; each test has its own, much shorter, timeout (see parlab.course.grading_plugin).
GRADING_TIMEOUT_S = 600
# Where the table sends a learner for a hint, from a notebook and from a terminal.
NOTEBOOK_HINT = 'parlab.hint("{task}")'
TERMINAL_HINT = "parlab hint {task}"


@dataclass(frozen=True)
class Score:
    earned: float
    possible: float

    @property
    def full_marks(self):
        return self.possible > 0 and self.earned == self.possible


def check(name=None, impl="exercises", root=ROOT, hint=NOTEBOOK_HINT):
    """Grade topic ``name`` ("collectives"), one task of it ("collectives.ring_all_reduce"),
    or every topic (None), printing a line per task as it finishes, then the points table,
    whose reasons end with ``hint`` (the task in place of ``{task}``). Returns the ``Score``.
    A name that is no topic or task raises ValueError naming the closest, before grading."""
    return score(grade_and_print(name, impl, root, hint))


def grade_and_print(name=None, impl="exercises", root=ROOT, hint=TERMINAL_HINT, file=None):
    """What ``check`` does, printed to ``file`` (default: stdout): a line saying what is
    graded, a line per task as it finishes, the points table. Returns the graded tests
    (``run_grading``)."""
    file = file or sys.stdout
    check_name(name, root)
    print(f"grading {name or 'all topics'} on {impl} ...", file=file, flush=True)
    results = run_grading(name, impl, root, progress=lambda line: print(line, file=file, flush=True))
    print(format_table(results, name or "all topics", impl, hint), file=file, flush=True)
    return results


def grading_topics(root=ROOT):
    """The topics with grading tests: tests/grading/test_<topic>.py."""
    return sorted(path.stem[len("test_") :] for path in (Path(root) / "tests" / "grading").glob("test_*.py"))


def grading_tasks(topic, root=ROOT):
    """The tasks of ``topic``'s grading tests, "topic.task" in the file's order: the names
    in its ``@pytest.mark.task(...)`` marks, read without importing the file."""
    tree = ast.parse((Path(root) / "tests" / "grading" / f"test_{topic}.py").read_text())
    marks = [node for node in ast.walk(tree) if isinstance(node, ast.Call) and node.args
             and ast.unparse(node.func) == "pytest.mark.task" and isinstance(node.args[0], ast.Constant)]
    marks.sort(key=lambda node: node.lineno)
    return list(dict.fromkeys(f"{topic}.{node.args[0].value}" for node in marks))


def check_name(name, root=ROOT):
    """Refuse, before anything runs, a ``name`` that is neither a topic with grading tests
    nor one of their tasks: ValueError naming the closest (None, every topic, passes)."""
    if name is None:
        return
    if not isinstance(name, str):
        raise ValueError(f"name a topic or a task as text, such as 'collectives' or 'collectives.ring_all_reduce', "
                         f"not {name!r}.")
    topic = name.partition(".")[0]
    topics = grading_topics(root)
    tasks = [task for known in topics for task in grading_tasks(known, root)]
    if topic not in topics or ("." in name and name not in tasks):
        raise ValueError(refuse_name(name, tasks))


def run_grading(name=None, impl="exercises", root=ROOT, timeout=GRADING_TIMEOUT_S, progress=None):
    """Run the grading tests of ``name`` (topic, "topic.task" or None for all) on
    ``impl/<topic>.py``; return one dict per graded test: test, task, points, passed, reason.
    ``progress`` is called with a line of text (task, tests and points) as each task finishes.
    A misspelt ``name`` or a missing ``impl`` raises ValueError before pytest starts; a run
    past ``timeout`` seconds, or one pytest could not start, raises RuntimeError."""
    root = Path(root)
    check_name(name, root)
    topic = name.split(".")[0] if name else None
    known = grading_topics(root)
    impl_dir = _find_impl(impl, root)
    files = [f"tests/grading/test_{t}.py" for t in ([topic] if topic else known)]
    # Only the plugins grading needs: autoloading every installed one (nbval and the
    # Jupyter stack it imports) costs seconds per run. (The ranks dump their own stacks when
    # gloo aborts one, see parlab.runtime.worker: its hint names the line it was receiving at.)
    env = dict(os.environ, PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")
    # Nor the options of the pytest around it (PYTEST_ADDOPTS="-n 3" names a plugin not loaded here).
    env.pop("PYTEST_ADDOPTS", None)
    # The report and pytest's output go to files without a name, so that nothing is left on
    # disk whatever ends this process (a kernel restart is a SIGKILL): pytest writes the
    # report through /dev/fd/N, the descriptor it inherits.
    with tempfile.TemporaryFile("w+") as report_file, tempfile.TemporaryFile("w+") as log:
        progress_read, progress_write = os.pipe()
        command = [*files, "-q", "-o", "addopts=", "-p", "no:cacheprovider"]
        command += ["-p", "pytest_timeout", "-p", "parlab.course.grading_plugin"]
        command += ["--impl", str(impl_dir), "--grade-report", f"/dev/fd/{report_file.fileno()}"]
        command += ["--grade-progress", str(progress_write)]
        if name and name != topic:
            command += ["--grade-task", name]
        # A fork of this process's fork server (torch loaded), whose clusters fork their
        # workers from it too; else a fresh interpreter.
        try:
            pytest_process = start_module("pytest", command, env, root, log,
                                          pass_fds=(progress_write, report_file.fileno()))
        finally:
            os.close(progress_write)
        finished = _follow(pytest_process, progress_read, timeout, progress or (lambda line: None))
        report_text, output = _read_back(report_file), _read_back(log)
    report = json.loads(report_text) if report_text else None
    if not finished:
        raise RuntimeError(f"grading did not finish within {timeout} s.")
    if report is not None and report["error"]:
        raise ValueError(report["error"])
    if report is None or pytest_process.returncode not in (0, 1):  # 1: some tests failed
        code = pytest_process.returncode
        raise RuntimeError(f"the grading tests could not run (pytest exited with {code}):\n{output.strip()[-3000:]}")
    return report["tests"]


def _follow(process, progress_fd, timeout, progress):
    """Pass each progress line to ``progress`` (in this thread: a notebook shows what this
    thread prints in the running cell) until pytest exits; kill it after ``timeout`` seconds.
    Returns whether it finished in time."""
    timed_out = threading.Event()

    def stop():
        timed_out.set()
        process.kill()

    timer = threading.Timer(timeout, stop)
    timer.start()
    try:
        with os.fdopen(progress_fd) as lines:  # ends when pytest exits and its end closes
            for line in lines:
                progress(line.rstrip("\n"))
        process.wait()
    except BaseException:  # Ctrl-C or a failing callback: pytest must not run on alone
        process.kill()
        process.wait()
        raise
    finally:
        timer.cancel()
    return not timed_out.is_set()


def _read_back(file):
    file.seek(0)
    return file.read()


def _find_impl(impl, root):
    """The graded folder: ``impl`` as given, else relative to the repository (so that
    "exercises" works from a notebook running in notebooks/)."""
    for candidate in (Path(impl), root / impl):
        if candidate.is_dir():
            return candidate.resolve()
    raise ValueError(f"there is no folder {impl!r} here or in {root}: --impl names the folder of graded files.")


def score(results):
    """The ``Score`` of graded tests: the points of those passed, out of all their points."""
    return Score(
        earned=sum(test["points"] for test in results if test["passed"]),
        possible=sum(test["points"] for test in results),
    )


def format_table(results, title, impl, hint=None):
    """The points table: a row per task (earned / possible), why each failed test failed. A
    reason every test shares (a file that does not import) is said once, above the table;
    one that several tests of a task share, once under the task. With ``hint`` (a text with
    ``{task}``, e.g. ``NOTEBOOK_HINT``) each reason line ends with where that task's hints are."""
    tasks = {}
    for test in results:
        tasks.setdefault(test["task"], []).append(test)
    width = max([len("task"), len("total")] + [len(task) for task in tasks]) + 2
    total = score(results)
    lines = [f"{title}, graded on {impl}"]
    shared = _shared_reason(results)
    if shared and len(results) > 1:
        task = next(iter(tasks)) if len(tasks) == 1 else None
        lines.append(f"every test: {shared}{hint_pointer(hint, task)}")
    lines.append(f"{'task':<{width}}points")
    for task, tests in tasks.items():
        task_score = score(tests)
        lines.append(f"{task:<{width}}{task_score.earned:g} / {task_score.possible:g}")
        if not (shared and len(results) > 1):
            lines += reason_lines(tests, hint_pointer(hint, task))
    verdict = "  full marks" if total.full_marks else ""
    lines.append(f"{'total':<{width}}{total.earned:g} / {total.possible:g}{verdict}")
    return "\n".join(lines)


def reason_lines(tests, pointer=""):
    """A line per reason the failed ``tests`` give: "    test: reason" or "    3 tests: reason",
    each followed by ``pointer``."""
    named = {}
    for test in tests:
        if not test["passed"]:
            named.setdefault(test["reason"], []).append(test["test"])
    return [f"    {names[0] if len(names) == 1 else f'{len(names)} tests'}: {why}{pointer}"
            for why, names in named.items()]


def hint_pointer(hint, task):
    """" [hint: parlab.hint("topic.task")]", or for a reason shared by several tasks, the form
    to use with any of them; "" without ``hint``."""
    if hint is None:
        return ""
    if task is None:
        return f" [hints: {hint.format(task='TASK')}, TASK a task below]"
    return f" [hint: {hint.format(task=task)}]"


def _shared_reason(tests):
    """The reason every one of ``tests`` failed for, when they all failed for the same one."""
    reasons = {None if test["passed"] else test["reason"] for test in tests}
    return reasons.pop() if len(reasons) == 1 else None
