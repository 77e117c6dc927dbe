"""Grading tests: ``test_<topic>.py`` grades ``<--impl DIR>/<topic>.py`` (see
``parlab.course.grading_plugin``): one class per task, marked ``task``, each test marked ``points``.

Clusters: ``cluster2`` and ``cluster4`` come from tests/conftest.py; ``cluster3`` is started
here, once per session. Parametrize the ``cluster`` fixture indirectly with a world size to
run a test at several.
"""

from pathlib import Path

import pytest

import parlab


@pytest.fixture(scope="session")
def cluster3():
    with parlab.Cluster(world_size=3, timeout=60) as cluster:
        yield cluster


@pytest.fixture
def cluster(request):
    """The shared cluster of ``request.param`` ranks (2, 3 or 4)."""
    return request.getfixturevalue(f"cluster{request.param}")


def pytest_collection_modifyitems(items):
    here = Path(__file__).parent
    for item in items:
        if here in item.path.parents and item.get_closest_marker("points") is None:
            raise pytest.UsageError(f"{item.nodeid} grades nothing: mark it with @pytest.mark.points(n).")
