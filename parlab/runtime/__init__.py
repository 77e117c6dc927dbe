"""The runtime: a persistent cluster of ranks (``Cluster``), one-shot ``launch``, and the
errors that name failing or stuck ranks. It knows nothing of the techniques built on it."""

from parlab.runtime.cluster import Cluster
from parlab.runtime.context import device
from parlab.runtime.errors import RankError, RankTimeout
from parlab.runtime.launch import launch

__all__ = ["Cluster", "RankError", "RankTimeout", "device", "launch"]
