"""Collectives that run in the background: a rank's communication thread.

    handle = background.start(collectives.ring_all_reduce, bucket, check=False)
    ...                                            # backward goes on computing
    handle.wait()                                  # the bucket is reduced

A GPU overlaps communication with computation by putting collectives on a stream of their
own; parlab's collectives are Python loops of sends and receives, so each rank runs them on
one background thread instead. Started collectives run one at a time, in the order they were
started (every rank starts the same collectives in the same order, so the rings line up),
while the caller goes on. DDP uses this to overlap its bucketed all-reduces with backward
when the links are emulated, so that their messages pay the emulated link's time.
"""

import threading
from concurrent.futures import ThreadPoolExecutor

_thread = None
_lock = threading.Lock()


def start(collective, *args, **kwargs):
    """Start ``collective(*args, **kwargs)`` on this rank's communication thread; returns a
    handle whose ``wait()`` returns its result (and raises its exception, if any)."""
    global _thread
    if not callable(collective):
        raise ValueError(f"start runs a collective, e.g. parlab.collectives.ring_all_reduce; got {collective!r}.")
    with _lock:
        if _thread is None:
            _thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="parlab-comm")
    return Handle(_thread.submit(collective, *args, **kwargs))


class Handle:
    """A collective started in the background."""

    def __init__(self, future):
        self._future = future

    def wait(self):
        return self._future.result()

    def is_completed(self):
        return self._future.done()
