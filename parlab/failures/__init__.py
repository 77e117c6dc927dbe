"""Surviving failures (lecture 10): lose a rank, find out why a job hangs, resume, and
choose how often to checkpoint.

- ``injection``: ``Faults(kill={rank: step}, hang={rank: step})``, called each step with
  ``.at(step)``: a rank SIGKILLs its own process or blocks for good;
- ``resume``: ZeRO stage 2 or FSDP training that checkpoints every I steps (``train``),
  ``reshard`` of a sharded checkpoint (ZeroDP stages 1-2, FSDP) for N' ranks, and
  ``train_with_failure``: uninterrupted against killed and resumed, on the same or fewer ranks;
- ``elastic``: the same under ``torchrun --max-restarts 1`` (``python -m parlab.failures.elastic``);
- ``young_daly``: the checkpoint interval of Young (1974) and Daly (2006), the goodput
  model and a simulation of runs with failures at a declared MTBF;
- ``hangs``: a collective that not every rank calls, what the runtime's stacks show,
  TORCH_DISTRIBUTED_DEBUG=DETAIL's fingerprint check and torch's flight recorder on gloo.

Symbols: I (the interval: compute time, or steps, between checkpoints), delta (the time to
write a checkpoint), t_R (the time to restart: new processes, rendezvous, loading the
checkpoint), Theta (the mean time between failures, MTBF, of the whole job).
"""

import importlib

_PUBLIC = {
    "Faults": "parlab.failures.injection",
    "train_with_failure": "parlab.failures.resume",
    "reshard": "parlab.failures.resume",
    "young_interval": "parlab.failures.young_daly",
    "daly_interval": "parlab.failures.young_daly",
    "goodput": "parlab.failures.young_daly",
    "goodput_curve": "parlab.failures.young_daly",
}


def __getattr__(name):
    # Imported on first use: a learner reading the interval's formulas should not pay for
    # importing the ZeRO engine.
    if name in _PUBLIC:
        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'parlab.failures' has no attribute {name!r}")


__all__ = list(_PUBLIC)
