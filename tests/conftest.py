"""Shared clusters: starting ranks costs seconds, so tests of the same world size share one.
Tests that break a cluster on purpose rely on it repairing itself, which they also check."""

import sys

import pytest

import parlab

# The graded exercises' options (--impl, --grade-task, --grade-report), marks (task, points)
# and the impl fixture. pytest takes command-line options only from plugins and the root
# conftest, so the plugin is loaded here rather than in tests/grading/conftest.py.
pytest_plugins = ["parlab.grading_plugin"]


@pytest.hookimpl(trylast=True)  # after -k and -m have chosen the items
def pytest_collection_modifyitems(config, items):
    """Each lecture runs once. Where the browser test runs a lecture (it is chosen, and
    Chromium and playwright are here), it also makes nbval's check of the cells marked
    ``# NBVAL_CHECK_OUTPUT``, so nbval's own run of that lecture is left out."""
    browsed = {item.callspec.params["lecture"] for item in items
               if item.path.name == "test_browser.py" and item.module.CHROMIUM is not None}
    twice = {item for item in items if item.path.suffix == ".ipynb" and item.path.name in browsed}
    if twice:
        config.hook.pytest_deselected(items=list(twice))
        items[:] = [item for item in items if item not in twice]


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
