"""Measured timelines: what every rank did, and when, on one clock.

Inside a function run by ``cluster.trace(fn)``, each rank records

- communication events from parlab's traced point-to-point calls (``parlab.p2p``) and the
  collectives built on them: op, peer, bytes, start, end;
- compute spans that techniques mark with ``with trace.span("forward", stage=s, microbatch=m):``.

The parent gathers the events of all ranks into a :class:`Timeline`. All ranks of a cluster
live on one host and read the same monotonic clock (``time.perf_counter_ns``), so their
events line up without any clock correction. Outside ``cluster.trace`` recording is off and
``span`` costs one attribute lookup.

``timeline.plot()`` (``plot_timeline``) draws the Gantt chart, each kind of span in a colour
of its own; drawn from a script, the chart is shown (or saved) when the script ends, as a
notebook shows it under its cell (``show_from_script``). This module imports nothing of
parlab: the runtime's workers record with it, and everything that draws or analyses a
timeline (``parlab.viz``, ``parlab.pipeline.simulate``) imports it, never the reverse.
"""

import atexit
import sys
import time
import weakref
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

COMM, COMPUTE = "comm", "compute"


@dataclass(frozen=True)
class Event:
    """One interval on one rank. Times are seconds since the traced call was dispatched."""

    rank: int
    kind: str  # COMM or COMPUTE
    name: str  # "send", "recv", ... or a compute label such as "forward"
    start: float
    end: float
    peer: int | None = None
    nbytes: int = 0
    stage: int | None = None
    microbatch: int | None = None

    @property
    def duration(self):
        return self.end - self.start


class _Recorder:
    """Per-process event buffer; ``events is None`` means recording is off."""

    rank = 0
    events = None


_recorder = _Recorder()


def start(rank):
    """Start recording on this rank (the worker calls this around a traced function)."""
    _recorder.rank = rank
    _recorder.events = []


def stop():
    """Stop recording and return the raw events: tuples of Event fields, times in ns."""
    events, _recorder.events = _recorder.events or [], None
    return events


def recording():
    return _recorder.events is not None


def now():
    return time.perf_counter_ns()


def record_comm(op, peer, nbytes, start_ns, end_ns):
    """Record a communication event (used by parlab.p2p and the collectives)."""
    if _recorder.events is not None:
        _recorder.events.append((_recorder.rank, COMM, op, start_ns, end_ns, peer, nbytes, None, None))


@contextmanager
def span(name, stage=None, microbatch=None):
    """Mark a compute span: ``with trace.span("backward", stage=1, microbatch=3): ...``."""
    if _recorder.events is None:
        yield
        return
    t0 = now()
    try:
        yield
    finally:
        _recorder.events.append((_recorder.rank, COMPUTE, name, t0, now(), None, 0, stage, microbatch))


class Timeline:
    """The events of every rank of one traced call, and the call's per-rank results."""

    def __init__(self, events, world_size, results=None, origin_ns=0, regime="real time"):
        self.world_size = world_size
        self.results = results
        # How the times came about: "real time", "emulated: link ..." (see
        # parlab.runtime.emulation) or "simulated"; every plot of the timeline says it.
        self.regime = regime
        self.events = sorted(
            (
                Event(r, k, n, (s - origin_ns) / 1e9, (e - origin_ns) / 1e9, p, b, st, mb)
                for (r, k, n, s, e, p, b, st, mb) in events
            ),
            key=lambda ev: (ev.start, ev.rank),
        )

    def __repr__(self):
        return (
            f"Timeline({self.world_size} ranks, {len(self.events)} events, "
            f"{self.duration * 1e3:.2f} ms, {sum(self.bytes_sent())} bytes sent; {self.regime})"
        )

    def window(self, span="step", index=-1):
        """The events inside each rank's ``index``-th span named ``span`` (default: its last
        "step"), as a Timeline: one step of a loop without the warm-up before it. Mark the
        steps with ``with trace.span("step"): ...``."""
        windows = []
        for rank in range(self.world_size):
            spans = self.select(rank=rank, kind=COMPUTE, name=span)
            if not spans or not -len(spans) <= index < len(spans):
                raise ValueError(
                    f"rank {rank} has {len(spans)} spans named {span!r}, so there is no span {index}: mark each "
                    f'step with `with trace.span("{span}"):` in the traced function, or pick another index.'
                )
            windows.append(spans[index])
        step = Timeline([], self.world_size, self.results, regime=self.regime)
        step.events = [ev for ev in self.events if windows[ev.rank].start <= ev.start <= windows[ev.rank].end]
        return step

    def select(self, rank=None, kind=None, name=None):
        """Events filtered by rank, kind (COMM/COMPUTE) and name, in start order."""
        return [
            ev
            for ev in self.events
            if (rank is None or ev.rank == rank)
            and (kind is None or ev.kind == kind)
            and (name is None or ev.name == name)
        ]

    def bytes_sent(self):
        """Bytes each rank sent, as a list indexed by rank (exact: counted, not timed)."""
        return self._bytes(("send", "isend"))

    def bytes_received(self):
        """Bytes each rank received, as a list indexed by rank."""
        return self._bytes(("recv", "irecv"))

    def _bytes(self, ops):
        totals = [0] * self.world_size
        for ev in self.events:
            if ev.kind == COMM and ev.name in ops:
                totals[ev.rank] += ev.nbytes
        return totals

    @property
    def duration(self):
        if not self.events:
            return 0.0
        return max(ev.end for ev in self.events) - min(ev.start for ev in self.events)

    def plot(self, ax=None, title=None):
        """Draw a Gantt chart: one row per rank, compute spans above, communication below
        (``plot_timeline``). Returns the axes. Without ``ax``, from a script, the chart is
        shown (or saved) when the script ends (``show_from_script``)."""
        return plot_timeline(self, ax=ax, title=title)


# --- the Gantt chart ---------------------------------------------------------------------------
# Drawn here, beside the Timeline it draws, so that ``timeline.plot()`` needs nothing above
# this module (matplotlib is imported only when a chart is drawn; the ranks never draw).

# Every kind of span parlab marks has a colour of its own. A name without one takes its first
# word's ("all-gather parameters" draws as an all-gather), and within one chart no two names
# share a colour: a name whose colour is taken there, or that has none (a learner's own
# span), takes the first spare colour still free (``chart_colours``).
COMPUTE_COLOURS = {
    "forward": "tab:blue",
    "backward": "tab:green",
    "weight": "tab:olive",
    "optimizer": "tab:orange",
    "gradient": "teal",  # one gradient of lecture 06's problem: forward and backward in one
    "step": "lightgray",  # a step encloses the spans inside it, which draw over it
    "emulated compute": "#aec7e8",
    # ZeRO, FSDP and tensor parallelism mark their collectives as spans; their sends and
    # receives draw in the lower half of the row, in COMM_COLOURS.
    "all-gather": "tab:cyan",
    "reduce-scatter": "tab:pink",
    "all-reduce": "darkgoldenrod",
    "data-parallel all-gather": "cadetblue",  # beside a tensor-parallel all-gather on a grid
    "data-parallel reduce-scatter": "orchid",
    "data-parallel all-reduce": "gold",
    "sequence-parallel gradients": "yellowgreen",
    "parameters to device": "slategray",  # ZeRO's offload
    "gradients to host": "rosybrown",
    "attention": "sienna",  # context parallelism's blocks (lecture 09)
    "all-to-all": "darkorchid",  # Ulysses and the experts' dispatch and combine
    "amax": "peru",  # FSDP's exchange of amaxes for its fp8 scales (lecture 10)
}
# A send and an isend are one kind of transfer, and so are a recv and an irecv.
COMM_COLOURS = {"send": "tab:red", "isend": "tab:red", "recv": "tab:purple", "irecv": "tab:purple",
                "all_reduce": "tab:brown", "broadcast": "maroon",
                # a mesh's messages by the axis they travel along (parlab.mesh_training.by_axis)
                "tp": "tab:red", "dp": "darkviolet", "pp": "black"}
SPARE_COLOURS = ["#ffbb78", "#98df8a", "#c5b0d5", "#c49c94", "#f7b6d2", "#dbdb8d", "#9edae5", "#ff9896", "navy",
                 "darkolivegreen", "chocolate", "indigo", "crimson", "black"]


def chart_colours(events):
    """(kind, name) -> colour for the events of one chart: a name's own colour
    (COMPUTE_COLOURS, COMM_COLOURS), else its first word's, else, or when another name in the
    chart has that colour, the first spare colour still free (grey when none is). Names with
    a colour of their own choose first, the others in order of appearance; two names share a
    colour only when it is their own (send and isend)."""
    keys = list(dict.fromkeys((ev.kind, ev.name) for ev in events))
    keys.sort(key=lambda key: key[1] not in _table(key[0]))
    colours = {}
    for kind, name in keys:
        own = _table(kind).get(name)
        wanted = [own, _table(kind).get(name.split(" ")[0])] + SPARE_COLOURS
        used = set(colours.values())
        colours[kind, name] = next((c for c in wanted if c and (c == own or c not in used)), "tab:gray")
    return colours


def _table(kind):
    return COMPUTE_COLOURS if kind == COMPUTE else COMM_COLOURS


def plot_timeline(timeline, ax=None, title=None):
    """Gantt chart of a ``parlab.trace.Timeline``: one row per rank (rank 0 on top), compute
    spans in the upper half of a row, communication in the lower half, time in ms."""
    if not isinstance(timeline, Timeline):
        raise ValueError(f"plot_timeline draws a parlab.trace.Timeline, got {type(timeline).__name__}: pass what "
                         "cluster.trace(...) returns.")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    if ax is None:
        _, ax = plt.subplots(figsize=(10, 0.7 * timeline.world_size + 1.4))
        show_from_script(ax.figure, "timeline")
    t0 = min((ev.start for ev in timeline.events), default=0.0)
    span_ms = max(timeline.duration * 1e3, 1e-6)
    lanes, colours = _comm_lanes(timeline.events), chart_colours(timeline.events)
    enclosing = _enclosing_spans(timeline.events)  # a step around its backward: labelled by the legend only
    for ev in timeline.events:
        start, width = (ev.start - t0) * 1e3, max(ev.duration * 1e3, span_ms / 2000)
        colour = colours[ev.kind, ev.name]
        if ev.kind == COMPUTE:
            bottom, height, label = ev.rank - 0.42, 0.4, _compute_label(ev)
        else:
            # Transfers that overlap in time (an isend still pending during a recv) get
            # lanes of their own in the lower half of the row instead of drawing on top.
            lane, count = lanes[ev]
            height = 0.4 / count
            bottom, label = ev.rank + 0.02 + lane * height, _comm_label(ev)
        ax.broken_barh([(start, width)], (bottom, height), facecolors=colour, edgecolor="white", linewidth=0.5)
        if width > span_ms * 0.03 and height >= 0.2 and ev not in enclosing:
            ax.text(start + width / 2, bottom + height / 2, label, ha="center", va="center", fontsize=7,
                color=_text_colour(colour))
    ax.set_yticks(range(timeline.world_size), [f"rank {r}" for r in range(timeline.world_size)])
    ax.set_ylim(timeline.world_size - 0.5, -0.5)
    ax.set_xlim(0, span_ms * 1.01)
    ax.set_xlabel("time (ms)")
    what = "simulated" if timeline.regime == "simulated" else "measured"
    heading = title or f"{what} timeline ({timeline.duration * 1e3:.1f} ms)"
    # Every chart says how its times came about: real, emulated (and how), or simulated.
    ax.set_title(heading if timeline.regime == "simulated" else f"{heading}\n{timeline.regime}", fontsize=10)
    legend = {}  # colour -> the names drawn in it (send and isend share one), in order of appearance
    for kind, name in dict.fromkeys((ev.kind, ev.name) for ev in timeline.events):
        legend.setdefault(colours[kind, name], []).append(name)
    if legend:
        handles = [Patch(color=colour, label=" / ".join(names)) for colour, names in legend.items()]
        ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    return ax


def _comm_lanes(events):
    """Event -> (lane, lanes on its rank): greedy interval partitioning of each rank's
    communication events, so that events in one lane never overlap in time."""
    placed, lane_ends = {}, {}
    for ev in events:  # in start order
        if ev.kind != COMM:
            continue
        ends = lane_ends.setdefault(ev.rank, [])
        lane = next((i for i, end in enumerate(ends) if end <= ev.start), len(ends))
        if lane == len(ends):
            ends.append(ev.end)
        else:
            ends[lane] = ev.end
        placed[ev] = lane
    return {ev: (lane, len(lane_ends[ev.rank])) for ev, lane in placed.items()}


def _enclosing_spans(events):
    """The compute spans inside which another span of their rank starts (events in start order)."""
    enclosing, last = set(), {}
    for ev in events:
        if ev.kind == COMPUTE:
            outer = last.get(ev.rank)
            if outer is not None and ev.start < outer.end:
                enclosing.add(outer)
            last[ev.rank] = ev
    return enclosing


def _text_colour(colour):
    """White on a dark bar, black on a light one (lightgray steps, gold all-reduces)."""
    from matplotlib.colors import to_rgb

    red, green, blue = to_rgb(colour)
    return "black" if 0.299 * red + 0.587 * green + 0.114 * blue > 0.6 else "white"


def _compute_label(ev):
    """Pipeline spans read as the schedule notation, "{stage}{F|B|W}{micro-batch}" (an
    interleaved rank runs several stages); spans without a stage drop it ("B3")."""
    if ev.microbatch is not None:
        stage = "" if ev.stage is None else ev.stage
        return f"{stage}{ev.name[0].upper()}{ev.microbatch}"
    return ev.name


def _comm_label(ev):
    arrow = "→" if "send" in ev.name else "←"
    return f"{arrow}{ev.peer}" if ev.peer is not None else ev.name


# --- charts drawn from a script -------------------------------------------------------------------
# In a notebook a chart appears under its cell; a script's pyplot figures appear only when the
# script calls plt.show(), so ``timeline.plot()`` alone would show nothing there.

_from_script = []  # (weak reference to a figure, the stem of its file name) drawn outside IPython


def show_from_script(figure, stem):
    """Let a chart that parlab made for a script (``plot(ax=None)``) be seen: when the script
    ends, every such figure still open (neither shown by plt.show() nor closed) is shown in a
    window if matplotlib can open one, and otherwise saved as ``stem.png`` in the working
    directory (``stem-2.png``, ... beside existing files, never over them), with a line on
    stderr saying where. Nothing changes in IPython and Jupyter, which show figures
    themselves, nor under plt.ion(), which shows them at once."""
    import matplotlib.pyplot as plt

    if _in_ipython() or plt.isinteractive():
        return
    if not _from_script:
        # registered after pyplot's own exit handler, which closes every figure, so it runs first
        atexit.register(_show_at_exit)
    _from_script.append((weakref.ref(figure), stem))


def _in_ipython():
    ipython = sys.modules.get("IPython")
    return ipython is not None and ipython.get_ipython() is not None


def _show_at_exit():
    import matplotlib
    import matplotlib.pyplot as plt

    still_open = [plt.figure(number) for number in plt.get_fignums()]
    figures = [(ref(), stem) for ref, stem in _from_script if any(ref() is figure for figure in still_open)]
    if not figures:
        return
    backend = matplotlib.get_backend()
    if _opens_windows(backend):
        plt.show()
        return
    for figure, stem in figures:
        path = _free_path(stem).resolve()
        figure.savefig(path, bbox_inches="tight")
        print(f"parlab: matplotlib cannot open a window here (backend {backend}), so the chart was saved to {path}",
              file=sys.stderr)


def _opens_windows(backend):
    try:
        from matplotlib.backends import BackendFilter, backend_registry

        non_interactive = backend_registry.list_builtin(BackendFilter.NON_INTERACTIVE)
    except ImportError:  # matplotlib before 3.9
        from matplotlib.rcsetup import non_interactive_bk as non_interactive
    return backend.lower() not in {name.lower() for name in non_interactive}


def _free_path(stem):
    path, n = Path(f"{stem}.png"), 1
    while path.exists():
        n += 1
        path = Path(f"{stem}-{n}.png")
    return path
