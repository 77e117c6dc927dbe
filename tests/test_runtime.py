"""The cluster runtime: results, output, failures, hangs, repair, placement, no orphans."""

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

import parlab
from parlab.runtime.cluster import DEATH_GRACE_S, FAILURE_GRACE_S
from parlab.runtime.placement import resolve

pytestmark = pytest.mark.timeout(120)


def rank_and_sum(offset, scale=1):
    tensor = torch.tensor([float(dist.get_rank() + offset)])
    dist.all_reduce(tensor)
    return dist.get_rank(), dist.get_world_size(), tensor.item() * scale


def all_reduce_ranks():
    tensor = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(tensor)
    return tensor.item()


def expected_sum(world_size):
    return world_size * (world_size - 1) / 2


def test_results_come_back_in_rank_order_with_args_and_kwargs(cluster4):
    results = cluster4.run(rank_and_sum, 1, scale=2)
    assert results == [(r, 4, 2 * (expected_sum(4) + 4)) for r in range(4)]


@pytest.mark.parametrize("world_size", [1, 3])
def test_launch_at_other_world_sizes(world_size):
    assert parlab.launch(all_reduce_ranks, world_size) == [expected_sum(world_size)] * world_size


def test_function_defined_in_main_travels_by_value(cluster2):
    # A notebook cell defines functions in __main__, which the workers cannot import.
    namespace = {"__name__": "__main__"}
    exec("import torch.distributed as dist\ndef cell_fn(x):\n    return x * 10 + dist.get_rank()", namespace)
    assert namespace["cell_fn"].__module__ == "__main__"
    assert cluster2.run(namespace["cell_fn"], 4) == [40, 41]


def test_closures_and_lambdas(cluster2):
    base = 7
    assert cluster2.run(lambda: base + dist.get_rank()) == [7, 8]


def test_output_is_printed_in_rank_order_with_prefix(cluster4, capsys):
    def talk():
        rank = dist.get_rank()
        time.sleep(0.05 * (3 - rank))  # rank 3 speaks first
        print(f"hello from {rank}")
        print(f"warning from {rank}", file=sys.stderr)
        print("line one\nline two")

    cluster4.run(talk)
    out, err = capsys.readouterr()
    lines = [(f"[rank {r}] hello from {r}", f"[rank {r}] line one", f"[rank {r}] line two") for r in range(4)]
    assert out.splitlines() == [line for rank_lines in lines for line in rank_lines]
    assert err.splitlines() == [f"[rank {r}] warning from {r}" for r in range(4)]


def fail_on_rank_1():
    if dist.get_rank() == 1:
        raise ValueError("rank one is unhappy")
    return dist.get_rank()


def test_rank_error_names_the_failing_rank_and_carries_its_traceback(cluster2):
    with pytest.raises(parlab.RankError) as info:
        cluster2.run(fail_on_rank_1)
    assert info.value.ranks == [1]
    assert "rank 1 failed: ValueError: rank one is unhappy" in str(info.value)
    assert "fail_on_rank_1" in info.value.failures[1]  # the remote traceback
    assert "worker.py" not in info.value.failures[1]  # without the runtime's own frames
    assert cluster2.run(all_reduce_ranks) == [1.0, 1.0]


def test_failure_while_others_wait_in_a_collective(cluster4):
    def fail_before_barrier():
        if dist.get_rank() == 2:
            raise RuntimeError("no barrier for me")
        dist.barrier()

    old_pids = cluster4.pids
    start = time.monotonic()
    with pytest.raises(parlab.RankError) as info:
        cluster4.run(fail_before_barrier)
    assert time.monotonic() - start < 10
    assert info.value.ranks == [2]
    assert sorted(info.value.stuck) == [0, 1, 3]
    assert all("barrier" in stack for stack in info.value.stuck.values())
    assert cluster4.run(all_reduce_ranks) == [6.0] * 4
    # Ranks stuck in a collective that can never end are replaced; rank 2 re-joined in its own process.
    assert not any(is_alive(old_pids[rank]) for rank in (0, 1, 3))
    assert cluster4.pids[2] == old_pids[2]


def test_every_rank_failing_keeps_the_workers(cluster2):
    pids = cluster2.pids
    with pytest.raises(parlab.RankError) as info:
        cluster2.run(lambda: 1 / 0)
    assert info.value.ranks == [0, 1]
    assert cluster2.run(all_reduce_ranks) == [1.0, 1.0]
    assert cluster2.pids == pids  # repaired by rebuilding the process group, not respawning


def deadlock():
    if dist.get_rank() == 0:
        dist.recv(torch.zeros(1), src=1)  # rank 1 never sends
    return dist.get_rank()


def test_hang_becomes_rank_timeout_and_the_next_run_works(cluster2):
    old_pids = cluster2.pids
    start = time.monotonic()
    with pytest.raises(parlab.RankTimeout) as info:
        cluster2.run(deadlock, timeout=5)
    assert time.monotonic() - start < 10
    assert info.value.ranks == [0] and info.value.finished == [1]
    assert "deadlock" in info.value.stuck[0] and "recv" in info.value.stuck[0]
    assert "A send without a matching recv" in str(info.value) and "emulat" not in str(info.value)
    assert cluster2.run(all_reduce_ranks) == [1.0, 1.0]
    assert not is_alive(old_pids[0]) and cluster2.pids[1] == old_pids[1]  # only the stuck rank is replaced


def test_a_worker_that_dies_is_reported_first_and_replaced(cluster2):
    def die():
        if dist.get_rank() == 1:
            os._exit(3)
        dist.barrier()  # fails: rank 1's death closed its connections

    with pytest.raises(parlab.RankError) as info:
        cluster2.run(die)
    assert info.value.ranks == [0, 1] and info.value.dead == [1]
    assert "exited with code 3" in info.value.failures[1]
    # The cause leads, not the lowest rank's consequence (a lost connection).
    assert str(info.value).splitlines()[0] == "ranks 0, 1 failed: rank 1's worker exited with code 3 during the call"
    assert cluster2.run(all_reduce_ranks) == [1.0, 1.0]


def test_after_a_death_the_others_are_stopped_without_the_failure_grace(cluster2):
    def die_or_sleep():
        if dist.get_rank() == 1:
            os._exit(3)
        time.sleep(1.5)  # well within FAILURE_GRACE_S, far beyond DEATH_GRACE_S

    assert DEATH_GRACE_S < 1.0 < 1.5 < FAILURE_GRACE_S
    with pytest.raises(parlab.RankError) as info:
        cluster2.run(die_or_sleep)
    assert info.value.ranks == [1] and list(info.value.stuck) == [0]
    assert "die_or_sleep" in info.value.stuck[0]  # where it was, from its stack
    assert cluster2.run(all_reduce_ranks) == [1.0, 1.0]


def abort_here():
    if dist.get_rank() == 1:
        os.abort()  # as gloo does (std::terminate) on a message longer than its receive


def test_a_rank_killed_by_a_fatal_signal_leaves_its_python_stack(cluster2):
    with pytest.raises(parlab.RankError) as info:
        cluster2.run(abort_here)
    assert info.value.dead == [1]
    failure = info.value.failures[1]
    assert "Fatal Python error: Aborted" in failure
    assert f'test_runtime.py", line {abort_here.__code__.co_firstlineno + 2} in abort_here' in failure
    assert failure.splitlines()[-1] == "rank 1's worker was killed by SIGABRT during the call"
    assert cluster2.run(all_reduce_ranks) == [1.0, 1.0]


def slow_compute_and_slow_message():
    from parlab import p2p
    from parlab.runtime import emulation

    tensor = torch.zeros(500)  # 2000 bytes: 3 s on the link below
    if dist.get_rank() == 0:
        request = p2p.isend(tensor, 1)
        emulation.compute(5.0)  # while the message travels
        request.wait()
    else:
        p2p.recv(tensor, 0)  # sleeps until the message has arrived


# What a RankTimeout adds where the ranks waited for a CPU (a loaded machine).
BUSY_MACHINE = r" \(and [\d.]+ s waiting for a CPU that other programs held\)"


def test_a_timeout_in_an_emulated_sleep_says_so_and_what_was_declared(cluster2):
    # Both ranks sleep for seconds beyond the timeout, which leaves them 1.5 s to start sleeping on a busy machine.
    link, devices = parlab.Link(latency=1.0, bandwidth=1e3), parlab.Devices(slowdown={1: 2.0})
    with cluster2.emulate(link=link, devices=devices), pytest.raises(parlab.RankTimeout) as info:
        cluster2.run(slow_compute_and_slow_message, timeout=1.5)
    heading = re.sub(BUSY_MACHINE, "", str(info.value).split("\n")[0])
    assert heading.startswith(
        "ranks 0, 1 still running after 1.5 s. In the emulation: rank 1 was sleeping in the emulated link "
        "(declared: 1 s + bytes / (1 kB/s)); rank 0 was sleeping in an emulated device's compute (declared by a "
        "SleepLayer, ComputeTime or emulation.compute, in seconds; rank 1 2x slower). It sleeps every declared "
        "time for real: check that times are in seconds (200 µs is 200e-6)"
    ), heading
    assert "A send without a matching recv" not in heading
    assert cluster2.run(all_reduce_ranks) == [1.0, 1.0]


def test_a_rank_waiting_for_one_asleep_in_the_emulation_is_named_apart():
    def dump(*frames):
        lines = "".join(f'  File "{path}", line 1 in {function}\n' for path, function in frames)
        return f"Current thread 0x00007f (most recent call first):\n{lines}"

    sleeping = dump(("/x/parlab/runtime/emulation.py", "sleep_until"), ("/x/parlab/runtime/emulation.py", "compute"),
                    ("<dynamic-code>", "step"))
    waiting = dump(("/x/torch/distributed/distributed_c10d.py", "recv"), ("<dynamic-code>", "step"))
    # sleep_until below the top of a stack is not where the rank is now
    woke = dump(("/x/parlab/p2p.py", "wait"), ("/x/parlab/runtime/emulation.py", "sleep_until"))
    message = str(parlab.RankTimeout(30, {2: sleeping, 0: waiting, 1: woke}, finished=[3]))
    assert message.startswith(
        "ranks 0, 1, 2 still running after 30 s (rank 3 finished). In the emulation: rank 2 was sleeping in an "
        "emulated device's compute (declared by a SleepLayer, ComputeTime or emulation.compute, in seconds; devices "
        "not emulated); ranks 0, 1 waited for them."
    ), message
    assert str(parlab.RankTimeout(30, {0: waiting}, finished=[1])).startswith(
        "rank 0 still running after 30 s (rank 1 finished). A send without a matching recv"
    )


def test_the_rank_error_heading_leads_with_a_dead_rank():
    lost = "Traceback ...\nConnectionError: rank 0 lost its connections"
    died = "Last output of rank 2's worker:\n(none)\nrank 2's worker was killed by SIGKILL during the call"
    error = parlab.RankError({0: lost, 2: died}, dead=[2])
    assert str(error).splitlines()[0] == "ranks 0, 2 failed: rank 2's worker was killed by SIGKILL during the call"
    assert str(parlab.RankError({0: lost, 2: died})).splitlines()[0] == (
        "ranks 0, 2 failed: ConnectionError: rank 0 lost its connections"
    )


def test_a_function_that_cannot_be_shipped_is_a_value_error(cluster2):
    lock = threading.Lock()
    with pytest.raises(ValueError, match="cannot be sent to the workers"):
        cluster2.run(lambda: lock.locked())


def test_a_result_that_cannot_come_back_is_explained(cluster2):
    with pytest.raises(parlab.RankError, match="return value could not be sent back"):
        cluster2.run(lambda: threading.Lock())
    assert cluster2.run(lambda: "fine") == ["fine", "fine"]


def test_not_a_function(cluster2):
    with pytest.raises(ValueError, match="needs a function"):
        cluster2.run(42)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"world_size": 0}, "at least 1"),
        ({"world_size": -2}, "at least 1"),
        ({"world_size": 2.5}, "whole number"),
        ({"world_size": "4"}, "whole number"),
        ({"world_size": 2, "backend": "mpi"}, "unknown backend"),
        ({"world_size": 2, "device": "tpu"}, "unknown device"),
        ({"world_size": 2, "devices": parlab.Devices(slowdown={5: 3.0})}, r"names rank 5, but the cluster has 2"),
    ],
)
def test_bad_arguments_are_value_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        parlab.Cluster(**kwargs)


def test_gpu_requests_without_gpus_are_value_errors():
    with pytest.raises(ValueError, match="backend='nccl' needs CUDA GPUs"):
        resolve(2, backend="nccl", gpu_count=0)
    with pytest.raises(ValueError, match="device='cuda'"):
        resolve(2, device="cuda", gpu_count=0)
    with pytest.raises(ValueError, match="one GPU per rank"):
        resolve(4, backend="nccl", gpu_count=2, nccl_available=True)
    with pytest.raises(ValueError, match="no nccl backend"):
        resolve(2, backend="nccl", gpu_count=2, nccl_available=False)


def test_auto_placement_rules():
    assert resolve(4, gpu_count=0) == resolve(4, backend="gloo", device="cpu", gpu_count=8)
    assert resolve(4, gpu_count=0).backend == "gloo"
    on_gpus = resolve(4, gpu_count=4, nccl_available=True)
    assert (on_gpus.backend, on_gpus.device(3)) == ("nccl", "cuda:3")
    with pytest.warns(UserWarning, match="has no nccl"):
        assert resolve(4, gpu_count=4, nccl_available=False).backend == "gloo"
    with pytest.warns(UserWarning, match="host staging"):
        shared = resolve(4, gpu_count=2, nccl_available=True)
    assert (shared.backend, shared.host_staging, shared.device(3)) == ("gloo", True, "cuda:1")


def test_two_clusters_at_once(cluster2):
    with parlab.Cluster(world_size=2) as other:
        assert other.run(all_reduce_ranks) == cluster2.run(all_reduce_ranks) == [1.0, 1.0]


def make_groups(n):
    """n process groups of every rank, left alive; this rank's live groups and threads."""
    from torch.distributed.distributed_c10d import _world

    groups = [dist.new_group() for _ in range(n)]
    assert all(dist.get_world_size(group) == 2 for group in groups)
    return len(_world.pg_map), threading.active_count(), len(os.listdir(f"/proc/{os.getpid()}/task"))


def test_groups_calls_leave_alive_are_destroyed_beyond_a_few(cluster2):
    # each gloo group keeps a thread that wakes every 10 ms (parlab.runtime.worker's docstring)
    from parlab.runtime.worker import KEPT_GROUPS

    before = cluster2.run(make_groups, 0)
    during = cluster2.run(make_groups, KEPT_GROUPS + 4)
    assert [groups for groups, _, _ in during] == [groups + KEPT_GROUPS + 4 for groups, _, _ in before]
    after = cluster2.run(make_groups, 0)
    for (groups, _, threads), (groups_during, _, threads_during) in zip(after, during):
        assert groups_during - groups >= 4 and threads <= threads_during - 4  # the oldest went, with their threads
        assert groups <= 1 + KEPT_GROUPS + 1  # the world, the kept ones, an emulated link's header group


def test_close_leaves_no_processes_and_refuses_more_work():
    cluster = parlab.Cluster(world_size=2)
    pids = cluster.pids
    cluster.close()
    cluster.close()
    assert not any(is_alive(pid) for pid in pids)
    assert "closed" in repr(cluster)
    with pytest.raises(RuntimeError, match="closed"):
        cluster.run(all_reduce_ranks)


# A script starts a Python with torch and its ranks: on CI's two loaded cores that took over a
# minute once, so these give it SCRIPT_S; what they check is what is left after, not speed.
SCRIPT_S = 240


@pytest.mark.timeout(SCRIPT_S + 60)
@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGTERM])
def test_a_killed_parent_leaves_no_worker_and_no_file(tmp_path, signum):
    # A kernel restart kills the parent without any chance to clean up. Its temporary folder
    # is one of its own, so other tests' files cannot be mistaken for leftovers.
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    script = tmp_path / "parent.py"
    script.write_text(textwrap.dedent(f"""
        import os, time, parlab
        cluster = parlab.Cluster(world_size=2)
        cluster.run(print, "some output for the worker's log")
        try:
            cluster.run(time.sleep, 5, timeout=0.5)  # a stack dump, written to the stack files
        except parlab.RankTimeout:
            pass
        print(*cluster.pids, flush=True)
        os.kill(os.getpid(), {int(signum)})
    """))
    result = run_script([sys.executable, str(script)], timeout=SCRIPT_S, env=dict(os.environ, TMPDIR=str(tmp)))
    assert result.returncode == -signum, result.stderr[-2000:]
    pids = [int(pid) for pid in result.stdout.split()[-2:]]
    deadline = time.monotonic() + 10
    while any(is_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(is_alive(pid) for pid in pids)
    assert leftovers(tmp) == []


@pytest.mark.timeout(SCRIPT_S + 60)
def test_an_interrupted_call_frees_the_kernel_and_the_next_run_works(tmp_path):
    # Jupyter's "interrupt kernel" is a SIGINT to the parent while it waits for the ranks. The
    # script handles SIGINT itself: started from a shell's background job (as CI may start
    # pytest), it would inherit SIGINT ignored, and Python then leaves it ignored.
    script = tmp_path / "interrupt.py"
    script.write_text(textwrap.dedent("""
        import os, signal, threading, time, parlab
        signal.signal(signal.SIGINT, signal.default_int_handler)  # a Jupyter kernel's, whatever the parent ignores
        with parlab.Cluster(world_size=2) as cluster:
            threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT)).start()
            start = time.monotonic()
            try:
                cluster.run(time.sleep, 60)
            except KeyboardInterrupt:
                print("interrupted after", round(time.monotonic() - start), "s")
            print("next run", cluster.run(lambda: "ok"))
    """))
    result = run_script([sys.executable, str(script)], timeout=SCRIPT_S)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "next run ['ok', 'ok']" in result.stdout
    assert int(result.stdout.split("interrupted after ")[1].split()[0]) < 10
    assert "workers were replaced" in result.stderr


@pytest.mark.timeout(SCRIPT_S + 60)
def test_launch_runs_in_process_under_torchrun(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""
        import os, torch, torch.distributed as dist, parlab

        def step():
            t = torch.tensor([float(dist.get_rank())])
            dist.all_reduce(t)
            return os.getpid(), t.item()

        results = parlab.launch(step, world_size=8)  # torchrun's world size wins
        if int(os.environ["RANK"]) == 0:
            print("pids", results[0][0] == os.getpid(), "sums", [r[1] for r in results])
    """))
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    result = run_script([torchrun, "--standalone", "--nproc-per-node", "2", str(script)], timeout=SCRIPT_S)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "pids True sums [1.0, 1.0]" in result.stdout


def run_script(command, timeout, env=None):
    """Run a command in its own process group; on timeout kill the whole group, so that no
    grandchild (a torchrun agent, say) outlives the test. Not a session of its own: where
    Linux schedules sessions as groups, a new one would run at nice 0 beside the lectures."""
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, process_group=0, env=env
    )
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        pytest.fail(f"{command[-1]} did not finish within {timeout} s:\n{stderr[-2000:]}")
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def leftovers(folder):
    """What a run left in ``folder``, its temporary folder. Not torch's compile cache
    (torchinductor_<user>, made by importing torch._dynamo, as the fork server does), which is
    kept across runs by design."""
    return [name for name in os.listdir(folder) if not name.startswith("torchinductor_")]


def is_alive(pid):
    """True until the process has exited completely: a killed process's main thread turns
    zombie (state Z) while its other threads are still on their way out."""
    try:
        with open(f"/proc/{pid}/status") as status:
            fields = dict(line.split(":\t", 1) for line in status.read().splitlines() if ":\t" in line)
    except FileNotFoundError:
        return False
    return not (fields["State"].startswith("Z") and fields["Threads"] == "1")
