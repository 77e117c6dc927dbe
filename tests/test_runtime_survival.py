"""The runtime survives what learners do to it: workers killed behind its back (while idle,
while starting, while their process group is rebuilt), calls from two threads at once, and
close() from another thread. Each test starts its own small cluster, since it breaks it."""

import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
import torch.distributed as dist
from test_runtime import all_reduce_ranks, is_alive, run_script

import parlab
from parlab.collectives import ring_all_reduce
from parlab.runtime import cluster as cluster_module
from parlab.runtime.process import waited_for_a_cpu_s

pytestmark = pytest.mark.timeout(120)
TESTS = os.path.dirname(os.path.abspath(__file__))


def kill_and_wait(pid, signum):
    os.kill(pid, signum)
    deadline = time.monotonic() + 10
    while is_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not is_alive(pid)


@pytest.mark.parametrize("call", ["run", "trace"])
def test_a_worker_killed_while_idle_is_reported_once_then_replaced(call):
    with parlab.Cluster(world_size=2, timeout=60) as cluster:
        survivor, victim = cluster.pids
        kill_and_wait(victim, signal.SIGKILL)
        assert "rank 1's worker was killed by SIGKILL" in repr(cluster)

        with pytest.raises(parlab.RankError) as info:
            getattr(cluster, call)(all_reduce_ranks)
        assert info.value.ranks == [1] and info.value.dead == [1]
        assert str(info.value).splitlines()[0] == (
            "rank 1's worker was killed by SIGKILL while idle (out of memory, or a kill -9?). The call did not run; "
            "rank 1's worker was replaced (anything it kept between calls is gone), so run it again."
        )
        assert victim not in cluster.pids
        assert cluster.pids[0] == survivor  # it re-joins the new process group in its own process
        assert repr(cluster).endswith("; restarting>")  # the new workers join during the next call

        result = getattr(cluster, call)(all_reduce_ranks)
        assert (result if call == "run" else result.results) == [1.0, 1.0]
        assert repr(cluster).endswith("; running>")


def test_every_dead_worker_is_named_with_its_signal():
    with parlab.Cluster(world_size=3, timeout=60) as cluster:
        survivor = cluster.pids[1]
        kill_and_wait(cluster.pids[0], signal.SIGKILL)
        kill_and_wait(cluster.pids[2], signal.SIGTERM)
        with pytest.raises(parlab.RankError) as info:
            cluster.run(all_reduce_ranks)
        assert info.value.ranks == [0, 2]
        assert str(info.value).splitlines()[0].startswith(
            "rank 0's worker was killed by SIGKILL while idle (out of memory, or a kill -9?); "
            "rank 2's worker was killed by SIGTERM while idle. The call did not run; the workers of ranks 0, 2 "
            "were replaced"
        )
        assert cluster.run(all_reduce_ranks) == [3.0] * 3
        assert cluster.pids[1] == survivor


def test_close_with_dead_workers_leaves_no_process():
    cluster = parlab.Cluster(world_size=2, timeout=60)
    pids = cluster.pids
    kill_and_wait(pids[0], signal.SIGKILL)
    cluster.close()
    assert not any(is_alive(pid) for pid in pids)
    assert cluster.closed and repr(cluster).endswith("; closed>")


def _worker_processes():
    """Live worker processes that are children of this process."""
    found = set()
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/status") as status:
                fields = dict(line.split(":\t", 1) for line in status.read().splitlines() if ":\t" in line)
            with open(f"/proc/{entry}/cmdline", "rb") as cmdline:
                command = cmdline.read()
        except (FileNotFoundError, NotADirectoryError, ProcessLookupError):
            continue
        if fields.get("PPid") == str(os.getpid()) and b"parlab.runtime.worker" in command:
            if not fields.get("State", "").startswith("Z"):
                found.add(int(entry))
    return found


def rank_1_at_start_up(tmp_path, action):
    """Make rank 1's worker run ``action`` as its interpreter starts: Python imports
    sitecustomize at start-up, from the folder returned, when it is on PYTHONPATH."""
    (tmp_path / "sitecustomize.py").write_text(textwrap.dedent(f"""
        import json, os, signal, time
        if json.loads(os.environ.get("PARLAB_WORKER", "{{}}")).get("rank") == 1:
            {action}
    """))
    return str(tmp_path)


def test_a_worker_dying_while_starting_is_reported_and_the_others_stopped(tmp_path, monkeypatch):
    kill = "os.kill(os.getpid(), signal.SIGKILL)"
    monkeypatch.setenv("PYTHONPATH", rank_1_at_start_up(tmp_path, kill), prepend=os.pathsep)
    before = _worker_processes()
    with pytest.raises(RuntimeError, match="could not start: .*rank 1's worker was killed by SIGKILL while starting"):
        parlab.Cluster(world_size=2, start_timeout=60)
    assert _worker_processes() - before == set()


def test_an_interrupted_start_leaves_no_worker_even_if_the_exception_is_kept(tmp_path):
    # IPython keeps the last exception, and with it the half-made cluster, alive.
    script = tmp_path / "start.py"
    script.write_text(textwrap.dedent("""
        import os, signal, threading, parlab
        from test_runtime_survival import _worker_processes
        signal.signal(signal.SIGINT, signal.default_int_handler)  # not inherited ignored (a shell's background job)
        threading.Timer(3.0, os.kill, (os.getpid(), signal.SIGINT)).start()
        try:
            parlab.Cluster(world_size=2, start_timeout=60)
        except KeyboardInterrupt as exc:
            kept = exc
        print("workers left:", sorted(_worker_processes()))
    """))
    paths = [rank_1_at_start_up(tmp_path, "time.sleep(60)"), TESTS, os.environ.get("PYTHONPATH")]
    # Fresh interpreters: a fork of the fork server would not run sitecustomize again.
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, paths)), PARLAB_FORK_SERVER="0")
    result = run_script([sys.executable, str(script)], timeout=90, env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.splitlines()[-1] == "workers left: []"


def test_a_worker_dying_while_its_process_group_is_rebuilt_is_reported_then_replaced():
    def fail_and_die_in_the_repair():
        if dist.get_rank() == 1:
            # After a failure on every rank, the workers rebuild their group in place, and
            # the first thing that does is destroy the old one.
            dist.destroy_process_group = lambda: os._exit(7)
        raise RuntimeError("planned failure")

    with parlab.Cluster(world_size=2, timeout=60) as cluster:
        with pytest.raises(parlab.RankError, match="planned failure"):
            cluster.run(fail_and_die_in_the_repair)
        with pytest.raises(parlab.RankError) as info:
            cluster.run(all_reduce_ranks)
        assert info.value.ranks == [1]
        assert str(info.value).startswith("rank 1's worker exited with code 7 while rebuilding its process group.")
        assert cluster.run(all_reduce_ranks) == [1.0, 1.0]


def leave_an_operation_that_never_ends():
    """Ranks 0 and 1 start mismatched collectives on their own group without waiting for
    them (each waits for the other forever), then every rank fails: the repair rebuilds the
    process group in the same processes, and leaving the old group waits for those."""
    if dist.get_rank() in (0, 1):
        # 10 s is long for a test. A fresh worker runs as __main__, a forked one as the module.
        for name in ("__main__", "parlab.runtime.worker"):
            if hasattr(sys.modules.get(name), "LEAVE_TIMEOUT_S"):
                sys.modules[name].LEAVE_TIMEOUT_S = 1.0
    pair = dist.new_group([0, 1])
    if dist.get_rank() == 0:
        dist.all_reduce(torch.ones(10), group=pair, async_op=True)
    elif dist.get_rank() == 1:
        dist.all_gather([torch.ones(7), torch.ones(7)], torch.ones(7), group=pair, async_op=True)
    raise ValueError("planned failure")


def test_a_rank_that_cannot_leave_its_process_group_is_replaced_within_the_leave_timeout():
    # Before, the repair waited start_timeout (120 s) for ranks that could never re-join.
    with parlab.Cluster(world_size=3, timeout=60, start_timeout=60) as cluster:
        with pytest.raises(parlab.RankError, match="planned failure"):
            cluster.run(leave_an_operation_that_never_ends)
        with pytest.raises(parlab.RankError) as info:
            cluster.run(all_reduce_ranks)
        head = str(info.value).splitlines()[0]
        assert "could not leave its process group within 1 s: an operation it started without waiting" in head
        assert "every worker was replaced" in head and "did not join" not in head
        assert cluster.run(all_reduce_ranks) == [3.0] * 3


def slow_sum(offset):
    time.sleep(0.02)
    tensor = torch.tensor([float(dist.get_rank() + offset)])
    dist.all_reduce(tensor)
    return tensor.item()


def ring_sum(offset):
    tensor = torch.arange(4.0) + dist.get_rank() + offset
    ring_all_reduce(tensor, check=False)  # no call check: the traffic is the ring's alone
    return tensor.tolist()


def test_calls_from_two_threads_take_turns_and_each_gets_its_own_results():
    # A widget's callback calls the cluster from another thread while a cell's call runs.
    offsets = {"run": [10 * i for i in range(8)], "trace": [1000 + 10 * i for i in range(8)]}
    got, errors = {}, []

    def caller(kind):
        try:
            if kind == "run":
                got[kind] = [cluster.run(slow_sum, offset) for offset in offsets[kind]]
            else:
                got[kind] = [cluster.trace(ring_sum, offset) for offset in offsets[kind]]
        except BaseException as exc:
            errors.append(exc)

    with parlab.Cluster(world_size=2, timeout=60) as cluster:
        threads = [threading.Thread(target=caller, args=(kind,)) for kind in offsets]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(90)
        assert not errors, errors
        assert got["run"] == [[2.0 * offset + 1] * 2 for offset in offsets["run"]]
        for offset, timeline in zip(offsets["trace"], got["trace"]):
            expected = [2 * (offset + i) + 1.0 for i in range(4)]
            assert timeline.results == [expected, expected]
            # The ring on 2 ranks: 2 (N - 1) = 2 steps of one half of 4 floats each.
            assert timeline.bytes_sent() == [16, 16]
        assert cluster.run(all_reduce_ranks) == [1.0, 1.0]


def test_close_from_another_thread_ends_the_running_call():
    cluster = parlab.Cluster(world_size=2, timeout=60)
    pids, outcome = cluster.pids, []

    def call():
        try:
            cluster.run(time.sleep, 30)
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=call)
    thread.start()
    time.sleep(1.0)  # the call is running by now; if not, it finds the cluster closed: also right
    cluster.close()
    thread.join(20)  # the call would sleep for 30 s if close() waited for it
    assert not thread.is_alive()
    assert [type(exc) for exc in outcome] == [RuntimeError]
    assert "cluster was closed during the call" in str(outcome[0]) or "cluster is closed" in str(outcome[0])
    assert not any(is_alive(pid) for pid in pids)
    assert cluster.closed
    with pytest.raises(RuntimeError, match="closed"):
        cluster.run(all_reduce_ranks)


@pytest.mark.skipif(not os.path.exists("/proc/self/schedstat"), reason="Linux's schedstat is needed")
def test_a_process_that_waits_for_a_busy_cpu_is_seen_waiting_and_a_sleeping_one_is_not():
    # Two busy loops on one CPU take turns: each waits about as long as it runs.
    loop = ("import os, time; os.sched_setaffinity(0, {0}); end = time.process_time() + 0.5\n"
            "while time.process_time() < end: pass")
    busy = [subprocess.Popen([sys.executable, "-c", loop]) for _ in range(2)]
    # The sleeper says when its start-up (which may wait for a CPU) is over, then sleeps in
    # a read until its stdin closes.
    sleeping = subprocess.Popen([sys.executable, "-c", "import sys; print('asleep', flush=True); sys.stdin.read()"],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert sleeping.stdout.readline() == "asleep\n"
    asleep = waited_for_a_cpu_s(sleeping.pid)
    time.sleep(0.5)
    waits = [waited_for_a_cpu_s(p.pid) for p in busy]
    asleep = waited_for_a_cpu_s(sleeping.pid) - asleep
    sleeping.stdin.close()
    for p in [*busy, sleeping]:
        p.wait(timeout=30)
    sleeping.stdout.close()
    assert all(wait > 0.2 for wait in waits), waits
    assert asleep < 0.01
    assert waited_for_a_cpu_s(sleeping.pid) == 0.0  # gone


def test_a_call_slowed_by_a_busy_machine_finishes_and_a_hang_still_times_out(cluster2, monkeypatch):
    # As if every rank waited for a CPU for 80% of the time: the 0.5 s timeout stretches to 2.5 s.
    started = time.monotonic()
    monkeypatch.setattr(cluster_module, "waited_for_a_cpu_s", lambda pid: 0.8 * (time.monotonic() - started))
    assert cluster2.run(time.sleep, 1.0, timeout=0.5) == [None, None]
    started = time.monotonic()
    with pytest.raises(parlab.RankTimeout) as info:
        cluster2.run(time.sleep, 30, timeout=0.5)
    assert 2.4 < time.monotonic() - started < 10
    assert re.search(r"still running after 0.5 s \(and 2\.\d s waiting for a CPU that other programs held\)",
                     str(info.value))
    monkeypatch.undo()
    assert cluster2.run(all_reduce_ranks) == [1.0, 1.0]
