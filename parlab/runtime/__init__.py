"""The runtime: a persistent cluster of ranks (``Cluster``), one-shot ``launch``, the errors
that name failing or stuck ranks, the time the ranks run in (real, or emulated links and
devices: ``Link``, ``Nodes``, ``Devices``, ``Straggler``), and the ranks as a ``Mesh`` with one
axis per parallelism. It knows nothing of the techniques built on it."""

from parlab.runtime.cluster import Cluster
from parlab.runtime.context import device
from parlab.runtime.emulation import Devices, Link, Nodes, Straggler
from parlab.runtime.errors import RankError, RankTimeout
from parlab.runtime.launch import launch
from parlab.runtime.mesh import Mesh

__all__ = ["Cluster", "Devices", "Link", "Mesh", "Nodes", "RankError", "RankTimeout", "Straggler", "device", "launch"]
