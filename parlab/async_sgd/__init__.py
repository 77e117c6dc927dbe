"""Asynchronous, local and decentralised SGD (lecture 06): what synchronisation costs and
three ways to pay less of it.

- ``parameter_server``: asynchronous SGD through server ranks; staleness tau recorded,
  bounded staleness as an option;
- ``backup``: synchronous SGD that waits for its slowest worker, and backup workers (run
  N + e, use the first N);
- ``local_sgd``: average the replicas every H steps (torch's PeriodicModelAverager schedule);
- ``gossip``: D-PSGD on a graph: mixing matrices, rho, one gossip step, consensus distance;
- ``theory``: the numbers to measure against (delayed gradient descent's stability
  threshold, the harmonic-number step time of backup workers).
"""

from parlab.async_sgd import gossip, local_sgd, parameter_server, theory

__all__ = ["gossip", "local_sgd", "parameter_server", "theory"]
