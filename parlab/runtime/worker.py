"""One rank of a parlab.Cluster: a process that joins the process group once, then runs
whatever functions the parent sends, until told to exit or the parent disappears.

Started by the parent as ``python -m parlab.runtime.worker`` with its settings in the
PARLAB_WORKER environment variable (JSON) and a socket to the parent on file descriptor
``conn_fd``. Messages both ways are pickled tuples:

    parent -> worker   ("run", call_id, payload, traced, regime) | ("reinit", generation) | ("exit",)
    worker -> parent   ("started", rank) | ("ready", rank) | ("out", stream, text) |
                       ("done", call_id, ok, result_or_traceback, events)

Process groups that calls create and leave alive (``dist.new_group``, a ``parlab.Mesh`` left
open) are destroyed once more than KEPT_GROUPS of them are, the oldest first, when a call
returns: each gloo group keeps a thread that wakes every 10 ms whether or not a message comes
(``epoll_wait`` with a 10 ms timeout in gloo's ``gloo/transport/tcp/loop.cc``, ``Loop::run``,
at commit 2242f7d), so a worker that ran a hundred calls each making a group would spend its
cores waking a hundred threads. The most recent ones are kept: a group made right after one
of the same ranks was destroyed has failed gloo's connection under load.
"""

import faulthandler
import json
import os
import pickle
import select
import signal
import sys
import threading
import traceback
from datetime import timedelta
from multiprocessing.connection import Connection

from parlab.runtime import emulation

# Gloo waits this long inside a collective before giving up. The cluster's own call timeout
# is what normally ends a hang; this only keeps an abandoned worker from waiting forever.
PROCESS_GROUP_TIMEOUT = timedelta(minutes=30)
# Leaving a process group takes milliseconds, unless an operation left running in it can never
# end (see _destroy_process_group).
LEAVE_TIMEOUT_S = 10.0
# Process groups made by calls and still alive that a worker keeps (module docstring).
KEPT_GROUPS = 8
_made_by_calls = []  # their names, in the order they were made (a reference would keep a group alive)


def main(conn_fd=None, stack_fd=None):
    """Run the worker. A fork of ``parlab.runtime.fork_server`` passes the descriptors it
    received (their numbers differ from the parent's) and watches the server as its parent."""
    config = json.loads(os.environ.pop("PARLAB_WORKER"))
    if conn_fd is not None:
        config.update(conn_fd=conn_fd, stack_fd=stack_fd, parent_pid=os.getppid())
    for path in reversed(config["sys_path"]):
        if path not in sys.path:
            sys.path.insert(0, path)
    _watch_parent(config["parent_pid"])
    _keep_priority()
    # The parent holds this file too and reads the stacks from it (see parlab.runtime.pool).
    faulthandler.register(signal.SIGUSR1, file=config["stack_fd"], all_threads=True)
    # A rank that dies of a fatal signal leaves its Python stack in its log, which the parent
    # shows: gloo aborts a rank (SIGABRT) on a message longer than its receive, from a thread
    # of its own, and the stack tells which receive it was (see errors.explain_size_mismatch).
    faulthandler.enable(file=sys.stderr, all_threads=True)
    emulation.lower_timer_slack()

    conn = Connection(config["conn_fd"])
    rank = config["rank"]
    try:
        # Loading torch is most of a start; joining the group ends together for all ranks, so
        # this is the moment a progress bar can count.
        import torch.distributed  # noqa: F401

        conn.send_bytes(pickle.dumps(("started", rank)))
        _init_process_group(config, config["generation"])
    except BaseException:
        conn.send_bytes(pickle.dumps(("failed", rank, traceback.format_exc())))
        return
    conn.send_bytes(pickle.dumps(("ready", rank)))
    _serve(conn, config)


def _serve(conn, config):
    from parlab import trace

    lock = threading.Lock()

    def reply(message):
        data = pickle.dumps(message)
        with lock:
            conn.send_bytes(data)

    while True:
        try:
            message = pickle.loads(conn.recv_bytes())
        except EOFError:
            return
        if message[0] == "exit":
            # Skip the interpreter's and torch's slow teardown: nothing here needs it, and
            # the process group dies with the process.
            sys.stdout.flush()
            os._exit(0)
        if message[0] == "reinit":
            _made_by_calls.clear()  # destroyed with the process group; the next ones reuse the names
            try:
                _destroy_process_group()
                _init_process_group(config, message[1])
            except BaseException:
                reply(("failed", config["rank"], traceback.format_exc()))
                return
            reply(("ready", config["rank"]))
            continue
        _, call_id, payload, traced, regime = message
        _begin_call(regime, config["rank"])
        groups = set(_live_groups())  # names only: a reference would keep a group alive
        out, err = sys.stdout, sys.stderr
        sys.stdout, sys.stderr = _Stream("stdout", reply), _Stream("stderr", reply)
        if traced:
            trace.start(config["rank"])
        try:
            ok, result = _run_call(payload)
        finally:
            events = trace.stop() if traced else []
            sys.stdout, sys.stderr = out, err
        _destroy_groups_made_since(groups)
        reply(("done", call_id, ok, result, events))


class _Stream:
    """Stands in for sys.stdout/sys.stderr during a call: forwards each write to the parent,
    which prints it after the call, prefixed with the rank, in rank order."""

    encoding = "utf-8"

    def __init__(self, name, reply):
        self.name, self._reply = name, reply

    def write(self, text):
        if text:
            self._reply(("out", self.name, text))
        return len(text)

    def flush(self):
        pass

    def isatty(self):
        return False


def _run_call(payload):
    """Unpickle and call the function; returns (True, pickled result) or (False, traceback)."""
    import cloudpickle

    try:
        fn, args, kwargs = cloudpickle.loads(payload)
    except BaseException as exc:
        return False, _format_failure(exc, "The function could not be unpickled on this rank: ")
    try:
        result = fn(*args, **kwargs)
    except BaseException as exc:
        return False, _format_failure(exc)
    try:
        return True, cloudpickle.dumps(result)
    except BaseException as exc:
        return False, _format_failure(
            exc,
            "The function's return value could not be sent back to the parent: return tensors, "
            "numbers, or lists and dicts of them, not open files, locks or generators. ",
        )


def _format_failure(exc, explanation=""):
    """The traceback as the learner wants it: from their function down, without our loop."""
    tb = exc.__traceback__.tb_next if exc.__traceback__ else None
    text = "".join(traceback.format_exception(type(exc), exc, tb))
    return text + (f"\n{explanation}\n" if explanation else "")


def _init_process_group(config, generation):
    import torch
    import torch.distributed as dist

    from parlab.runtime.context import set_device
    from parlab.runtime.placement import Placement

    rank, world_size = config["rank"], config["world_size"]
    device = Placement(world_size, config["backend"], config["device_type"], config["gpu_count"]).device(rank)
    set_device(device)
    if config["device_type"] == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        # Ranks share the machine's cores; more intra-op threads than cores only thrash.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    # The first ranks wait here for the last to start, as long as the parent waits for all.
    store = dist.TCPStore(
        "127.0.0.1", config["store_port"], world_size, is_master=False,
        timeout=timedelta(seconds=config["start_timeout"]),
    )
    dist.init_process_group(
        config["backend"],
        store=dist.PrefixStore(f"generation{generation}", store),
        rank=rank,
        world_size=world_size,
        timeout=PROCESS_GROUP_TIMEOUT,
        device_id=torch.device(device) if config["backend"] == "nccl" else None,
    )


def _begin_call(regime, rank):
    """Put the call's time regime in place (``parlab.runtime.emulation``). Emulated links
    need a second process group for the messages' headers: every rank gets the same regime
    with every call, so all create it together, once per process group."""
    emulation.begin_call(regime, rank)
    if regime.network is not None and emulation.header_group() is None:
        import torch.distributed as dist

        emulation.set_header_group(dist.new_group(backend="gloo"))


def _live_groups():
    """The process groups alive now, by name (none before the process group exists)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return {}
    from torch.distributed.distributed_c10d import _world

    return {name: group for group, name in _world.pg_names.items()}


def _destroy_groups_made_since(groups):
    """Note the process groups created since those named ``groups`` were alive, and destroy the oldest
    of those calls made beyond KEPT_GROUPS (module docstring), within LEAVE_TIMEOUT_S: a group
    still running an operation that a call started and never waited for may not be left."""
    live = _live_groups()
    _made_by_calls[:] = [name for name in _made_by_calls if name in live]  # a Mesh destroys its own
    _made_by_calls.extend(sorted(live.keys() - groups, key=lambda name: (len(name), name)))  # counts
    if len(_made_by_calls) <= KEPT_GROUPS:
        return
    oldest = [live[name] for name in _made_by_calls[:-KEPT_GROUPS]]
    del _made_by_calls[:-KEPT_GROUPS], live
    import torch.distributed as dist

    leaving = threading.Thread(target=_call_into, args=(lambda: [dist.destroy_process_group(g) for g in oldest], []),
                               daemon=True)
    leaving.start()
    leaving.join(LEAVE_TIMEOUT_S)


def _destroy_process_group():
    """Leave the process group, within LEAVE_TIMEOUT_S: leaving waits for the operations
    still running in it, and one that a function started without waiting for it (an
    ``async_op=True`` collective, say) and that waits for a rank doing something else never
    ends. Past the limit this raises, and the parent replaces every worker."""
    import torch.distributed as dist

    emulation.set_header_group(None)  # destroyed with the group
    if not dist.is_initialized():
        return
    errors = []
    leaving = threading.Thread(target=_call_into, args=(dist.destroy_process_group, errors), daemon=True)
    leaving.start()
    leaving.join(LEAVE_TIMEOUT_S)
    if leaving.is_alive():
        raise TimeoutError(
            f"this rank could not leave its process group within {LEAVE_TIMEOUT_S:g} s: an operation it started "
            "without waiting for it (async_op=True, isend, irecv) still waits for another rank"
        )
    if errors:
        raise errors[0]


def _call_into(fn, errors):
    try:
        fn()
    except BaseException as exc:
        errors.append(exc)


def _keep_priority():
    """A worker leads a session of its own, and where Linux schedules each session as a group
    (autogroup), the group's priority is what counts: without this, the workers of a parent
    run under ``nice`` would compete at full priority. The group takes the worker's nice value,
    inherited from its parent."""
    try:
        with open("/proc/self/autogroup", "w") as group:
            group.write(str(os.getpriority(os.PRIO_PROCESS, 0)))
    except OSError:
        pass  # not Linux, or no autogroup


def _watch_parent(parent_pid):
    """Exit as soon as the parent is gone: its end of our stdin closes (EOF) when it dies,
    however it dies; re-parenting is the fallback if another process holds the pipe."""

    def watch():
        while True:
            readable, _, _ = select.select([sys.stdin], [], [], 1.0)
            if readable and not os.read(sys.stdin.fileno(), 1):
                os._exit(1)
            if os.getppid() != parent_pid:
                os._exit(1)

    threading.Thread(target=watch, name="parlab-parent-watch", daemon=True).start()


if __name__ == "__main__":
    main()
