"""parlab.show: a lecture shows the package's own code."""

import pytest

from parlab import collectives
from parlab.source import show, source


def test_source_is_the_function_as_written_in_the_package():
    text = source(collectives.ring_allreduce)
    assert text.startswith("def ring_allreduce(")
    assert "ring_reduce_scatter(" in text and "ring_all_gather(" in text


def test_lines_pick_a_part_counted_within_the_object():
    text = source(collectives.ring_allreduce, lines=(1, 1))
    assert text.startswith("def ring_allreduce(") and text.count("\n") == 1


def test_show_prints_the_qualified_name_and_the_code_outside_a_notebook(capsys):
    show(collectives.ring_allreduce)
    out = capsys.readouterr().out
    assert out.startswith("# parlab.collectives.ring.ring_allreduce\ndef ring_allreduce(")  # the module to open


@pytest.mark.parametrize("obj, lines, fix", [(42, None, "pass a function"),
                                             (collectives.ring_allreduce, (3, 1), "first <= last"),
                                             (collectives.ring_allreduce, 5, "lines must be")])
def test_bad_input_says_what_to_pass(obj, lines, fix):
    with pytest.raises(ValueError, match=fix):
        source(obj, lines)
