"""The async_sgd grader names a learner's likely mistake in a gossip step, and writes numbers as
a learner reads them (3.667, not float32's 3.6666667461395264): classic mistakes made in an
otherwise correct solution, graded in one run each."""

import re

import pytest

from parlab.course import exercises, grade

pytestmark = pytest.mark.timeout(300)


def failed_with(mistakes, directory):
    """{test: reason} of the gossip tests that fail on the solution with each ``right`` text of
    ``mistakes`` replaced by its ``wrong`` one."""
    solution = (exercises.ROOT / "solutions" / "async_sgd.py").read_text()
    for right, wrong in mistakes.items():
        assert solution.count(right) == 1, right
        solution = solution.replace(right, wrong)
    (directory / "async_sgd.py").write_text(solution)
    results = grade.run_grading("async_sgd", impl=directory)
    return {test["test"]: test["reason"] for test in results if not test["passed"]}


def test_a_gradient_taken_at_the_mixed_x_is_named_and_its_numbers_are_short(tmp_path):
    failed = failed_with({"        mixed = mixed - lr * g\n": "        mixed = mixed - lr * gradient(mixed)\n"},
                         tmp_path)
    assert sorted(failed) == [f"test_subtracts_the_gradient_at_the_old_x[{n} ranks]" for n in (3, 4)]
    for reason in failed.values():
        assert "the gradient is taken at the mixed x: call gradient(x) on the x you were given" in reason, reason
        assert not re.search(r"\d\.\d{6}", reason), reason  # no raw float32 digits


def test_a_forgotten_own_value_is_named(tmp_path):
    failed = failed_with({"    mixed = (received[left] + x + received[right]) / 3\n":
                          "    mixed = (received[left] + received[right]) / 2\n"},
                         tmp_path)
    # every x_j still weighs 1/2 + 1/2 over the ranks, so the mean is kept: the values tell
    assert sorted(failed) == ([f"test_averages_with_both_neighbours_and_keeps_the_mean[{n} ranks]" for n in (2, 3, 4)]
                              + [f"test_subtracts_the_gradient_at_the_old_x[{n} ranks]" for n in (3, 4)])
    for reason in failed.values():
        assert "your own x_r is left out: average x_(r-1), x_r and x_(r+1)" in reason, reason
