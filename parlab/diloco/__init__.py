"""Low-communication training (lecture 10): DiLoCo and Streaming DiLoCo.

- ``outer``: ``DiLoCo``, H inner steps per replica, then an outer Nesterov step on the
  averaged pseudo-gradient; with fragments, overlap and a compressor, Streaming DiLoCo;
- ``schedule``: Streaming DiLoCo's strided fragments and staggered, delayed schedule;
- ``costs``: the alpha-beta model of a step of each method, where DiLoCo overtakes DDP
  (``crossover``), and the wall time to a target loss (the lecture's widget);
- ``training``: DDP, local SGD, DiLoCo and Streaming DiLoCo on one problem under one regime
  (``parlab bench diloco``).
"""

from parlab.diloco import schedule
from parlab.diloco.outer import DiLoCo

__all__ = ["DiLoCo", "schedule"]
