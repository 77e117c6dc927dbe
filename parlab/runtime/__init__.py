"""The runtime: a persistent cluster of ranks (``Cluster``), one-shot ``launch``, the errors
that name failing or stuck ranks, and the time the ranks run in (real, or emulated links and
devices: ``Link``, ``Nodes``, ``Devices``, ``Straggler``). It knows nothing of the
techniques built on it."""

from parlab.runtime.cluster import Cluster
from parlab.runtime.context import device
from parlab.runtime.emulation import Devices, Link, Nodes, Straggler
from parlab.runtime.errors import RankError, RankTimeout
from parlab.runtime.launch import launch

__all__ = ["Cluster", "Devices", "Link", "Nodes", "RankError", "RankTimeout", "Straggler", "device", "launch"]
