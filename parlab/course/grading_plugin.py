"""pytest plugin for graded exercises: tasks and points, the implementation under test, and
a JSON report of every graded test for ``parlab grade``.

Loaded by ``tests/conftest.py`` (``pytest_plugins``) and by ``parlab.course.grade`` (``-p``).
A grading test file is ``tests/grading/test_<topic>.py``; one class per task:

    @pytest.mark.task("ring_all_reduce")                  # the task "<topic>.ring_all_reduce"
    class TestRingAllreduce:
        @pytest.mark.points(1)                           # each parametrized case counts once
        def test_matches_dist_all_reduce(self, cluster2, impl):
            cluster2.run(run_all_reduce, impl.ring_all_reduce, timeout=3)

``impl`` is the module ``<--impl DIR>/<topic>.py`` imported by path, never parlab's own
reference; it is registered with cloudpickle to travel by value, so its functions (and the
helpers they call) run on the cluster's ranks although the workers cannot import it.

Hangs, stubs and aborts. Every test with points runs under pytest-timeout
(``GRADED_TEST_TIMEOUT_S`` unless it carries its own ``timeout`` mark); tests should also
pass a short ``timeout`` to ``cluster.run``. Once a test of a task times out, raises
NotImplementedError, or makes gloo abort a rank on a message of the wrong size, the task's
remaining tests fail at once ("not run: ...", or the same NotImplementedError): they would
only fail the same way, and each hang or abort costs a cluster restart. So the tests of a
task should all call the task's function.

A file that cannot be imported fails every test before any cluster starts, with one
sentence naming the file, the line and the error.

Options: ``--impl DIR`` (default ``solutions``), ``--grade-task NAME`` (run only the tests
of a task "topic.task" or of a topic), ``--grade-report PATH`` (write the JSON report),
``--grade-progress FD`` (write a line to file descriptor FD as each task finishes).
"""

import hashlib
import importlib.util
import json
import os
import re
import sys
import time
import traceback
from pathlib import Path

import pytest

from parlab.runtime.errors import RankError, RankTimeout, explain_size_mismatch
from parlab.runtime.process import prepare_workers

# Covers the first test on a cluster that must start first (seconds on a busy machine).
GRADED_TEST_TIMEOUT_S = 60
_PYTEST_TIMEOUT = re.compile(r"^Timeout \(>(?P<seconds>[\d.]+)s\) from pytest-timeout")
_RESULTS = pytest.StashKey[dict]()
_GIVEN_UP = pytest.StashKey[dict]()  # task -> why its remaining tests fail at once
_ERROR = pytest.StashKey[str]()
_IMPLEMENTATIONS = pytest.StashKey[dict]()  # topic -> module, or the sentence why it failed to import
_PROGRESS = pytest.StashKey[dict]()


def pytest_addoption(parser):
    group = parser.getgroup("parlab grading")
    group.addoption("--impl", metavar="DIR", help="grade DIR/<topic>.py (default: solutions)")
    group.addoption("--grade-task", metavar="NAME", help='run only the tests of a task "topic.task" or a topic')
    group.addoption("--grade-report", metavar="PATH", help="write every graded test's result to PATH as JSON")
    group.addoption("--grade-progress", metavar="FD", type=int, help="write a line to FD as each task finishes")


def pytest_configure(config):
    config.addinivalue_line("markers", 'task(name): the exercise task a test grades, e.g. "ring_all_reduce"')
    config.addinivalue_line("markers", "points(n): the points a graded test is worth")
    config.stash[_RESULTS] = {}
    config.stash[_GIVEN_UP] = {}
    config.stash[_IMPLEMENTATIONS] = {}
    fd = config.getoption("grade_progress")
    stream = os.fdopen(fd, "w", buffering=1) if fd is not None else None
    config.stash[_PROGRESS] = {"stream": stream, "task_of": {}, "last": {}, "started": {}, "width": 0}
    # Graded tests run on clusters: their workers' fork server loads torch while pytest collects,
    # on a core collection leaves idle. Not under pytest-xdist: its controller runs no test, and
    # its processes collect on every core at once (a process's first cluster starts the server).
    if not hasattr(config, "workerinput") and not getattr(config.option, "numprocesses", None):
        prepare_workers()


def pytest_unconfigure(config):
    stream = config.stash[_PROGRESS]["stream"]
    if stream is not None:
        stream.close()


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
    if wanted:
        selected = [item for item, grade in graded if grade and wanted in (grade[0], grade[0].split(".")[0])]
        if not selected:
            tasks = ", ".join(sorted({grade[0] for _, grade in graded if grade})) or "none"
            config.stash[_ERROR] = f"there is no task {wanted!r}; the tasks are: {tasks}."
            _write_report(config)
            raise pytest.UsageError(config.stash[_ERROR])
        config.hook.pytest_deselected(items=[item for item in items if item not in selected])
        items[:] = selected
    _plan_progress(config, items)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    grade = grade_of(item)
    if grade is None:
        return
    if grade[0] in item.config.stash[_GIVEN_UP]:
        pytest.fail(item.config.stash[_GIVEN_UP][grade[0]], pytrace=False)
    if "impl" in item.fixturenames:
        # Before the fixtures, so that a file that cannot be imported starts no cluster.
        loaded = _implementation(item.config, topic_of(item.path))
        if isinstance(loaded, str):
            pytest.fail(loaded, pytrace=False)


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
        elif call.excinfo and isinstance(call.excinfo.value, RankError) and _size_mismatch(call.excinfo.value):
            item.config.stash[_GIVEN_UP][grade[0]] = (
                f"not run: an earlier test of {grade[0]} sent a message of the wrong size"
            )


def failure_reason(excinfo):
    """One line saying why a graded test failed, for the points table."""
    exc = excinfo.value
    if isinstance(exc, RankTimeout):
        ranks = ("rank " if len(exc.ranks) == 1 else "ranks ") + ", ".join(map(str, exc.ranks))
        return f"timed out after {exc.timeout:g} s ({ranks} still waiting: a send or recv without its match?)"
    if isinstance(exc, RankError):
        if _size_mismatch(exc):
            return _size_mismatch(exc)
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


def _size_mismatch(exc):
    return explain_size_mismatch(exc.failures)


def _plan_progress(config, items):
    """Note the last test of each task, where its progress line is written."""
    progress = config.stash[_PROGRESS]
    tasks = {item.nodeid: grade[0] for item in items if (grade := grade_of(item))}
    progress.update(task_of=tasks, last={task: nodeid for nodeid, task in tasks.items()})
    progress["width"] = max(map(len, tasks.values()), default=0)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item):
    progress = item.config.stash[_PROGRESS]
    task = progress["task_of"].get(item.nodeid)
    if task is not None:
        progress["started"].setdefault(task, time.monotonic())
    yield
    if task is not None and progress["last"][task] == item.nodeid and progress["stream"] is not None:
        tests = [test for test in item.config.stash[_RESULTS].values() if test["task"] == task]
        passed = [test for test in tests if test["passed"]]
        points = f"{sum(test['points'] for test in passed):g} / {sum(test['points'] for test in tests):g} points"
        seconds = time.monotonic() - progress["started"][task]
        progress["stream"].write(
            f"{task:<{progress['width']}}  {len(passed)} / {len(tests)} tests, {points} ({seconds:.1f} s)\n"
        )


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
    loaded = _implementation(request.config, topic_of(request.path))
    if isinstance(loaded, str):
        pytest.fail(loaded, pytrace=False)
    return loaded


def _implementation(config, topic):
    """The module graded for ``topic``, imported once per session, or the sentence saying
    why it could not be."""
    loaded = config.stash[_IMPLEMENTATIONS]
    if topic not in loaded:
        option = config.getoption("impl")
        impl_dir = config.invocation_params.dir / option if option else config.rootpath / "solutions"
        try:
            loaded[topic] = load_implementation(topic, impl_dir)
        except (ImportError, ValueError) as exc:
            loaded[topic] = str(exc)
    return loaded[topic]


def load_implementation(topic, impl_dir):
    """Import ``impl_dir/<topic>.py`` as a fresh module and register it with cloudpickle so
    that functions from it travel by value to worker processes that cannot import it.
    Raises ImportError with one sentence (file, line, error) when the file fails to import."""
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
        raise ImportError(_import_failure(path, exc)) from exc
    cloudpickle.register_pickle_by_value(module)
    return module


def _import_failure(path, exc):
    """"<path>, line 3, could not be imported: NameError: name 'x' is not defined"."""
    if isinstance(exc, SyntaxError):
        line, error = exc.lineno, f"{type(exc).__name__}: {exc.msg}"
    else:
        frames = [frame for frame in traceback.extract_tb(exc.__traceback__) if frame.filename == str(path)]
        line, error = (frames[-1].lineno if frames else None), f"{type(exc).__name__}: {exc}"
    where = f"{path}, line {line}," if line else str(path)
    return f"{where} could not be imported: {error}"
