"""nbval's lax check, for a lecture run elsewhere: the cells marked ``# NBVAL_CHECK_OUTPUT``
must give the outputs stored in the notebook, compared as nbval compares them (streams of one
name joined, carriage returns applied, the sanitize file's patterns applied to both sides,
pictures, widget ids, metadata and counters ignored).

The browser test runs every lecture in JupyterLab anyway; checking these cells there lets
one run of a lecture serve both checks. tests/conftest.py then leaves nbval's own run of the
lectures out (a run of ``pytest notebooks/NN_x.ipynb`` alone still uses nbval).
"""

import json
import pathlib
import re
from collections import defaultdict

from nbval.plugin import find_comment_markers, get_sanitize_patterns

SANITIZE_FILE = pathlib.Path(__file__).resolve().parent / "nbval_sanitize.cfg"
# What nbval leaves out of the comparison (nbval.plugin.IPyNbFile.skip_compare without --nbdime).
SKIPPED = {"metadata", "traceback", "prompt_number", "output_type", "name", "execution_count",
           "application/vnd.jupyter.widget-view+json", "image/png", "image/jpeg"}
# Text a terminal would overwrite: a character before a backspace, or a line's text
# before a carriage return (nbval.plugin.coalesce_streams).
BACKSPACE, CARRIAGE_RETURN = re.compile("[^\n]\x08"), re.compile(r"^.*\r(?=[^\n])", re.MULTILINE)


def checked_cells(notebook):
    """{cell index: stored outputs} of the code cells of ``notebook`` (a path) that carry
    ``# NBVAL_CHECK_OUTPUT`` and were run when the notebook was saved."""
    cells = json.loads(pathlib.Path(notebook).read_text(encoding="utf-8"))["cells"]
    return {index: cell["outputs"] for index, cell in enumerate(cells)
            if cell["cell_type"] == "code" and cell.get("execution_count") is not None
            and dict(find_comment_markers(_text(cell["source"]))).get("check")}


def differences(stored, fresh, patterns=None):
    """Where the outputs ``fresh`` of a cell differ from its ``stored`` outputs as nbval
    compares them: a list of sentences, empty when they agree."""
    patterns = get_sanitize_patterns(SANITIZE_FILE.read_text()) if patterns is None else patterns
    expected, got = _flatten(stored, patterns), _flatten(fresh, patterns)
    if expected.keys() != got.keys():
        return [f"output kinds differ: stored {sorted(expected)}, now {sorted(got)}"]
    return [f"{kind}: stored\n{expected[kind]}\nnow\n{got[kind]}" for kind in expected if expected[kind] != got[kind]]


def _flatten(outputs, patterns):
    """{key: [sanitized values]}: streams by their name, data by MIME type, other keys by name."""
    streams = defaultdict(str)
    flat = defaultdict(list)
    for output in outputs:
        if output["output_type"] == "stream":
            streams[output["name"]] += _text(output["text"])
            continue
        for key, value in output.items():
            if key == "data":
                for kind, data in value.items():
                    if kind not in SKIPPED:
                        flat[kind].append(_sanitize(_text(data), patterns))
            elif key not in SKIPPED:
                flat[key].append(_sanitize(_text(value), patterns))
    for name, text in streams.items():
        previous = None
        while previous != text:
            previous, text = text, BACKSPACE.sub("", text)
        flat[name].append(_sanitize(CARRIAGE_RETURN.sub("", text), patterns))
    return dict(flat)


def _text(value):
    return "".join(value) if isinstance(value, list) else value


def _sanitize(value, patterns):
    if not isinstance(value, str):
        return value
    for regex, replace in patterns:
        value = re.sub(regex, replace, value)
    return value
