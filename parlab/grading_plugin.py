"""pytest plugin for graded exercises: tasks and points, the implementation under test, and
a JSON report of every graded test for ``python -m parlab.grade``.

Loaded by ``tests/conftest.py`` (``pytest_plugins``) and by ``parlab.grade`` (``-p``).
A grading test file is ``tests/grading/test_<topic>.py``; one class per task:

    @pytest.mark.task("ring_allreduce")                  # the task "<topic>.ring_allreduce"
    class TestRingAllreduce:
        @pytest.mark.points(1)                           # each parametrized case counts once
        def test_matches_dist_all_reduce(self, cluster2, impl):
            cluster2.run(run_allreduce, impl.ring_allreduce, timeout=3)

``impl`` is the module ``<--impl DIR>/<topic>.py`` imported by path, never parlab's own
reference; it is registered with cloudpickle to travel by value, so its functions (and the
helpers they call) run on the cluster's ranks although the workers cannot import it.

Hangs and stubs. Every test with points runs under pytest-timeout (``GRADED_TEST_TIMEOUT_S``
unless it carries its own ``timeout`` mark); tests should also pass a short ``timeout`` to
``cluster.run``. Once a test of a task times out, or raises NotImplementedError, the task's
remaining tests fail at once ("not run: ... timed out", or the same NotImplementedError):
they would only fail the same way, and a hang costs the task its points, not the session
minutes. So the tests of a task should all call the task's function.

Options: ``--impl DIR`` (default ``solutions``), ``--grade-task NAME`` (run only the tests
of a task "topic.task" or of a topic), ``--grade-report PATH`` (write the JSON report).
"""

import hashlib
import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest

from parlab.runtime.errors import RankError, RankTimeout

# Covers the first test on a cluster that must start first (seconds on a busy machine).
GRADED_TEST_TIMEOUT_S = 60
_PYTEST_TIMEOUT = re.compile(r"^Timeout \(>(?P<seconds>[\d.]+)s\) from pytest-timeout")
_RESULTS = pytest.StashKey[dict]()
_GIVEN_UP = pytest.StashKey[dict]()  # task -> why its remaining tests fail at once
_ERROR = pytest.StashKey[str]()


def pytest_addoption(parser):
    group = parser.getgroup("parlab grading")
    group.addoption("--impl", metavar="DIR", help="grade DIR/<topic>.py (default: solutions)")
    group.addoption("--grade-task", metavar="NAME", help='run only the tests of a task "topic.task" or a topic')
    group.addoption("--grade-report", metavar="PATH", help="write every graded test's result to PATH as JSON")


def pytest_configure(config):
    config.addinivalue_line("markers", 'task(name): the exercise task a test grades, e.g. "ring_allreduce"')
    config.addinivalue_line("markers", "points(n): the points a graded test is worth")
    config.stash[_RESULTS] = {}
    config.stash[_GIVEN_UP] = {}


def grade_of(item):
    """(task "topic.name", points) of a graded test, or None for an ordinary test.
    Raises pytest.UsageError when a test has one of the two marks without the other."""
    task, points = item.get_closest_marker("task"), item.get_closest_marker("points")
    if task is None and points is None:
        return None
    if task is None or points is None:
        missing = "task" if task is None else "points"
        raise pytest.UsageError(f"{item.nodeid} has no @pytest.mark.{missing}(...): graded tests need both marks.")
    return f"{topic_of(item.path)}.{task.args[0]}", points.args[0]


def topic_of(path):
    """"collectives" for tests/grading/test_collectives.py."""
    name = Path(path).stem
    if not name.startswith("test_"):
        raise ValueError(f"{path}: a grading test file is named test_<topic>.py, after solutions/<topic>.py.")
    return name[len("test_") :]


def pytest_collection_modifyitems(config, items):
    graded = [(item, grade_of(item)) for item in items]
    for item, grade in graded:
        if grade and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(GRADED_TEST_TIMEOUT_S))
    wanted = config.getoption("grade_task")
    if not wanted:
        return
    selected = [item for item, grade in graded if grade and wanted in (grade[0], grade[0].split(".")[0])]
    if not selected:
        tasks = ", ".join(sorted({grade[0] for _, grade in graded if grade})) or "none"
        config.stash[_ERROR] = f"there is no task {wanted!r}; the tasks are: {tasks}."
        _write_report(config)
        raise pytest.UsageError(config.stash[_ERROR])
    config.hook.pytest_deselected(items=[item for item in items if item not in selected])
    items[:] = selected


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    grade = grade_of(item)
    if grade and grade[0] in item.config.stash[_GIVEN_UP]:
        pytest.fail(item.config.stash[_GIVEN_UP][grade[0]], pytrace=False)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    report = (yield).get_result()
    grade = grade_of(item)
    if grade is None:
        return
    results = item.config.stash[_RESULTS]
    record = results.setdefault(
        item.nodeid, {"test": item.name, "task": grade[0], "points": grade[1], "passed": False, "reason": None}
    )
    if report.when == "call" and report.passed:
        record["passed"] = True
    elif report.skipped and record["reason"] is None:
        record["reason"] = "skipped: " + str(report.longrepr[-1] if isinstance(report.longrepr, tuple) else "")
    elif report.failed:
        record["passed"] = False
        if record["reason"] is None:
            record["reason"] = failure_reason(call.excinfo) if call.excinfo else f"failed in {report.when}"
        if record["reason"].startswith("timed out"):
            item.config.stash[_GIVEN_UP][grade[0]] = f"not run: an earlier test of {grade[0]} timed out"
        elif record["reason"].startswith("NotImplementedError"):
            item.config.stash[_GIVEN_UP][grade[0]] = record["reason"]


def failure_reason(excinfo):
    """One line saying why a graded test failed, for the points table."""
    exc = excinfo.value
    if isinstance(exc, RankTimeout):
        ranks = ("rank " if len(exc.ranks) == 1 else "ranks ") + ", ".join(map(str, exc.ranks))
        return f"timed out after {exc.timeout:g} s ({ranks} still waiting: a send or recv without its match?)"
    if isinstance(exc, RankError):
        last_line = next(iter(exc.failures.values())).strip().splitlines()[-1:]
        if last_line and last_line[0].startswith("NotImplementedError"):
            return last_line[0]
        return _first_line(str(exc))
    if isinstance(exc, pytest.fail.Exception):
        match = _PYTEST_TIMEOUT.match(exc.msg)
        return f"timed out after {float(match['seconds']):g} s" if match else _first_line(exc.msg)
    if isinstance(exc, AssertionError):
        return _first_line(str(exc)) or "assertion failed"
    return f"{type(exc).__name__}: {_first_line(str(exc))}".rstrip(": ")


def _first_line(text):
    return text.strip().split("\n", 1)[0]


def pytest_sessionfinish(session):
    _write_report(session.config)


def _write_report(config):
    path = config.getoption("grade_report")
    if path:
        report = {"error": config.stash.get(_ERROR, None), "tests": list(config.stash[_RESULTS].values())}
        Path(path).write_text(json.dumps(report, indent=1))


@pytest.fixture(scope="module")
def impl(request):
    """The implementation under grade: ``<--impl DIR>/<topic>.py`` for the test file
    ``test_<topic>.py``, imported by path, its functions shipped to the ranks by value."""
    option = request.config.getoption("impl")
    impl_dir = request.config.invocation_params.dir / option if option else request.config.rootpath / "solutions"
    return load_implementation(topic_of(request.path), impl_dir)


def load_implementation(topic, impl_dir):
    """Import ``impl_dir/<topic>.py`` as a fresh module and register it with cloudpickle so
    that functions from it travel by value to worker processes that cannot import it."""
    import cloudpickle

    path = Path(impl_dir).resolve() / f"{topic}.py"
    if not path.is_file():
        raise ValueError(f"{path} does not exist: --impl names a directory holding {topic}.py, such as exercises.")
    # One name per file, so that two implementations of a topic can be loaded side by side.
    name = f"graded_{topic}_{hashlib.sha1(str(path).encode()).hexdigest()[:8]}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[name]
        raise ImportError(f"{path} could not be imported: {type(exc).__name__}: {exc}") from exc
    cloudpickle.register_pickle_by_value(module)
    return module
