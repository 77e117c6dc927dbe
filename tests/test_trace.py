"""Tracing: exact byte counts, one clock across ranks, compute spans, and the Gantt chart."""

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import matplotlib
import pytest
import torch
import torch.distributed as dist

from parlab import p2p, trace
from parlab.trace import COMPUTE, Timeline
from parlab.viz import plot_collective

matplotlib.use("Agg")
pytestmark = pytest.mark.timeout(120)

STEPS, NUMEL = 3, 1000
ROOT = Path(__file__).resolve().parents[1]


def ring_pass(blocking):
    """Pass each rank's tensor STEPS times around the ring, marking a compute span per step."""
    rank, world = dist.get_rank(), dist.get_world_size()
    tensor = torch.full((NUMEL,), float(rank))
    for step in range(STEPS):
        with trace.span("forward", stage=rank, microbatch=step):
            tensor = tensor + 0
        incoming = torch.empty_like(tensor)
        if blocking and rank % 2 == 0:
            p2p.send(tensor, (rank + 1) % world)
            p2p.recv(incoming, (rank - 1) % world)
        elif blocking:
            p2p.recv(incoming, (rank - 1) % world)
            p2p.send(tensor, (rank + 1) % world)
        else:
            requests = [p2p.isend(tensor, (rank + 1) % world), p2p.irecv(incoming, (rank - 1) % world)]
            p2p.wait_all(requests)
        tensor = incoming
    return tensor[0].item()


@pytest.mark.parametrize("blocking", [True, False])
def test_ring_pass_traffic_is_counted_exactly(cluster4, blocking):
    timeline = cluster4.trace(ring_pass, blocking)
    assert timeline.results == [float((r - STEPS) % 4) for r in range(4)]
    expected = STEPS * NUMEL * 4  # float32
    assert timeline.bytes_sent() == [expected] * 4
    assert timeline.bytes_received() == [expected] * 4
    sends = timeline.select(rank=1, kind=trace.COMM, name="send" if blocking else "isend")
    assert [ev.peer for ev in sends] == [2] * STEPS
    assert all(ev.nbytes == NUMEL * 4 and ev.end >= ev.start for ev in sends)


def test_ranks_share_one_clock(cluster2):
    timeline = cluster2.trace(ring_pass, True)
    # Causality across processes: rank 1 cannot finish receiving step k before rank 0
    # started sending it. Only true if both ranks' times are on the same clock.
    sends = timeline.select(rank=0, name="send")
    recvs = timeline.select(rank=1, name="recv")
    assert len(sends) == len(recvs) == STEPS
    assert all(recv.end >= send.start for send, recv in zip(sends, recvs))
    assert all(ev.start >= 0 for ev in timeline.events)


def test_compute_spans_carry_stage_and_microbatch(cluster2):
    timeline = cluster2.trace(ring_pass, True)
    spans = timeline.select(rank=1, kind=trace.COMPUTE)
    assert [(ev.name, ev.stage, ev.microbatch) for ev in spans] == [("forward", 1, k) for k in range(STEPS)]


def test_run_without_trace_records_nothing(cluster2):
    assert cluster2.run(lambda: trace.recording()) == [False, False]
    assert cluster2.trace(lambda: trace.recording()).results == [True, True]
    assert cluster2.run(lambda: trace.recording()) == [False, False]


def test_noncontiguous_tensors_are_refused_clearly(cluster2):
    def send_transposed():
        p2p.send(torch.zeros(3, 4).t(), 1 - dist.get_rank())

    import parlab

    with pytest.raises(parlab.RankError, match="contiguous"):
        cluster2.run(send_transposed)


def test_request_wait_is_idempotent(cluster2):
    def exchange():
        peer = 1 - dist.get_rank()
        incoming = torch.zeros(2)
        requests = [p2p.isend(torch.ones(2) * dist.get_rank(), peer), p2p.irecv(incoming, peer)]
        p2p.wait_all(requests)
        p2p.wait_all(requests)
        return incoming.tolist(), all(r.is_completed() for r in requests)

    timeline = cluster2.trace(exchange)
    assert timeline.results == [([1.0, 1.0], True), ([0.0, 0.0], True)]
    assert timeline.bytes_sent() == [8, 8]  # waiting twice records once


def test_timeline_plot_draws_one_row_per_rank(cluster4):
    timeline = cluster4.trace(ring_pass, False)
    ax = timeline.plot()
    assert [t.get_text() for t in ax.get_yticklabels()] == [f"rank {r}" for r in range(4)]
    assert len(ax.collections) == len(timeline.events)
    assert {t.get_text() for t in ax.get_legend().get_texts()} == {"forward", "isend", "irecv"}
    assert "measured timeline" in ax.get_title()
    assert "4 ranks" in repr(timeline)


def test_plot_collective_draws_every_cell():
    axes = plot_collective([[1, 2], [3, 4], None], [[4, 6], None, None], "reduce (sum) to rank 0")
    cells = [sum(isinstance(p, matplotlib.patches.Rectangle) for p in ax.patches) for ax in axes]
    assert cells == [4, 2]
    assert axes[0].figure._suptitle.get_text() == "reduce (sum) to rank 0"


def test_collective_spans_have_colours_of_their_own():
    from matplotlib.colors import to_rgba

    events = [(0, COMPUTE, name, i * 10, i * 10 + 5, None, 0, None, None)
              for i, name in enumerate(["forward", "all-gather", "reduce-scatter gradients", "all-reduce", "mystery"])]
    ax = Timeline(events, world_size=1).plot()
    colours = [tuple(bar.get_facecolor()[0]) for bar in ax.collections]
    assert colours[1] == to_rgba("tab:cyan") and colours[2] == to_rgba("tab:pink")  # by the first word
    assert colours[3] == to_rgba("darkgoldenrod") and colours[4] == to_rgba(trace.SPARE_COLOURS[0])
    assert len(set(colours)) == 5


def span_names_drawn():
    """Every span name that parlab, the solutions and the lectures mark with trace.span("...")."""
    sources = [path.read_text() for folder in ("parlab", "solutions") for path in (ROOT / folder).rglob("*.py")]
    for notebook in (ROOT / "notebooks").glob("*.ipynb"):
        sources += ["".join(cell["source"]) for cell in json.loads(notebook.read_text())["cells"]
                    if cell["cell_type"] == "code"]
    calls = [call.split("stage=")[0] for text in sources for call in re.findall(r"trace\.span\(([^)]*)\)", text)]
    return sorted({name for call in calls for name in re.findall(r'"([^"{}]+)"', call)})  # not f"{span}"


def test_every_span_kind_a_lecture_draws_has_a_colour_no_other_kind_has():
    # Lecture 06's timeline drew "step" and "gradient" in one grey: neither had a colour.
    names = span_names_drawn()
    assert {"step", "gradient", "forward", "all-gather parameters", "data-parallel all-reduce"} <= set(names)
    one_chart = trace.chart_colours([trace.Event(0, COMPUTE, name, 0, 1) for name in names])
    assert len(set(one_chart.values())) == len(names), one_chart  # all of them at once, each its own
    for name in names:  # and each alone draws in its own or its family's colour, never a spare or grey
        (colour,) = trace.chart_colours([trace.Event(0, COMPUTE, name, 0, 1)]).values()
        assert colour in (trace.COMPUTE_COLOURS.get(name), trace.COMPUTE_COLOURS.get(name.split(" ")[0])), name
    own = list(trace.COMPUTE_COLOURS.values())
    assert len(set(own)) == len(own) and not set(own) & (set(trace.COMM_COLOURS.values()) | set(trace.SPARE_COLOURS))


def test_in_one_chart_names_never_share_a_colour_but_a_send_and_an_isend_do():
    computes = ["all-gather parameters", "all-gather", "my span", "my other span"]
    events = [trace.Event(0, COMPUTE, name, 0, 1) for name in computes]
    events += [trace.Event(0, trace.COMM, op, 0, 1) for op in ("send", "isend", "recv")]
    colours = trace.chart_colours(events)
    assert colours[COMPUTE, "all-gather"] == "tab:cyan"  # its own colour, before its family member takes it
    assert colours[COMPUTE, "all-gather parameters"] == trace.SPARE_COLOURS[0]
    assert colours[COMPUTE, "my span"] == trace.SPARE_COLOURS[1]
    assert colours[trace.COMM, "send"] == colours[trace.COMM, "isend"] == "tab:red"
    assert len(set(colours.values())) == len(colours) - 1  # only send and isend share
    ax = Timeline([(0, ev.kind, ev.name, 0, 1, None, 0, None, None) for ev in events], 1).plot()
    assert "send / isend" in [t.get_text() for t in ax.get_legend().get_texts()]


def test_a_step_and_the_gradient_inside_it_draw_apart_and_the_legend_names_both():
    from matplotlib.colors import to_rgba

    timeline = Timeline([_span(0, "step", 0, 10_000_000), _span(0, "gradient", 1_000_000, 8_000_000)], 1)
    ax = timeline.plot()
    step, gradient = (tuple(bar.get_facecolor()[0]) for bar in ax.collections)
    assert step == to_rgba("lightgray") and gradient == to_rgba("teal")
    assert [t.get_text() for t in ax.texts] == ["gradient"]  # the step's label would sit on its gradient
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["step", "gradient"]


def _span(rank, name, start, end):
    return (rank, COMPUTE, name, start, end, None, 0, None, None)


def test_window_keeps_what_each_rank_did_inside_its_chosen_step():
    events = [_span(0, "step", 0, 10), _span(0, "forward", 1, 2), _span(0, "step", 20, 30), _span(0, "forward", 21, 22),
              _span(1, "step", 5, 15), _span(1, "step", 25, 40), _span(1, "backward", 26, 39), _span(1, "late", 41, 42)]
    last = Timeline(events, world_size=2, regime="emulated: something").window()
    assert [(ev.rank, ev.name, ev.start * 1e9) for ev in last.events] == [
        (0, "step", 20), (0, "forward", 21), (1, "step", 25), (1, "backward", 26)]
    assert last.regime == "emulated: something"
    assert [ev.name for ev in Timeline(events, 2).window(index=0).events] == ["step", "forward", "step"]
    with pytest.raises(ValueError, match='trace.span\\("optimizer"\\)'):
        Timeline(events, 2).window("optimizer")


@pytest.mark.parametrize("regime, shown", [("real time", "real time"), ("emulated: link 1 µs", "emulated: link 1 µs"),
                                           ("simulated", None)])
def test_every_timeline_plot_says_how_its_times_came_about(regime, shown):
    title = Timeline([_span(0, "forward", 0, 5)], 1, regime=regime).plot().get_title()
    assert (title.endswith("\n" + shown) if shown else title.startswith("simulated timeline"))
    assert regime in repr(Timeline([], 1, regime=regime))


# --- a chart drawn from a script --------------------------------------------------------------

SCRIPT = textwrap.dedent("""
    from parlab.trace import COMPUTE, Timeline
    timeline = Timeline([(0, COMPUTE, "forward", 0, 5_000_000, None, 0, None, None)], 1)
    timeline.plot()
    timeline.plot(title="a second chart")
    print("the script ends")
""")


def run_script(tmp_path, backend, code=SCRIPT):
    (tmp_path / "script.py").write_text(code)
    environment = {"MPLBACKEND": backend, "PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"}
    return subprocess.run([sys.executable, "script.py"], cwd=tmp_path, env=environment, capture_output=True,
                          text=True, timeout=90, check=True)


def test_a_script_without_a_display_gets_its_charts_saved_and_told_where(tmp_path):
    (tmp_path / "timeline.png").write_text("the learner's own file")
    code = SCRIPT + 'from parlab.viz import plot_collective\nplot_collective([[1], [2]], [[3], [3]], "sum")\n'
    done = run_script(tmp_path, "Agg", code)
    saved = [tmp_path / "timeline-2.png", tmp_path / "timeline-3.png", tmp_path / "collective.png"]
    assert done.stdout == "the script ends\n"
    assert done.stderr.splitlines() == [
        f"parlab: matplotlib cannot open a window here (backend Agg), so the chart was saved to {path}"
        for path in saved]
    assert all(path.read_bytes().startswith(b"\x89PNG") for path in saved)
    assert (tmp_path / "timeline.png").read_text() == "the learner's own file"  # never overwritten


def test_a_script_with_a_display_shows_its_charts_when_it_ends(tmp_path):
    # A stand-in for a window-opening backend (TkAgg, QtAgg) that reports what plt.show() shows.
    (tmp_path / "window_backend.py").write_text(textwrap.dedent("""
        from matplotlib.backends.backend_agg import FigureCanvasAgg as FigureCanvas  # noqa: F401

        def show(*args, **kwargs):
            import matplotlib.pyplot as plt
            print("shown in windows:", [fig.axes[0].get_title().split(chr(10))[0] for fig in map(plt.figure,
                                                                                               plt.get_fignums())])
    """))
    done = run_script(tmp_path, "module://window_backend")
    assert done.stdout.splitlines() == ["the script ends", "shown in windows: ['measured timeline (5.0 ms)', "
                                        "'a second chart']"]
    assert done.stderr == "" and not list(tmp_path.glob("*.png"))


def test_a_script_that_shows_or_closes_its_charts_itself_gets_nothing_more(tmp_path):
    code = SCRIPT.replace('print("the script ends")', 'import matplotlib.pyplot as plt\nplt.close("all")')
    done = run_script(tmp_path, "Agg", code)
    assert done.stdout == done.stderr == "" and [p.name for p in tmp_path.iterdir()] == ["script.py"]


def test_in_a_notebook_or_with_an_axis_the_chart_is_left_to_them(monkeypatch):
    import types

    drawn = len(trace._from_script)
    Timeline([_span(0, "forward", 0, 5)], 1).plot(ax=matplotlib.pyplot.subplots()[1])  # the caller's figure
    monkeypatch.setitem(sys.modules, "IPython", types.SimpleNamespace(get_ipython=lambda: object()))
    Timeline([_span(0, "forward", 0, 5)], 1).plot()  # IPython shows it under the cell
    assert len(trace._from_script) == drawn
    monkeypatch.delitem(sys.modules, "IPython")
    Timeline([_span(0, "forward", 0, 5)], 1).plot()  # a script (here: pytest, which closes it after the test)
    assert len(trace._from_script) == drawn + 1
