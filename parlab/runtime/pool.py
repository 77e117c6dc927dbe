"""The worker processes behind a Cluster: start them, talk to them, dump their stacks,
replace them, and make sure none outlives its parent.

Each worker is ``python -m parlab.runtime.worker`` in its own session (so a Ctrl-C in the
parent's terminal reaches only the parent), with

- a socket pair to the parent for messages,
- a pipe on its stdin that only the parent holds: when the parent dies the pipe closes and
  the worker exits (see ``worker._watch_parent``),
- a log file for anything written at the C level, and a stack file that faulthandler fills
  on SIGUSR1, which is how a stuck rank tells us where it is stuck.
"""

import json
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from multiprocessing.connection import Connection, wait

import parlab

STACK_DUMP_WAIT_S = 2.0
EXIT_WAIT_S = 5.0


class WorkerPool:
    def __init__(self, placement, start_timeout):
        from torch.distributed import TCPStore

        self.placement = placement
        self.start_timeout = start_timeout
        self.closed = False
        self._generation = 0
        self._procs, self._conns, self._ready = [], [], set()
        self._tmpdir = tempfile.mkdtemp(prefix="parlab-")
        # The rendezvous store lives in the parent on a port the OS picks, so clusters never
        # collide; each generation of workers uses its own key prefix in it.
        self._store = TCPStore("127.0.0.1", 0, placement.world_size, is_master=True, wait_for_workers=False)

    @property
    def pids(self):
        return [proc.pid for proc in self._procs]

    def start(self):
        """Start one generation of workers (does not wait for them to join)."""
        self._generation += 1
        self._procs, self._conns, self._ready = [], [], set()
        # Fixed for the life of these processes, whatever reinit() does to the generation.
        self._logs = [self._path(rank, "log") for rank in range(self.placement.world_size)]
        self._stacks = [self._path(rank, "stack") for rank in range(self.placement.world_size)]
        for rank in range(self.placement.world_size):
            parent_end, child_end = socket.socketpair()
            with open(self._logs[rank], "wb") as log:
                proc = subprocess.Popen(
                    [sys.executable, "-m", "parlab.runtime.worker"],
                    stdin=subprocess.PIPE,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    pass_fds=(child_end.fileno(),),
                    env=self._environment(rank, child_end.fileno()),
                    start_new_session=True,
                )
            child_end.close()
            self._procs.append(proc)
            self._conns.append(Connection(parent_end.detach()))

    def wait_ready(self):
        """Block until every worker has joined the process group."""
        deadline = time.monotonic() + self.start_timeout
        while len(self._ready) < self.placement.world_size:
            waiting = [c for r, c in enumerate(self._conns) if r not in self._ready]
            if not wait(waiting, max(0.0, deadline - time.monotonic())):
                self._give_up(
                    f"ranks {sorted(set(range(self.placement.world_size)) - self._ready)} did "
                    f"not join the process group within {self.start_timeout:g} s"
                )
            for conn in wait(waiting, 0):
                rank = self._conns.index(conn)
                message = self.receive(rank)
                if message is None:
                    self._give_up(self.death_report(rank))
                elif message[0] == "failed":
                    self._give_up(f"rank {rank} could not join the process group:\n{message[2]}")
                elif message[0] == "ready":
                    self._ready.add(rank)

    def _give_up(self, reason):
        self.shutdown()
        raise RuntimeError(f"the cluster could not start: {reason}")

    def send(self, rank, message):
        self._conns[rank].send_bytes(pickle.dumps(message))

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

    def all_alive(self):
        return all(proc.poll() is None for proc in self._procs)

    def reinit(self):
        """Rebuild the process group in the same processes (after a failed call that left
        every rank responsive): cheap, and drops any message still in flight."""
        self._generation += 1
        self._ready = set()
        for rank in range(self.placement.world_size):
            self.send(rank, ("reinit", self._generation))

    def restart(self):
        """Kill every worker and start a new generation; the next call waits for it."""
        self._kill()
        self.start()

    def dump_stacks(self, ranks):
        """Ask the given ranks for their Python stacks (faulthandler on SIGUSR1), all at once;
        a dump is complete when its file has stopped growing."""
        offsets = {rank: _size(self._stacks[rank]) for rank in ranks}
        for rank in ranks:
            _signal(self._procs[rank], signal.SIGUSR1)
        stacks = {rank: "" for rank in ranks}
        deadline = time.monotonic() + STACK_DUMP_WAIT_S
        while time.monotonic() < deadline:
            time.sleep(0.05)
            latest = {rank: _read_from(self._stacks[rank], offsets[rank]) for rank in ranks}
            settled = all(latest[rank] and latest[rank] == stacks[rank] for rank in ranks)
            stacks = latest
            if settled:
                break
        return {rank: _readable_stack(text) for rank, text in stacks.items()}

    def death_report(self, rank):
        proc = self._procs[rank]
        try:
            code = proc.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            code = None
        log = _read_from(self._logs[rank], 0)[-3000:]
        how = "closed its connection" if code is None else f"exited with code {code}"
        if code is not None and code < 0:
            how += f" ({signal.Signals(-code).name})"
        return f"rank {rank}'s worker process {how} during the call.\nIts last output:\n{log or '(none)'}"

    def shutdown(self):
        """Stop the workers: ask politely, then kill. Idempotent."""
        if self.closed:
            return
        self.closed = True
        for rank in range(len(self._procs)):
            try:
                self.send(rank, ("exit",))
            except OSError:
                pass
        deadline = time.monotonic() + EXIT_WAIT_S
        for proc in self._procs:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        self._kill()
        shutil.rmtree(self._tmpdir, ignore_errors=True)

    def _kill(self):
        for proc in self._procs:
            _signal(proc, signal.SIGKILL, group=True)
        for proc, conn in zip(self._procs, self._conns):
            proc.wait()
            conn.close()
            if proc.stdin:
                proc.stdin.close()

    def _path(self, rank, kind):
        return os.path.join(self._tmpdir, f"gen{self._generation}-rank{rank}.{kind}")

    def _environment(self, rank, conn_fd):
        package_root = os.path.dirname(os.path.dirname(os.path.abspath(parlab.__file__)))
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")]))
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
                "parent_pid": os.getpid(),
                "stack_file": self._stacks[rank],
                "sys_path": [p for p in sys.path if p],
            }
        )
        return env


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


def _size(path):
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def _read_from(path, offset):
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def _readable_stack(text):
    """Keep the threads that run user code, without the worker's own plumbing frames."""
    blocks = [block for block in text.strip().split("\n\n") if block]
    kept = [
        "\n".join(line for line in block.splitlines() if not _plumbing(line))
        for block in blocks
        if "in watch" not in block
    ]
    return "\n\n".join(kept)


def _plumbing(line):
    return "parlab/runtime/worker.py" in line or "<frozen runpy>" in line
