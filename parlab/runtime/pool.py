"""The worker processes behind a Cluster, one generation at a time: start them, wait for
them to join the process group, talk to them, dump their stacks, replace them, and shut them
down. What the parent holds of one worker, and how it makes sure none outlives its parent
and none leaves a file behind: ``parlab.runtime.process``.
"""

import os
import pickle
import signal
import subprocess
import time
from multiprocessing.connection import wait

from parlab.runtime.errors import readable_stack
from parlab.runtime.process import WorkerProcess, read_from

STACK_DUMP_WAIT_S = 2.0
DEATHS_SETTLE_S = 1.0  # how long the exits of workers that died together may take to arrive
EXIT_WAIT_S = 5.0


class WorkerPool:
    def __init__(self, placement, start_timeout, progress=False):
        from torch.distributed import TCPStore

        self.placement = placement
        self.start_timeout = start_timeout
        self.progress = progress
        self.closed = False
        self._interrupted = False
        self._generation = 0
        self._fresh = set()  # the ranks whose workers were started for the current generation
        self._workers, self._ready = [], set()  # WorkerProcess of rank r at index r
        self._lost = {}
        # The rendezvous store lives in the parent on a port the OS picks, so clusters never
        # collide; each generation of workers uses its own key prefix in it.
        self._store = TCPStore("127.0.0.1", 0, placement.world_size, is_master=True, wait_for_workers=False)

    @property
    def pids(self):
        return [worker.pid for worker in self._workers]

    @property
    def ranks(self):
        return range(self.placement.world_size)

    def start(self):
        """Start one generation of workers (does not wait for them to join). All start at
        once: measured, starting them a few at a time is slower, on a busy machine much so."""
        self._generation += 1
        self._fresh, self._ready = set(self.ranks), set()
        self._workers = []
        for rank in self.ranks:
            self._workers.append(self._spawn(rank))

    def _spawn(self, rank):
        """Start the worker of ``rank`` for the current generation."""
        return WorkerProcess(rank, {
            "world_size": self.placement.world_size,
            "backend": self.placement.backend,
            "device_type": self.placement.device_type,
            "gpu_count": self.placement.gpu_count,
            "store_port": self._store.port,
            "generation": self._generation,
            "start_timeout": self.start_timeout,
        })

    def wait_ready(self):
        """Block until every worker has joined the process group, with a progress bar when
        the start is expected to be slow. A worker lost while joining after a ``repair`` is
        noted in ``take_lost()`` and every worker replaced; one lost while all start afresh
        means the cluster cannot start: the pool shuts down."""
        if len(self._ready) == self.placement.world_size:
            return
        # Fresh workers only: the same processes re-join their group in a moment.
        bar = _progress_bar(len(self._fresh)) if self.progress and self._fresh else None
        try:
            self._wait_ready(bar)
        finally:
            if bar is not None:
                bar.close()

    def _wait_ready(self, bar):
        deadline = time.monotonic() + self.start_timeout
        while len(self._ready) < self.placement.world_size:
            failed = self._await_joins(deadline, bar)
            if failed:
                self._not_joined(failed)  # gives up, or replaces every worker: wait for the new ones
                deadline = time.monotonic() + self.start_timeout
                if bar is not None:
                    bar.reset(total=len(self._fresh))

    def _await_joins(self, deadline, bar):
        """Take in the next "started" (counted by ``bar``) and "ready" messages; return the
        ranks that failed to join instead (rank -> (summary, details)), or {}."""
        waiting = self.pending_connections(self._ready)
        answered = wait(waiting, max(0.0, deadline - time.monotonic()))
        if not answered:
            late = sorted(set(self.ranks) - self._ready)
            return {rank: (f"rank {rank} did not join the process group within {self.start_timeout:g} s", "")
                    for rank in late}
        for conn in answered:
            rank = self.rank_of(conn)
            message = self.receive(rank)
            when = "while starting" if rank in self._fresh else "while rebuilding its process group"
            if message is None:
                worker = self._workers[rank]
                return {rank: (worker.death_line(when), worker.last_output())}
            if message[0] == "started":
                if bar is not None:
                    bar.update(1)
                continue
            if message[0] != "ready":
                error = message[2].strip().splitlines()[-1]
                return {rank: (f"rank {rank} could not join the process group {when}: {error}", message[2])}
            self._ready.add(rank)
        return {}

    def _not_joined(self, reports):
        """Ranks that did not join (rank -> (summary, details)): after a repair, they are
        noted for ``take_lost`` and every worker is replaced; when every worker was fresh,
        the cluster cannot start."""
        if len(self._fresh) == self.placement.world_size:
            self._give_up("; ".join(summary for summary, _ in reports.values()) + ".\n" +
                          "\n".join(details for _, details in reports.values() if details))
        for rank, (summary, details) in reports.items():
            self._lost[rank] = f"{details}\n{summary}".strip()
        self.restart()

    def take_lost(self):
        """The workers lost since the last call (rank -> report whose last line says how),
        forgotten once taken."""
        lost, self._lost = self._lost, {}
        return lost

    def _give_up(self, reason):
        if self._interrupted:
            reason = "close() was called (from another thread) while the workers started"
        self.shutdown()
        raise RuntimeError(f"the cluster could not start: {reason}")

    def send_all(self, message):
        """Send ``message`` to every rank; return the ranks it could not reach (dead workers)."""
        data = pickle.dumps(message)
        return [rank for rank, worker in enumerate(self._workers) if not worker.send(data)]

    def receive(self, rank):
        """The next message from ``rank``, or None if the worker is gone."""
        return self._workers[rank].receive()

    def pending_connections(self, done):
        return [worker.conn for rank, worker in enumerate(self._workers) if rank not in done]

    def rank_of(self, conn):
        return [worker.conn for worker in self._workers].index(conn)

    def dead_ranks(self, settle_s=0.0):
        """The ranks whose worker has ended. With ``settle_s``, once one has, the others get
        that long to be found ended too: a forked worker's exit reaches this process through
        the fork server, a moment after it happens, and workers that die together (a lost
        node, two killed by hand) are then named together, not one call after another."""
        dead = [rank for rank, worker in enumerate(self._workers) if worker.dead()]
        deadline = time.monotonic() + settle_s
        while dead and len(dead) < len(self._workers) and time.monotonic() < deadline:
            time.sleep(0.05)
            dead = [rank for rank, worker in enumerate(self._workers) if worker.dead()]
        return dead

    def state(self):
        """In words: "closed", "restarting" (workers not all joined yet), "running", or which
        workers are dead (found out, reported and replaced by the next call)."""
        if self.closed:
            return "closed"
        dead = self.dead_ranks()
        if dead:
            lines = "; ".join(self._workers[rank].death_line(wait_s=0) for rank in dead)
            return f"{lines}: the next call reports it and replaces the dead workers"
        return "running" if len(self._ready) == self.placement.world_size else "restarting"

    def repair(self, replace=()):
        """Rebuild the process group in a new generation, dropping any message still in
        flight: the workers of the ranks in ``replace`` (dead, or stuck in a call that can
        never end) are killed and started afresh, the others re-join in their own processes.
        Starting a worker (loading torch) is most of the cost of a start, so a repair costs
        what its fresh workers cost. The next call waits for the new group."""
        replace = set(replace)
        if len(replace) == self.placement.world_size:
            self.restart()
            return
        self._generation += 1
        self._fresh, self._ready = replace, set()
        self._kill(replace)
        for rank in replace:
            self._workers[rank] = self._spawn(rank)
        message, others = pickle.dumps(("reinit", self._generation)), set(self.ranks) - replace
        if any(not self._workers[rank].send(message) for rank in others):
            self.restart()

    def restart(self):
        """Kill every worker and start a new generation; the next call waits for it."""
        self._kill()
        self.start()

    def interrupt(self):
        """Kill the workers and nothing else, safe while another thread talks to them: that
        thread sees them die and ends its call; ``shutdown`` then tidies up."""
        self._interrupted = True
        for worker in list(self._workers):
            worker.kill()

    def dump_stacks(self, ranks):
        """Ask the given ranks for their Python stacks (faulthandler on SIGUSR1), all at once;
        a dump is complete when its file has stopped growing."""
        stack_files = {rank: self._workers[rank].stack for rank in ranks}
        offsets = {rank: os.fstat(f.fileno()).st_size for rank, f in stack_files.items()}
        for rank in ranks:
            self._workers[rank].signal(signal.SIGUSR1)
        stacks = {rank: "" for rank in ranks}
        deadline = time.monotonic() + STACK_DUMP_WAIT_S
        while time.monotonic() < deadline:
            time.sleep(0.05)
            latest = {rank: read_from(stack_files[rank], offsets[rank]) for rank in ranks}
            settled = all(latest[rank] and latest[rank] == stacks[rank] for rank in ranks)
            stacks = latest
            if settled:
                break
        return {rank: readable_stack(text) for rank, text in stacks.items()}

    def death_report(self, rank, when):
        """What a dead worker last wrote, then how it ended (last, as in a traceback)."""
        worker = self._workers[rank]
        return f"{worker.last_output()}\n{worker.death_line(when)}"

    def shutdown(self):
        """Stop the workers: ask politely, then kill. Idempotent."""
        if self.closed:
            return
        self.closed = True
        self.send_all(("exit",))
        deadline = time.monotonic() + EXIT_WAIT_S
        for worker in self._workers:
            try:
                worker.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        self._kill()

    def _kill(self, ranks=None):
        """Kill the workers of ``ranks`` (default: all), all at once, and close what the
        parent holds of them."""
        ranks = range(len(self._workers)) if ranks is None else ranks
        for rank in ranks:
            self._workers[rank].kill()
        for rank in ranks:
            self._workers[rank].close()


def _progress_bar(world_size):
    from .progress import progress_bar

    return progress_bar(world_size, "ranks started", unit="rank")
