"""The package's own code, shown in a lecture: ``parlab.show(obj)``.

A lecture explains an idea and then shows the function or class of parlab that is that idea
(the ring's loop, the bucketing hook, 1F1B's warm-up), read from the installed package. Only
whole functions and classes are shown, never a range of lines, so that a listing names exactly
what it shows, and ``stale_listings`` finds every stored listing of a notebook that no longer
equals the package's code (tests/test_source.py runs it on every lecture): a change to the code
fails the tests until the lecture is re-executed.
"""

import importlib
import inspect
import json
import re
import textwrap

# A listing as a notebook stores it: the object's qualified name, then its code.
HEADING, OPENING, CLOSING = "`{where}`\n", "```python\n", "```"
SHOW_CALL = re.compile(r"\bparlab\.show\(")
RERUN = "re-execute the lecture"


def source(obj):
    """The source text of a function, class or method of parlab, dedented."""
    try:
        return textwrap.dedent(inspect.getsource(obj))
    except (TypeError, OSError) as exc:
        raise ValueError(
            f"there is no source to show for {obj!r}: pass a function, class or method, such as "
            "parlab.collectives.ring_reduce_scatter."
        ) from exc


def qualified_name(obj):
    """``module.qualname`` of ``obj``, the heading a listing carries: the module to open."""
    module = inspect.getmodule(obj)
    return f"{module.__name__}.{obj.__qualname__}" if module else getattr(obj, "__qualname__", repr(obj))


def show(obj):
    """Display ``source(obj)`` with its qualified name as a heading: highlighted as Python in
    a notebook, plain text elsewhere. Returns None (the display is the point)."""
    text, where = source(obj), qualified_name(obj)
    try:
        from IPython import get_ipython
        from IPython.display import Markdown, display
    except ImportError:
        get_ipython = None
    if get_ipython is not None and get_ipython() is not None:
        display(Markdown(HEADING.format(where=where) + OPENING + text + CLOSING))
    else:
        print(f"# {where}\n{text}", end="")


def resolve(where):
    """The object a qualified name ``package.module.Class.method`` names (the longest
    importable prefix is the module, the rest attributes), or ValueError saying what is missing."""
    parts = where.split(".")
    for split in range(len(parts) - 1, 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        for name in parts[split:]:
            if not hasattr(obj, name):
                raise ValueError(f"{where} no longer exists: {'.'.join(parts[:split])} has no {name}.")
            obj = getattr(obj, name)
        return obj
    raise ValueError(f"{where}: no module of it can be imported.")


def _cells(notebook):
    with open(notebook, encoding="utf-8") as file:
        return json.load(file)["cells"]


def stored_listings(notebook):
    """Every listing that ``show`` left in the outputs of the notebook at path ``notebook``:
    (cell index, qualified name, code) in cell order."""
    found = []
    for index, cell in enumerate(_cells(notebook)):
        for output in cell.get("outputs", []):
            markdown = output.get("data", {}).get("text/markdown")
            text = "".join(markdown) if isinstance(markdown, list) else markdown
            if not text or not text.startswith("`") or OPENING not in text:
                continue
            heading, _, rest = text.partition(OPENING)
            found.append((index, heading.strip().strip("`"), rest.removesuffix(CLOSING)))
    return found


def stale_listings(notebook):
    """One sentence for each stored listing of ``notebook`` that differs from the package's
    current source of the object it names (or names an object that is gone), and for each
    cell that calls ``parlab.show`` more often than it holds listings (not executed); [] if none."""
    listings = stored_listings(notebook)
    stale = []
    for index, cell in enumerate(_cells(notebook)):
        calls = len(SHOW_CALL.findall("".join(cell["source"]))) if cell["cell_type"] == "code" else 0
        stored = sum(1 for listed, _, _ in listings if listed == index)
        if calls > stored:
            stale.append(f"cell {index}: calls parlab.show {calls} times but holds {stored} listings: {RERUN}")
    for index, where, stored in listings:
        try:
            current = source(resolve(where))
        except ValueError as exc:
            stale.append(f"cell {index}: {exc}")
            continue
        if stored != current:
            stale.append(f"cell {index}: the listing of {where} differs from the package's code: {RERUN}")
    return stale
