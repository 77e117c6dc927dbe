"""parlab: parallel and distributed deep-learning training, built from scratch on
torch.distributed, for learning.

    import parlab
    with parlab.Cluster(world_size=4) as cluster:
        results = cluster.run(fn)

Every module of the package is reachable from here (``parlab.collectives``, ``parlab.zero``,
...), imported on first use: ``import parlab`` itself stays quick and does not load torch.
"""

import functools
import importlib

from parlab.runtime import Cluster, Devices, Link, Mesh, Nodes, RankError, RankTimeout, Straggler, device, launch

__version__ = "0.1.0"
__all__ = ["Cluster", "Devices", "Link", "Mesh", "Nodes", "RankError", "RankTimeout", "Straggler", "check", "device",
           "hint", "launch", "show"]

# The plumbing of the `parlab` command and of pytest; every other module is for learners.
_PLUMBING = {"__main__", "cli"}


@functools.cache
def _submodules():
    """The package's public modules, found on disk so that a new one needs no list here
    (a name starting with "_", such as ``_checks``, is private)."""
    import pkgutil

    names = (module.name for module in pkgutil.iter_modules(__path__))
    return frozenset(name for name in names if name not in _PLUMBING and not name.startswith("_"))


def __getattr__(name):
    # Imported on first use: `import parlab` stays quick (it loads neither torch nor the grader).
    if name in _submodules():
        return importlib.import_module(f"parlab.{name}")
    if name == "check":
        from parlab.course.grade import check

        return check
    if name == "hint":
        from parlab.course.exercises import hint

        return hint
    if name == "show":
        from parlab.course.source import show

        return show
    raise AttributeError(f"module 'parlab' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__) | _submodules())
