"""Start workers in milliseconds instead of seconds: a fork server.

Loading torch is nearly all of a worker's start (about 3 s of CPU on a laptop core, and 2 s
more with the first optimizer), and a lecture or a test suite starts hundreds of workers. So
each parent starts, once, an interpreter that loads torch and then waits; every worker is a
fork of it, with torch already loaded, its own session, and the same socket, pipe and files
a fresh interpreter gets (see ``parlab.runtime.process``). The server reaps its forks and
tells the parent how each ended.

A fork only equals a fresh interpreter when the variables read as an interpreter starts or
loads torch are the same, so a worker whose environment differs in one of them (PYTHONPATH,
OMP_NUM_THREADS, ...) is started as a fresh interpreter instead, as are all workers off Linux
or with PARLAB_FORK_SERVER=0 (to run code at a worker's interpreter start-up, say).

Messages (pickled, one per packet): parent -> server ``(environment,)`` with the worker's
four descriptors attached (stdin, log, connection, stack); server -> parent ``("ready",)``
once, then ``("started", pid)`` or ``("failed", traceback)`` per request, and
``("ended", pid, exit_code)`` whenever a fork ends (exit codes as ``subprocess`` gives them).
"""

import atexit
import os
import pickle
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback

# The variables an interpreter reads as it starts or loads torch: a fork has the server's.
START_VARIABLES = ("PYTHON", "LD_", "OMP_", "MKL_", "KMP_", "TORCH_", "CUDA_", "NCCL_", "PARLAB_FORK")
READY_TIMEOUT_S = 120.0
PACKET = 1 << 20

_lock = threading.Lock()
_server = None


def start_worker(env, fds):
    """Fork a worker with environment ``env`` holding ``fds`` = (stdin, log, connection,
    stack) as descriptors; returns its process handle, or None where a fresh interpreter must
    start it instead (see the module's docstring)."""
    with _lock:
        server = _current(env)
        if server is None or server.key != _start_key(env) or not server.wait_ready():
            return None
        return server.fork(env, fds)


def prepare(env):
    """Start the server for workers with environment ``env`` now, without waiting for it: it
    loads torch while the parent does other work (a test session collecting its tests)."""
    with _lock:
        _current(env)


def _current(env):
    """This process's server, started with ``env`` if there is none; None where forks are
    not used."""
    global _server
    if not sys.platform.startswith("linux") or env.get("PARLAB_FORK_SERVER") == "0":
        return None
    if _server is not None and _server.failed and _server.owner == os.getpid():
        return None
    if _server is None or _server.gone or _server.owner != os.getpid():
        _server = _Server(env, _start_key(env))
        atexit.register(_server.close)
    return _server


def _start_key(env):
    return sys.executable, tuple(sorted((k, v) for k, v in env.items() if k.startswith(START_VARIABLES)))


class _Server:
    """The parent's side of the fork server."""

    def __init__(self, env, key):
        self.key, self.gone, self.ready, self.failed, self.owner = key, False, False, False, os.getpid()
        self.lock = threading.Lock()
        self.ended, self.live = {}, set()  # pid -> exit code; forks not yet ended
        parent_end, child_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.log = tempfile.TemporaryFile(prefix="parlab-")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "parlab.runtime.fork_server"],
            stdin=subprocess.PIPE, stdout=self.log, stderr=subprocess.STDOUT,
            pass_fds=(child_end.fileno(),),
            env={**{k: v for k, v in env.items() if k != "PARLAB_WORKER"},
                 "PARLAB_FORK_SERVER_FD": str(child_end.fileno())},
            start_new_session=True,
        )
        child_end.close()
        self.sock = parent_end

    def wait_ready(self):
        """True once the server has loaded torch; False (and the server gone) if it failed."""
        if self.ready:
            return True
        try:
            answered, _, _ = select.select([self.sock], [], [], READY_TIMEOUT_S)
            data = self.sock.recv(PACKET) if answered else b""
        except BaseException:
            self._end()
            raise
        self.ready = bool(data) and pickle.loads(data) == ("ready",)
        if not self.ready:
            self.failed = True  # it could not load torch: fresh interpreters from now on
            self._end()
        return self.ready

    def fork(self, env, fds):
        with self.lock:
            try:
                socket.send_fds(self.sock, [pickle.dumps((env,))], list(fds))
                while True:
                    message = self._next(None)
                    if message is None or message[0] == "failed":
                        return None
                    if message[0] == "started":
                        self.live.add(message[1])
                        return _Forked(self, message[1])
            except OSError:
                self._end()
                return None

    def exit_code(self, pid, timeout):
        """``pid``'s exit code, once it has ended; None while it runs (waits up to ``timeout``
        seconds, None: for ever), in short slices so other threads can ask in between."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self.lock:
                if pid in self.ended or self.gone:
                    return self.ended.get(pid)
                remaining = 0.05 if deadline is None else min(0.05, max(0.0, deadline - time.monotonic()))
                self._next(remaining)
                if remaining == 0.0:
                    return self.ended.get(pid)

    def _next(self, timeout):
        """The next message other than "ended" (recorded on the way), or None: none within
        ``timeout`` s, or the server is gone (its forks are then killed)."""
        while not self.gone:
            answered, _, _ = select.select([self.sock], [], [], timeout)
            if not answered:
                return None
            data = self.sock.recv(PACKET)
            if not data:
                self._end()
                return None
            message = pickle.loads(data)
            if message[0] != "ended":
                return message
            self.ended[message[1]] = message[2]
            self.live.discard(message[1])
            timeout = 0.0
        return None

    def close(self):
        """At the parent's exit: the server leaves when its stdin closes."""
        if not self.gone:
            self.gone = True
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=1.0)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.sock.close()
            self.log.close()

    def _end(self):
        """The server is gone or failed: kill it and its forks (they would leave on their own,
        seeing their parent gone, but their ends must be known here)."""
        self.gone = True
        for pid in self.live:
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.ended[pid] = -signal.SIGKILL
        self.live.clear()
        self.proc.kill()
        self.proc.wait()
        self.proc.stdin.close()
        self.sock.close()
        self.log.close()


class _Forked:
    """A forked worker, held like a ``subprocess.Popen``: pid, poll, wait."""

    def __init__(self, server, pid):
        self.server, self.pid, self.returncode = server, pid, None

    def poll(self):
        return self.wait(timeout=0.0, raise_on_timeout=False)

    def wait(self, timeout=None, raise_on_timeout=True):
        if self.returncode is None:
            self.returncode = self.server.exit_code(self.pid, timeout)
        if self.returncode is None and raise_on_timeout:
            raise subprocess.TimeoutExpired(f"worker {self.pid}", timeout)
        return self.returncode


def _serve():
    """The server: load torch, then fork a worker per request until the parent is gone."""
    control = socket.socket(fileno=int(os.environ.pop("PARLAB_FORK_SERVER_FD")))
    import cloudpickle  # noqa: F401
    import torch._dynamo  # noqa: F401  (a torch.optim optimizer loads it as it is made: 2 s more)
    import torch.distributed  # noqa: F401

    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(wake_write)
    control.send(pickle.dumps(("ready",)))
    while True:
        readable, _, _ = select.select([control, wake_read, 0], [], [])
        if 0 in readable and not os.read(0, 1):
            os._exit(0)  # the parent is gone; so are its workers, which watch it too
        if wake_read in readable:
            os.read(wake_read, 4096)
            _reap(control)
        if control in readable:
            message, fds, _, _ = socket.recv_fds(control, PACKET, 4)
            if not message:
                os._exit(0)
            env = pickle.loads(message)[0]
            try:
                pid = os.fork()
            except OSError:
                control.send(pickle.dumps(("failed", traceback.format_exc())))
                pid = None
            if pid == 0:
                _become_worker(env, fds, control, (wake_read, wake_write))
            for fd in fds:
                os.close(fd)
            if pid:
                control.send(pickle.dumps(("started", pid)))
            _reap(control)


def _reap(control):
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        control.send(pickle.dumps(("ended", pid, os.waitstatus_to_exitcode(status))))


def _become_worker(env, fds, control, wake_fds):
    """In the fork: take the worker's descriptors, drop the server's, and run the worker."""
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        os.setsid()
        stdin, log, conn, stack = fds
        os.dup2(stdin, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        control.detach()
        for fd in {stdin, log, *wake_fds} | _open_descriptors() - {0, 1, 2, conn, stack}:
            try:
                os.close(fd)
            except OSError:
                pass
        os.environ.clear()
        os.environ.update(env)
        from parlab.runtime import worker

        worker.main(conn_fd=conn, stack_fd=stack)
    except BaseException:
        traceback.print_exc()
        os._exit(1)
    os._exit(0)


def _open_descriptors():
    return {int(fd) for fd in os.listdir("/proc/self/fd")}


if __name__ == "__main__":
    _serve()
