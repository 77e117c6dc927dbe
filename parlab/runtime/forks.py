"""Asking the fork server (``parlab.runtime.fork_server``) for workers and programs: this
process's server, started on first use or inherited from the parent (``share``), and a handle
per fork that waits on it like a ``subprocess.Popen``. A fork the server cannot make (another
start-up environment, no Linux, PARLAB_FORK_SERVER=0, a server that failed to start) is None
here: the caller starts a fresh interpreter instead."""

import atexit
import hashlib
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

# The variables an interpreter reads as it starts or loads torch: a fork has the server's.
START_VARIABLES = ("PYTHON", "LD_", "OMP_", "MKL_", "KMP_", "TORCH_", "CUDA_", "NCCL_", "PARLAB_FORK")
READY_TIMEOUT_S = 120.0
PACKET = 1 << 20  # a message's bytes, at most
MAX_FDS = 16  # a request's descriptors, at most
# A child's inherited connection to its parent's server: "descriptor:key", read once, here.
SHARED = "PARLAB_SHARED_FORKS"
_inherited = os.environ.pop(SHARED, None)

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


def start_program(argv, env, folder, fds, workers_env):
    """Fork ``python -m argv[0] argv[1:]`` in ``folder`` with environment ``env``, its
    stdout and stderr going to ``fds[0]``, given ``fds[1:]`` at the same numbers; its
    workers, with environment ``workers_env``, fork from the same server. Returns its process
    handle (it is killed if this process dies), or None (see the module's docstring)."""
    with _lock:
        server = _current(workers_env)
        if server is None or server.key != _start_key(workers_env) or not server.wait_ready():
            return None
        return server.run(argv, env, folder, fds)


def inherit(given):
    """In a program the server became (``fork_server``): ``given`` is the connection to use,
    as a fresh interpreter reads it from its environment (``SHARED``) at import."""
    global _inherited
    _inherited = given


def prepare(env):
    """Start the server for workers with environment ``env`` now, without waiting for it: it
    loads torch while the parent does other work (a test session collecting its tests)."""
    with _lock:
        _current(env)


def share(env):
    """For a child process that will start clusters with environment ``env``: a new
    connection to this process's server, as (socket, variables to add to the child's
    environment); pass the socket's descriptor to the child (``pass_fds``), then close it
    here. None where this process has no server (the child starts its own, while it loads
    everything else, rather than wait here for one) or forks are not used."""
    with _lock:
        server = _server if _server is not None and _server.owner == os.getpid() and not _server.gone else None
        if server is None or server.key != _start_key(env) or not server.wait_ready():
            return None
        connection = server.connect()
        if connection is None:
            return None
        return connection, {SHARED: f"{connection.fileno()}:{_digest(server.key)}"}


def _current(env):
    """This process's server, inherited from its parent or started with ``env`` if there is
    none; None where forks are not used."""
    global _server
    if not sys.platform.startswith("linux") or env.get("PARLAB_FORK_SERVER") == "0":
        return None
    if _server is not None and _server.failed and _server.owner == os.getpid():
        return None
    if _server is None or _server.gone or _server.owner != os.getpid():
        _server = _inherited_server(env) or _Server(env, _start_key(env))
        atexit.register(_server.close)
    return _server


def _inherited_server(env):
    """The connection to the parent's server this process was given (``share``), if it
    matches ``env``'s start-up variables and really comes from the parent; used once."""
    global _inherited
    given, _inherited = _inherited, None
    try:
        fd, digest = given.split(":")
        sock = socket.socket(fileno=int(fd))
    except (AttributeError, ValueError, OSError):
        return None  # none given, or not a descriptor of this process
    peer_pid = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12) if sock.family == socket.AF_UNIX else b""
    if int.from_bytes(peer_pid[:4], sys.byteorder) != os.getppid() or digest != _digest(_start_key(env)):
        sock.detach()  # not ours to close
        return None
    return _Shared(sock, _start_key(env))


def _start_key(env):
    return sys.executable, tuple(sorted((k, v) for k, v in env.items() if k.startswith(START_VARIABLES)))


def _digest(key):
    return hashlib.sha256(repr(key).encode()).hexdigest()[:16]


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
        return self._ask(("fork", env, os.getcwd(), os.getpriority(os.PRIO_PROCESS, 0)), fds)

    def run(self, argv, env, folder, fds):
        """A program (``start_program``) and the write end of its watch pipe, which only this
        process holds: when it dies, the pipe closes and the program ends."""
        watch, held = os.pipe()
        request = ("run", env, folder, os.getpriority(os.PRIO_PROCESS, 0), list(argv), list(fds[1:]),
                   _digest(self.key))
        try:
            program = self._ask(request, (watch, *fds))
        finally:
            os.close(watch)
        if program is None:
            os.close(held)
        else:
            program.held = held
        return program

    def _ask(self, request, fds):
        """Send ``request`` with ``fds``; the fork's handle, or None if it failed."""
        with self.lock:
            try:
                socket.send_fds(self.sock, [pickle.dumps(request)], list(fds))
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

    def connect(self):
        """A new connection to the server, for a child process (``share``); None if it is gone."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with self.lock:
            try:
                socket.send_fds(self.sock, [pickle.dumps(("connect",))], [theirs.fileno()])
            except OSError:
                self._end()
                ours.close()
                return None
            finally:
                theirs.close()
        return ours

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
        """At the parent's exit: its forks are killed and their ends recorded (a cluster left
        open stops its workers after this, from its own finalizer), and the server leaves
        when its stdin closes."""
        if not self.gone:
            self._kill_forks()
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
        self._kill_forks()
        self.proc.kill()
        self.proc.wait()
        self.proc.stdin.close()
        self.sock.close()
        self.log.close()

    def _kill_forks(self):
        """Mark the server gone, kill the forks this process asked for, record their ends."""
        self.gone = True
        for pid in self.live:
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.ended[pid] = -signal.SIGKILL
        self.live.clear()


class _Shared(_Server):
    """A child's connection to its parent's server (``share``): it forks this process's
    workers, and the server's life is the parent's business."""

    def __init__(self, sock, key):
        self.key, self.gone, self.ready, self.failed, self.owner = key, False, True, False, os.getpid()
        self.lock = threading.Lock()
        self.ended, self.live = {}, set()
        self.sock = sock

    def close(self):
        """At this process's exit, as the parent's server's ``close``."""
        if not self.gone:
            self._end()

    def _end(self):
        self._kill_forks()
        self.sock.close()


class _Forked:
    """A fork (a worker or a program), held like a ``subprocess.Popen``: pid, poll, wait,
    kill (its session)."""

    def __init__(self, server, pid):
        self.server, self.pid, self.returncode, self.held = server, pid, None, None

    def poll(self):
        return self.wait(timeout=0.0, raise_on_timeout=False)

    def wait(self, timeout=None, raise_on_timeout=True):
        if self.returncode is None:
            self.returncode = self.server.exit_code(self.pid, timeout)
        if self.returncode is not None and self.held is not None:
            os.close(self.held)
            self.held = None
        if self.returncode is None and raise_on_timeout:
            raise subprocess.TimeoutExpired(f"fork {self.pid}", timeout)
        return self.returncode

    def kill(self):
        if self.poll() is None:
            try:
                os.killpg(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
