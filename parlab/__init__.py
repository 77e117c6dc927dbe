"""parlab: parallel and distributed deep-learning training, built from scratch on
torch.distributed, for learning.

    import parlab
    with parlab.Cluster(world_size=4) as cluster:
        results = cluster.run(fn)
"""

from parlab import trace
from parlab.grade import check
from parlab.runtime import Cluster, RankError, RankTimeout, device, launch

__version__ = "0.1.0"
__all__ = ["Cluster", "RankError", "RankTimeout", "check", "device", "launch", "trace"]
