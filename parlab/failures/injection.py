"""Fault injection: a rank dies or hangs at a chosen step of a training loop.

    faults = Faults(kill={2: 5}, hang={1: 7})      # rank 2 dies at step 5, rank 1 hangs at step 7
    for step in range(steps):                      # inside a function run by cluster.run
        faults.at(step)                            # before the step's work
        ...

A real failure is not an exception a rank can catch: a node loses power, the kernel's
out-of-memory killer sends SIGKILL, a GPU falls off the bus. ``kill`` therefore ends the
rank's own process with SIGKILL, which no ``try``/``finally`` and no atexit handler sees; its
peers learn of it only through their connections. ``hang`` is the other failure: the process
lives on but never reaches its next collective (a deadlock, a stuck file system, a rank
waiting on a lock), so its peers wait in that collective until a timeout.

What the learner sees in the parent (``parlab.Cluster``, ``parlab.runtime.cluster``):

- kill: a ``RankError`` whose first line names the dead rank ("rank 2's worker was killed by
  SIGKILL during the call"); its section shows the line ``kill`` wrote to the worker's log
  just before dying, and the survivors' sections show gloo's "Connection reset by peer" or
  "Connection closed by peer" where they talked to it, or their stacks where they were still
  waiting (gloo's ring does not connect every rank to every other). The dead worker is
  replaced, so the next ``run`` works.
- hang: a ``RankTimeout`` after the call's timeout, with every rank's stack: the hung rank's
  ends in ``hang`` below the line that called ``faults.at``; the others' in the collective
  they were waiting in.
"""

import os
import signal
import sys
import threading

from parlab._checks import refuse, whole_number

KILL_SIGNAL = signal.SIGKILL


class Faults:
    """Failures to inject, chosen in the parent and shipped with the function.

    kill, hang: {rank: step} (a rank in both dies at the earlier of its steps). ``at(step)``
    is called by every rank at the start of each step; the rank named for that step dies
    (``kill``) or sleeps for good (``hang``), the others return at once. Steps count from 0,
    as the training loop counts them."""

    def __init__(self, kill=None, hang=None):
        self.kill = _steps("kill", kill)
        self.hang = _steps("hang", hang)

    def __repr__(self):
        return f"Faults(kill={self.kill}, hang={self.hang})"

    def at(self, step, rank=None):
        """Inject what is due for ``rank`` (default: this process's rank in the default
        process group) at ``step``; return when nothing is."""
        if rank is None:
            import torch.distributed as dist

            rank = dist.get_rank()
        if self.kill.get(rank) == step:
            die(f"parlab.failures: rank {rank} killed itself with SIGKILL at step {step} ({self!r})")
        if self.hang.get(rank) == step:
            hang(f"parlab.failures: rank {rank} hangs at step {step} ({self!r})")

    def first_failure(self):
        """The step of the first injected failure (kill or hang), or None without any."""
        return min([*self.kill.values(), *self.hang.values()], default=None)


def die(reason):
    """End this process at once with SIGKILL, as the kernel would, after writing ``reason``
    to the worker's own log (``sys.__stderr__``): a cluster shows the last lines of a dead
    worker's log in its RankError, so the learner sees the failure was injected and not,
    as a SIGKILL usually means, the out-of-memory killer."""
    sys.__stderr__.write(reason + "\n")
    sys.__stderr__.flush()
    os.kill(os.getpid(), KILL_SIGNAL)
    threading.Event().wait()  # the signal is delivered asynchronously: never go on meanwhile


def hang(reason):
    """Block this thread for good without using the CPU, as a rank that never reaches its
    next collective; ``reason`` goes to the worker's log."""
    sys.__stderr__.write(reason + "\n")
    sys.__stderr__.flush()
    threading.Event().wait()


def _steps(name, mapping):
    """{rank: step} as ints; a step or rank that is not a whole number is refused."""
    if mapping is None:
        return {}
    if not isinstance(mapping, dict):
        refuse(name, "a dict {rank: step}", mapping, f"e.g. {name}={{1: 5}} for rank 1 at step 5.")
    return {whole_number(f"a rank in {name}", rank, "ranks count from 0.", minimum=0):
            whole_number(f"{name}'s step for rank {rank}", step, "steps count from 0, as the loop's.", minimum=0)
            for rank, step in mapping.items()}
