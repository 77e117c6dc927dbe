"""Grade exercises: run the grading tests in a subprocess and print a points table.

    python -m parlab.grade [TOPIC[.TASK]] [--impl DIR]   every topic when none is named
    parlab.check("collectives.ring_allreduce")           the same from a notebook cell

``--impl`` is the directory whose ``<topic>.py`` is graded: ``exercises`` (yours, the
default) or ``solutions``. The table has one row per task, points earned out of points
possible, and under it one line per failed test saying why. The exit code is 0 only with
full marks.

The tests run in a subprocess (pytest with ``parlab.grading_plugin``), so a deadlocked or
crashing exercise never takes the notebook kernel down with it; every graded test has a
timeout, and a task whose first test hangs or raises NotImplementedError fails the rest at once.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from parlab.exercises import ROOT

# The whole run; each test has its own, much shorter, timeout (see parlab.grading_plugin).
GRADING_TIMEOUT_S = 600


@dataclass(frozen=True)
class Score:
    earned: float
    possible: float

    @property
    def full_marks(self):
        return self.possible > 0 and self.earned == self.possible


def check(name=None, impl="exercises", root=ROOT):
    """Grade topic ``name`` ("collectives"), one task of it ("collectives.ring_allreduce"),
    or every topic (None), and print the points table. Returns the ``Score``."""
    results = run_grading(name, impl, root)
    print(format_table(results, name or "all topics", impl))
    return score(results)


def grading_topics(root=ROOT):
    """The topics with grading tests: tests/grading/test_<topic>.py."""
    return sorted(path.stem[len("test_") :] for path in (Path(root) / "tests" / "grading").glob("test_*.py"))


def run_grading(name=None, impl="exercises", root=ROOT, timeout=GRADING_TIMEOUT_S):
    """Run the grading tests of ``name`` (topic, "topic.task" or None for all) on
    ``impl/<topic>.py``; return one dict per graded test: test, task, points, passed, reason."""
    root = Path(root)
    topic = name.split(".")[0] if name else None
    known = grading_topics(root)
    if topic is not None and topic not in known:
        listed = ", ".join(known) or "none"
        raise ValueError(f"there are no grading tests for {topic!r}; the topics are: {listed}.")
    impl_dir = _find_impl(impl, root)
    files = [f"tests/grading/test_{t}.py" for t in ([topic] if topic else known)]
    # Only the plugins grading needs: autoloading every installed one (nbval and the
    # Jupyter stack it imports) costs seconds per run.
    env = dict(os.environ, PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")
    with tempfile.TemporaryDirectory(prefix="parlab-grade-") as tmp:
        report_path = Path(tmp) / "report.json"
        command = [sys.executable, "-m", "pytest", *files, "-q", "-o", "addopts=", "-p", "no:cacheprovider"]
        command += ["-p", "pytest_timeout", "-p", "parlab.grading_plugin"]
        command += ["--impl", str(impl_dir), "--grade-report", str(report_path)]
        if name and name != topic:
            command += ["--grade-task", name]
        try:
            finished = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"grading did not finish within {timeout} s.") from None
        report = json.loads(report_path.read_text()) if report_path.exists() else None
    if report is not None and report["error"]:
        raise ValueError(report["error"])
    if report is None or finished.returncode not in (0, 1):  # 1: some tests failed
        output = (finished.stdout + finished.stderr).strip()[-3000:]
        raise RuntimeError(f"the grading tests could not run (pytest exited with {finished.returncode}):\n{output}")
    return report["tests"]


def _find_impl(impl, root):
    """The graded folder: ``impl`` as given, else relative to the repository (so that
    "exercises" works from a notebook running in notebooks/)."""
    for candidate in (Path(impl), root / impl):
        if candidate.is_dir():
            return candidate.resolve()
    raise ValueError(f"there is no folder {impl!r} here or in {root}: --impl names the folder of graded files.")


def score(results):
    return Score(
        earned=sum(test["points"] for test in results if test["passed"]),
        possible=sum(test["points"] for test in results),
    )


def format_table(results, title, impl):
    """The points table: a row per task (earned / possible), a reason per failed test."""
    tasks = {}
    for test in results:
        tasks.setdefault(test["task"], []).append(test)
    width = max([len("task"), len("total")] + [len(task) for task in tasks]) + 2
    total = score(results)
    lines = [f"{title}, graded on {impl}", f"{'task':<{width}}points"]
    for task, tests in tasks.items():
        task_score = score(tests)
        lines.append(f"{task:<{width}}{task_score.earned:g} / {task_score.possible:g}")
        lines += [f"    {test['test']}: {test['reason']}" for test in tests if not test["passed"]]
    verdict = "  full marks" if total.full_marks else ""
    lines.append(f"{'total':<{width}}{total.earned:g} / {total.possible:g}{verdict}")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m parlab.grade", description=__doc__.split("\n\n")[0])
    parser.add_argument("name", nargs="?", help='a topic ("collectives") or a task ("collectives.ring_allreduce")')
    parser.add_argument("--impl", default="exercises", help="the folder of graded files (default: exercises)")
    args = parser.parse_args(argv)
    try:
        result = check(args.name, args.impl)
    except (ValueError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0 if result.full_marks else 1


if __name__ == "__main__":
    sys.exit(main())
