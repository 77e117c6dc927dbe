"""How a solution's text becomes an exercise's text (``parlab.course.exercises`` writes the files).

A solution marks what the learner writes with two comment lines:

        # BEGIN SOLUTION: the N - 1 ring steps
        ...reference code...
        # END SOLUTION

The exercise has in their place, at the indentation of the BEGIN line,

        raise NotImplementedError("ring_reduce_scatter is not implemented yet: the N - 1 ring steps")

naming the function around the block; the text after ``BEGIN SOLUTION:`` is an optional
note on what goes there. Everything else (docstrings, helpers, imports) is copied as it is:
the docstring is the specification (what the function computes, its shapes and formula,
what it returns and may call), never the steps to write. The block of hints between
``# BEGIN HINTS`` and ``# END HINTS`` is left out.

A generated text starts with a header whose last line holds the SHA-256 of the text below
it: ``was_edited`` tells a learner's edits from an older generation.
"""

import hashlib
import json
import re

_BEGIN = re.compile(r"^(?P<indent>[ \t]*)# BEGIN SOLUTION(?::[ \t]*(?P<note>.*?))?[ \t]*$")
_END = re.compile(r"^[ \t]*# END SOLUTION[ \t]*$")
BEGIN_HINTS = re.compile(r"^# BEGIN HINTS\b.*$")
END_HINTS = re.compile(r"^# END HINTS[ \t]*$")
_DEF = re.compile(r"^(?P<indent>[ \t]*)(?:async[ \t]+)?def[ \t]+(?P<name>\w+)")
_HASH_LINE = re.compile(r"^# parlab-generated sha256=(?P<digest>[0-9a-f]{64})$")
_HEADER = (
    "# Generated from solutions/{topic}.py by `python -m parlab.course.exercises build`.\n"
    "# Write your code where it raises NotImplementedError, then run `parlab grade {topic}`.\n"
    "# parlab-generated sha256={digest}\n"
)
_HEADER_LINES = _HEADER.count("\n")


def generate(source, topic, source_name=None):
    """The exercise text for the solution text ``source``: every BEGIN/END SOLUTION block
    replaced by a ``raise NotImplementedError``, under a header holding the hash of the rest.

    Raises ValueError (naming the line) for unbalanced markers or a result that is not
    valid Python.
    """
    source_name = source_name or f"solutions/{topic}.py"
    body = _stub_blocks(source, topic, source_name)
    try:
        compile(body, source_name, "exec")
    except SyntaxError as exc:
        raise ValueError(
            f"{source_name}: the exercise generated from it is not valid Python (line {exc.lineno}: "
            f"{exc.msg}); put the SOLUTION markers around whole statements."
        ) from exc
    return _HEADER.format(topic=topic, digest=_digest(body)) + body


def was_edited(text):
    """Whether an exercise file's text differs from what generated it (per its header hash)."""
    lines = text.splitlines(keepends=True)
    if len(lines) < _HEADER_LINES:
        return True
    match = _HASH_LINE.match(lines[_HEADER_LINES - 1].rstrip("\n"))
    return match is None or match["digest"] != _digest("".join(lines[_HEADER_LINES:]))


def _stub_blocks(source, topic, source_name):
    lines = source.splitlines(keepends=True)
    out, begin, hints_begin = [], None, None
    for number, line in enumerate(lines, start=1):
        text = line.rstrip("\r\n")
        if hints_begin is not None:
            if END_HINTS.match(text):
                hints_begin = None
        elif BEGIN_HINTS.match(text):
            if begin is not None:
                raise ValueError(f"{source_name}, line {number}: BEGIN HINTS inside the SOLUTION block opened on "
                                 f"line {begin}.")
            hints_begin = number
        elif _BEGIN.match(text):
            if begin is not None:
                raise ValueError(
                    f"{source_name}, line {number}: BEGIN SOLUTION inside the block opened on line {begin}."
                )
            begin, match = number, _BEGIN.match(text)
            name = _enclosing_function(lines, number, match["indent"]) or topic
            out.append(_stub(match["indent"], name, match["note"]))
        elif _END.match(text):
            if begin is None:
                raise ValueError(f"{source_name}, line {number}: END SOLUTION without a BEGIN SOLUTION above.")
            begin = None
        elif begin is None:
            out.append(line)
    if begin is not None:
        raise ValueError(f"{source_name}, line {begin}: BEGIN SOLUTION is never closed by an END SOLUTION.")
    if hints_begin is not None:
        raise ValueError(f"{source_name}, line {hints_begin}: BEGIN HINTS is never closed by an END HINTS.")
    return "".join(out).rstrip("\n") + "\n"  # the blank lines before a final hints block go with it


def _stub(indent, name, note):
    message = f"{name} is not implemented yet" + (f": {note}" if note else "")
    return f"{indent}raise NotImplementedError({json.dumps(message, ensure_ascii=False)})\n"


def _enclosing_function(lines, number, indent):
    """The name of the innermost ``def`` above line ``number`` that is less indented."""
    for line in reversed(lines[: number - 1]):
        match = _DEF.match(line)
        if match and len(match["indent"]) < len(indent):
            return match["name"]
    return None


def _digest(text):
    return hashlib.sha256(text.encode()).hexdigest()
