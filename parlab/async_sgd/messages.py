"""The messages of a parameter server, and receiving "from any worker" on parlab.p2p.

parlab's point-to-point layer receives from one named rank, so a server posts one receive per
worker and waits for all of them at once, each on a thread (``Inbox``); under an emulated
link each receive waits out the link's time, so messages arrive in emulated order. Every message carries a
few counters after its values, in the weights' dtype (exact up to 2^24 in fp32):

    push:  [g (d_s), the version g was computed at, GRADIENT or LEAVE]
    reply: [w (d_s), its version, stop (0 or 1), the staleness tau of the push answered]
"""

import threading
from concurrent import futures

import torch

from parlab import p2p

GRADIENT, LEAVE = 0.0, 1.0


def reply(shard, version, stop, tau=0):
    """A reply message: [w_s (d_s), version, stop, tau of the push answered]."""
    return torch.cat([shard, torch.tensor([version, float(stop), tau], dtype=shard.dtype)])


def push(g, version, kind):
    """A push message: [g_s (d_s), the version it was computed at, GRADIENT or LEAVE]."""
    return torch.cat([g, torch.tensor([version, kind], dtype=g.dtype)])


class Inbox:
    """One posted receive per source, each waited for on a thread of this rank: ``take(among)``
    returns (source, message) from whichever of ``among`` arrives first (of several arrived,
    the first in ``among``); ``listen(source)`` posts the next receive from ``source``."""

    def __init__(self, sources, numel, dtype):
        self._buffers = {s: torch.empty(numel, dtype=dtype) for s in sources}
        self._pending = {}
        for s in sources:
            self.listen(s)

    def listen(self, source):
        self._pending[source] = arrival(p2p.irecv(self._buffers[source], source))

    def take(self, among):
        waiting = [self._pending[source] for source in among]
        futures.wait(waiting, return_when=futures.FIRST_COMPLETED)
        source = next(source for source in among if self._pending[source].done())
        return source, self._pending.pop(source).result().clone()


def arrival(request):
    """A future that is done when ``request`` (a p2p receive or send) is: its ``wait()`` runs
    on a thread of its own. gloo tells whether a receive has completed only to ``wait()``
    (``is_completed()`` stays False until then), so a rank that must not block on one
    message waits for it on a thread. The thread is a daemon: one left waiting after another
    rank failed neither holds up this process's exit nor a slot that later waits need."""
    future = futures.Future()

    def wait():
        try:
            future.set_result(request.wait())
        except BaseException as error:  # handed to whoever reads the future
            future.set_exception(error)

    threading.Thread(target=wait, name="parlab-inbox", daemon=True).start()
    return future


def finish_sent(sends):
    """Wait for (and so trace) the sends that gloo has completed; returns the others. Under
    an emulated link the wait holds the server for the message's time on its port."""
    for request in sends:
        if request.is_completed():
            request.wait()
    return [request for request in sends if not request.is_completed()]
