"""The lectures as a learner meets them: JupyterLab in a headless Chromium, loaded once (the
slow part) in one page that opens each lecture in turn. For each lecture: open it, run all
cells, wait for the kernel, and find no error output, no "Error displaying widget" and no
label cut short; then move each slider, pick another dropdown entry and each other toggle
(and back), press each button, and see the widget's output change without an error sentence
(a button that measures on the cluster finds it closed by the lecture's last cell: the
widget starts a new one). Last, save: what a learner reopens after closing the notebook must have,
in every cell with a widget, a static picture (a PNG that decodes), since the widget's model
is gone with the kernel. Then its kernel is shut down and its notebook disposed of: the next
lecture is alone in the page (which is loaded afresh where a failure left anything behind).
The run also serves as nbval's: the cells marked ``# NBVAL_CHECK_OUTPUT`` must give their
stored outputs (tests/checked_outputs.py), so a full ``pytest`` runs each lecture once.

Needs Chromium (Debian: apt-get install chromium) and playwright (pip); skipped without them.
Nothing in the repository is written: JupyterLab serves copies of the notebooks from a
temporary folder. On a failure a screenshot is saved to a temporary folder, named in the
message. Each lecture prints its timings (pytest -s shows them).
"""

import base64
import functools
import io
import json
import os
import pathlib
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

import matplotlib.image
import pytest
from checked_outputs import checked_cells, differences

sync_api = pytest.importorskip("playwright.sync_api", reason="the browser test needs playwright (pip install it)")
pytest.importorskip("jupyterlab", reason="the browser test needs JupyterLab (pip install -e '.[dev]')")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="the browser test needs Chromium (apt-get install chromium)")

NOTEBOOKS = pathlib.Path(__file__).resolve().parent.parent / "notebooks"
LECTURES = sorted(path.name for path in NOTEBOOKS.glob("*.ipynb"))
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]
# JupyterLab settings: every cell in the page (no windowing, so every output can be found), and
# no news or update pop-up over the notebook.
LAB_SETTINGS = {"@jupyterlab/notebook-extension/tracker": {"windowingMode": "none"},
                "@jupyterlab/apputils-extension/notification": {"fetchNews": "false", "checkForUpdates": False}}
RUN_ALL_S = 300  # the longest a lecture may take to run all its cells (each takes under a minute)
WIDGET_S = 120  # the longest one widget action may take (a button may first start a cluster)
WIDGET_POLL_MS = 50  # how often a widget's change is looked for: most answer within a second

NOTEBOOK = "window.jupyterapp.shell.currentWidget"
KERNEL_IDLE = f"""() => {{
    const kernel = window.jupyterapp && {NOTEBOOK} && {NOTEBOOK}.sessionContext?.session?.kernel;
    return !!kernel && kernel.status === 'idle';
}}"""
# The lecture at ``path`` is the notebook in front, and its kernel has started.
OPENED = f"path => {NOTEBOOK}?.context?.path === path && ({KERNEL_IDLE})()"
# What the page must not hold when a lecture opens: another notebook or the log console (the
# selectors below search the whole page), or a dialog (it would cover the lecture).
LEFT_BEHIND = ".jp-NotebookPanel, .jp-LogConsolePanel, .jp-Dialog"
# Shut down the kernel of each open notebook (its clusters with it) and dispose of everything in
# the main area: no "unsaved changes" dialog, and nothing of this lecture left in the page.
CLOSE = """async () => { for (const widget of Array.from(window.jupyterapp.shell.widgets('main'))) {
    await widget.sessionContext?.shutdown();
    widget.dispose();
} }"""
# Run all cells; the command's promise settles when the last cell has run or one has failed.
RUN_ALL = """async limit => Promise.race([window.jupyterapp.commands.execute('notebook:run-all-cells'),
    new Promise(resolve => setTimeout(() => resolve('timeout'), limit))])"""
# Per code cell: its index, and its outputs as saved (output_type, stream name, data keys, text).
OUTPUTS = f"""() => {NOTEBOOK}.content.widgets.map((cell, index) => cell.model.type !== 'code' ? null : {{
    index, outputs: Array.from({{length: cell.model.outputs.length}}, (_, j) => cell.model.outputs.get(j).toJSON())
}}).filter(Boolean)"""
# Labels, readouts and buttons of widgets whose text is cut (wider than their box).
CUT_LABELS = """() => Array.from(document.querySelectorAll(
    '.jp-OutputArea-output .widget-label, .jp-OutputArea-output .widget-readout, .jp-OutputArea-output button'))
    .filter(e => e.offsetParent !== null && e.scrollWidth > e.clientWidth + 1).map(e => e.textContent)"""
# How many messages JupyterLab's log console holds for the notebook: where an exception raised
# in a widget callback goes when the widget does not show it (the status bar's count).
LOGGED = "() => Number(document.querySelector('.jp-LogConsoleStatusItem')?.innerText.trim() || 0)"
# What a widget shows: its pictures (a new blob URL each redraw) and its HTML text.
SHOWN = """root => Array.from(root.querySelectorAll('img')).map(img => img.src).join(' ')
    + Array.from(root.querySelectorAll('.widget-html-content')).map(e => e.innerText).join(' ')"""


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """A JupyterLab server on a free port with a token, serving copies of the lectures."""
    root = tmp_path_factory.mktemp("lab")
    served = root / "notebooks"
    shutil.copytree(NOTEBOOKS, served, ignore=shutil.ignore_patterns(".*"))
    for name, values in LAB_SETTINGS.items():
        path = root / "settings" / f"{name}.jupyterlab-settings"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(values))
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    token = secrets.token_hex(16)
    env = dict(os.environ, JUPYTER_CONFIG_DIR=str(root / "config"), JUPYTERLAB_SETTINGS_DIR=str(root / "settings"),
               JUPYTERLAB_WORKSPACES_DIR=str(root / "workspaces"), JUPYTER_RUNTIME_DIR=str(root / "runtime"),
               IPYTHONDIR=str(root / "ipython"))
    command = [sys.executable, "-m", "jupyterlab", "--no-browser", "--ServerApp.ip=127.0.0.1",
               f"--ServerApp.port={port}", f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={served}",
               "--LabApp.expose_app_in_browser=True"] + (["--allow-root"] if os.geteuid() == 0 else [])
    base = f"http://127.0.0.1:{port}"
    with open(root / "jupyterlab.log", "wb") as log:
        server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        _wait_for_server(base, token, server, root / "jupyterlab.log")
        yield {"base": base, "token": token, "served": served}
    finally:
        _stop(base, token, server)


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    with sync_api.sync_playwright() as playwright:
        context = playwright.chromium.launch_persistent_context(
            tmp_path_factory.mktemp("chromium-profile"), executable_path=CHROMIUM, args=CHROMIUM_FLAGS,
            viewport={"width": 1400, "height": 1000})
        yield context
        context.close()


@pytest.fixture(scope="module")
def page(lab, browser):
    """One page of JupyterLab for all the lectures: loading the app takes ~10 s of Chromium's
    CPU, opening a notebook in it about a second. Its own dialogs (leave the page with unsaved
    changes?) are accepted."""
    page = browser.new_page()
    page.on("dialog", lambda dialog: dialog.accept())
    started = time.monotonic()
    _load(page, lab)
    print(f"\nJupyterLab: load {time.monotonic() - started:.0f} s")
    yield page
    page.close()


@pytest.mark.timeout(RUN_ALL_S + 300)
@pytest.mark.parametrize("lecture", LECTURES)
def test_the_lecture_runs_and_its_widgets_answer_in_jupyterlab(lecture, lab, page):
    timings, stderr = {}, []
    try:
        started = time.monotonic()
        _open(page, lab, lecture)
        timings["open"] = time.monotonic() - started
        started = time.monotonic()
        finished = page.evaluate(RUN_ALL, RUN_ALL_S * 1000)
        assert finished != "timeout", f"running all cells took more than {RUN_ALL_S} s"
        page.wait_for_function(KERNEL_IDLE, timeout=60_000, polling=500)
        timings["run all"] = time.monotonic() - started
        cells = page.evaluate(OUTPUTS)
        stderr = _check_outputs(page, cells)
        _check_stored_outputs(cells, NOTEBOOKS / lecture)
        started = time.monotonic()
        actions = _use_every_control(page)
        timings[f"{actions} widget actions"] = time.monotonic() - started
        started = time.monotonic()
        _check_saved(page, lab, lecture)
        timings["save"] = time.monotonic() - started
    except Exception as error:
        folder = tempfile.mkdtemp(prefix="parlab-browser-")
        page.screenshot(path=f"{folder}/{lecture}.png", full_page=True)
        raise AssertionError(f"{lecture}: {error}\nscreenshot: {folder}/{lecture}.png") from error
    finally:
        print(f"\n{lecture}: " + ", ".join(f"{what} {seconds:.0f} s" for what, seconds in timings.items())
              + "".join(f"\n  stderr output (a pink box) in {line}" for line in stderr))
        page.evaluate(CLOSE)


def _load(page, lab):
    """Load JupyterLab in an emptied workspace (reset): it would otherwise reopen the lectures
    open when the page was last left."""
    page.goto(f"{lab['base']}/lab/workspaces/lectures?reset&token={lab['token']}")
    page.wait_for_function("() => window.jupyterapp", timeout=120_000, polling=500)
    page.evaluate("() => window.jupyterapp.restored.then(() => null)")


def _open(page, lab, lecture):
    """Open ``lecture`` in the loaded app and wait for its kernel; first load the app afresh
    if a lecture before left anything behind (LEFT_BEHIND)."""
    if page.locator(LEFT_BEHIND).count():
        _load(page, lab)
    page.evaluate("path => window.jupyterapp.commands.execute('docmanager:open', {path}).then(() => null)", lecture)
    page.wait_for_function(OPENED, arg=lecture, timeout=120_000, polling=500)


def _check_outputs(page, cells):
    """No error output in ``cells`` (OUTPUTS after running all), every widget displayed, no
    label cut. Returns the first line of each stderr output: not a failure (warnings go there),
    but a learner sees a pink box."""
    errors, stderr, widgets = [], [], 0
    for cell in cells:
        for output in cell["outputs"]:
            if output["output_type"] == "error":
                errors.append(f"cell {cell['index']}: {output['ename']}: {output['evalue'][:300]}")
            if output.get("name") == "stderr":
                stderr.append(f"cell {cell['index']}: {output['text'].strip().splitlines()[0][:100]}")
            widgets += "application/vnd.jupyter.widget-view+json" in output.get("data", {})
    assert not errors, "error outputs after running all cells:\n" + "\n".join(errors)
    page.wait_for_function("() => !document.body.innerText.includes('Loading widget')", timeout=60_000)
    assert page.get_by_text("Error displaying widget").count() == 0, "a widget did not display"
    assert page.locator(".jp-OutputArea-output .widget-vbox").count() >= widgets, "a widget is missing"
    cut = page.evaluate(CUT_LABELS)
    assert not cut, f"labels cut short: {cut}"
    return stderr


def _check_stored_outputs(cells, notebook):
    """nbval's lax check on this run: every cell marked ``# NBVAL_CHECK_OUTPUT`` gives the
    outputs stored in ``notebook``."""
    fresh = {cell["index"]: cell["outputs"] for cell in cells}
    failed = [f"cell {index}: " + "\n".join(differences(stored, fresh[index]))
              for index, stored in checked_cells(notebook).items() if differences(stored, fresh[index])]
    assert not failed, "checked cells (# NBVAL_CHECK_OUTPUT) differ from their stored outputs:\n" + "\n".join(failed)


def _use_every_control(page):
    """Move every enabled slider one step and back, pick another dropdown entry and back,
    click every other toggle and back, then press every button; after each, the widget must
    show something new and no error sentence. Each control is put back before the next is
    used: a button measures what the others chose (lecture 03's runs only K = 4 on 4 ranks).
    Returns the number of actions."""
    actions = 0
    for handle in page.locator(".jp-OutputArea-output .widget-slider .noUi-handle").all():
        if handle.evaluate("e => e.closest('.noUi-target').hasAttribute('disabled')"):
            continue
        at_end = handle.get_attribute("aria-valuenow") == handle.get_attribute("aria-valuemax")
        for key in (["ArrowLeft", "ArrowRight"] if at_end else ["ArrowRight", "ArrowLeft"]):
            actions += _expect_update(page, handle, functools.partial(handle.press, key))
    for select in page.locator(".jp-OutputArea-output .widget-dropdown select").all():
        first = select.input_value()
        # The last other entry: a first entry such as the memory widget's "custom" may change nothing.
        for value in [v for v in select.evaluate("e => Array.from(e.options).map(o => o.value)") if v != first][-1:]:
            for chosen in (value, first):
                actions += _expect_update(page, select, functools.partial(select.select_option, chosen))
    for group in page.locator(".jp-OutputArea-output .widget-toggle-buttons").all():
        toggles = group.locator("button").all()
        active = [toggle for toggle in toggles if "mod-active" in toggle.get_attribute("class")]
        for toggle in toggles:
            if toggle not in active:
                actions += _expect_update(page, toggle, toggle.click)
                actions += sum(_expect_update(page, first, first.click) for first in active)
    for pressed in page.locator(".jp-OutputArea-output button.widget-button").all():
        actions += _expect_update(page, pressed, pressed.click)
    return actions


def _expect_update(page, control, act):
    root = control.locator("xpath=ancestor::div[contains(@class, 'jp-OutputArea-output')][1]")
    before, logged = root.evaluate(SHOWN), page.evaluate(LOGGED)
    what = control.evaluate("e => (e.closest('.widget-inline-hbox, .widget-button, .widget-toggle-buttons')"
                            " || e).innerText.trim().slice(0, 60)")
    act()
    try:
        page.wait_for_function(f"([root, before]) => ({SHOWN})(root) !== before", arg=[root.element_handle(), before],
                               timeout=WIDGET_S * 1000, polling=WIDGET_POLL_MS)
    except sync_api.TimeoutError:
        raise AssertionError(f"the widget did not change after using {what!r}") from None
    page.wait_for_function(KERNEL_IDLE, timeout=WIDGET_S * 1000, polling=WIDGET_POLL_MS)
    errors = root.locator(".parlab-error").all_inner_texts()
    assert not errors, f"after using {what!r} the widget says: {errors}"
    if page.evaluate(LOGGED) > logged:
        page.evaluate("() => window.jupyterapp.commands.execute('logconsole:open')")
        console = page.locator(".jp-LogConsolePanel")
        console.wait_for(timeout=10_000)
        raise AssertionError(f"after using {what!r}, JupyterLab's log console got (not the widget):\n"
                             f"{console.inner_text()[-2000:]}")
    return 1


def _check_saved(page, lab, lecture):
    """Save: in the saved notebook every cell with a widget output also has a static picture,
    a PNG that decodes (what a learner sees there once the kernel, and the widget, is gone)."""
    page.evaluate("() => window.jupyterapp.commands.execute('docmanager:save')")
    saved = json.loads((lab["served"] / lecture).read_text())
    missing = []
    for index, cell in enumerate(saved["cells"]):
        data = [output.get("data", {}) for output in cell.get("outputs", [])]
        if any("application/vnd.jupyter.widget-view+json" in kinds for kinds in data):
            pictures = [_decoded(kinds["image/png"]) for kinds in data if "image/png" in kinds]
            if not any(picture is not None and picture.size for picture in pictures):
                missing.append(index)
    assert not missing, f"cells with a widget but no static picture (a PNG that decodes): {missing}"


def _decoded(png):
    try:
        return matplotlib.image.imread(io.BytesIO(base64.b64decode(png)), format="png")
    except (ValueError, SyntaxError, OSError):
        return None


def _wait_for_server(base, token, server, log):
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"jupyter lab exited with {server.returncode}:\n{log.read_text()[-3000:]}")
        try:
            urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=5)
            return
        except OSError:
            time.sleep(0.5)
    raise RuntimeError(f"jupyter lab did not answer within 120 s:\n{log.read_text()[-3000:]}")


def _stop(base, token, server):
    """Shut down every kernel (each stops its cluster's workers), then the server."""
    try:
        with urllib.request.urlopen(f"{base}/api/kernels?token={token}", timeout=10) as answer:
            kernels = json.load(answer)
        for kernel in kernels:
            request = urllib.request.Request(f"{base}/api/kernels/{kernel['id']}?token={token}", method="DELETE")
            urllib.request.urlopen(request, timeout=30)
    except OSError:
        pass  # the server is gone or never started: terminating it below is all there is to do
    finally:
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
