"""Shared clusters: starting ranks costs seconds, so tests of the same world size share one.
Tests that break a cluster on purpose rely on it repairing itself, which they also check."""

import pytest

import parlab


@pytest.fixture(scope="session")
def cluster2():
    with parlab.Cluster(world_size=2, timeout=60) as cluster:
        yield cluster


@pytest.fixture(scope="session")
def cluster4():
    with parlab.Cluster(world_size=4, timeout=60) as cluster:
        yield cluster


# --- Graded exercises (added by the grading machinery) -----------------------------------
# parlab.grading_plugin registers --impl, --grade-task and --grade-report, the task and
# points marks and the impl fixture; pytest takes command-line options only from plugins
# and the root conftest, so it is loaded here.
pytest_plugins = ["parlab.grading_plugin"]
