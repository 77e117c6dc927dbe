"""Shared clusters: starting ranks costs seconds, so tests of the same world size share one.
Tests that break a cluster on purpose rely on it repairing itself, which they also check."""

import os
import sys

import pytest

import parlab

# The graded exercises' options (--impl, --grade-task, --grade-report), marks (task, points)
# and the impl fixture. pytest takes command-line options only from plugins and the root
# conftest, so the plugin is loaded here rather than in tests/grading/conftest.py.
pytest_plugins = ["parlab.course.grading_plugin"]


@pytest.hookimpl(trylast=True)  # after -k and -m have chosen the items
def pytest_collection_modifyitems(config, items):
    """Each lecture runs once. Where the browser test runs a lecture (it is chosen, and
    Chromium and playwright are here), it also makes nbval's check of the cells marked
    ``# NBVAL_CHECK_OUTPUT``, so nbval's own run of that lecture is left out.

    The browser test comes first: under ``pytest -n 2`` (pyproject.toml's addopts add
    ``--dist loadfile``) one process runs it from the start, the longest file by far, while
    the other runs the rest at a lower priority (``lower_priority_beside_the_lectures``)."""
    browsed = {item.callspec.params["lecture"] for item in items if _browses(item)}
    twice = {item for item in items if item.path.suffix == ".ipynb" and item.path.name in browsed}
    if twice:
        config.hook.pytest_deselected(items=list(twice))
        items[:] = [item for item in items if item not in twice]
    items.sort(key=lambda item: not _browses(item))
    config.stash[_BROWSING] = bool(browsed)


_BROWSING = pytest.StashKey[bool]()
# How much lower the other process's priority is: at nice 19 the kernel gives it under 2% of
# a core the lectures want (weights 15 against 1024), and every core they leave idle (their
# emulated links and devices sleep). Its clusters' timeouts count only the time their ranks
# had a CPU (parlab.runtime.cluster), and its emulated runs declare times long enough for a
# late wake-up not to matter.
BESIDE_THE_LECTURES = 19
_DECIDED = []


def _browses(item):
    return item.path.name == "test_browser.py" and item.module.CHROMIUM is not None


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    lower_priority_beside_the_lectures(item)


def lower_priority_beside_the_lectures(item):
    """In a pytest-xdist worker whose first test is not the browser test while another runs
    it: lower this process's priority and its children's (the clusters' fork server), so
    the lectures' measurements of time run as on a quiet machine. Once per process."""
    if _DECIDED or "PYTEST_XDIST_WORKER" not in os.environ:
        return
    _DECIDED.append(True)
    if not item.config.stash.get(_BROWSING, False) or _browses(item):
        return
    # Linux's autogroup schedules each session as one group, at the group's nice: in pytest's
    # session this process's nice would only count against JupyterLab, Chromium and the other
    # process. In a session of its own, its group's nice weighs against the lectures' kernels.
    try:
        os.setsid()
    except OSError:
        pass  # already a session's or a process group's leader
    os.nice(BESIDE_THE_LECTURES)
    try:
        with open("/proc/self/autogroup", "w") as group:
            group.write(str(os.getpriority(os.PRIO_PROCESS, 0)))
    except OSError:
        pass  # not Linux, or no autogroup
    for pid in _children():
        try:
            os.setpriority(os.PRIO_PROCESS, pid, os.getpriority(os.PRIO_PROCESS, pid) + BESIDE_THE_LECTURES)
        except OSError:
            pass


def _children():
    found = []
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # the process is gone
        if fields[1] == str(os.getpid()):
            found.append(int(entry))
    return found


@pytest.fixture(autouse=True)
def close_figures():
    """Every test leaves no open matplotlib figure behind (a test that never drew imports
    nothing: pyplot is closed only where some test has loaded it)."""
    yield
    pyplot = sys.modules.get("matplotlib.pyplot")
    if pyplot is not None:
        pyplot.close("all")


@pytest.fixture(scope="session")
def cluster2():
    with parlab.Cluster(world_size=2, timeout=60) as cluster:
        yield cluster


@pytest.fixture(scope="session")
def cluster4():
    with parlab.Cluster(world_size=4, timeout=60) as cluster:
        yield cluster


@pytest.fixture(scope="session")
def cluster8():
    with parlab.Cluster(world_size=8, timeout=120) as cluster:
        yield cluster
