"""A persistent group of ranks: start the processes once, then run functions on them.

    with parlab.Cluster(world_size=4) as cluster:
        results = cluster.run(fn, *args, **kwargs)     # fn runs on every rank

Spawning processes and joining a process group takes seconds; a cluster pays that once and
then dispatches a call in about a millisecond. ``fn`` may be defined in a notebook cell: it
travels by value (cloudpickle). Everything a rank prints is shown after the call, prefixed
``[rank r]``, in rank order. A failure on any rank raises ``RankError``; a call that outlives
its timeout raises ``RankTimeout`` with the stacks of the stuck ranks. Either way the cluster
repairs itself, so the next call works: the workers of dead and stuck ranks are replaced, the
others re-join a new process group in their own processes (see ``WorkerPool.repair``). A
worker that dies between calls (the out-of-memory killer, a ``kill -9``) is reported once,
by the next call, as a ``RankError`` naming the rank and the signal; it is replaced and the
call after works.
"""

import contextlib
import itertools
import pickle
import sys
import threading
import time
import weakref
from multiprocessing.connection import wait

from parlab.runtime import capacity, emulation
from parlab.runtime import placement as placement_rules
from parlab.runtime.errors import RankError, RankTimeout
from parlab.runtime.pool import DEATHS_SETTLE_S, WorkerPool
from parlab.runtime.process import waited_for_a_cpu_s

# After the first rank fails, the others get this long to finish before they are taken for
# stuck (typically waiting in a collective the failed rank never reached) and replaced.
FAILURE_GRACE_S = 2.0
# After a worker dies during a call, the others only get this long: its death has broken the
# process group for every rank, and those talking to it fail at once (their ConnectionErrors
# say what they sent it); the rest are stuck for good.
DEATH_GRACE_S = 0.3


class Cluster:
    """``world_size`` worker processes joined in one ``torch.distributed`` process group.

    backend: "auto" | "gloo" | "nccl"; device: "auto" | "cpu" | "cuda" (see
    ``parlab.runtime.placement`` for the rules). ``timeout`` is the default limit in seconds
    for one ``run`` (None: no limit); ``start_timeout`` bounds the start of the workers.
    More ranks than the machine's memory or open-file limit can hold are refused with a
    ValueError, far more than its cores get a warning, and a slow start shows a progress
    bar (see ``parlab.runtime.capacity``).

    Calls from several threads (a widget's callback while a cell runs) take turns: each
    call, and the repairs after it, has the workers to itself.

    Time: real by default. ``link`` (a ``parlab.Link`` or ``parlab.Nodes``) emulates the
    network and ``devices`` (a ``parlab.Devices``) the ranks' compute, as
    ``parlab.runtime.emulation`` describes; ``emulate(...)`` changes that for a few calls.
    """

    def __init__(self, world_size, backend="auto", device="auto", timeout=300.0, start_timeout=120.0,
                 link=None, devices=None):
        self.regime = emulation.Regime(link, devices)
        self.placement = placement_rules.resolve(world_size, backend, device)
        self.regime.check_ranks(self.placement.world_size)
        slow_start = capacity.check(self.placement.world_size)
        self.world_size = self.placement.world_size
        self.timeout = timeout
        self._calls = itertools.count()
        self._lock = threading.RLock()
        self._closing = False
        self._pool = WorkerPool(self.placement, start_timeout, progress=slow_start)
        self._finalizer = weakref.finalize(self, self._pool.shutdown)
        try:
            self._pool.start()
            self._pool.wait_ready()
        except BaseException:
            self._pool.shutdown()  # a Ctrl-C during a long start leaves no worker behind
            raise

    @property
    def backend(self):
        return self.placement.backend

    @property
    def pids(self):
        """Process ids of the current workers, in rank order."""
        return self._pool.pids

    @property
    def closed(self):
        """True once ``close()`` has run (or the workers could not be started)."""
        return self._pool.closed

    def __repr__(self):
        return f"<parlab.Cluster: {self.placement.describe()}; {self.regime.describe()}; {self._pool.state()}>"

    @contextlib.contextmanager
    def emulate(self, link=None, devices=None):
        """Run the calls inside ``with cluster.emulate(link=..., devices=...):`` in that
        regime (``link=None, devices=None``: real time), then return to the cluster's own.
        The workers stay as they are: the regime travels with each call."""
        regime = emulation.Regime(link, devices)
        regime.check_ranks(self.world_size)
        with self._lock:
            previous, self.regime = self.regime, regime
        try:
            yield self
        finally:
            with self._lock:
                self.regime = previous

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self):
        """Stop the workers (gracefully, then by force). Safe to call twice, and from another
        thread while a call runs: that call ends at once with a RuntimeError."""
        self._closing = True
        if not self._lock.acquire(blocking=False):
            self._pool.interrupt()
            self._lock.acquire()
        try:
            self._finalizer()
        finally:
            self._lock.release()

    def run(self, fn, *args, timeout=None, **kwargs):
        """Run ``fn(*args, **kwargs)`` on every rank; return the results in rank order.

        ``timeout`` (seconds) overrides the cluster's default for this call.
        """
        results, _, _ = self._call(fn, args, kwargs, timeout, traced=False)
        return results

    def trace(self, fn, *args, timeout=None, **kwargs):
        """Like ``run`` with recording on: returns a ``parlab.trace.Timeline`` whose
        ``results`` are the per-rank return values."""
        from parlab.trace import Timeline

        regime = self.regime
        results, events, origin = self._call(fn, args, kwargs, timeout, traced=True)
        return Timeline(events, self.world_size, results, origin, regime=regime.describe())

    def _call(self, fn, args, kwargs, timeout, traced):
        """Returns (results, events, the dispatch time in perf_counter_ns)."""
        if not callable(fn):
            raise ValueError(f"run() needs a function to run on every rank, got {fn!r}.")
        payload = _serialise(fn, args, kwargs)
        timeout = self.timeout if timeout is None else timeout
        with self._lock:
            self._check_open()
            self._pool.wait_ready()
            call_id, regime = next(self._calls), self.regime
            origin = time.perf_counter_ns()
            self._dispatch(("run", call_id, payload, traced, regime))
            outputs = {rank: [] for rank in range(self.world_size)}
            done, dead, waited = {}, set(), 0.0
            try:
                waited = self._collect(call_id, timeout, outputs, done, dead)
            except KeyboardInterrupt:
                stuck = self._stuck_stacks(done)
                self._repair(dead | set(stuck))
                _print_outputs(outputs)
                print(f"Interrupted: {len(stuck)} rank(s) still running; their workers were replaced.", file=sys.stderr)
                raise
            stuck = self._stuck_stacks(done) if len(done) < self.world_size else {}
            _print_outputs(outputs)
            failures = {rank: detail for rank, (ok, detail, _) in done.items() if not ok}
            if (failures or stuck) and self._closing:
                raise RuntimeError(
                    "this cluster was closed during the call (by close() in another thread), which stopped its "
                    "workers; create a new parlab.Cluster."
                )
            if failures or stuck:
                self._repair(dead | set(stuck))
            if failures:
                raise RankError(failures, stuck, dead=dead)
            if stuck:
                raise RankTimeout(timeout, stuck, finished=done, regime=regime, waited_for_a_cpu=waited)
            events = [event for rank in range(self.world_size) for event in done[rank][2]]
            results = [_deserialise(done[rank][1], rank) for rank in range(self.world_size)]
            return results, events, origin

    def _check_open(self):
        if self._pool.closed or self._closing:
            raise RuntimeError("this cluster is closed; create a new parlab.Cluster.")

    def _dispatch(self, message):
        """Send ``message`` to every rank. Workers found dead (killed while idle, say, by the
        out-of-memory killer, or lost while their process group was rebuilt) are reported
        once, as a RankError, and replaced, so the next call works; the call itself does not
        run."""
        lost = self._pool.take_lost()  # when one is lost re-joining, every worker is replaced
        dead = self._pool.dead_ranks(settle_s=DEATHS_SETTLE_S)
        unreachable = [] if lost or dead else self._pool.send_all(message)
        found = sorted(set(dead) | set(unreachable))
        if not lost and not found:
            return
        # Workers that the message reached are running the call: with a rank gone, it cannot end.
        replaced = found if found and not lost and not unreachable else list(range(self.world_size))
        for rank in found:
            lost[rank] = self._pool.death_report(rank, "while idle")
        if found:
            self._check_open()
            self._pool.repair(replaced)
        how = "; ".join(report.splitlines()[-1] for report in lost.values())
        what_now = f"The call did not run; {_replaced(replaced, self.world_size)}, so run it again."
        raise RankError(lost, dead=lost, summary=f"{how}. {what_now}")

    def _collect(self, call_id, timeout, outputs, done, dead):
        """Gather every rank's output and answer into ``outputs`` and ``done`` (rank ->
        (ok, result or traceback, events)), and the ranks whose worker died into ``dead``,
        until all have answered, the timeout runs out, or the grace period after the first
        failure ends (a short one after a death). Returns the seconds of waiting for a CPU
        that the timeout did not count.

        The timeout counts the time the ranks had: it is extended by the longest time a rank
        still running waited for a CPU that other programs held (``waited_for_a_cpu_s``), so a
        busy machine slows a call down without turning it into a RankTimeout; a hang, where
        the ranks sleep, or a loop that never ends, which runs, still times out."""
        pool = self._pool
        start, limit = time.monotonic(), None if timeout is None else time.monotonic() + timeout
        waited_before = dict(enumerate(map(waited_for_a_cpu_s, pool.pids)))
        failed = False
        while len(done) < self.world_size:
            remaining = None if limit is None else max(0.0, limit - time.monotonic())
            ready = wait(pool.pending_connections(done), remaining)
            if not ready:
                if failed or timeout is None:
                    return 0.0
                waited = max(waited_for_a_cpu_s(pid) - waited_before[rank]
                             for rank, pid in enumerate(pool.pids) if rank not in done)
                if start + timeout + waited <= time.monotonic():
                    return waited
                limit = max(start + timeout + waited, time.monotonic() + 0.05)  # not a busy loop
                continue
            for conn in ready:
                rank = pool.rank_of(conn)
                message = pool.receive(rank)
                if message is None:
                    done[rank] = (False, pool.death_report(rank, "during the call"), [])
                    dead.add(rank)
                elif message[0] == "out":
                    outputs[rank].append(message[1:])
                elif message[0] == "done" and message[1] == call_id:
                    done[rank] = message[2:]
                if rank in done and not done[rank][0]:
                    failed = True
                    grace_end = time.monotonic() + (DEATH_GRACE_S if rank in dead else FAILURE_GRACE_S)
                    limit = grace_end if limit is None else min(limit, grace_end)

    def _stuck_stacks(self, done):
        """The Python stacks of the ranks that have not answered (rank -> stack)."""
        return self._pool.dump_stacks([rank for rank in range(self.world_size) if rank not in done])

    def _repair(self, replace):
        """After a failed or stuck call: rebuild the process group, which may hold unmatched
        messages, with new workers for the ranks in ``replace`` (dead ones, and stuck ones: a
        rank stuck in a collective cannot be freed any other way); the others re-join in their
        own processes. Nothing to do once the cluster is closing."""
        if not self._closing:
            self._pool.repair(replace)


def _serialise(fn, args, kwargs):
    import cloudpickle

    try:
        return cloudpickle.dumps((fn, args, kwargs))
    except Exception as exc:
        raise ValueError(
            f"{getattr(fn, '__name__', fn)!r} or its arguments cannot be sent to the workers: "
            f"{type(exc).__name__}: {exc}. Functions travel by value with everything they "
            "refer to; create open files, locks, sockets or threads inside the function "
            "instead of capturing them."
        ) from exc


def _deserialise(data, rank):
    try:
        return pickle.loads(data)
    except Exception as exc:
        raise RankError(
            {rank: f"the result of rank {rank} could not be unpickled in the parent: {exc!r}"}
        ) from exc


def _replaced(ranks, world_size):
    """Which workers a repair replaced, and what that means to the learner."""
    if len(ranks) == world_size:
        return "every worker was replaced (anything the ranks kept between calls is gone)"
    if len(ranks) == 1:
        return f"rank {ranks[0]}'s worker was replaced (anything it kept between calls is gone)"
    return f"the workers of ranks {', '.join(map(str, ranks))} were replaced (anything they kept between calls is gone)"


def _print_outputs(outputs):
    """Print what each rank wrote, rank by rank, each line prefixed with its rank; stdout
    and stderr go to the parent's stdout and stderr, in the order the rank wrote them."""
    for rank, chunks in outputs.items():
        for stream_name, group in itertools.groupby(chunks, key=lambda chunk: chunk[0]):
            text = "".join(text for _, text in group)
            stream = sys.stdout if stream_name == "stdout" else sys.stderr
            stream.write("".join(f"[rank {rank}] {line}\n" for line in text.splitlines()))
            stream.flush()
