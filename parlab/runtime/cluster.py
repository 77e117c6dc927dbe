"""A persistent group of ranks: start the processes once, then run functions on them.

    with parlab.Cluster(world_size=4) as cluster:
        results = cluster.run(fn, *args, **kwargs)     # fn runs on every rank

Spawning processes and joining a process group takes seconds; a cluster pays that once and
then dispatches a call in about a millisecond. ``fn`` may be defined in a notebook cell: it
travels by value (cloudpickle). Everything a rank prints is shown after the call, prefixed
``[rank r]``, in rank order. A failure on any rank raises ``RankError``; a call that outlives
its timeout raises ``RankTimeout`` with the stacks of the stuck ranks. Either way the cluster
repairs itself, so the next call works.
"""

import itertools
import pickle
import sys
import time
import weakref
from multiprocessing.connection import wait

from parlab.runtime import placement as placement_rules
from parlab.runtime.errors import RankError, RankTimeout
from parlab.runtime.pool import WorkerPool

# After the first rank fails, the others get this long to finish before they are taken for
# stuck (typically waiting in a collective the failed rank never reached) and replaced.
FAILURE_GRACE_S = 2.0


class Cluster:
    """``world_size`` worker processes joined in one ``torch.distributed`` process group.

    backend: "auto" | "gloo" | "nccl"; device: "auto" | "cpu" | "cuda" (see
    ``parlab.runtime.placement`` for the rules). ``timeout`` is the default limit in seconds
    for one ``run`` (None: no limit); ``start_timeout`` bounds the start of the workers.
    """

    def __init__(self, world_size, backend="auto", device="auto", timeout=300.0, start_timeout=120.0):
        self.placement = placement_rules.resolve(world_size, backend, device)
        self.world_size = world_size
        self.timeout = timeout
        self._calls = itertools.count()
        self._pool = WorkerPool(self.placement, start_timeout)
        self._finalizer = weakref.finalize(self, self._pool.shutdown)
        self._pool.start()
        self._pool.wait_ready()

    @property
    def backend(self):
        return self.placement.backend

    @property
    def pids(self):
        """Process ids of the current workers, in rank order."""
        return self._pool.pids

    def __repr__(self):
        state = "closed" if self._pool.closed else "running"
        return f"<parlab.Cluster: {self.placement.describe()}; {state}>"

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self):
        """Stop the workers (gracefully, then by force). Safe to call twice."""
        self._finalizer()

    def run(self, fn, *args, timeout=None, **kwargs):
        """Run ``fn(*args, **kwargs)`` on every rank; return the results in rank order.

        ``timeout`` (seconds) overrides the cluster's default for this call.
        """
        results, _ = self._call(fn, args, kwargs, timeout, traced=False)
        return results

    def trace(self, fn, *args, timeout=None, **kwargs):
        """Like ``run`` with recording on: returns a ``parlab.trace.Timeline`` whose
        ``results`` are the per-rank return values."""
        from parlab.trace import Timeline

        origin = time.perf_counter_ns()
        results, events = self._call(fn, args, kwargs, timeout, traced=True)
        return Timeline(events, self.world_size, results, origin)

    def _call(self, fn, args, kwargs, timeout, traced):
        if self._pool.closed:
            raise RuntimeError("this cluster is closed; create a new parlab.Cluster.")
        if not callable(fn):
            raise ValueError(f"run() needs a function to run on every rank, got {fn!r}.")
        payload = _serialise(fn, args, kwargs)
        timeout = self.timeout if timeout is None else timeout
        self._pool.wait_ready()
        call_id = next(self._calls)
        for rank in range(self.world_size):
            self._pool.send(rank, ("run", call_id, payload, traced))

        outputs = {rank: [] for rank in range(self.world_size)}
        done = {}
        try:
            self._collect(call_id, timeout, outputs, done)
        except KeyboardInterrupt:
            stuck = self._stop_stuck_ranks(done)
            _print_outputs(outputs)
            print(f"Interrupted: {len(stuck)} rank(s) still running; the workers were replaced.", file=sys.stderr)
            raise
        stuck = self._stop_stuck_ranks(done) if len(done) < self.world_size else {}
        _print_outputs(outputs)

        failures = {rank: detail for rank, (ok, detail, _) in done.items() if not ok}
        if failures:
            # A failed call may leave unmatched messages in the process group: rebuild it,
            # in the same processes when all are alive (fast), else with new ones.
            if stuck:
                pass  # _stop_stuck_ranks already replaced every worker
            elif self._pool.all_alive():
                self._pool.reinit()
            else:
                self._pool.restart()
            raise RankError(failures, stuck)
        if stuck:
            raise RankTimeout(timeout, stuck, finished=done)
        events = [event for rank in range(self.world_size) for event in done[rank][2]]
        results = [_deserialise(done[rank][1], rank) for rank in range(self.world_size)]
        return results, events

    def _collect(self, call_id, timeout, outputs, done):
        """Gather every rank's output and answer into ``outputs`` and ``done`` (rank ->
        (ok, result or traceback, events)) until all have answered, the timeout runs out, or
        the grace period after the first failure ends."""
        pool = self._pool
        limit = None if timeout is None else time.monotonic() + timeout
        while len(done) < self.world_size:
            remaining = None if limit is None else max(0.0, limit - time.monotonic())
            ready = wait(pool.pending_connections(done), remaining)
            if not ready:
                return
            for conn in ready:
                rank = pool.rank_of(conn)
                message = pool.receive(rank)
                if message is None:
                    done[rank] = (False, pool.death_report(rank), [])
                elif message[0] == "out":
                    outputs[rank].append(message[1:])
                elif message[0] == "done" and message[1] == call_id:
                    done[rank] = message[2:]
                if rank in done and not done[rank][0]:
                    grace_end = time.monotonic() + FAILURE_GRACE_S
                    limit = grace_end if limit is None else min(limit, grace_end)

    def _stop_stuck_ranks(self, done):
        """Collect the Python stacks of the ranks that have not answered, then replace
        every worker: a rank stuck in a collective cannot be freed any other way."""
        stuck = [rank for rank in range(self.world_size) if rank not in done]
        stacks = self._pool.dump_stacks(stuck)
        self._pool.restart()
        return stacks


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


def _print_outputs(outputs):
    """Print what each rank wrote, rank by rank, each line prefixed with its rank; stdout
    and stderr go to the parent's stdout and stderr, in the order the rank wrote them."""
    for rank, chunks in outputs.items():
        for stream_name, group in itertools.groupby(chunks, key=lambda chunk: chunk[0]):
            text = "".join(text for _, text in group)
            stream = sys.stdout if stream_name == "stdout" else sys.stderr
            stream.write("".join(f"[rank {rank}] {line}\n" for line in text.splitlines()))
            stream.flush()
