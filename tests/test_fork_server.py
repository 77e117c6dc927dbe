"""Workers forked from an interpreter that has loaded torch (parlab.runtime.fork_server)
behave as fresh interpreters do: same results, same reports of how they ended, nothing left
when the parent dies; a worker whose start-up environment differs is a fresh interpreter.
So does a program run as a fork of the server (the grader's pytest), whose workers fork from
the same server."""

import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest
from test_runtime import all_reduce_ranks, is_alive, run_script

import parlab

TESTS = os.path.dirname(os.path.abspath(__file__))
pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the fork server runs on Linux only"),
]


def parent_and_command(pid):
    with open(f"/proc/{pid}/status") as status:
        fields = dict(line.split(":\t", 1) for line in status.read().splitlines() if ":\t" in line)
    with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
        return int(fields["PPid"]), cmdline.read().replace(b"\0", b" ").decode()


def test_workers_are_forks_of_the_server_and_compute_what_fresh_ones_do(monkeypatch):
    with parlab.Cluster(world_size=3, timeout=60) as cluster:
        forked = cluster.run(all_reduce_ranks)
        servers = {parent_and_command(pid)[0] for pid in cluster.pids}
    assert len(servers) == 1
    parent, command = parent_and_command(servers.pop())
    assert parent == os.getpid() and "-m parlab.runtime.fork_server" in command

    monkeypatch.setenv("PARLAB_FORK_SERVER", "0")
    with parlab.Cluster(world_size=3, timeout=60) as cluster:
        assert cluster.run(all_reduce_ranks) == forked == [3.0] * 3
        for pid in cluster.pids:
            parent, command = parent_and_command(pid)
            assert parent == os.getpid() and "-m parlab.runtime.worker" in command


def test_a_different_start_up_environment_gets_fresh_interpreters(monkeypatch):
    with parlab.Cluster(world_size=2, timeout=60) as cluster:
        cluster.run(all_reduce_ranks)  # the server exists, started with this environment
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # read as torch loads: a fork would keep the server's
    with parlab.Cluster(world_size=2, timeout=60) as cluster:
        assert cluster.run(lambda: os.environ["OMP_NUM_THREADS"]) == ["1", "1"]
        assert all(parent_and_command(pid)[0] == os.getpid() for pid in cluster.pids)


def test_a_killed_server_takes_its_workers_and_the_next_call_replaces_them(tmp_path):
    # In a script of its own: every cluster of this process shares the server.
    script = tmp_path / "kill_server.py"
    script.write_text(textwrap.dedent("""
        import os, signal, time, parlab
        from test_fork_server import parent_and_command
        from test_runtime import all_reduce_ranks, is_alive
        with parlab.Cluster(world_size=2, timeout=60) as cluster:
            server = parent_and_command(cluster.pids[0])[0]
            os.kill(server, signal.SIGKILL)
            deadline = time.monotonic() + 10
            while any(is_alive(pid) for pid in cluster.pids) and time.monotonic() < deadline:
                time.sleep(0.05)
            print("workers alive:", [is_alive(pid) for pid in cluster.pids])
            try:
                cluster.run(all_reduce_ranks)
            except parlab.RankError as error:
                print(str(error).splitlines()[0])
            print("next call:", cluster.run(all_reduce_ranks))
            print("new server:", parent_and_command(cluster.pids[0])[0] != server)
    """))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [TESTS, os.environ.get("PYTHONPATH")])))
    result = run_script([sys.executable, str(script)], timeout=90, env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    alive, error, after, new_server = result.stdout.splitlines()[-4:]
    assert alive == "workers alive: [False, False]"  # they watch the server as their parent
    assert error.startswith("rank 0's worker was killed by SIGKILL while idle")
    assert after == "next call: [1.0, 1.0]" and new_server == "new server: True"


def test_a_killed_parent_leaves_neither_server_nor_workers(tmp_path):
    script = tmp_path / "parent.py"
    script.write_text(textwrap.dedent("""
        import os, signal, parlab
        cluster = parlab.Cluster(world_size=2)
        status = open(f"/proc/{cluster.pids[0]}/status").read()
        server = [line.split()[1] for line in status.splitlines() if line.startswith("PPid:")][0]
        print(server, *cluster.pids, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """))
    result = run_script([sys.executable, str(script)], timeout=60)
    assert result.returncode == -signal.SIGKILL, result.stderr[-2000:]
    pids = [int(pid) for pid in result.stdout.split()[-3:]]
    deadline = time.monotonic() + 10
    while any(is_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(is_alive(pid) for pid in pids)


def test_a_script_that_leaves_its_cluster_open_exits_quietly_and_leaves_no_worker(tmp_path):
    # A learner's script or kernel that never calls close: at exit the server closes first
    # (its atexit handler is the later one), then the cluster's finalizer stops the workers.
    script = tmp_path / "left_open.py"
    script.write_text(textwrap.dedent("""
        import parlab
        from test_fork_server import parent_and_command
        cluster = parlab.Cluster(world_size=2)
        server = parent_and_command(cluster.pids[0])[0]
        print(server, *cluster.pids, cluster.run(sum, [1, 2])[0], flush=True)
    """))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [TESTS, os.environ.get("PYTHONPATH")])))
    result = run_script([sys.executable, str(script)], timeout=60, env=env)
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr[-2000:]
    *pids, answer = result.stdout.split()[-4:]
    assert answer == "3"
    deadline = time.monotonic() + 10
    while any(is_alive(int(pid)) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(is_alive(int(pid)) for pid in pids)


@pytest.mark.parametrize("fork", ["1", "0"])
def test_the_workers_of_a_nice_parent_keep_its_priority_in_their_own_sessions(tmp_path, fork):
    # Each worker leads a session; where Linux schedules sessions as groups, the group's nice counts.
    script = tmp_path / "nice.py"
    script.write_text(textwrap.dedent("""
        import os, parlab
        def priority():
            group = "/proc/self/autogroup"  # "/autogroup-12 nice 5"; none without autogroup
            own = os.getpriority(os.PRIO_PROCESS, 0)
            return own, open(group).read().split()[-1] if os.path.exists(group) else str(own)
        with parlab.Cluster(world_size=2) as cluster:
            parent = int(open(f"/proc/{cluster.pids[0]}/stat").read().rsplit(")", 1)[1].split()[1])
            if parent != os.getpid():  # the fork server, which leads a session too
                print("server", open(f"/proc/{parent}/autogroup").read().split()[-1])
            print(cluster.run(priority))
    """))
    result = run_script(["nice", "-n", "5", sys.executable, str(script)], timeout=90,
                        env=dict(os.environ, PARLAB_FORK_SERVER=fork))
    assert result.returncode == 0, result.stderr[-2000:]
    nice = min(os.nice(0) + 5, 19)  # this test may itself run at a lower priority (pytest -n 2)
    assert result.stdout.splitlines()[-1] == str([(nice, str(nice))] * 2)
    if fork == "1" and os.path.exists("/proc/self/autogroup"):
        assert result.stdout.splitlines()[-2] == f"server {nice}"


def test_a_server_that_cannot_start_leaves_the_workers_to_fresh_interpreters(tmp_path):
    # The server dies as it starts (Python runs sitecustomize first): every cluster still starts.
    (tmp_path / "sitecustomize.py").write_text('import os\nif "PARLAB_FORK_SERVER_FD" in os.environ: os._exit(3)\n')
    script = tmp_path / "start.py"
    script.write_text(textwrap.dedent("""
        import os, parlab
        from test_fork_server import parent_and_command
        from test_runtime import all_reduce_ranks
        for _ in range(2):
            with parlab.Cluster(world_size=2, timeout=60) as cluster:
                parents = {parent_and_command(pid)[0] for pid in cluster.pids}
                print(cluster.run(all_reduce_ranks), parents == {os.getpid()})
    """))
    paths = [str(tmp_path), TESTS, os.environ.get("PYTHONPATH")]
    result = run_script([sys.executable, str(script)], timeout=90,
                        env=dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, paths))))
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.splitlines()[-2:] == ["[1.0, 1.0] True"] * 2


CHILD = textwrap.dedent("""
    import json, os, parlab
    from test_fork_server import parent_and_command
    from test_runtime import all_reduce_ranks
    with parlab.Cluster(world_size=2, timeout=60) as cluster:
        servers = {parent_and_command(pid)[0] for pid in cluster.pids}
        print(json.dumps({"results": cluster.run(all_reduce_ranks), "pid": os.getpid(),
                          "servers": {s: parent_and_command(s)[0] for s in servers}}))
""")


def run_child(tmp_path, env, pass_fds=()):
    script = tmp_path / "child.py"
    script.write_text(f"import sys\nsys.path.insert(0, {TESTS!r})\n" + CHILD)
    child = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=90, cwd=TESTS,
                           env=env, pass_fds=pass_fds)
    assert child.returncode == 0, child.stderr[-2000:]
    return json.loads(child.stdout.splitlines()[-1])


def test_a_child_given_the_server_forks_its_workers_from_it_and_the_server_serves_on(tmp_path):
    # The grader's pytest does this: its clusters start without loading torch once more.
    from parlab.runtime import forks, process

    with parlab.Cluster(world_size=2, timeout=60) as cluster:
        server = parent_and_command(cluster.pids[0])[0]
    connection, variables = forks.share(process.worker_environment())
    try:
        child = run_child(tmp_path, dict(os.environ, **variables), pass_fds=(connection.fileno(),))
    finally:
        connection.close()
    assert child["results"] == [1.0, 1.0] and child["servers"] == {str(server): os.getpid()}
    with parlab.Cluster(world_size=2, timeout=60) as cluster:  # the child's end left the server serving
        assert cluster.run(all_reduce_ranks) == [1.0, 1.0]
        assert parent_and_command(cluster.pids[0])[0] == server


def test_a_connection_not_given_by_the_parent_is_not_used(tmp_path):
    # A stale variable (in a grandchild, or a descriptor number reused): the child starts its own server.
    child = run_child(tmp_path, dict(os.environ, PARLAB_SHARED_FORKS="0:0123456789abcdef"))
    assert child["results"] == [1.0, 1.0] and list(child["servers"].values()) == [child["pid"]]


def test_a_worker_starts_in_the_folder_of_the_process_that_asked(tmp_path, monkeypatch):
    with parlab.Cluster(world_size=2, timeout=60) as cluster:
        cluster.run(all_reduce_ranks)  # the server exists, started in the session's folder
    monkeypatch.chdir(tmp_path)
    with parlab.Cluster(world_size=2, timeout=60) as cluster:
        assert cluster.run(os.getcwd) == [str(tmp_path)] * 2


PROGRAM = textwrap.dedent("""
    import json, os, sys
    first = sys.path[0]  # the folder, as for python -m
    sys.path.insert(0, {tests!r})
    import parlab
    from test_fork_server import parent_and_command
    from test_runtime import all_reduce_ranks
    with parlab.Cluster(world_size=2, timeout=60) as cluster:
        results = cluster.run(all_reduce_ranks)
        servers = sorted({{parent_and_command(pid)[0] for pid in cluster.pids}})
    answer = {{"results": results, "servers": servers, "parent": os.getppid(), "argv": sys.argv[1:],
              "folder": os.getcwd(), "mark": os.environ.get("MARK"), "path": first}}
    os.write(int(sys.argv[1]), json.dumps(answer).encode())
    print("to the log")
    sys.exit(3)
""")


def test_a_program_runs_as_a_fork_of_the_server_as_python_m_would_and_its_workers_fork_from_it(tmp_path):
    from parlab.runtime import process

    (tmp_path / "program.py").write_text(PROGRAM.format(tests=TESTS))
    with parlab.Cluster(world_size=2, timeout=60) as cluster:
        server = parent_and_command(cluster.pids[0])[0]
    read, write = os.pipe()
    with tempfile.TemporaryFile() as log, os.fdopen(read) as answers:
        program = process.start_module("program", [str(write), "x"], dict(os.environ, MARK="set"), tmp_path, log,
                                       pass_fds=(write,))
        os.close(write)
        assert program.wait(timeout=90) == 3
        answer = json.loads(answers.read())
        log.seek(0)
        assert log.read().decode() == "to the log\n"
    assert answer == {"results": [1.0, 1.0], "servers": [server], "parent": server, "argv": [str(write), "x"],
                      "folder": str(tmp_path), "mark": "set", "path": str(tmp_path)}


def test_a_program_ends_when_the_process_that_asked_for_it_dies(tmp_path):
    (tmp_path / "sleeper.py").write_text("import time\ntime.sleep(120)\n")
    script = tmp_path / "parent.py"
    script.write_text(textwrap.dedent(f"""
        import os, signal, tempfile, time
        from parlab.runtime import process
        program = process.start_module("sleeper", [], dict(os.environ), {str(tmp_path)!r}, tempfile.TemporaryFile())
        time.sleep(0.5)
        print(program.pid, program.poll(), flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """))
    result = run_script([sys.executable, str(script)], timeout=60)
    assert result.returncode == -signal.SIGKILL, result.stderr[-2000:]
    pid, running = result.stdout.split()[-2:]
    assert running == "None"  # it was sleeping when its asker died
    deadline = time.monotonic() + 10
    while is_alive(int(pid)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not is_alive(int(pid))


def test_a_program_of_a_nice_parent_keeps_its_priority_in_its_own_session(tmp_path):
    # Before, the forked grader's session ran at nice 0 beside the lectures, its parent at 19.
    (tmp_path / "priority.py").write_text(textwrap.dedent("""
        import os
        group = "/proc/self/autogroup"  # "/autogroup-12 nice 5"; none without autogroup
        own = os.getpriority(os.PRIO_PROCESS, 0)
        print(own, open(group).read().split()[-1] if os.path.exists(group) else own, os.getsid(0) == os.getpid())
    """))
    script = tmp_path / "nice.py"
    script.write_text(textwrap.dedent(f"""
        import os, tempfile
        from parlab.runtime import process
        with tempfile.TemporaryFile() as log:
            program = process.start_module("priority", [], dict(os.environ), {str(tmp_path)!r}, log)
            assert program.wait(timeout=60) == 0
            log.seek(0)
            print(log.read().decode().strip())
    """))
    result = run_script(["nice", "-n", "5", sys.executable, str(script)], timeout=90)
    assert result.returncode == 0, result.stderr[-2000:]
    nice = min(os.nice(0) + 5, 19)
    assert result.stdout.splitlines()[-1] == f"{nice} {nice} True"  # its own session: a fork, not a child
