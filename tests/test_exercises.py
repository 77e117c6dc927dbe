"""Exercises and grading: generation from solutions, protection of edited files, the
implementation travelling to the ranks, and proof that the grading tests bite: solutions
score full marks, the stubs generated afresh zero (a learner's finished exercises never
make these tests fail), a whole-tensor exchange loses exactly the
traffic points, a deadlocked implementation costs its points within 30 s, and classic
mistakes (a DDP hook that all-reduces the weights, full optimizer state on every rank, a
1F1B backward seeded with 1 instead of 1/M, ...) lose exactly their points, with a reason;
and a class of submissions graded against their deadlines."""

import contextlib
import csv
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from test_runtime import leftovers

import parlab
from parlab import cli
from parlab.course import exercises, grade
from parlab.course.grade import command
from parlab.course.grading_plugin import failure_reason, load_implementation
from parlab.runtime.errors import RankError, RankTimeout

FIXTURES = exercises.ROOT / "tests" / "grading" / "fixtures"
TASKS = ("ring_reduce_scatter", "ring_all_gather", "ring_all_reduce")
SOLUTION = textwrap.dedent(
    '''\
    """A topic."""


    def double(x):
        """Twice x."""
        # BEGIN SOLUTION: multiply by two
        y = x * 2
        return y
        # END SOLUTION


    # BEGIN SOLUTION
    CONSTANT = 1
    # END SOLUTION
    '''
)


@pytest.fixture(scope="module")
def stubs(tmp_path_factory):
    """A folder of the exercises generated afresh from solutions/: what graded stubs are,
    whatever the learner's exercises/ hold by now."""
    return write_stubs(exercises.ROOT, tmp_path_factory.mktemp("stubs"))


def write_stubs(root, directory):
    for topic in exercises.topics(root):
        (directory / f"{topic}.py").write_text(exercises.fresh(topic, root))
    return directory


def test_committed_exercises_are_generated_from_the_current_solutions():
    check_exercises_as_generated(exercises.ROOT)


def check_exercises_as_generated(root):
    """Fail when an exercise as generated (the working file while untouched, else git HEAD's)
    is out of date or missing; skip, saying why, when only a learner's edits are to be had."""
    stale = exercises.stale(root=root)
    wrong = {topic: state for topic, state in stale.items() if state[0] != "edited"}
    assert not wrong, f"run `python -m parlab.course.exercises build` and commit exercises/: {wrong}"
    if stale:
        pytest.skip("; ".join(where for _, where in stale.values()))


def test_every_topic_has_stubs_and_grading_tests():
    check_stubs_and_grading_tests(exercises.ROOT)


def check_stubs_and_grading_tests(root):
    assert exercises.topics(root) == grade.grading_topics(root)
    for topic in exercises.topics(root):
        body = exercises.fresh(topic, root).split("\n", 3)[3]
        assert "NotImplementedError" in body and "SOLUTION" not in body, topic


def test_finished_exercises_keep_the_checks_green(tmp_path):
    # A learner's clone whose exercises/ hold finished work (the solutions' code). The checks
    # read the exercises as generated (git's HEAD here) and the stubs generated afresh, never
    # the work; before, they read exercises/ and failed ("edited", no NotImplementedError).
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    root = tmp_path / "clone"
    for folder, pattern in (("solutions", "*.py"), ("tests/grading", "test_*.py")):
        (root / folder).mkdir(parents=True)
        for path in (exercises.ROOT / folder).glob(pattern):
            shutil.copy(path, root / folder)
    exercises.build(root=root)
    git = ["git", "-C", str(root), "-c", "user.name=learner", "-c", "user.email=learner@example.org"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "solutions", "tests", "exercises"], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "the course as handed out"], check=True)
    for topic in exercises.topics(root):
        header = "".join(exercises.fresh(topic, root).splitlines(keepends=True)[:3])
        solution = (root / "solutions" / f"{topic}.py").read_text().splitlines(keepends=True)
        work = "".join(line for line in solution if "SOLUTION" not in line)
        (root / "exercises" / f"{topic}.py").write_text(header + work)
        assert exercises.status(topic, root) == "edited"

    check_exercises_as_generated(root)
    check_stubs_and_grading_tests(root)
    for path in write_stubs(root, tmp_path).glob("*.py"):
        assert "NotImplementedError" in path.read_text(), path

    # The check still bites: a solution changed after the exercises were committed.
    solution = root / "solutions" / "collectives.py"
    solution.write_text(solution.read_text().replace("Ring reduce-scatter, in place", "Ring reduce-scatter"))
    with pytest.raises(AssertionError, match="'collectives': \\('outdated', \"exercises/collectives.py in git's HEAD"):
        check_exercises_as_generated(root)
    # Outside a git checkout no untouched version is left to compare with: skipped, saying so.
    shutil.rmtree(root / ".git")
    with pytest.raises(pytest.skip.Exception, match="exercises/ddp.py was edited and .* is not a git checkout"):
        check_exercises_as_generated(root)


def test_generate_replaces_each_block_with_a_stub_at_its_indentation():
    body = exercises.generate(SOLUTION, "topic").split("\n", 3)[3]
    assert body == textwrap.dedent(
        '''\
        """A topic."""


        def double(x):
            """Twice x."""
            raise NotImplementedError("double is not implemented yet: multiply by two")


        raise NotImplementedError("topic is not implemented yet")
        '''
    )


# --- Hints: stored with the solution, opened one level at a time, never in the exercise ---


def graded_tasks(root):
    """Every "topic.task" of the grading tests, read from their task marks."""
    return sorted(f"{topic}.{task}" for topic in grade.grading_topics(root)
                  for task in re.findall(r'@pytest\.mark\.task\("(\w+)"\)',
                                         (root / "tests" / "grading" / f"test_{topic}.py").read_text()))


def test_every_graded_task_has_three_levels_of_hints():
    assert exercises.hint_tasks() == graded_tasks(exercises.ROOT)
    for topic in exercises.topics():
        for task, levels in exercises.hints(topic).items():
            assert len(levels) == len(exercises.HINT_LEVELS) and len(set(levels)) == len(levels), task


def test_the_generated_exercises_hold_no_hint_text():
    # Before, the docstrings spelled the algorithm out line by line; the help now lives in
    # the solution's HINTS block, which generation drops.
    for topic in exercises.topics():
        exercise = exercises.fresh(topic)
        assert "HINTS" not in exercise and "BEGIN" not in exercise, topic
        for task, levels in exercises.hints(topic).items():
            for text in levels:
                for line in (line.strip() for line in text.splitlines()):
                    if len(line) > 30 and not line.startswith("def "):  # a hint's own line, not a signature
                        assert line not in exercise, (topic, task, line)
    assert exercises.generate(SOLUTION + "\n\n" + HINTS_BLOCK, "topic") == exercises.generate(SOLUTION, "topic")


HINTS_BLOCK = textwrap.dedent(
    '''\
    # BEGIN HINTS
    HINTS = {"double": ("a nudge", "the plan", "the sketch")}
    # END HINTS
    '''
)


def test_hint_prints_the_levels_in_order_then_repeats_the_last(capsys, monkeypatch):
    monkeypatch.setattr(exercises, "_opened", {})
    task = "collectives.ring_all_gather"
    levels = exercises.hints("collectives")["ring_all_gather"]
    printed = []
    for _ in range(4):
        exercises.hint(task)
        printed.append(capsys.readouterr().out)
    for number, (out, text) in enumerate(zip(printed, [*levels, levels[-1]]), start=1):
        level = min(number, 3)
        assert out.startswith(f"{task}, hint {level} of 3 ({exercises.HINT_LEVELS[level - 1]}):\n"), out
        assert text.splitlines()[0] in out and sum(other.splitlines()[0] in out for other in levels) == 1, out
    assert f'parlab.hint("{task}") again opens hint 2 (the plan)' in printed[0]
    assert "That was the last hint" in printed[2]
    exercises.hint(task, level=1)  # re-read a level on purpose
    assert f"{task}, hint 1 of 3" in capsys.readouterr().out


def test_unknown_tasks_and_levels_are_refused_naming_the_closest():
    # Before, a misspelt task listed all the tasks of every topic (22).
    with pytest.raises(ValueError, match=r"^there is no task 'ddp\.assign_bucket': did you mean "
                                         r"'ddp\.assign_buckets'\?$"):
        exercises.hint("ddp.assign_bucket")
    with pytest.raises(ValueError, match=r"^there is no task 'colectives\.ring_all_reduce': did you mean "
                                         r"'collectives\.ring_all_reduce'\?$"):
        exercises.hint("colectives.ring_all_reduce")
    with pytest.raises(ValueError, match=r"^there is no task 'zero\.xyzzy'; the tasks of zero are: "
                                         r"zero\.reduce_scatter_gradients, zero\.sharded_optimizer\.$"):
        exercises.hint("zero.xyzzy")  # nothing close: the tasks of its topic, not every task
    with pytest.raises(ValueError, match="^there is no topic 'nope'; the topics are: async_sgd, collectives, "):
        exercises.hint("nope.task")
    with pytest.raises(ValueError, match=r"level must be 1 to 3, got 4: hints go from 1 \(a nudge\)"):
        exercises.hint("ddp.assign_buckets", level=4)


def test_a_hints_block_left_open_or_malformed_says_where(tmp_path):
    with pytest.raises(ValueError, match="line 1: BEGIN HINTS is never closed"):
        exercises.generate("# BEGIN HINTS\nHINTS = {}\n", "topic")
    (tmp_path / "solutions").mkdir()
    (tmp_path / "solutions" / "topic.py").write_text(SOLUTION + HINTS_BLOCK.replace('"the sketch"', ""))
    with pytest.raises(ValueError, match="solutions/topic.py: HINTS maps each task to 3 texts"):
        exercises.hints("topic", root=tmp_path)


def test_the_terminal_prints_one_level_and_the_command_for_the_next(capsys):
    assert cli.main(["hint", "collectives.ring_all_reduce", "--level", "2"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("collectives.ring_all_reduce, hint 2 of 3 (the plan):\n")
    assert out.endswith("Next, a sketch close to the solution: parlab hint collectives.ring_all_reduce --level 3\n")
    # python -m parlab.course.grade keeps its --hint, a task or a task of the topic named.
    assert command.main(["collectives", "--hint", "ring_all_reduce", "--level", "2"]) == 0
    assert capsys.readouterr().out == out
    assert cli.main(["hint", "collectives.nope"]) == 2
    assert "there is no task 'collectives.nope'; the tasks of collectives are: " in capsys.readouterr().err
    assert cli.main(["hint"]) == 0  # no task: the tasks
    assert capsys.readouterr().out.splitlines()[1:] == [f"    {task}" for task in exercises.hint_tasks()]


def test_each_reason_of_a_failed_task_ends_with_where_its_hints_are():
    results = [
        {"test": "test_a", "task": "collectives.ring_all_reduce", "points": 1, "passed": False, "reason": "wrong"},
        {"test": "test_b", "task": "collectives.ring_all_reduce", "points": 1, "passed": True, "reason": None},
        {"test": "test_c", "task": "ddp.assign_buckets", "points": 1, "passed": False, "reason": "off by one"},
    ]
    table = grade.format_table(results, "all topics", "exercises", grade.NOTEBOOK_HINT)
    assert '    test_a: wrong [hint: parlab.hint("collectives.ring_all_reduce")]\n' in table
    assert '    test_c: off by one [hint: parlab.hint("ddp.assign_buckets")]\n' in table
    shared = [dict(test, passed=False, reason="no file") for test in results]
    table = grade.format_table(shared, "all topics", "exercises", grade.TERMINAL_HINT)
    assert "every test: no file [hints: parlab hint TASK, TASK a task below]\n" in table
    assert "hint" not in grade.format_table(results, "all topics", "exercises")  # no pointer asked for


@pytest.mark.parametrize(
    "source, line, problem",
    [
        ("# BEGIN SOLUTION\nx = 1\n", 1, "never closed"),
        ("x = 1\n# END SOLUTION\n", 2, "without a BEGIN"),
        ("# BEGIN SOLUTION\n# BEGIN SOLUTION\n# END SOLUTION\n", 2, "inside the block opened on line 1"),
        ("if True:\n# BEGIN SOLUTION\n    x = 1\n# END SOLUTION\n", 2, "not valid Python"),
    ],
)
def test_misplaced_markers_raise_value_error_naming_the_line(source, line, problem):
    with pytest.raises(ValueError, match=f"line {line}.*{problem}|{problem}.*line {line}"):
        exercises.generate(source, "topic")


def test_build_never_overwrites_an_edited_exercise_unless_forced(tmp_path):
    (tmp_path / "solutions").mkdir()
    solution, exercise = tmp_path / "solutions" / "topic.py", tmp_path / "exercises" / "topic.py"
    solution.write_text(SOLUTION)
    assert exercises.build(root=tmp_path) == {"topic": "written"}
    assert exercises.build(root=tmp_path) == {"topic": "up to date"}

    solution.write_text(SOLUTION.replace("Twice x.", "Two times x."))  # an instructor's fix
    assert exercises.stale(root=tmp_path) == {"topic": ("outdated", "exercises/topic.py")}
    assert exercises.build(root=tmp_path) == {"topic": "written"}  # never edited: rebuilt
    assert "Two times x." in exercise.read_text()

    edited = exercise.read_text().replace('raise NotImplementedError("double', 'return x + x  # ("double')
    exercise.write_text(edited)
    assert exercises.status("topic", root=tmp_path) == "edited"
    assert exercises.build(root=tmp_path)["topic"].startswith("kept: edited by hand")
    assert exercise.read_text() == edited
    assert exercises.build(["topic"], force=True, root=tmp_path) == {"topic": "written"}
    assert exercises.stale(root=tmp_path) == {}


def test_unknown_topics_are_refused_with_the_list_of_topics(capsys):
    with pytest.raises(ValueError, match="there is no solutions/nope.py; the topics are: async_sgd, collectives"):
        exercises.build(["nope"])
    assert exercises.main(["check", "nope"]) == 2
    assert "the topics are: async_sgd, collectives" in capsys.readouterr().err
    with pytest.raises(ValueError, match="^there is no topic 'nope'; the topics are: async_sgd, collectives"):
        grade.check("nope")
    with pytest.raises(ValueError,
                       match="^there is no task 'nope.ring_all_reduce': did you mean 'collectives.ring_all"):
        grade.check("nope.ring_all_reduce")


def test_a_misspelt_name_is_refused_with_the_closest_before_anything_runs(monkeypatch, capsys):
    # Before, parlab.check("compression.randk") graded for 2.6 s before saying it does not exist.
    def no_process(*args, **kwargs):
        raise AssertionError("grading started a process for a name that does not exist")

    monkeypatch.setattr(grade, "start_module", no_process)
    with pytest.raises(ValueError, match=r"^there is no task 'compression\.randk': did you mean "
                                         r"'compression\.rand_k'\?$"):
        parlab.check("compression.randk")
    assert capsys.readouterr().out == ""  # not even "grading ..."
    with pytest.raises(ValueError, match=r"^there is no topic 'colectives': did you mean 'collectives'\?$"):
        grade.run_grading("colectives")
    assert cli.main(["grade", "compression.randk", "--json"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "error: there is no task 'compression.randk': did you mean" in captured.err


def test_an_implementation_outside_sys_path_runs_on_the_ranks(tmp_path, cluster2):
    # A learner's file is imported by path: the workers could not import it by name.
    (tmp_path / "topic.py").write_text(
        "import torch.distributed as dist\n"
        "SCALE = 10\n"
        "def helper(x):\n    return x * SCALE\n"
        "def on_rank(x):\n    return helper(x) + dist.get_rank()\n"
    )
    module = load_implementation("topic", tmp_path)
    assert cluster2.run(module.on_rank, 4) == [40, 41]


def test_failure_reasons_are_one_line_each():
    def reason(exc):
        try:
            raise exc
        except BaseException:
            return failure_reason(pytest.ExceptionInfo.from_current())

    traceback = "Traceback (most recent call last):\n  ...\nNotImplementedError: f is not implemented yet: hint"
    assert reason(RankError({0: traceback, 1: traceback})) == "NotImplementedError: f is not implemented yet: hint"
    assert reason(RankError({1: "Traceback ...\nValueError: bad size"})) == "rank 1 failed: ValueError: bad size"
    assert reason(RankTimeout(3, {0: "stack", 1: "stack"}, finished=[])).startswith(
        "timed out after 3 s (ranks 0, 1 still waiting"
    )
    assert reason(pytest.fail.Exception("Timeout (>60.0s) from pytest-timeout.")) == "timed out after 60 s"
    assert reason(AssertionError("rank 0 sent 2 messages\nassert False")) == "rank 0 sent 2 messages"
    assert reason(KeyError("x")) == "KeyError: 'x'"


# --- The grader, end to end (each run starts its own clusters in a subprocess) -------------


def test_solutions_score_full_marks(capsys):
    assert cli.main(["grade", "collectives", "--impl", str(exercises.ROOT / "solutions")]) == 0
    table = capsys.readouterr().out
    assert "total" in table and "15 / 15  full marks" in table


def test_generated_stubs_score_zero_and_say_what_to_implement(stubs):
    started = time.monotonic()
    results = grade.run_grading("collectives", impl=stubs)
    assert time.monotonic() - started < 30
    assert grade.score(results) == grade.Score(0, 15)
    for test in results:
        function = test["task"].split(".")[1]
        assert test["reason"].startswith(f"NotImplementedError: {function} is not implemented yet"), test


def test_exchanging_whole_tensors_earns_correctness_but_not_traffic_points():
    results = grade.run_grading("collectives", impl=FIXTURES / "gather_and_sum")
    traffic = [test for test in results if test["test"].startswith("test_sends_")]
    correctness = [test for test in results if test not in traffic]
    assert len(traffic) == 6 and len(correctness) == 9
    assert all(test["passed"] for test in correctness), correctness
    for test in traffic:
        assert not test["passed"]
        assert "exchanging whole tensors and combining them locally gives the right numbers" in test["reason"]


def test_a_deadlocked_implementation_costs_its_points_within_30_s():
    started = time.monotonic()
    results = grade.run_grading("collectives", impl=FIXTURES / "send_first")
    assert time.monotonic() - started < 30
    assert grade.score(results).earned == 0
    reasons = {test["reason"].split(" (")[0] for test in results}
    assert reasons == {"timed out after 3 s"} | {
        f"not run: an earlier test of collectives.{task} timed out" for task in TASKS
    }


def test_a_file_that_fails_to_import_is_reported_once(tmp_path):
    path = tmp_path / "collectives.py"
    path.write_text("import torch\n\nCHUNKS = torch.tensor_split(torch.arange(10), world_size)\n")
    lines = []
    results = grade.run_grading("collectives", impl=tmp_path, progress=lines.append)
    reason = f"{path}, line 3, could not be imported: NameError: name 'world_size' is not defined"
    assert [test["reason"] for test in results] == [reason] * 15
    table = grade.format_table(results, "collectives", tmp_path)
    assert table.count("could not be imported") == 1 and f"every test: {reason}\n" in table, table
    assert [line.split()[0] for line in lines] == [f"collectives.{task}" for task in TASKS], lines
    assert all(" 0 / 5 tests, 0 / 5 points (" in line for line in lines), lines


@pytest.mark.timeout(120)
def test_a_grader_killed_midway_leaves_no_file(tmp_path):
    # A kernel restart during parlab.check kills the grading process with SIGKILL.
    (tmp_path / "collectives.py").write_text("import torch\n\nCHUNKS = world_size\n")  # fails fast
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    script = tmp_path / "grade_then_die.py"
    script.write_text(textwrap.dedent(f"""
        import os, signal
        from parlab.course import grade
        grade.run_grading("collectives", impl={str(tmp_path)!r}, progress=lambda line: os.kill(os.getpid(), 9))
    """))
    # Its own process group, so that a grading pytest left behind can be stopped with it.
    process = subprocess.Popen([sys.executable, str(script)], env=dict(os.environ, TMPDIR=str(tmp)),
                               process_group=0, stderr=subprocess.PIPE, text=True)
    try:
        assert process.wait(timeout=90) == -signal.SIGKILL, process.stderr.read()[-2000:]
    finally:
        with contextlib.suppress(ProcessLookupError):  # the grading pytest, if it still runs
            os.killpg(process.pid, signal.SIGKILL)
    assert leftovers(tmp) == []


def test_a_chunk_size_off_by_one_gets_a_hint_and_costs_one_test_per_task():
    # Before, gloo aborted the receiving rank on each of 10 tests (about 50 s), each reason
    # gloo's "enforce fail ... op.preamble.length <= op.nbytes", with no progress shown.
    lines = []
    started = time.monotonic()
    results = grade.run_grading("collectives", impl=FIXTURES / "chunk_size_off_by_one", progress=lines.append)
    assert time.monotonic() - started < 120  # catches a hang, not a slow machine
    assert [line.split()[0] for line in lines] == [f"collectives.{task}" for task in TASKS], lines
    assert lines[1].split("  ", 1)[1].lstrip().startswith("5 / 5 tests, 5 / 5 points ("), lines
    line = r" \(in ring_reduce_scatter, line 21\)"  # the fixture's receive, from the aborted rank's stack
    hint = re.compile(
        rf"^rank \d (expected \d+ float32 elements from rank \d{line} but rank \d sent \d+|received \d+ bytes "
        rf"into a tensor of \d+ bytes{line}): sender and receiver must agree on every message's size "
        r"\(for chunks, check how chunk sizes are computed for uneven lengths\)$"
    )
    for task in ("ring_reduce_scatter", "ring_all_reduce"):
        first, *rest = [test["reason"] for test in results if test["task"] == f"collectives.{task}"]
        assert hint.match(first), first
        assert rest == [f"not run: an earlier test of collectives.{task} sent a message of the wrong size"] * 4
    assert all(test["passed"] for test in results if test["task"] == "collectives.ring_all_gather")


# topic -> (full marks, the stub a learner meets first in each task when nothing is written)
FIRST_STUB = {
    "async_sgd": (13, {"async_sgd.gossip_ring_step": "gossip_ring_step",
                       "async_sgd.parameter_server_worker": "parameter_server_worker",
                       "async_sgd.first_n_average": "first_n_average"}),
    # BucketedDDP plans its buckets with the learner's assign_buckets: that stub comes first.
    "ddp": (6, {"ddp.assign_buckets": "assign_buckets", "ddp.bucketed_ddp": "assign_buckets"}),
    "compression": (8, {"compression.topk_error_feedback": "topk_error_feedback", "compression.rand_k": "rand_k",
                        "compression.orthogonalize": "orthogonalize", "compression.powersgd_step": "powersgd_step"}),
    "zero": (10, {"zero.sharded_optimizer": "build_optimizer",
                  "zero.reduce_scatter_gradients": "reduce_scatter_gradients"}),
    "pipeline": (10, {"pipeline.one_f_one_b": "one_f_one_b", "pipeline.stage_step": "forward_step"}),
    # ColumnParallelLinear.forward (the learner's first stub) is met before f and g are called.
    "tensor_parallel": (7, {"tensor_parallel.column_row_linear": "forward", "tensor_parallel.loss_scaler": "unscale_"}),
    "planner": (10, {"planner.model_state_bytes_per_gpu": "model_state_bytes_per_gpu",
                     "planner.activation_bytes_per_gpu": "activation_bytes_per_gpu",
                     "planner.memory_per_gpu": "memory_per_gpu", "planner.torchrun_all_reduce": "torchrun_all_reduce"}),
    "context_parallel": (9, {"context_parallel.merge_partial": "merge_partial",
                             "context_parallel.ring_attention_forward": "ring_attention_forward",
                             "context_parallel.zigzag_indices": "zigzag_indices"}),
    "experts": (6, {"experts.route": "route", "experts.dispatch_and_combine": "dispatch_and_combine"}),
    "diloco": (9, {"diloco.outer_step": "outer_step", "diloco.reshard": "reshard", "diloco.young_daly": "young_daly"}),
}


@pytest.fixture(scope="module")
def every_stub_graded(stubs):
    """Every topic's stubs graded in one run (one start of the grader's clusters), and how long it took."""
    started = time.monotonic()
    results = grade.run_grading(impl=stubs)
    return results, time.monotonic() - started


def test_every_topic_is_graded_quickly_on_stubs(every_stub_graded):
    assert every_stub_graded[1] < 30 * len(FIRST_STUB)  # 30 s a topic: a stub fails at its first test


# Solutions' full marks, topic by topic: every test of tests/grading passes against solutions/ in this
# same pytest run (its --impl defaults to solutions), and test_solutions_score_full_marks below checks the
# grader's tally of those tests end to end; grading solutions again here would only repeat those runs.
@pytest.mark.parametrize("topic", list(FIRST_STUB))
def test_stubs_score_zero_with_the_full_marks_possible_and_say_what_to_implement(topic, every_stub_graded):
    full, first_stub = FIRST_STUB[topic]
    results = [test for test in every_stub_graded[0] if test["task"].split(".")[0] == topic]
    assert grade.score(results) == grade.Score(0, full)
    for test in results:
        stub = first_stub[test["task"]]
        assert test["reason"].startswith(f"NotImplementedError: {stub} is not implemented yet"), test


CLASS_TOPIC = "ddp"  # any topic serves; ddp grades fastest (the planner's torchrun task took 22 s here, ddp 9 s)


def test_a_class_is_graded_against_its_deadlines_one_report_each(tmp_path, stubs, capsys):
    # Two students, one grading run each: alice hands in the solutions, in a folder, a day
    # and a half late (two days: 0.25 a day takes half her points); bob hands in the stubs, a
    # file bob.py, a day late but within the extension of the deadlines file.
    full, first_stub = FIRST_STUB[CLASS_TOPIC]
    deadline = 1_740_873_540  # 2025-03-01T23:59:00Z
    hand_ins, reports = tmp_path / "hand-ins", tmp_path / "reports"
    (hand_ins / "alice").mkdir(parents=True)
    shutil.copy(exercises.ROOT / "solutions" / f"{CLASS_TOPIC}.py", hand_ins / "alice")
    shutil.copy(stubs / f"{CLASS_TOPIC}.py", hand_ins / "bob.py")
    (hand_ins / "notes.txt").write_text("not a submission")
    os.utime(hand_ins / "alice" / f"{CLASS_TOPIC}.py", (deadline + 36 * 3600,) * 2)
    os.utime(hand_ins / "bob.py", (deadline + 24 * 3600,) * 2)
    (tmp_path / "extensions").write_text("# student  deadline\nbob 2025-03-03T23:59:00Z\n")
    argv = ["grade", CLASS_TOPIC, "--submissions", str(hand_ins), "--reports", str(reports),
            "--deadline", "2025-03-01T23:59:00Z", "--deadlines", str(tmp_path / "extensions"), "--late-penalty", "0.25"]
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out

    with open(reports / "summary.csv") as file:
        rows = {row["student"]: row for row in csv.DictReader(file)}
    assert sorted(rows) == ["alice", "bob"]
    assert {key: rows["alice"][key] for key in ("days_late", "earned", "possible", "score", "note")} == {
        "days_late": "2", "earned": str(full), "possible": str(full), "score": str(full / 2),
        "note": "late by 2 days (points x 0.5)"}
    assert rows["alice"]["deadline"] == "2025-03-01T23:59:00+00:00"
    assert {key: rows["bob"][key] for key in ("deadline", "days_late", "earned", "score", "note")} == {
        "deadline": "2025-03-03T23:59:00+00:00", "days_late": "0", "earned": "0", "score": "0.0", "note": "on time"}
    assert "late by 2 days (points x 0.5)" in printed and "reports: " in printed

    alice = json.loads((reports / "alice" / "results.json").read_text())
    assert alice["score"] == full / 2 and alice["extra_data"]["earned"] == full
    assert {task["name"] for task in alice["tests"]} == set(first_stub)
    assert all(task["status"] == "passed" and task["score"] == task["max_score"] for task in alice["tests"])
    assert alice["extra_data"]["lateness"]["days_late"] == 2
    report = (reports / "alice" / "report.txt").read_text()
    assert report.startswith(f"{CLASS_TOPIC}: {full} / {full} points; late by 2 days") and "full marks" in report

    bob = json.loads((reports / "bob" / "results.json").read_text())
    assert bob["score"] == 0 and bob["extra_data"]["max_score"] == full
    assert bob["execution_time"] < 30  # the stubs fail fast, as for a learner
    for task in bob["tests"]:
        stub = first_stub[task["name"]]
        for test in task["extra_data"]["tests"]:
            assert test["reason"].startswith(f"NotImplementedError: {stub} is not implemented yet"), test


def graded_with_mistakes(topic, mistakes, directory):
    """Grade the solution of ``topic`` with each ``right`` text of ``mistakes`` replaced by its
    ``wrong`` one (classic mistakes in otherwise correct code, derived at test time rather
    than kept as copies). Returns {test name: reason} of the tests that failed."""
    solution = (exercises.ROOT / "solutions" / f"{topic}.py").read_text()
    for right, wrong in mistakes.items():
        assert solution.count(right) == 1, right
        solution = solution.replace(right, wrong)
    (directory / f"{topic}.py").write_text(solution)
    return {test["test"]: test["reason"] for test in grade.run_grading(topic, impl=directory) if not test["passed"]}


def test_a_ddp_hook_that_all_reduces_the_weights_is_told_so(tmp_path):
    # The classic hook mistake, made in an otherwise correct solution: the hook is handed
    # the parameter, and this learner all-reduces it instead of its .grad.
    failed = graded_with_mistakes("ddp", {"torch.cat([p.grad.reshape(-1) for p in bucket])":
                                          "torch.cat([p.detach().reshape(-1) for p in bucket])"}, tmp_path)
    assert sorted(failed) == [f"test_trains_like_one_process_on_the_full_batch[{n} ranks]" for n in (2, 4)]
    for reason in failed.values():
        assert "your hook synchronises weights, not gradients" in reason, reason


def test_one_task_is_graded_alone_and_a_broken_file_says_why_once_in_json_too(tmp_path, capsys):
    # (Written here rather than kept in fixtures/: a file that does not parse would trip
    # every tool that reads the tree.) One run, through `parlab grade --json --results`: the
    # JSON on stdout, the same in the results file, the progress and the table on stderr.
    path = tmp_path / "collectives.py"
    path.write_text("def ring_all_reduce(tensor)\n    return tensor\n")
    results_file = tmp_path / "results" / "results.json"
    argv = ["grade", "collectives.ring_all_reduce", "--impl", str(tmp_path), "--json", "--results", str(results_file)]
    assert cli.main(argv) == 1  # points missing
    captured = capsys.readouterr()
    table, document = captured.err, json.loads(captured.out)
    assert "collectives.ring_all_reduce" in table and "ring_reduce_scatter" not in table
    assert table.count("could not be imported") == 1, table
    reason = f"{path}, line 1, could not be imported: SyntaxError: expected ':'"
    assert f"every test: {reason} [hint: parlab hint collectives.ring_all_reduce]\n" in table
    assert json.loads(results_file.read_text()) == document
    assert document["score"] == 0 and document["output"] == "collectives.ring_all_reduce: 0 / 5 points"
    assert document["extra_data"] == {"graded": "collectives.ring_all_reduce", "earned": 0, "max_score": 5}
    [task] = document["tests"]
    assert {key: task[key] for key in ("name", "score", "max_score", "status")} == {
        "name": "collectives.ring_all_reduce", "score": 0, "max_score": 5, "status": "failed"}
    assert task["output"] == f"5 tests: {reason} [hint: parlab hint collectives.ring_all_reduce]"
    assert [test["reason"] for test in task["extra_data"]["tests"]] == [reason] * 5
    with pytest.raises(ValueError, match="no task 'collectives.ring'; the tasks of collectives are: collectives.ring_"):
        grade.check("collectives.ring", impl=tmp_path)


def test_zero_full_optimizer_state_and_an_all_reduce_lose_exactly_their_points(tmp_path):
    # Two classic mistakes in an otherwise correct solution, graded in one run: Adam built
    # over the whole model (right numbers at stage 1 but N_d times the state, and nothing to
    # step at stage 2, where only the shard has a gradient), and the gradients all-reduced
    # before the shard is taken (right shard, twice the traffic).
    failed = graded_with_mistakes("zero", {
        "optimizer_class([self.shard], **optimizer_kwargs)": "optimizer_class(self.trainable, **optimizer_kwargs)",
        "reduce_scatter(flat_grad, layout, dist.get_rank())": (
            "layout.shard(ring_all_reduce(flat_grad, op='avg', check=False), dist.get_rank())"
        ),
        "import torch\n": "import torch\nfrom parlab.collectives import ring_all_reduce\n",
    }, tmp_path)
    assert sorted(failed) == [
        "test_holds_one_shard_of_the_optimizer_state[2 ranks]",
        "test_holds_one_shard_of_the_optimizer_state[4 ranks]",
        "test_sends_a_reduce_scatter_not_an_all_reduce",
        "test_steps_on_a_reduce_scattered_gradient",
    ]
    for name, reason in failed.items():
        if name.startswith("test_holds"):
            assert "holds the full optimizer state" in reason and "over this rank's shard only" in reason, reason
        elif name.startswith("test_steps"):
            assert "no parameter changed in step(): the optimizer must step self.shard" in reason, reason
        else:
            assert "that is an all-reduce, twice a reduce-scatter" in reason, reason


def test_pipeline_late_backwards_and_a_missing_1_over_m_lose_exactly_their_points(tmp_path):
    # Two classic mistakes in an otherwise correct solution, graded in one run: one warm-up
    # forward too many (a valid schedule, but not 1F1B's, holding one more micro-batch),
    # and each micro-batch's backward started from 1 instead of 1/M.
    mistakes = {"warmup = K - r - 1": "warmup = K - r", "1.0 / executor.schedule.num_microbatches": "1.0"}
    failed = graded_with_mistakes("pipeline", mistakes, tmp_path)
    assert sorted(failed) == [
        "test_golden_grids",
        "test_gradients_like_one_process_on_the_full_batch[2 ranks]",
        "test_gradients_like_one_process_on_the_full_batch[4 ranks]",
        "test_one_stage_in_one_process",
        "test_rank_r_holds_k_minus_r_microbatches",
    ]
    assert "1F1B's warm-up is K - r - 1" in failed["test_golden_grids"]
    assert "1F1B holds K - r = 1" in failed["test_rank_r_holds_k_minus_r_microbatches"]
    for name, reason in failed.items():
        if name.startswith("test_gradients") or name == "test_one_stage_in_one_process":
            assert "gradients are M = " in reason and "times too large: scale each micro-batch loss by 1/M" in reason


def test_gossip_weights_that_do_not_sum_to_one_are_told_the_mean_moved(tmp_path):
    # The classic gossip mistake in an otherwise correct solution: three values averaged over
    # two. The mean over ranks is no longer kept, which the grader names before any value.
    failed = graded_with_mistakes("async_sgd", {"mixed = (received[left] + x + received[right]) / 3\n":
                                                "mixed = (received[left] + x + received[right]) / 2\n"}, tmp_path)
    assert sorted(failed) == (
        [f"test_averages_with_both_neighbours_and_keeps_the_mean[{n} ranks]" for n in (2, 3, 4)]
        + [f"test_subtracts_the_gradient_at_the_old_x[{n} ranks]" for n in (3, 4)])
    for name, reason in failed.items():
        if name.startswith("test_averages"):
            assert "the mean over ranks changed" in reason and "must sum to 1" in reason, reason


def test_tensor_parallel_without_f_s_all_reduce_is_told_which_operator_is_missing(tmp_path):
    # The classic mistake, in an otherwise correct solution: f's backward passes the gradient
    # through as g's does, so each rank keeps only its own part of the input's gradient.
    failed = graded_with_mistakes("tensor_parallel", {"        return all_reduce(grad)\n": "        return grad\n"},
                                  tmp_path)
    assert sorted(failed) == ["test_one_all_reduce_forward_and_one_backward",
                              *(f"test_the_gradients_are_the_one_process_gradients[{n} ranks]" for n in (2, 4))]
    for name, reason in failed.items():
        if name.startswith("test_the_gradients"):
            assert "f (CopyToParallel) is missing its all-reduce in backward" in reason, reason
        else:
            assert "1 all-reduces in forward and 0 in backward" in reason, reason


def test_compression_a_forgotten_residual_and_a_missing_d_over_k_lose_exactly_their_points(tmp_path):
    # Two classic mistakes in an otherwise correct solution, graded in one run: error
    # feedback that drops the residual (top-k alone, biased), and random-k without its d/k
    # scale (every step k/d times too short). The grader names each from a statistic: the
    # residual's norm, the sampled mean.
    failed = graded_with_mistakes("compression", {"\n    return delta, p - delta": "\n    return delta, 0 * p",
                                                  "\n    kept[indices] = flat[indices] * (d / k)":
                                                  "\n    kept[indices] = flat[indices]"}, tmp_path)
    assert sorted(failed) == ["test_is_unbiased_by_sampling", "test_keeps_k_positions_scaled_by_d_over_k",
                              "test_the_residual_keeps_what_was_dropped"]
    assert "the residual is missing" in failed["test_the_residual_keeps_what_was_dropped"]
    assert "the d/k = 4 scale is missing" in failed["test_keeps_k_positions_scaled_by_d_over_k"]
    assert "the mean over 4000 draws is k/d x, not x" in failed["test_is_unbiased_by_sampling"]


def test_planner_zero_0_sharded_micro_batches_forgotten_and_float32_lose_exactly_their_points(tmp_path):
    # Three classic mistakes in an otherwise correct solution, graded in one run: Psi divided
    # by N_d whatever the ZeRO stage, the first stage's min(K, M) micro-batches in flight
    # forgotten, and the torchrun sum taken in float32 (values beyond its 24 bits).
    failed = graded_with_mistakes("planner", {
        "model.psi / (plan.t * plan.K), plan.zero, plan.N_d, *precision)":
            "model.psi / (plan.t * plan.K * plan.N_d), plan.zero, 1, *precision)",
        "activations = layer * (model.L // plan.K) * min(plan.K, plan.M)": "activations = layer * (model.L // plan.K)",
        "torch.tensor([value], dtype=torch.int64, device=device)  #":
            "torch.tensor([value], dtype=torch.float32, device=device)  #",
    }, tmp_path)
    states = ["test_data_parallelism_replicates_or_shards_by_the_zero_stage",
              "test_tensor_and_pipeline_parallelism_split_the_model", "test_with_the_precision_given"]
    activations = ["test_the_micro_batches_in_flight_on_the_first_stage", "test_with_recompute"]
    total = "test_states_plus_activations_on_every_plan"
    launched = "test_every_process_gets_the_sum_one_process_computes"
    assert sorted(failed) == sorted([*states, *activations, total, launched])
    for name in states:
        assert "you divided Psi by N_d but ZeRO-0 replicates every model state" in failed[name], failed[name]
    for name in activations:
        assert "you forgot the micro-batches in flight on the first stage" in failed[name], failed[name]
    assert "the sum is right, one of the parts is not" in failed[total]
    assert "the values went through float32" in failed[launched]


def diloco_failures(mistake):
    """{test name: reason} of the diloco tests that the fixture ``mistake`` fails, and its score."""
    results = grade.run_grading("diloco", impl=FIXTURES / mistake)
    return {test["test"]: test["reason"] for test in results if not test["passed"]}, grade.score(results)


DILOCO_OUTER_STEP = ["test_averages_over_its_group_only",
                     *(f"test_is_nesterov_sgd_on_the_averaged_pseudo_gradient[{n} ranks]" for n in (2, 4)),
                     "test_within_rounding_on_real_valued_weights"]


def test_diloco_a_flipped_pseudo_gradient_unpadded_shards_and_young_without_2_are_each_named():
    # One slip per task in one run: each costs its own task's tests, and only those (Daly's
    # series is judged on the learner's own first order, the values of the shards end to end).
    reasons, score = diloco_failures("pseudo_gradient_flipped")
    assert score == grade.Score(3, 9)
    assert sorted(reasons) == sorted([*DILOCO_OUTER_STEP, "test_cuts_equal_shards_padded_with_zeros",
                                      "test_young_s_first_order_interval"])
    for name in DILOCO_OUTER_STEP:
        assert "you have the sign of Delta flipped" in reasons[name], reasons[name]
    assert "pad the d values with zeros at the end" in reasons["test_cuts_equal_shards_padded_with_zeros"]
    assert "misses Young's factor 2" in reasons["test_young_s_first_order_interval"]


@pytest.mark.parametrize("mistake, named", [
    ("pseudo_gradients_summed", "times too large: that is the sum of the pseudo-gradients; divide"),
    ("heavy_ball_momentum", "that is heavy-ball momentum, w = w_start - eta buf"),
], ids=["summed", "heavy ball"])
def test_diloco_a_sum_or_heavy_ball_loses_the_outer_step_only_and_is_named(mistake, named):
    reasons, score = diloco_failures(mistake)
    assert score == grade.Score(5, 9)
    assert sorted(reasons) == DILOCO_OUTER_STEP
    for reason in reasons.values():
        assert named in reason, reason


def test_the_options_of_the_pytest_around_it_do_not_reach_the_grader(monkeypatch):
    # Before, PYTEST_ADDOPTS="-n 3" made every grading run fail: the grader loads no xdist.
    monkeypatch.setenv("PYTEST_ADDOPTS", "-n 3 --no-such-option")
    results = grade.run_grading("collectives.ring_all_gather", impl="solutions")
    assert results and all(test["passed"] for test in results)
