"""One worker process, as its parent holds it: the process, the parent's end of its socket,
and its two files.

Each worker is ``python -m parlab.runtime.worker`` (or, much faster, a fork of an
interpreter that has loaded torch already: ``parlab.runtime.fork_server``) in its own
session (so a Ctrl-C in the parent's terminal reaches only the parent), with

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
from multiprocessing.connection import Connection

from parlab.runtime import forks
from parlab.runtime.errors import worker_ended

# The folder that holds the parlab package, for workers started from a parent that found it
# through sys.path rather than an installation.
PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class WorkerProcess:
    """The worker of ``rank``, started at construction (it then joins the process group on
    its own). ``settings``: what the pool tells every worker of its generation (world size,
    backend, store port, generation, ...), passed on in the PARLAB_WORKER variable with this
    worker's rank and descriptors."""

    def __init__(self, rank, settings):
        self.rank = rank
        parent_end, child_end = socket.socketpair()
        self.log, self.stack = tempfile.TemporaryFile(prefix="parlab-"), tempfile.TemporaryFile(prefix="parlab-")
        try:
            self.proc = self._fork(settings, child_end) or self._start(settings, child_end)
        finally:
            child_end.close()
        self.conn = Connection(parent_end.detach())

    def _fork(self, settings, child_end):
        """The worker as a fork of the fork server (loaded torch already), or None."""
        stdin_read, stdin_write = os.pipe()
        fds = (stdin_read, self.log.fileno(), child_end.fileno(), self.stack.fileno())
        try:
            proc = forks.start_worker(_environment(settings, self.rank, -1, -1), fds)
        finally:
            os.close(stdin_read)
        if proc is None:
            os.close(stdin_write)
            return None
        proc.stdin = os.fdopen(stdin_write, "wb")
        return proc

    def _start(self, settings, child_end):
        """The worker as a fresh interpreter."""
        return subprocess.Popen(
            [sys.executable, "-m", "parlab.runtime.worker"],
            stdin=subprocess.PIPE,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            pass_fds=(child_end.fileno(), self.stack.fileno()),
            env=_environment(settings, self.rank, child_end.fileno(), self.stack.fileno()),
            start_new_session=True,
        )

    @property
    def pid(self):
        return self.proc.pid

    def send(self, data):
        """Send pickled ``data``; False if the worker is gone."""
        try:
            self.conn.send_bytes(data)
        except OSError:
            return False
        return True

    def receive(self):
        """The next message, or None if the worker is gone."""
        try:
            return pickle.loads(self.conn.recv_bytes())
        except (EOFError, OSError):
            return None

    def dead(self):
        return self.proc.poll() is not None

    def signal(self, signum, group=False):
        """Send ``signum`` to the worker (with ``group``, to its whole session) unless it ended."""
        if self.dead():
            return
        try:
            if group:
                os.killpg(self.proc.pid, signum)
            else:
                os.kill(self.proc.pid, signum)
        except ProcessLookupError:
            pass

    def kill(self):
        """SIGKILL to its session, without waiting: ``close`` waits."""
        self.signal(signal.SIGKILL, group=True)

    def close(self):
        """Wait for the (killed) process and close what the parent holds of it."""
        self.proc.wait()
        self.conn.close()
        if self.proc.stdin:
            self.proc.stdin.close()
        self.log.close()
        self.stack.close()

    def death_line(self, when=None, wait_s=1.0):
        """One line on how the worker ended (see ``errors.worker_ended``)."""
        try:
            code = self.proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            code = None
        return worker_ended(self.rank, code, when)

    def last_output(self):
        log = read_from(self.log, 0)[-3000:].rstrip()
        return f"Last output of rank {self.rank}'s worker:\n{log or '(none)'}"


def prepare_workers():
    """Have the fork server load torch now, so that the first workers start at once: for a
    process that will start clusters and has other work to do first."""
    forks.prepare(worker_environment())


def start_module(module, args, env, folder, log, pass_fds=()):
    """``python -m module args`` in ``folder`` with environment ``env``, its stdout and stderr
    in ``log``, ``pass_fds`` kept at their numbers: a process handle (pid, poll, wait, kill,
    returncode). A program that starts clusters (the grader's pytest) is best a fork of the
    fork server: it starts without loading torch, and its workers fork from the same server.
    Otherwise a fresh interpreter, given a connection to this process's server if it has one."""
    fds, folder, workers_env = (log.fileno(), *pass_fds), os.fspath(folder), worker_environment(env)
    program = forks.start_program([module, *args], env, folder, fds, workers_env)
    if program is not None:
        return program
    shared = forks.share(workers_env)
    connection, variables = shared or (None, {})
    try:
        return subprocess.Popen(
            [sys.executable, "-m", module, *args], cwd=folder, env={**env, **variables},
            stdout=log, stderr=subprocess.STDOUT,
            pass_fds=(*pass_fds, *([connection.fileno()] if connection else [])),
        )
    finally:
        if connection:
            connection.close()


def worker_environment(env=None):
    """The parent's environment (or ``env``), with the parlab package findable."""
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [PACKAGE_ROOT, env.get("PYTHONPATH")]))
    return env


def _environment(settings, rank, conn_fd, stack_fd):
    env = worker_environment()
    env["PARLAB_WORKER"] = json.dumps(
        {
            "rank": rank,
            **settings,
            "conn_fd": conn_fd,
            "stack_fd": stack_fd,
            "parent_pid": os.getpid(),
            "sys_path": [p for p in sys.path if p],
        }
    )
    return env


def waited_for_a_cpu_s(pid):
    """Seconds the main thread of process ``pid`` has spent ready to run while every CPU was
    busy with other work (Linux's /proc/<pid>/schedstat, second field); 0.0 where that cannot
    be read (not Linux, or the process is gone)."""
    try:
        with open(f"/proc/{pid}/schedstat") as stats:
            return int(stats.read().split()[1]) / 1e9
    except (OSError, ValueError, IndexError):
        return 0.0


def read_from(file, offset):
    """The text of an open file from ``offset`` on, read without moving the file's position
    (the worker writes through a descriptor that shares it)."""
    size = os.fstat(file.fileno()).st_size
    return os.pread(file.fileno(), max(0, size - offset), offset).decode(errors="replace")
