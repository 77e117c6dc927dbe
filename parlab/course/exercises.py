"""Exercise files: the learner's ``exercises/<topic>.py``, generated from ``solutions/<topic>.py``,
and the hints a learner opens on purpose.

    python -m parlab.course.exercises build [TOPIC ...] [--force]   write the exercise files
    python -m parlab.course.exercises check [TOPIC ...]             exit 1 if any is out of date
    hint("collectives.ring_reduce_scatter")                  the next hint for a task

How a solution's marked blocks become stubs, and the header that tells a learner's edits from
an older generation: ``parlab.course.exercise_stubs``.

Hints. The step-by-step help lives in the solution too, in one block that the exercise
leaves out, at the top level of the file:

    # BEGIN HINTS
    HINTS = {"ring_reduce_scatter": ("a nudge", "the plan", "a sketch close to the solution")}
    # END HINTS

one entry per graded task (``tests/grading/test_<topic>.py``), three levels each
(``HINT_LEVELS``). ``hint("<topic>.<task>")`` prints them one level at a time, each call the
next; ``parlab hint <topic>.<task> [--level L]`` prints one from a terminal. A misspelt task
is refused naming the closest one (``refuse_name``, which grading uses too).

Edited exercises are safe. A file whose text no longer matches the hash in its header was
edited by the learner: ``build`` leaves it alone, and says so, unless ``force``.

Out of date. ``check`` (and a test of the suite) compares each exercise as generated with a
fresh generation, so CI fails when a solution changed but its exercise was not rebuilt. It
never judges a learner's work: an edited file is set aside for the version git's HEAD holds
(``generated_status``), and finishing an exercise never makes the check fail.
"""

import argparse
import ast
import difflib
import inspect
import subprocess
import sys
from pathlib import Path

from parlab.course.exercise_stubs import BEGIN_HINTS, END_HINTS, generate, was_edited

__all__ = ["HINT_LEVELS", "ROOT", "build", "fresh", "generate", "generated_status", "hint", "hint_tasks", "hint_text",
           "hints", "main", "refuse_name", "stale", "status", "topics", "was_edited"]

# The repository: parlab is installed from it in editable mode (pip install -e .).
ROOT = Path(__file__).resolve().parents[2]
HINT_LEVELS = ("a nudge", "the plan", "a sketch close to the solution")


def topics(root=ROOT):
    """The topics that have a solution: the names of ``solutions/*.py``, sorted."""
    paths = (Path(root) / "solutions").glob("*.py")
    return sorted(path.stem for path in paths if not path.stem.startswith("_"))


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


_opened = {}  # "topic.task" -> the deepest hint level printed in this process


def hint(task, level=None, root=ROOT):
    """Print a hint for the exercise task ``task`` ("collectives.ring_reduce_scatter"), one
    level at a time: the first call in this process a nudge, the next the plan, the third a
    sketch close to the solution (``HINT_LEVELS``); later calls repeat the last. ``level``
    (1 to 3) prints that level instead. An unknown task raises ValueError naming the closest."""
    if level is None:
        level = min(_opened.get(task, 0) + 1, len(HINT_LEVELS))
    text = hint_text(task, level, root)
    _opened[task] = max(_opened.get(task, 0), level)
    more = (f'parlab.hint("{task}") again opens hint {level + 1} ({HINT_LEVELS[level]}).'
            if level < len(HINT_LEVELS) else "That was the last hint; the grader's reasons say what is still wrong.")
    print(f"{text}\n\n{more}")


def hint_text(task, level, root=ROOT):
    """Hint ``level`` (1 to 3) of ``task`` as printed: a heading line, then the hint indented."""
    levels = _hint_levels(task, root)
    if isinstance(level, bool) or not isinstance(level, int) or not 1 <= level <= len(levels):
        raise ValueError(f"level must be 1 to {len(levels)}, got {level!r}: hints go from 1 ({HINT_LEVELS[0]}) to "
                         f"{len(levels)} ({HINT_LEVELS[-1]}).")
    text = levels[level - 1]
    body = "\n".join(f"    {line}" if line else "" for line in text.splitlines())
    return f"{task}, hint {level} of {len(HINT_LEVELS)} ({HINT_LEVELS[level - 1]}):\n\n{body}"


def hints(topic, root=ROOT):
    """{task: (nudge, plan, sketch)} of ``solutions/<topic>.py``: its HINTS dict, between
    ``# BEGIN HINTS`` and ``# END HINTS``, read without importing the solution. Raises
    ValueError naming the file when the block is missing or not such a dict."""
    name = f"solutions/{topic}.py"
    lines = (Path(root) / "solutions" / f"{topic}.py").read_text().splitlines()
    starts = [i for i, line in enumerate(lines) if BEGIN_HINTS.match(line)]
    ends = [i for i, line in enumerate(lines) if END_HINTS.match(line)]
    if len(starts) != 1 or len(ends) != 1 or ends[0] < starts[0]:
        raise ValueError(f"{name} needs one block of hints, '# BEGIN HINTS' ... '# END HINTS', at the top level.")
    block = ast.parse("\n".join(lines[starts[0] + 1 : ends[0]]), name).body
    if len(block) != 1 or not isinstance(block[0], ast.Assign) or ast.unparse(block[0].targets[0]) != "HINTS":
        raise ValueError(f"{name}: the hints block holds one assignment, HINTS = {{task: (nudge, plan, sketch)}}.")
    found = ast.literal_eval(block[0].value)
    if not isinstance(found, dict) or not all(
            isinstance(levels, (tuple, list)) and len(levels) == len(HINT_LEVELS)
            and all(isinstance(text, str) and text.strip() for text in levels) for levels in found.values()):
        raise ValueError(f"{name}: HINTS maps each task to {len(HINT_LEVELS)} texts: {', '.join(HINT_LEVELS)}.")
    return {task: tuple(inspect.cleandoc(text) for text in levels) for task, levels in found.items()}


def hint_tasks(root=ROOT):
    """Every "topic.task" that has hints, sorted."""
    return sorted(f"{topic}.{task}" for topic in topics(root) for task in hints(topic, root))


def refuse_name(name, tasks, kind=None):
    """The sentence refusing ``name``, a topic or a task ("topic.task") that is none of
    ``tasks`` (every "topic.task"): the closest name (difflib) when one is close, else the
    tasks of its topic, or the topics. A task is compared with its topic's tasks, whose
    shared "topic." would make any two look alike. ``kind`` is "task" or "topic" (default:
    "task" when ``name`` has a dot)."""
    kind = kind or ("task" if "." in name else "topic")
    topics = sorted({task.partition(".")[0] for task in tasks})
    topic, _, task = name.partition(".")
    if kind == "task" and topic in topics:
        own = [known for known in tasks if known.partition(".")[0] == topic]
        close = difflib.get_close_matches(task, [known.partition(".")[2] for known in own], n=1)
        if close:
            return f"there is no task {name!r}: did you mean '{topic}.{close[0]}'?"
        return f"there is no task {name!r}; the tasks of {topic} are: {', '.join(own)}."
    close = difflib.get_close_matches(name, tasks if kind == "task" else topics, n=1)
    if close:
        return f"there is no {kind} {name!r}: did you mean {close[0]!r}?"
    return f"there is no topic {topic!r}; the topics are: {', '.join(topics)}."


def _hint_levels(task, root):
    topic, _, name = task.partition(".") if isinstance(task, str) else ("", "", "")
    levels = hints(topic, root).get(name) if topic in topics(root) else None
    if levels is None:
        raise ValueError(refuse_name(str(task), hint_tasks(root), kind="task"))
    return levels


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m parlab.course.exercises", description=__doc__.split("\n\n")[0])
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
            print(f"{where} is {state}: run `python -m parlab.course.exercises build {topic}` and commit it.")
    return 1 if failed else 0


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
