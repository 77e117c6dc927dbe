"""Progress bars for long work: starting many ranks, a bench's measurements.

In a terminal the bar is ``tqdm``'s line on stderr, so stdout keeps only a table or JSON. In
a notebook it is an ipywidgets bar shown through a display handle, and when the work ends the
handle replaces the bar by one line of text ("parlab bench collectives: 12/12 sizes in 31 s").
A saved notebook so keeps a sentence that still reads after the kernel is gone, never a
widget whose model died with the kernel (tqdm's notebook bar leaves one, frozen at 0%).
"""

import sys
import time


def progress_bar(total, desc, unit="step"):
    """A bar over ``total`` steps named ``desc``; use it as a context manager, count a step
    with ``bar.update()``, name the step under way with ``bar.set_postfix_str(what)``."""
    if _in_notebook():
        return NotebookBar(total, desc, unit)
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr)


def _in_notebook():
    """Whether this process is a Jupyter kernel that can show widgets."""
    shell = sys.modules.get("IPython") and sys.modules["IPython"].get_ipython()
    if shell is None or not hasattr(shell, "kernel"):
        return False
    try:
        import ipywidgets  # noqa: F401
    except ImportError:
        return False
    return True


class NotebookBar:
    """An ipywidgets progress bar that turns into one line of text when closed."""

    def __init__(self, total, desc, unit="step"):
        import ipywidgets as widgets
        from IPython.display import display

        self.total, self.desc, self.unit, self.n = total, desc, unit, 0
        self.started = time.monotonic()
        self._bar = widgets.IntProgress(0, min=0, max=max(1, total))
        self._label = widgets.Label(self._text())
        self._box = widgets.HBox([widgets.Label(desc), self._bar, self._label])
        self._handle = display(self._box, display_id=True)
        self._closed = False

    def _text(self, postfix=""):
        done = f"{self.n}/{self.total} {self.unit}s"
        return f"{done}, {postfix}" if postfix else done

    def update(self, n=1):
        self.n += n
        self._bar.value = min(self.n, self._bar.max)
        self._label.value = self._text()

    def set_postfix_str(self, text):
        self._label.value = self._text(text)

    def reset(self, total=None):
        if total is not None:
            self.total, self._bar.max = total, max(1, total)
        self.n, self._bar.value = 0, 0
        self._label.value = self._text()

    def close(self):
        if self._closed:
            return
        self._closed = True
        seconds = time.monotonic() - self.started
        self._handle.update({"text/plain": f"{self.desc}: {self._text()} in {seconds:.0f} s"}, raw=True)
        self._box.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
