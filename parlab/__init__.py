"""parlab: parallel and distributed deep-learning training, built from scratch on
torch.distributed, for learning.

    import parlab
    with parlab.Cluster(world_size=4) as cluster:
        results = cluster.run(fn)
"""

from parlab import trace
from parlab.runtime import Cluster, RankError, RankTimeout, device, launch

__version__ = "0.1.0"
__all__ = ["Cluster", "RankError", "RankTimeout", "check", "device", "launch", "trace"]


def __getattr__(name):
    # parlab.check is imported on first use: importing parlab.grade here would make
    # `python -m parlab.grade` find its own module already imported (runpy warns).
    if name == "check":
        from parlab.grade import check

        return check
    raise AttributeError(f"module 'parlab' has no attribute {name!r}")
