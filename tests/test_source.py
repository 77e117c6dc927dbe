"""parlab.show: a lecture shows the package's own code, and every stored listing is current."""

import json
import pathlib

import pytest

from parlab import collectives
from parlab.course.source import show, source, stale_listings, stored_listings

NOTEBOOKS = sorted((pathlib.Path(__file__).resolve().parent.parent / "notebooks").glob("*.ipynb"))


def test_source_is_the_function_as_written_in_the_package():
    text = source(collectives.ring_all_reduce)
    assert text.startswith("def ring_all_reduce(")
    assert "ring_reduce_scatter(" in text and "ring_all_gather(" in text


def test_show_prints_the_qualified_name_and_the_code_outside_a_notebook(capsys):
    show(collectives.ring_all_reduce)
    out = capsys.readouterr().out
    assert out.startswith("# parlab.collectives.ring.ring_all_reduce\ndef ring_all_reduce(")  # the module to open


def test_show_shows_whole_objects_only():
    with pytest.raises(TypeError):
        show(collectives.ring_all_reduce, lines=(1, 3))


def test_bad_input_says_what_to_pass():
    with pytest.raises(ValueError, match="pass a function"):
        source(42)


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda path: path.stem)
def test_every_stored_listing_equals_the_package_source(notebook):
    assert stale_listings(notebook) == []


def _notebook_with_listing(tmp_path, where, code, calls=1):
    markdown = f"`{where}`\n```python\n{code}```"
    cell = {"cell_type": "code", "metadata": {}, "execution_count": 1,
            "source": "import parlab\n" + "parlab.show(x)\n" * calls,
            "outputs": [{"output_type": "display_data", "metadata": {},
                         "data": {"text/markdown": markdown, "text/plain": "<Markdown>"}}]}
    path = tmp_path / "lecture.ipynb"
    path.write_text(json.dumps({"cells": [{"cell_type": "markdown", "metadata": {}, "source": "# x"}, cell]}))
    return path


def test_a_current_listing_passes(tmp_path):
    where = "parlab.collectives.ring.ring_all_reduce"
    path = _notebook_with_listing(tmp_path, where, source(collectives.ring_all_reduce))
    assert stored_listings(path) == [(1, where, source(collectives.ring_all_reduce))]
    assert stale_listings(path) == []


def test_a_listing_that_drifted_from_the_code_is_found(tmp_path):
    old = source(collectives.ring_all_reduce).replace("ring_all_gather(", "an_older_loop(")
    path = _notebook_with_listing(tmp_path, "parlab.collectives.ring.ring_all_reduce", old)
    assert stale_listings(path) == [
        "cell 1: the listing of parlab.collectives.ring.ring_all_reduce differs from the package's code: "
        "re-execute the lecture"]


def test_a_listing_of_something_gone_is_found(tmp_path):
    path = _notebook_with_listing(tmp_path, "parlab.collectives.ring.ring_that_was_renamed", "def f():\n")
    assert stale_listings(path) == ["cell 1: parlab.collectives.ring.ring_that_was_renamed no longer exists: "
                                     "parlab.collectives.ring has no ring_that_was_renamed."]


def test_a_show_without_its_stored_listing_is_found(tmp_path):
    path = _notebook_with_listing(tmp_path, "parlab.collectives.ring.ring_all_reduce",
                                  source(collectives.ring_all_reduce), calls=2)
    assert stale_listings(path) == ["cell 1: calls parlab.show 2 times but holds 1 listings: re-execute the lecture"]
