"""The ``parlab`` command: every subcommand's help, doctor's checks and exit code, ``bench
runtime`` as a function and as JSON, and clear errors for bad input. Timings are checked for
shape and sign only: this runs on shared, noisy machines."""

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_imports import test_one_spelling_for_this_ranks_device as check_one_device_spelling

import parlab
from parlab import cli
from parlab.bench import byte_size, format_bytes, format_table, percentile, positive_int, progress_bar, ratio_header
from parlab.bench.runtime import REFERENCE, bench_runtime, format_report
from parlab.course import doctor

STATUSES = {doctor.OK, doctor.PROBLEM, doctor.INFO}
QUICK_CHECKS = [check for check in doctor.CHECKS if check is not doctor.check_all_reduce]
TIMES = ["cluster_start_s", "cluster_median_s", "cluster_p90_s", "spawn_median_s", "ratio"]


def subcommands(parser=None, prefix=()):
    """Every command line that has a parser of its own: (), ("grade",), ("bench", "ddp"), ..."""
    parser = parser or cli.build_parser()
    found = [prefix]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                found += subcommands(child, (*prefix, name))
    return found


@pytest.mark.timeout(30)
@pytest.mark.parametrize("argv", subcommands(), ids=lambda argv: " ".join(argv) or "parlab")
def test_every_subcommand_has_its_own_help(argv, capsys):
    # `parlab bench compression --help` crashed: a bare % in a help string.
    with pytest.raises(SystemExit) as exit_info:
        cli.main([*argv, "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: {' '.join(['parlab', *argv])} ") and len(out.splitlines()) > 3, out


def test_the_subcommands_are_grade_hint_bench_and_doctor():
    assert {argv for argv in subcommands() if len(argv) == 1} == {("grade",), ("hint",), ("bench",), ("doctor",)}
    assert {argv[1] for argv in subcommands() if argv[:1] == ("bench",) and len(argv) == 2} == set(cli.BENCHES)


@pytest.mark.timeout(30)
def test_every_bench_summary_is_its_docstrings_whole_first_paragraph(capsys):
    # `parlab bench --help` cut the plan bench's summary mid-sentence: its first line.
    with pytest.raises(SystemExit):
        cli.main(["bench", "--help"])
    listing = " ".join(capsys.readouterr().out.split())
    for name, module in cli.BENCHES.items():
        first_paragraph = " ".join(module.__doc__.strip().split("\n\n")[0].split())
        assert first_paragraph.endswith("."), name
        assert f"{name} {first_paragraph}" in listing, name


def test_learner_facing_text_names_no_internal_issue_numbers():
    # Help, docstrings and report headers said "issue 12's targets": say what the target is.
    package = Path(cli.__file__).parent
    for path in [*package.glob("bench/*.py"), *package.glob("course/**/*.py"), package / "cli.py"]:
        found = re.findall(r".*\b[Ii]ssues? \d+.*", path.read_text())
        assert not found, (path, found)


@pytest.mark.timeout(60)
def test_python_m_parlab_grade_is_parlab_grade():
    completed = subprocess.run([sys.executable, "-m", "parlab.course.grade", "--help"], capture_output=True, text=True,
                               timeout=50)
    assert completed.returncode == 0 and "--submissions DIR" in completed.stdout and "--hint TASK" in completed.stdout


@pytest.mark.timeout(30)
@pytest.mark.parametrize("check", QUICK_CHECKS, ids=lambda check: check.__name__)
def test_every_check_returns_a_status_and_a_message(check):
    status, message = check()
    assert status in STATUSES
    assert isinstance(message, str) and message


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "check", [doctor.check_python, doctor.check_torch, doctor.check_distributed, doctor.check_gloo]
)
def test_this_environment_has_what_the_lectures_need(check):
    assert check()[0] == doctor.OK


@pytest.mark.timeout(30)
@pytest.mark.skipif(torch.cuda.is_available(), reason="only CPU machines have no GPU")
def test_no_gpu_is_information_not_a_problem():
    assert doctor.check_gpus()[0] == doctor.INFO
    assert doctor.check_nccl()[0] in (doctor.OK, doctor.INFO)


@pytest.mark.timeout(30)
def test_widget_extension_is_found_in_this_environment():
    status, message = doctor.check_widget_extension()
    assert status == doctor.OK, message


@pytest.mark.timeout(30)
def test_missing_widget_extension_says_how_to_install_it(tmp_path):
    status, message = doctor.check_widget_extension([str(tmp_path)])
    assert status == doctor.PROBLEM
    assert "pip install" in message


@pytest.mark.timeout(120)
def test_all_reduce_smoke_test_passes():
    status, message = doctor.check_all_reduce()
    assert status == doctor.OK, message
    assert "every rank got 3" in message


def test_doctor_spells_this_ranks_device_as_the_techniques_do():
    # doctor keeps `import parlab` (tests replace parlab.launch), but not parlab.device().
    check_one_device_spelling("parlab.course.doctor")


@pytest.mark.timeout(30)
def test_a_failing_smoke_test_is_one_problem_line_with_the_first_line_of_the_error(monkeypatch):
    def failing_launch(*args, **kwargs):
        raise parlab.RankError({0: "Traceback (most recent call last):\n  ...\nOSError: port closed"})

    monkeypatch.setattr(parlab, "launch", failing_launch)
    status, message = doctor.check_all_reduce()
    assert status == doctor.PROBLEM
    assert "RankError: rank 0 failed: OSError: port closed" in message
    assert "\n" not in message


@pytest.mark.timeout(120)
def test_doctor_exits_0_here_with_one_marked_line_per_check(capsys):
    assert cli.main(["doctor"]) == 0
    lines = capsys.readouterr().out.splitlines()
    check_lines = lines[1:-1]
    assert len(check_lines) == len(doctor.CHECKS)
    assert all(line.split()[0] in (doctor.OK, doctor.INFO) for line in check_lines)


def _broken_check():
    raise RuntimeError("no such thing\nsecond line of detail")


@pytest.mark.timeout(30)
def test_doctor_exits_1_on_a_problem_and_reports_a_crashing_check_in_one_line(monkeypatch, capsys):
    monkeypatch.setattr(doctor, "CHECKS", (doctor.check_python, _broken_check))
    assert doctor.run() == 1
    out = capsys.readouterr().out
    assert "PROBLEM  _broken_check could not run: RuntimeError: no such thing" in out
    assert "second line" not in out and "Traceback" not in out


@pytest.fixture(scope="module")
def runtime_result():
    return bench_runtime(world_size=2, repeats=5, spawn_repeats=1)


def _assert_runtime_result(result, world_size, repeats, spawn_repeats):
    assert result["world_size"] == world_size
    assert result["repeats"] == repeats
    assert result["spawn_repeats"] == spawn_repeats
    assert result["torch_version"] == torch.__version__
    assert result["cpu_count"] >= 1
    assert all(result[key] > 0 for key in TIMES)
    assert result["cluster_median_s"] <= result["cluster_p90_s"]
    assert result["ratio"] == result["cluster_median_s"] / result["spawn_median_s"]  # parlab / reference
    assert result["ratio_means"] == ratio_header(REFERENCE)


@pytest.mark.timeout(180)
def test_bench_runtime_measures_both_sides(runtime_result):
    _assert_runtime_result(runtime_result, world_size=2, repeats=5, spawn_repeats=1)


@pytest.mark.timeout(180)
def test_bench_runtime_report_is_a_table_with_both_rows(runtime_result):
    report = format_report(runtime_result)
    assert "persistent parlab.Cluster.run" in report
    assert "fresh torch.multiprocessing.spawn" in report
    assert "cluster call / fresh spawn" in report


@pytest.mark.timeout(180)
def test_bench_runtime_json_on_stdout_progress_on_stderr(capsys):
    argv = ["bench", "runtime", "--json", "--world-size", "2", "--repeats", "3", "--spawn-repeats", "1"]
    assert cli.main(argv) == 0
    captured = capsys.readouterr()
    _assert_runtime_result(json.loads(captured.out), world_size=2, repeats=3, spawn_repeats=1)
    assert "spawn" in captured.err


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "argv, complaint",
    [
        (["bench", "runtime", "--world-size", "0"], "--world-size: expected a whole number of at least 1"),
        (["bench", "runtime", "--repeats", "many"], "--repeats: expected a whole number of at least 1"),
        (["bench", "nosuchbench"], "invalid choice: 'nosuchbench'"),
        (["bench"], "required: NAME"),
        ([], "required: COMMAND"),
        (["frobnicate"], "invalid choice: 'frobnicate'"),
        (["grade", "--late-penalty", "a lot"], "--late-penalty: invalid float value: 'a lot'"),
        (["hint", "--level", "two"], "--level: invalid int value: 'two'"),
    ],
)
def test_bad_command_lines_exit_2_with_a_clear_message(argv, complaint, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
    assert complaint in capsys.readouterr().err


@pytest.mark.timeout(30)
@pytest.mark.parametrize("repeats, spawn_repeats", [(0, 1), (5, 0)])
def test_bench_runtime_rejects_zero_repeats_before_starting_anything(repeats, spawn_repeats):
    with pytest.raises(ValueError, match="at least 1"):
        bench_runtime(world_size=2, repeats=repeats, spawn_repeats=spawn_repeats)


@pytest.mark.timeout(30)
def test_bench_runtime_rejects_a_world_size_of_zero():
    with pytest.raises(ValueError, match="world_size must be at least 1"):
        bench_runtime(world_size=0, repeats=1, spawn_repeats=1)


@pytest.mark.timeout(60)
def test_python_m_parlab_is_the_same_command():
    completed = subprocess.run(
        [sys.executable, "-m", "parlab", "bench", "--help"], capture_output=True, text=True, timeout=50
    )
    assert completed.returncode == 0
    assert "runtime" in completed.stdout and "emulation" in completed.stdout


@pytest.mark.timeout(10)
def test_bench_helpers():
    assert positive_int("3") == 3
    assert percentile([5.0], 90) == 5.0
    assert percentile([float(v) for v in range(1, 11)], 90) == 9.0
    assert percentile([float(v) for v in range(1, 11)], 50) == 5.0
    assert [byte_size(text) for text in ("4096", "1K", "4M", "1.5G", "64MB")] == [4096, 1024, 4 * 2**20,
                                                                                  3 * 2**29, 64 * 2**20]
    assert [format_bytes(n) for n in (12, 1024, 4 * 2**20, 3 * 2**29)] == ["12B", "1K", "4M", "1.5G"]
    assert format_table(["name", "n"], [["a", 10], ["long name", 2]]).splitlines() == [
        "name        n",
        "a          10",
        "long name   2",
    ]


@pytest.mark.timeout(10)
def test_progress_bar_counts_on_stderr_and_leaves_stdout_to_the_result(capsys):
    with progress_bar("demo", 2, unit="size") as bar:
        bar.set_postfix_str("N=4, 1M")
        bar.update(2)
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "parlab bench demo" in captured.err and "2/2" in captured.err and "N=4, 1M" in captured.err


@pytest.mark.timeout(10)
def test_a_notebook_progress_bar_leaves_a_line_of_text_not_a_dead_widget(monkeypatch):
    """In a notebook the bar is a widget shown through a display handle; closing it replaces
    the output by text, so a saved notebook reopened without its kernel still reads."""
    pytest.importorskip("ipywidgets")
    import IPython.display

    from parlab.runtime import progress

    shown = {}

    class Handle:
        def update(self, obj, raw=False):
            shown["output"] = obj if raw else {"text/plain": repr(obj)}

    def display(obj, display_id=False):
        shown["output"] = {"application/vnd.jupyter.widget-view+json": obj}
        return Handle()

    monkeypatch.setattr(progress, "_in_notebook", lambda: True)
    monkeypatch.setattr(IPython.display, "display", display)
    with progress_bar("demo", 3, unit="size") as bar:
        assert "application/vnd.jupyter.widget-view+json" in shown["output"]
        bar.set_postfix_str("N=4, 1M")
        bar.update(3)
    assert list(shown["output"]) == ["text/plain"]
    assert shown["output"]["text/plain"].startswith("parlab bench demo: 3/3 sizes in ")


@pytest.mark.parametrize("argv, gpu", [(["doctor"], False), (["doctor", "--gpu"], True)])
def test_doctor_runs_the_gpu_check_only_when_asked(argv, gpu, monkeypatch):
    asked = []
    monkeypatch.setattr(doctor, "run", lambda gpu=False: asked.append(gpu) or 0)
    assert cli.main(argv) == 0 and asked == [gpu]
