"""The graders of context_parallel and experts bite: their stubs, generated afresh, score zero
and say what to implement, and a classic mistake in otherwise correct code loses exactly its
points, with the mistake named (fixtures in tests/grading/fixtures/). That the solutions score
full marks is the grading tests themselves, run against solutions/ in this same pytest run."""

import pytest

from parlab.course import exercises, grade

FIXTURES = exercises.ROOT / "tests" / "grading" / "fixtures"
FULL_MARKS = {"context_parallel": 9, "experts": 6}


@pytest.fixture(scope="module")
def stubs(tmp_path_factory):
    """The two topics' exercises generated afresh from solutions/, whatever exercises/ hold."""
    directory = tmp_path_factory.mktemp("stubs")
    for topic in FULL_MARKS:
        (directory / f"{topic}.py").write_text(exercises.fresh(topic))
    return directory


def failed(topic, mistake):
    """{test name: reason} of the tests that the fixture ``mistake`` fails, and its score."""
    results = grade.run_grading(topic, impl=FIXTURES / mistake)
    return {test["test"]: test["reason"] for test in results if not test["passed"]}, grade.score(results)


def test_a_merge_without_the_max_loses_the_overflow_point_only():
    reasons, score = failed("context_parallel", "merge_without_max")
    assert score == grade.Score(8, 9)
    assert list(reasons) == ["test_large_scores_do_not_overflow"]
    reason = reasons["test_large_scores_do_not_overflow"]
    assert "inf or nan: exp(200) overflows float32" in reason and "subtract the max m = max(lse_a, lse_b)" in reason


def test_tokens_left_in_the_order_sent_lose_the_outputs_points_only():
    reasons, score = failed("experts", "tokens_left_in_sent_order")
    assert score == grade.Score(4, 6)  # the routing and the traffic are right
    assert sorted(reasons) == [f"test_every_token_comes_back_through_its_expert_to_its_place[{ep}]"
                               for ep in ("ep = 2 (two groups)", "ep = 4")]
    for reason in reasons.values():
        assert "a token returned to the wrong place: row 1 holds token 5's output" in reason, reason
        assert "put it back at that token's place (out[order] = returned)" in reason, reason
