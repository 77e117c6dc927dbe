"""Start workers in milliseconds instead of seconds: a fork server.

Loading torch is nearly all of a worker's start (about 3 s of CPU on a laptop core, and 2 s
more with the first optimizer), and a lecture or a test suite starts hundreds of workers. So
each parent starts, once, an interpreter that loads torch and then waits; every worker is a
fork of it, with torch already loaded, its own session, and the same socket, pipe and files
a fresh interpreter gets (see ``parlab.runtime.process``). The server reaps its forks and
tells the parent how each ended. The parent's side, which asks for forks, is
``parlab.runtime.forks``.

A fork only equals a fresh interpreter when the variables read as an interpreter starts or
loads torch are the same, so a worker whose environment differs in one of them (PYTHONPATH,
OMP_NUM_THREADS, ...) is started as a fresh interpreter instead, as are all workers off Linux
or with PARLAB_FORK_SERVER=0 (to run code at a worker's interpreter start-up, say). A fork
takes the asking process's working folder, and its priority where that is lower.

A program that starts clusters of its own (the grader's pytest) runs as a fork of the server
too, ``python -m module`` without loading torch, with a connection to the server for its
workers; or, started as a fresh interpreter, it inherits a connection (``forks.share``).

Messages (pickled, one per packet): parent -> server ``("fork", environment, folder, nice)``
with the worker's four descriptors attached (stdin, log, connection, stack);
``("run", environment, folder, nice, argv, numbers, digest)`` with the program's watch pipe,
log and the descriptors it is given at ``numbers`` attached; or ``("connect",)`` with a new
connection attached (for a child, which then sends its own requests on it); server -> parent
``("ready",)`` once, then ``("started", pid)`` or ``("failed", traceback)`` per request, and
``("ended", pid, exit_code)`` on the connection that asked for the fork, whenever it ends
(exit codes as ``subprocess`` gives them).
"""

import atexit
import fcntl
import os
import pickle
import runpy
import select
import signal
import socket
import sys
import threading
import traceback

from parlab.runtime import forks
from parlab.runtime.forks import MAX_FDS, PACKET


def _serve():
    """The server: load torch, then fork a worker per request until the parent is gone."""
    control = socket.socket(fileno=int(os.environ.pop("PARLAB_FORK_SERVER_FD")))
    _take_priority(os.getpriority(os.PRIO_PROCESS, 0))  # it leads a session: its group takes its nice
    import cloudpickle  # noqa: F401
    import torch._dynamo  # noqa: F401  (a torch.optim optimizer loads it as it is made: 2 s more)
    import torch.distributed  # noqa: F401

    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(wake_write)
    control.send(pickle.dumps(("ready",)))
    connections, asked = [control], {}  # the parent's and its children's; fork pid -> who asked
    while True:
        readable, _, _ = select.select([*connections, wake_read, 0], [], [])
        if 0 in readable and not os.read(0, 1):
            os._exit(0)  # the parent is gone; so are its workers, which watch it too
        if wake_read in readable:
            os.read(wake_read, 4096)
            _reap(asked)
        for connection in [c for c in connections if c in readable]:
            message, fds, _, _ = socket.recv_fds(connection, PACKET, MAX_FDS)
            if not message and connection is control:
                os._exit(0)
            if not message:  # a child that shared the server has ended
                connections.remove(connection)
                connection.close()
            elif pickle.loads(message)[0] == "connect":
                connections.append(socket.socket(fileno=fds[0]))
            else:
                kind, *request = pickle.loads(message)
                _fork(kind, request, fds, connection, asked, connections, (wake_read, wake_write))
                _reap(asked)


def _fork(kind, request, fds, connection, asked, connections, wake_fds):
    # A program gets a connection of its own, for its workers; a worker needs none.
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET) if kind == "run" else (None, None)
    try:
        pid = os.fork()
    except OSError:
        _tell(connection, ("failed", traceback.format_exc()))
        pid = None
    if pid == 0 and kind == "run":
        ours.close()
        _become_program(request, fds, theirs)
    if pid == 0:
        _become_worker(request, fds, wake_fds)
    for fd in fds:
        os.close(fd)
    if theirs is not None:
        theirs.close()
        if pid:
            connections.append(ours)  # the program's requests for workers come in on it
        else:
            ours.close()
    if pid:
        asked[pid] = connection
        _tell(connection, ("started", pid))


def _reap(asked):
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _tell(asked.pop(pid, None), ("ended", pid, os.waitstatus_to_exitcode(status)))


def _tell(connection, message):
    try:
        connection.send(pickle.dumps(message))
    except (AttributeError, OSError):
        pass  # a child that shared the server and has ended


def _become_worker(request, fds, wake_fds):
    """In the fork: take the worker's descriptors, drop the server's, take the asking
    process's folder and priority, and run the worker."""
    env, folder, nice = request
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        os.setsid()
        stdin, log, conn, stack = fds
        os.dup2(stdin, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        for fd in {stdin, log, *wake_fds} | _open_descriptors() - {0, 1, 2, conn, stack}:
            try:
                os.close(fd)
            except OSError:
                pass
        os.chdir(folder)
        _take_priority(nice)
        os.environ.clear()
        os.environ.update(env)
        from parlab.runtime import worker

        worker.main(conn_fd=conn, stack_fd=stack)
    except BaseException:
        traceback.print_exc()
        os._exit(1)
    os._exit(0)


def _become_program(request, fds, connection):
    """In the fork: become ``python -m module args`` as a fresh interpreter would (the
    descriptors it is given at their numbers, its folder first on sys.path, its environment),
    with ``connection`` to this server for its workers; exit when the asking process's end of
    the watch pipe closes (it died), taking this program's session along."""
    env, folder, nice, argv, numbers, digest = request
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        os.setsid()
        watch, connection = _renumber(fds, numbers, connection.detach())
        os.environ.clear()
        os.environ.update(env)
        forks.inherit(f"{connection}:{digest}")
        threading.Thread(target=_exit_when_closed, args=(watch,), daemon=True).start()
        os.chdir(folder)
        _take_priority(nice)
        sys.argv, sys.path[0] = list(argv), folder
        code = _run_module(argv[0])
        sys.stdout.flush()
        sys.stderr.flush()
        atexit._run_exitfuncs()
    except BaseException:
        traceback.print_exc()
        os._exit(1)
    os._exit(code)


def _take_priority(nice):
    """The asking process's priority where it is lower (raising needs privileges), for this
    process and for its session's group, which is what Linux's autogroup weighs against
    other sessions (a worker does the same as it starts, ``worker._keep_priority``)."""
    if nice > os.getpriority(os.PRIO_PROCESS, 0):
        os.setpriority(os.PRIO_PROCESS, 0, nice)
    try:
        with open("/proc/self/autogroup", "w") as group:
            group.write(str(os.getpriority(os.PRIO_PROCESS, 0)))
    except OSError:
        pass  # not Linux, or no autogroup


def _renumber(fds, numbers, connection):
    """Put the given descriptors (``fds[2:]``) at ``numbers``, the log at 1 and 2, /dev/null at
    0, and close every other one but the watch pipe and ``connection`` (moved out of the way
    first); returns the numbers of these two."""
    watch, log, *given = fds
    top = max([*_open_descriptors(), *numbers]) + 1
    moved = [fcntl.fcntl(fd, fcntl.F_DUPFD, top) for fd in (watch, log, connection, *given)]
    for fd, number in zip(moved[3:], numbers):
        os.dup2(fd, number)
    os.dup2(moved[1], 1)
    os.dup2(moved[1], 2)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    for fd in _open_descriptors() - {0, 1, 2, moved[0], moved[2], *numbers}:
        try:
            os.close(fd)
        except OSError:
            pass
    return moved[0], moved[2]


def _run_module(module):
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as end:
        if end.code is None or isinstance(end.code, int):
            return end.code or 0
        print(end.code, file=sys.stderr)
        return 1
    return 0


def _exit_when_closed(fd):
    select.select([fd], [], [])
    os.killpg(0, signal.SIGKILL)


def _open_descriptors():
    return {int(fd) for fd in os.listdir("/proc/self/fd")}


if __name__ == "__main__":
    _serve()
