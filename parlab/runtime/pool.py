"""The worker processes behind a Cluster: start them, talk to them, dump their stacks,
replace them, and make sure none outlives its parent and none leaves a file behind.

Each worker is ``python -m parlab.runtime.worker`` in its own session (so a Ctrl-C in the
parent's terminal reaches only the parent), with

- a socket pair to the parent for messages,
- a pipe on its stdin that only the parent holds: when the parent dies the pipe closes and
  the worker exits (see ``worker._watch_parent``),
- a log file for anything written at the C level, and a stack file that faulthandler fills
  on SIGUSR1, which is how a stuck rank tells us where it is stuck.

Both files are anonymous: the parent creates them without a name (or unlinks the name at
once), hands the worker their file descriptors and reads them through its own. Whatever kills
the parent or the workers, SIGKILL included, the kernel frees the files with the last
descriptor and nothing is left on disk.
"""

import json
import os
import pickle
import signal
import socket
import subprocess
import sys
import tempfile
import time
from multiprocessing.connection import Connection, wait

from parlab.runtime.errors import readable_stack, worker_ended

STACK_DUMP_WAIT_S = 2.0
EXIT_WAIT_S = 5.0
# The folder that holds the parlab package, for workers started from a parent that found it
# through sys.path rather than an installation.
PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


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
        self._procs, self._conns, self._files, self._ready = [], [], [], set()
        self._lost = {}
        # The rendezvous store lives in the parent on a port the OS picks, so clusters never
        # collide; each generation of workers uses its own key prefix in it.
        self._store = TCPStore("127.0.0.1", 0, placement.world_size, is_master=True, wait_for_workers=False)

    @property
    def pids(self):
        return [proc.pid for proc in self._procs]

    @property
    def ranks(self):
        return range(self.placement.world_size)

    def start(self):
        """Start one generation of workers (does not wait for them to join). All start at
        once: measured, starting them a few at a time is slower, on a busy machine much so."""
        self._generation += 1
        self._fresh, self._ready = set(self.ranks), set()
        self._procs, self._conns, self._files = [], [], []
        for rank in self.ranks:
            proc, conn, files = self._spawn(rank)
            self._procs.append(proc)
            self._conns.append(conn)
            self._files.append(files)

    def _spawn(self, rank):
        """Start the worker of ``rank`` for the current generation; (process, connection, files)."""
        parent_end, child_end = socket.socketpair()
        log, stack = tempfile.TemporaryFile(prefix="parlab-"), tempfile.TemporaryFile(prefix="parlab-")
        proc = subprocess.Popen(
            [sys.executable, "-m", "parlab.runtime.worker"],
            stdin=subprocess.PIPE,
            stdout=log,
            stderr=subprocess.STDOUT,
            pass_fds=(child_end.fileno(), stack.fileno()),
            env=self._environment(rank, child_end.fileno(), stack.fileno()),
            start_new_session=True,
        )
        child_end.close()
        return proc, Connection(parent_end.detach()), (log, stack)

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
        waiting = [conn for rank, conn in enumerate(self._conns) if rank not in self._ready]
        answered = wait(waiting, max(0.0, deadline - time.monotonic()))
        if not answered:
            late = sorted(set(self.ranks) - self._ready)
            return {rank: (f"rank {rank} did not join the process group within {self.start_timeout:g} s", "")
                    for rank in late}
        for conn in answered:
            rank = self._conns.index(conn)
            message = self.receive(rank)
            when = "while starting" if rank in self._fresh else "while rebuilding its process group"
            if message is None:
                return {rank: (self.death_line(rank, when), self.last_output(rank))}
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
        return [rank for rank in range(len(self._conns)) if not self._send(rank, data)]

    def _send(self, rank, data):
        try:
            self._conns[rank].send_bytes(data)
        except OSError:
            return False
        return True

    def receive(self, rank):
        """The next message from ``rank``, or None if the worker is gone."""
        try:
            return pickle.loads(self._conns[rank].recv_bytes())
        except (EOFError, OSError):
            return None

    def pending_connections(self, done):
        return [conn for rank, conn in enumerate(self._conns) if rank not in done]

    def rank_of(self, conn):
        return self._conns.index(conn)

    def dead_ranks(self):
        return [rank for rank, proc in enumerate(self._procs) if proc.poll() is not None]

    def state(self):
        """In words: "closed", "restarting" (workers not all joined yet), "running", or which
        workers are dead (found out, reported and replaced by the next call)."""
        if self.closed:
            return "closed"
        dead = self.dead_ranks()
        if dead:
            lines = "; ".join(self.death_line(rank, wait_s=0) for rank in dead)
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
            self._procs[rank], self._conns[rank], self._files[rank] = self._spawn(rank)
        message, others = pickle.dumps(("reinit", self._generation)), set(self.ranks) - replace
        if any(not self._send(rank, message) for rank in others):
            self.restart()

    def restart(self):
        """Kill every worker and start a new generation; the next call waits for it."""
        self._kill()
        self.start()

    def interrupt(self):
        """Kill the workers and nothing else, safe while another thread talks to them: that
        thread sees them die and ends its call; ``shutdown`` then tidies up."""
        self._interrupted = True
        for proc in list(self._procs):
            _signal(proc, signal.SIGKILL, group=True)

    def dump_stacks(self, ranks):
        """Ask the given ranks for their Python stacks (faulthandler on SIGUSR1), all at once;
        a dump is complete when its file has stopped growing."""
        stack_files = {rank: self._files[rank][1] for rank in ranks}
        offsets = {rank: os.fstat(f.fileno()).st_size for rank, f in stack_files.items()}
        for rank in ranks:
            _signal(self._procs[rank], signal.SIGUSR1)
        stacks = {rank: "" for rank in ranks}
        deadline = time.monotonic() + STACK_DUMP_WAIT_S
        while time.monotonic() < deadline:
            time.sleep(0.05)
            latest = {rank: _read_from(stack_files[rank], offsets[rank]) for rank in ranks}
            settled = all(latest[rank] and latest[rank] == stacks[rank] for rank in ranks)
            stacks = latest
            if settled:
                break
        return {rank: readable_stack(text) for rank, text in stacks.items()}

    def death_line(self, rank, when=None, wait_s=1.0):
        """One line on how ``rank``'s worker ended (see ``errors.worker_ended``)."""
        try:
            code = self._procs[rank].wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            code = None
        return worker_ended(rank, code, when)

    def last_output(self, rank):
        log = _read_from(self._files[rank][0], 0)[-3000:].rstrip()
        return f"Last output of rank {rank}'s worker:\n{log or '(none)'}"

    def death_report(self, rank, when):
        """What a dead worker last wrote, then ``death_line`` (last, as in a traceback)."""
        return f"{self.last_output(rank)}\n{self.death_line(rank, when)}"

    def shutdown(self):
        """Stop the workers: ask politely, then kill. Idempotent."""
        if self.closed:
            return
        self.closed = True
        self.send_all(("exit",))
        deadline = time.monotonic() + EXIT_WAIT_S
        for proc in self._procs:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        self._kill()

    def _kill(self, ranks=None):
        """Kill the workers of ``ranks`` (default: all), all at once, and close what the
        parent holds of them."""
        ranks = range(len(self._procs)) if ranks is None else ranks
        for rank in ranks:
            _signal(self._procs[rank], signal.SIGKILL, group=True)
        for rank in ranks:
            self._procs[rank].wait()
            self._conns[rank].close()
            if self._procs[rank].stdin:
                self._procs[rank].stdin.close()
            for f in self._files[rank]:
                f.close()

    def _environment(self, rank, conn_fd, stack_fd):
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [PACKAGE_ROOT, env.get("PYTHONPATH")]))
        env["PARLAB_WORKER"] = json.dumps(
            {
                "rank": rank,
                "world_size": self.placement.world_size,
                "backend": self.placement.backend,
                "device_type": self.placement.device_type,
                "gpu_count": self.placement.gpu_count,
                "store_port": self._store.port,
                "generation": self._generation,
                "conn_fd": conn_fd,
                "stack_fd": stack_fd,
                "parent_pid": os.getpid(),
                "start_timeout": self.start_timeout,
                "sys_path": [p for p in sys.path if p],
            }
        )
        return env


def _progress_bar(world_size):
    from .progress import progress_bar

    return progress_bar(world_size, "ranks started", unit="rank")


def _signal(proc, signum, group=False):
    if proc.poll() is not None:
        return
    try:
        if group:
            os.killpg(proc.pid, signum)
        else:
            os.kill(proc.pid, signum)
    except ProcessLookupError:
        pass


def _read_from(file, offset):
    """The text of an open file from ``offset`` on, read without moving the file's position
    (the worker writes through a descriptor that shares it)."""
    size = os.fstat(file.fileno()).st_size
    return os.pread(file.fileno(), max(0, size - offset), offset).decode(errors="replace")
