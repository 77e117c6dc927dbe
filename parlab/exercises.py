"""Exercise files: the learner's ``exercises/<topic>.py``, generated from ``solutions/<topic>.py``.

    python -m parlab.exercises build [TOPIC ...] [--force]   write the exercise files
    python -m parlab.exercises check [TOPIC ...]             exit 1 if any is out of date

A solution marks what the learner writes with two comment lines:

        # BEGIN SOLUTION: the N - 1 ring steps
        ...reference code...
        # END SOLUTION

The exercise has in their place, at the indentation of the BEGIN line,

        raise NotImplementedError("ring_reduce_scatter is not implemented yet: the N - 1 ring steps")

naming the function around the block; the text after ``BEGIN SOLUTION:`` is an optional
hint. Everything else (docstrings, helpers, imports) is copied as it is: the docstring is
the specification.

Edited exercises are safe. A generated file starts with a header whose last line holds the
SHA-256 of the text below it. A file whose text no longer matches its hash was edited by
the learner: ``build`` leaves it alone, and says so, unless ``force``.

Out of date. ``check`` (and a test of the suite) compares each exercise as generated with a
fresh generation, so CI fails when a solution changed but its exercise was not rebuilt. It
never judges a learner's work: an edited file is set aside for the version git's HEAD holds
(``generated_status``), and finishing an exercise never makes the check fail.
"""

import argparse
import hashlib
import json
import re
import subprocess
import sys
from pathlib import Path

# The repository: parlab is installed from it in editable mode (pip install -e .).
ROOT = Path(__file__).resolve().parent.parent

_BEGIN = re.compile(r"^(?P<indent>[ \t]*)# BEGIN SOLUTION(?::[ \t]*(?P<hint>.*?))?[ \t]*$")
_END = re.compile(r"^[ \t]*# END SOLUTION[ \t]*$")
_DEF = re.compile(r"^(?P<indent>[ \t]*)(?:async[ \t]+)?def[ \t]+(?P<name>\w+)")
_HASH_LINE = re.compile(r"^# parlab-generated sha256=(?P<digest>[0-9a-f]{64})$")
_HEADER = (
    "# Generated from solutions/{topic}.py by `python -m parlab.exercises build`.\n"
    "# Write your code where it raises NotImplementedError, then run `python -m parlab.grade {topic}`.\n"
    "# parlab-generated sha256={digest}\n"
)
_HEADER_LINES = _HEADER.count("\n")


def topics(root=ROOT):
    """The topics that have a solution: the names of ``solutions/*.py``, sorted."""
    paths = (Path(root) / "solutions").glob("*.py")
    return sorted(path.stem for path in paths if not path.stem.startswith("_"))


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


def fresh(topic, root=ROOT):
    """The text of ``exercises/<topic>.py`` generated now from ``solutions/<topic>.py``."""
    return generate((Path(root) / "solutions" / f"{topic}.py").read_text(), topic)


def status(topic, root=ROOT):
    """How ``exercises/<topic>.py`` compares with a fresh generation: "up to date", "missing",
    "outdated" (generated from an older solution, never edited) or "edited"."""
    path = _exercise_path(topic, root)
    return _compare(path.read_text() if path.exists() else None, topic, root)


def generated_status(topic, root=ROOT):
    """(status, where) of the exercise as generated, never of a learner's edits: the status
    of ``exercises/<topic>.py`` while nobody has edited it, else of the version git's HEAD
    holds. "edited" only when no untouched version is to be had (HEAD's was edited too, or
    ``root`` is not a git checkout); ``where`` says which version was compared, or why none."""
    working = status(topic, root)
    if working != "edited":
        return working, f"exercises/{topic}.py"
    committed = _git_show(root, f"exercises/{topic}.py")
    if committed is _NO_HISTORY:
        return "edited", f"exercises/{topic}.py was edited and {root} is not a git checkout holding the original"
    state = _compare(committed, topic, root)
    if state == "edited":
        return state, f"exercises/{topic}.py was edited, in git's HEAD too"
    return state, f"exercises/{topic}.py in git's HEAD (the working file was edited)"


def was_edited(text):
    """Whether an exercise file's text differs from what generated it (per its header hash)."""
    lines = text.splitlines(keepends=True)
    if len(lines) < _HEADER_LINES:
        return True
    match = _HASH_LINE.match(lines[_HEADER_LINES - 1].rstrip("\n"))
    return match is None or match["digest"] != _digest("".join(lines[_HEADER_LINES:]))


def build(names=None, force=False, root=ROOT):
    """Write ``exercises/<topic>.py`` for the given topics (default: all). Returns
    {topic: what happened}: "written", "up to date" or "kept: edited by hand ..."."""
    done = {}
    for topic in _checked_topics(names, root):
        state = status(topic, root)
        if state == "up to date":
            done[topic] = state
        elif state == "edited" and not force:
            done[topic] = "kept: edited by hand (build it with --force to overwrite your edits)"
        else:
            path = _exercise_path(topic, root)
            path.parent.mkdir(exist_ok=True)
            path.write_text(fresh(topic, root))
            done[topic] = "written"
    return done


def stale(names=None, root=ROOT):
    """{topic: (status, where)} for every exercise (of the given topics) whose version as
    generated (see ``generated_status``) is not up to date; empty when all are."""
    states = {topic: generated_status(topic, root) for topic in _checked_topics(names, root)}
    return {topic: state for topic, state in states.items() if state[0] != "up to date"}


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m parlab.exercises", description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=("build", "check"))
    parser.add_argument("topics", nargs="*", help="topics to build or check (default: all)")
    parser.add_argument("--force", action="store_true", help="overwrite exercise files you edited")
    args = parser.parse_args(argv)
    try:
        if args.command == "build":
            for topic, what in build(args.topics or None, args.force).items():
                print(f"exercises/{topic}.py: {what}")
            return 0
        outdated = stale(args.topics or None)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    failed = False
    for topic, (state, where) in outdated.items():
        if state == "edited":
            print(f"{where}: nothing to check (`build --force {topic}` would overwrite the edits).")
        else:
            failed = True
            print(f"{where} is {state}: run `python -m parlab.exercises build {topic}` and commit it.")
    return 1 if failed else 0


def _stub_blocks(source, topic, source_name):
    lines = source.splitlines(keepends=True)
    out, begin = [], None
    for number, line in enumerate(lines, start=1):
        text = line.rstrip("\r\n")
        if _BEGIN.match(text):
            if begin is not None:
                raise ValueError(
                    f"{source_name}, line {number}: BEGIN SOLUTION inside the block opened on line {begin}."
                )
            begin, match = number, _BEGIN.match(text)
            name = _enclosing_function(lines, number, match["indent"]) or topic
            out.append(_stub(match["indent"], name, match["hint"]))
        elif _END.match(text):
            if begin is None:
                raise ValueError(f"{source_name}, line {number}: END SOLUTION without a BEGIN SOLUTION above.")
            begin = None
        elif begin is None:
            out.append(line)
    if begin is not None:
        raise ValueError(f"{source_name}, line {begin}: BEGIN SOLUTION is never closed by an END SOLUTION.")
    return "".join(out)


def _stub(indent, name, hint):
    message = f"{name} is not implemented yet" + (f": {hint}" if hint else "")
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


def _checked_topics(names, root):
    known = topics(root)
    for name in names or ():
        if name not in known:
            listed = ", ".join(known) or "none yet"
            raise ValueError(f"there is no solutions/{name}.py; the topics are: {listed}.")
    return list(names or known)


def _compare(text, topic, root):
    if text is None:
        return "missing"
    if text == fresh(topic, root):
        return "up to date"
    return "edited" if was_edited(text) else "outdated"


_NO_HISTORY = object()


def _git_show(root, path):
    """The text of ``path`` (relative to ``root``) in git's HEAD; None when HEAD has no such
    file, ``_NO_HISTORY`` when ``root`` is not in a git checkout with a commit (or there is no git)."""
    def git(*args):
        return subprocess.run(["git", "-C", str(root), *args], capture_output=True)

    try:
        if git("rev-parse", "--verify", "--quiet", "HEAD").returncode != 0:
            return _NO_HISTORY
    except FileNotFoundError:
        return _NO_HISTORY
    shown = git("show", f"HEAD:./{path}")  # ./ : relative to root, wherever the checkout's top is
    return shown.stdout.decode() if shown.returncode == 0 else None


def _exercise_path(topic, root):
    return Path(root) / "exercises" / f"{topic}.py"


if __name__ == "__main__":
    sys.exit(main())
