"""The emulated regime on real ranks: a message never arrives before its link allows (alpha +
n beta after its ports are free), ports take one message at a time, results do not depend
on the regime, and the regime shows in the cluster, the timeline and its plot.

Only lower bounds are asserted: sleeping guarantees them on any machine, while how little a
message overshoots its declared time depends on the machine's load (``parlab bench
emulation`` measures that)."""

import pytest
import torch
import torch.distributed as dist

import parlab
from parlab import collectives, p2p, trace
from parlab.emulated import SleepLayer
from parlab.runtime.emulation import Devices, Link, Nodes

LINK = Link(latency=2e-3, bandwidth=50e6)  # slow enough that every bound is far above the noise
NBYTES = 100_000  # a message of 25,000 float32: 2 ms + 2 ms


@pytest.fixture(scope="module")
def cluster():
    with parlab.Cluster(world_size=4, timeout=60, link=LINK) as cluster:
        yield cluster


def send_to_ranks_1_and_2():
    tensor = torch.full((NBYTES // 4,), float(dist.get_rank()))
    if dist.get_rank() == 0:
        p2p.wait_all([p2p.isend(tensor, 1), p2p.isend(tensor, 2)])
    elif dist.get_rank() in (1, 2):
        p2p.recv(tensor, 0)
    return tensor[0].item()


def test_a_rank_s_sends_queue_on_its_link(cluster):
    timeline = cluster.trace(send_to_ranks_1_and_2)
    assert timeline.results[1:3] == [0.0, 0.0]
    message = LINK.time(NBYTES)
    start = timeline.select(rank=0, name="isend")[0].start
    arrivals = sorted(timeline.select(rank=r, name="recv")[0].end - start for r in (1, 2))
    assert arrivals[0] >= message and arrivals[1] >= 2 * message  # the second waited for the first


def naive_to_rank_0():
    tensor = torch.full((NBYTES // 4,), 1.0)
    collectives.naive_all_reduce(tensor, check=False)
    return tensor[0].item()


def test_the_root_receives_one_message_at_a_time_and_sends_one_at_a_time(cluster):
    timeline = cluster.trace(naive_to_rank_0)
    assert timeline.results == [4.0] * 4
    # The alpha-beta model of the naive all-reduce: 2 (N - 1) message times through the root.
    assert timeline.duration >= 2 * 3 * LINK.time(NBYTES)


def ring_sum(values):
    tensor = torch.tensor(values[dist.get_rank()])
    collectives.ring_all_reduce(tensor, check=False)
    return tensor


def test_results_do_not_depend_on_the_regime(cluster):
    values = [torch.randn(1001, generator=torch.Generator().manual_seed(r)).tolist() for r in range(4)]
    emulated = cluster.run(ring_sum, values)
    with cluster.emulate():
        real = cluster.run(ring_sum, values)
    assert all(torch.equal(a, b) for a, b in zip(emulated, real))  # the same additions in the same order


def test_the_regime_is_visible_and_emulate_switches_it_for_a_block(cluster):
    assert "emulated: link 2 ms + bytes / (50 MB/s)" in repr(cluster)
    with cluster.emulate(devices=Devices(slowdown={1: 2.0})):
        assert "rank 1 2x slower" in repr(cluster)
        assert "real time" not in cluster.trace(ring_sum, [[1.0]] * 4).regime
    assert cluster.trace(ring_sum, [[1.0]] * 4).plot().get_title().endswith("emulated: link 2 ms + bytes / (50 MB/s)")


def sleep_forward():
    layer = SleepLayer(0.02, 0.0)
    with trace.span("forward"):
        layer(torch.zeros(1))


def test_a_slow_device_takes_its_slowdown_times_the_declared_time(cluster):
    with cluster.emulate(devices=Devices(slowdown={2: 3.0})):
        timeline = cluster.trace(sleep_forward)
    durations = [timeline.select(rank=r, name="forward")[0].duration for r in range(4)]
    assert durations[2] >= 0.06 and all(d >= 0.02 for d in durations)


def exchange_with_the_next_node():
    tensor = torch.zeros(NBYTES // 4)
    rank = dist.get_rank()
    peer = rank ^ 1 if rank in (0, 1) else rank  # 0 <-> 1 inside node 0
    far = (rank + 2) % 4  # 0 <-> 2, 1 <-> 3 between the nodes
    requests = [p2p.isend(tensor, far), p2p.irecv(torch.zeros_like(tensor), far)]
    if peer != rank:
        requests += [p2p.isend(tensor, peer), p2p.irecv(torch.zeros_like(tensor), peer)]
    p2p.wait_all(requests)


def test_nodes_charge_the_link_between_them(cluster):
    slow = Link(latency=20e-3, bandwidth=50e6)
    with cluster.emulate(link=Nodes(2, inside=LINK, between=slow)):
        timeline = cluster.trace(exchange_with_the_next_node)
    inside = timeline.select(rank=0, name="irecv")
    assert timeline.duration >= slow.time(NBYTES)
    assert len(inside) == 2


def ddp_step(all_reduce=None):
    from parlab.ddp import DDP

    torch.manual_seed(0)
    # The first layer's backward (its weight's gradient) comes last and takes 50 ms: time
    # for the later layers' buckets to travel while backward goes on.
    model = torch.nn.Sequential(SleepLayer(0, 0, 0.05), torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    ddp = DDP(model, "overlapped", all_reduce=all_reduce)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(dist.get_rank()))
    loss = ddp(x).square().sum()
    with trace.span("backward"):
        loss.backward()
    ddp.finish_gradient_synchronization()
    return [p.grad for p in model.parameters()]


def test_ddp_under_emulated_links_overlaps_with_parlab_s_ring_and_averages_the_same(cluster):
    timeline = cluster.trace(ddp_step)
    with cluster.emulate():
        reference = cluster.run(ddp_step, collectives.ring_all_reduce)  # real time, the same rings, one at a time
    for rank in range(4):
        assert all(torch.equal(a, b) for a, b in zip(timeline.results[rank], reference[rank]))
    sends = timeline.select(rank=0, name="isend")
    assert sends and timeline.bytes_sent()[0] > 0  # the rings' messages, which the link charged
    # Overlap: the first bucket's ring starts before backward's last gradient is ready.
    assert sends[0].start < timeline.select(rank=0, name="backward")[0].end
