"""Grading for instructors, without grading runs (those are in test_exercises.py): the
results.json layout, the late rule, deadlines and the folder of submissions, and the command
line's refusals before anything is graded."""

import json
from datetime import datetime, timedelta, timezone

import pytest

from parlab import cli
from parlab.course.grade import reports
from parlab.course.grade.reports import days_late, describe_lateness, find_submissions, late_record, results_json

DEADLINE = datetime(2025, 3, 1, 23, 59, tzinfo=timezone.utc)
RESULTS = [
    {"test": "test_a", "task": "collectives.ring_all_reduce", "points": 1, "passed": False, "reason": "wrong"},
    {"test": "test_b", "task": "collectives.ring_all_reduce", "points": 2, "passed": True, "reason": None},
    {"test": "test_c", "task": "collectives.ring_all_gather", "points": 1, "passed": True, "reason": None},
]


def test_results_follow_gradescopes_layout_one_entry_per_task():
    document = results_json(RESULTS, "collectives", 12.4, late_record(DEADLINE + timedelta(hours=1), DEADLINE, 0.1))
    json.dumps(document)  # JSON-ready
    assert document["score"] == pytest.approx(3 * 0.9) and document["execution_time"] == 12
    assert document["output"] == "collectives: 3 / 4 points; late by 1 day (points x 0.9)"
    allreduce, all_gather = document["tests"]
    assert {key: allreduce[key] for key in ("name", "score", "max_score", "status", "output")} == {
        "name": "collectives.ring_all_reduce", "score": 2, "max_score": 3, "status": "failed",
        "output": "test_a: wrong [hint: parlab hint collectives.ring_all_reduce]"}
    assert [test["test"] for test in allreduce["extra_data"]["tests"]] == ["test_a", "test_b"]
    assert {key: all_gather[key] for key in ("score", "max_score", "status", "output")} == {
        "score": 1, "max_score": 1, "status": "passed", "output": "all 1 tests passed"}
    assert document["extra_data"]["earned"] == 3 and document["extra_data"]["max_score"] == 4
    assert document["extra_data"]["lateness"]["days_late"] == 1


def test_a_run_that_did_not_finish_still_has_a_results_file():
    document = results_json([], "zero", 600.2, error="grading did not finish within 600 s.")
    assert document["score"] == 0 and document["tests"] == []
    assert document["output"].endswith("grading did not finish: grading did not finish within 600 s.")


@pytest.mark.parametrize("late_by, days", [
    (timedelta(0), 0), (-timedelta(hours=5), 0), (timedelta(seconds=1), 1), (timedelta(days=1), 1),
    (timedelta(days=1, seconds=1), 2), (timedelta(days=9, hours=23), 10)])
def test_lateness_is_whole_days_rounded_up(late_by, days):
    assert days_late(DEADLINE + late_by, DEADLINE) == days


def test_the_penalty_takes_a_fraction_per_day_and_never_below_zero():
    assert late_record(DEADLINE + timedelta(days=3), DEADLINE, 0.1)["factor"] == pytest.approx(0.7)
    assert late_record(DEADLINE + timedelta(days=20), DEADLINE, 0.1)["factor"] == 0
    flagged = late_record(DEADLINE + timedelta(days=3), DEADLINE, 0.0)
    assert flagged["factor"] == 1 and describe_lateness(flagged) == "late by 3 days (flagged, no penalty)"
    assert describe_lateness(late_record(None, DEADLINE, 0.1)) == "not submitted"
    assert describe_lateness(late_record(DEADLINE, None, 0.1)) == "no deadline"
    assert describe_lateness(late_record(DEADLINE, DEADLINE, 0.1)) == "on time"


def test_deadlines_are_iso_8601_local_unless_zoned(tmp_path):
    assert reports.parse_time("2025-03-01T23:59Z", "--deadline") == DEADLINE
    local = reports.parse_time("2025-03-01T23:59", "--deadline")
    assert local.tzinfo is not None and local.replace(tzinfo=None) == DEADLINE.replace(tzinfo=None)
    with pytest.raises(ValueError, match="--deadline: 'Friday' is not a time; write it in ISO 8601"):
        reports.parse_time("Friday", "--deadline")
    path = tmp_path / "deadlines"
    path.write_text("# extensions\n\nbob 2025-03-03T23:59Z  # ill\n")
    assert reports.read_deadlines(path) == {"bob": DEADLINE + timedelta(days=2)}
    path.write_text("bob\n")
    with pytest.raises(ValueError, match="deadlines, line 1: write `student WHEN`"):
        reports.read_deadlines(path)


def test_a_submission_is_a_folder_or_a_file_per_student(tmp_path):
    (tmp_path / "alice").mkdir()
    (tmp_path / "bob.py").write_text("")
    for skipped in (".git", "_private"):
        (tmp_path / skipped).mkdir()
    (tmp_path / "marks.csv").write_text("")
    assert find_submissions(tmp_path, "zero") == {"alice": tmp_path / "alice" / "zero.py", "bob": tmp_path / "bob.py"}
    (tmp_path / "alice.py").write_text("")
    with pytest.raises(ValueError, match="both a folder and a file for 'alice'"):
        find_submissions(tmp_path, "zero")
    with pytest.raises(ValueError, match="holds no submission"):
        find_submissions(tmp_path / "_private", "zero")
    with pytest.raises(ValueError, match="there is no folder"):
        find_submissions(tmp_path / "nope", "zero")


def test_bad_class_options_are_refused_before_any_grading(tmp_path, monkeypatch, capsys):
    def no_grading(*args, **kwargs):
        raise AssertionError("graded although the options were refused")

    monkeypatch.setattr(reports, "run_grading", no_grading)
    (tmp_path / "alice").mkdir()
    cases = [
        (["grade", "zero", "--deadline", "2025-03-01T23:59"], "--deadline grade a class: give --submissions DIR too"),
        (["grade", "zero", "--submissions", str(tmp_path)], "--submissions needs --reports OUT"),
        (["grade", "zero", "--submissions", str(tmp_path), "--reports", str(tmp_path / "r"), "--impl", "solutions"],
         "leave out --impl and --results"),
        (["grade", "--submissions", str(tmp_path), "--reports", str(tmp_path / "r")], "name the topic"),
        (["grade", "zero", "--submissions", str(tmp_path), "--reports", str(tmp_path / "r"), "--late-penalty", "2"],
         "the late penalty is the fraction of the points taken per day late, from 0 to 1"),
        (["grade", "zero.shard", "--submissions", str(tmp_path), "--reports", str(tmp_path / "r")],
         "there is no task 'zero.shard'"),
    ]
    for argv, complaint in cases:
        assert cli.main(argv) == 2, argv
        assert complaint in capsys.readouterr().err, argv


def test_reports_kept_among_the_submissions_are_not_a_student(tmp_path, monkeypatch):
    monkeypatch.setattr(reports, "run_grading", lambda name, impl, root, progress: RESULTS)
    (tmp_path / "alice").mkdir()
    (tmp_path / "alice" / "collectives.py").write_text("")
    for _ in range(2):  # the second run finds the first one's reports in the folder
        summary = reports.grade_submissions("collectives", tmp_path, tmp_path / "reports", progress=lambda line: None)
        assert [row["student"] for row in summary] == ["alice"]
    assert summary[0]["note"] == "no deadline" and summary[0]["score"] == 3
    assert json.loads((tmp_path / "reports" / "alice" / "results.json").read_text())["score"] == 3
