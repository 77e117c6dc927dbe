"""The package's own code, shown in a lecture: ``parlab.show(obj)``.

A lecture explains an idea and then shows the few lines of parlab that are that idea (the
ring's steps, the bucketing hook, 1F1B's warm-up), read from the installed package, so the
page and the code the learner runs can never drift apart.
"""

import inspect
import textwrap


def source(obj, lines=None):
    """The source text of a function, class or method of parlab (dedented), or of the lines
    ``lines = (first, last)`` of it (1-based, inclusive, counted within the object)."""
    try:
        text = textwrap.dedent(inspect.getsource(obj))
    except (TypeError, OSError) as exc:
        raise ValueError(
            f"there is no source to show for {obj!r}: pass a function, class or method, such as "
            "parlab.collectives.ring_reduce_scatter."
        ) from exc
    if lines is None:
        return text
    all_lines = text.splitlines()
    first, last = lines if isinstance(lines, tuple) and len(lines) == 2 else (None, None)
    if not (isinstance(first, int) and isinstance(last, int) and 1 <= first <= last <= len(all_lines)):
        raise ValueError(f"lines must be (first, last) with 1 <= first <= last <= {len(all_lines)}, got {lines!r}.")
    return "\n".join(all_lines[first - 1:last]) + "\n"


def show(obj, lines=None):
    """Display ``source(obj, lines)`` with its file and line as a heading: highlighted as
    Python in a notebook, plain text elsewhere. Returns None (the display is the point)."""
    text = source(obj, lines)
    module = inspect.getmodule(obj)
    where = f"{module.__name__}.{obj.__qualname__}" if module else getattr(obj, "__qualname__", repr(obj))
    try:
        from IPython import get_ipython
        from IPython.display import Markdown, display
    except ImportError:
        get_ipython = None
    if get_ipython is not None and get_ipython() is not None:
        display(Markdown(f"`{where}`\n```python\n{text}```"))
    else:
        print(f"# {where}\n{text}", end="")
