"""The browser test's stand-in for nbval (tests/checked_outputs.py): it finds the checked cells
and compares their outputs as nbval does, so a lecture whose checked output changes fails."""

import json

from checked_outputs import checked_cells, differences

PATTERNS = [(r"\b\d+\.\d+ ?ms\b", "DURATION")]


def stream(text, name="stdout"):
    return {"output_type": "stream", "name": name, "text": text}


def result(text, **data):
    return {"output_type": "execute_result", "execution_count": 7, "metadata": {},
            "data": {"text/plain": text, **data}}


def test_equal_outputs_agree_and_what_nbval_ignores_is_ignored():
    stored = [stream(["a 1.5 ms\n", "b\n"]), result("42", **{"image/png": "AAAA"})]
    fresh = [stream("a 9.25 ms\n"), stream("b\n"),
             {**result("42", **{"image/png": "BBBB"}), "execution_count": 3, "metadata": {"x": 1}}]
    assert differences(stored, fresh, PATTERNS) == []


def test_a_changed_number_is_a_difference():
    assert differences([stream("8 all-reduces\n")], [stream("9 all-reduces\n")], PATTERNS) == [
        "stdout: stored\n['8 all-reduces\\n']\nnow\n['9 all-reduces\\n']"]


def test_a_missing_or_extra_kind_of_output_is_a_difference():
    assert differences([stream("x\n")], [stream("x\n"), stream("boom\n", "stderr")], PATTERNS) == [
        "output kinds differ: stored ['stdout'], now ['stderr', 'stdout']"]


def test_carriage_returns_keep_only_what_a_terminal_shows():
    assert differences([stream("done\n")], [stream("10%\r50%\rdone\n")], PATTERNS) == []


def test_the_sanitize_file_is_used_by_default():
    assert differences([stream("took 1.25 s\n")], [stream("took 3.5 s\n")]) == []


def test_only_run_cells_marked_for_checking_are_checked(tmp_path):
    def code(source, count, outputs):
        return {"cell_type": "code", "metadata": {}, "source": source, "execution_count": count, "outputs": outputs}
    cells = [{"cell_type": "markdown", "metadata": {}, "source": "# NBVAL_CHECK_OUTPUT"},
             code("# NBVAL_CHECK_OUTPUT\nprint(1)", 1, [stream("1\n")]),
             code("print(2)", 2, [stream("2\n")]),
             code(["# NBVAL_CHECK_OUTPUT\n", "print(3)"], None, [])]
    path = tmp_path / "lecture.ipynb"
    path.write_text(json.dumps({"cells": cells}))
    assert checked_cells(path) == {1: [stream("1\n")]}


def test_a_backspace_removes_the_character_before_it():
    assert differences([stream("ab\n")], [stream("abc\x08\n")], PATTERNS) == []
