"""Tracing: exact byte counts, one clock across ranks, compute spans, and the Gantt chart."""

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
    assert colours[3] == to_rgba("darkgoldenrod") and colours[4] == to_rgba("tab:gray")
    assert len(set(colours)) == 5


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
