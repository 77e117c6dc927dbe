"""Measured timelines: what every rank did, and when, on one clock.

Inside a function run by ``cluster.trace(fn)``, each rank records

- communication events from parlab's traced point-to-point calls (``parlab.p2p``) and the
  collectives built on them: op, peer, bytes, start, end;
- compute spans that techniques mark with ``with trace.span("forward", stage=s, microbatch=m):``.

The parent gathers the events of all ranks into a :class:`Timeline`. All ranks of a cluster
live on one host and read the same monotonic clock (``time.perf_counter_ns``), so their
events line up without any clock correction. Outside ``cluster.trace`` recording is off and
``span`` costs one attribute lookup.
"""

import time
from contextlib import contextmanager
from dataclasses import dataclass

COMM, COMPUTE = "comm", "compute"


@dataclass(frozen=True)
class Event:
    """One interval on one rank. Times are seconds since the traced call was dispatched."""

    rank: int
    kind: str  # COMM or COMPUTE
    name: str  # "send", "recv", ... or a compute label such as "forward"
    start: float
    end: float
    peer: int | None = None
    nbytes: int = 0
    stage: int | None = None
    microbatch: int | None = None

    @property
    def duration(self):
        return self.end - self.start


class _Recorder:
    """Per-process event buffer; ``events is None`` means recording is off."""

    rank = 0
    events = None


_recorder = _Recorder()


def start(rank):
    """Start recording on this rank (the worker calls this around a traced function)."""
    _recorder.rank = rank
    _recorder.events = []


def stop():
    """Stop recording and return the raw events: tuples of Event fields, times in ns."""
    events, _recorder.events = _recorder.events or [], None
    return events


def recording():
    return _recorder.events is not None


def now():
    return time.perf_counter_ns()


def record_comm(op, peer, nbytes, start_ns, end_ns):
    """Record a communication event (used by parlab.p2p and the collectives)."""
    if _recorder.events is not None:
        _recorder.events.append((_recorder.rank, COMM, op, start_ns, end_ns, peer, nbytes, None, None))


@contextmanager
def span(name, stage=None, microbatch=None):
    """Mark a compute span: ``with trace.span("backward", stage=1, microbatch=3): ...``."""
    if _recorder.events is None:
        yield
        return
    t0 = now()
    try:
        yield
    finally:
        _recorder.events.append((_recorder.rank, COMPUTE, name, t0, now(), None, 0, stage, microbatch))


class Timeline:
    """The events of every rank of one traced call, and the call's per-rank results."""

    def __init__(self, events, world_size, results=None, origin_ns=0):
        self.world_size = world_size
        self.results = results
        self.events = sorted(
            (
                Event(r, k, n, (s - origin_ns) / 1e9, (e - origin_ns) / 1e9, p, b, st, mb)
                for (r, k, n, s, e, p, b, st, mb) in events
            ),
            key=lambda ev: (ev.start, ev.rank),
        )

    def __repr__(self):
        return (
            f"Timeline({self.world_size} ranks, {len(self.events)} events, "
            f"{self.duration * 1e3:.2f} ms, {sum(self.bytes_sent())} bytes sent)"
        )

    def select(self, rank=None, kind=None, name=None):
        """Events filtered by rank, kind (COMM/COMPUTE) and name, in start order."""
        return [
            ev
            for ev in self.events
            if (rank is None or ev.rank == rank)
            and (kind is None or ev.kind == kind)
            and (name is None or ev.name == name)
        ]

    def bytes_sent(self):
        """Bytes each rank sent, as a list indexed by rank (exact: counted, not timed)."""
        return self._bytes(("send", "isend"))

    def bytes_received(self):
        """Bytes each rank received, as a list indexed by rank."""
        return self._bytes(("recv", "irecv"))

    def _bytes(self, ops):
        totals = [0] * self.world_size
        for ev in self.events:
            if ev.kind == COMM and ev.name in ops:
                totals[ev.rank] += ev.nbytes
        return totals

    @property
    def duration(self):
        if not self.events:
            return 0.0
        return max(ev.end for ev in self.events) - min(ev.start for ev in self.events)

    def plot(self, ax=None, title=None):
        """Draw a Gantt chart: one row per rank, compute spans above, communication below."""
        from parlab.viz import plot_timeline

        return plot_timeline(self, ax=ax, title=title)
