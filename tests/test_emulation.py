"""The emulated regime's arithmetic, without ranks: links (alpha + n beta, ports that take
one message at a time), nodes, devices and stragglers, the regime's description, and the
learner errors. The same rules on real ranks are tested in tests/test_emulation_ranks.py."""

import pytest

from parlab.runtime import emulation
from parlab.runtime.emulation import REAL, Devices, Link, Nodes, Regime, Straggler

SLOW = Link(latency=200e-6, bandwidth=100e6)
FAST = Link(latency=5e-6, bandwidth=10e9)


def test_a_message_takes_alpha_plus_n_beta():
    assert SLOW.time(0) == 200e-6
    assert SLOW.time(1_000_000) == pytest.approx(200e-6 + 0.01, rel=1e-15)


@pytest.fixture
def rank0(monkeypatch):
    """Rank 0 of a call under a flat slow link, at a clock we move by hand."""
    clock = [100.0]
    monkeypatch.setattr(emulation, "now", lambda: clock[0])
    emulation.begin_call(Regime(SLOW), rank=0)
    yield clock
    emulation.begin_call(REAL, rank=0)


def test_sends_queue_on_the_outgoing_port_one_after_another(rank0):
    message = SLOW.time(1000)
    first = emulation.departure(1, 1000)
    second = emulation.departure(2, 1000)  # another peer, the same port
    assert first == (100.0, 100.0 + message)
    assert second == (first[1], first[1] + message)  # the same arithmetic: exact


def test_a_port_that_is_free_starts_at_the_call(rank0):
    emulation.departure(1, 1000)
    rank0[0] = 200.0  # long after the first message
    assert emulation.departure(1, 1000)[0] == 200.0


def test_arrivals_queue_on_the_incoming_port_and_ports_are_full_duplex(rank0):
    message = SLOW.time(1000)
    # Three peers ready at the same moment: the root's port takes them one at a time, as the
    # alpha-beta model of the naive all-reduce assumes; sending does not delay receiving.
    emulation.departure(1, 1000)
    arrivals = [emulation.arrival(peer, 1000, ready=100.0) for peer in (1, 2, 3)]
    assert arrivals == [pytest.approx(100.0 + k * message) for k in (1, 2, 3)]


def test_nodes_use_the_inside_or_the_between_link_each_with_its_own_ports(rank0):
    emulation.begin_call(Regime(Nodes(2, inside=FAST, between=SLOW)), rank=0)
    inside = emulation.departure(1, 10_000)
    between = emulation.departure(2, 10_000)
    assert inside == (100.0, pytest.approx(100.0 + FAST.time(10_000)))
    assert between == (100.0, pytest.approx(100.0 + SLOW.time(10_000)))  # its own port: no queueing


def test_slowdown_and_stragglers_scale_declared_compute():
    devices = Devices(slowdown={2: 3.0}, straggler=Straggler(factor=5, every=10))
    assert devices.factor(0, 0, None) == 1.0
    assert devices.factor(2, 0, None) == 3.0
    assert [devices.factor(0, step, None) for step in range(20)].count(5.0) == 2  # steps 9 and 19
    assert devices.factor(2, 9, None) == 15.0


def test_random_stragglers_follow_their_probability_reproducibly():
    devices = Devices(straggler=Straggler(factor=5, probability=0.1, seed=3))
    emulation.begin_call(Regime(devices=devices), rank=1)
    first = [emulation.compute_factor(step) for step in range(2000)]
    emulation.begin_call(Regime(devices=devices), rank=1)
    assert [emulation.compute_factor(step) for step in range(2000)] == first
    # Binomial(2000, 0.1): 200 expected, standard deviation 13.4; 6 sigma either side.
    assert 120 <= first.count(5.0) <= 280
    emulation.begin_call(REAL, rank=0)


def test_compute_takes_its_declared_time_times_the_factor(monkeypatch):
    slept = []
    monkeypatch.setattr(emulation, "sleep_until", lambda deadline: slept.append(deadline - emulation.now()))
    emulation.begin_call(Regime(devices=Devices(slowdown={0: 2.0})), rank=0)
    emulation.compute(0.01)
    emulation.begin_call(REAL, rank=0)
    emulation.compute(0.01)
    assert slept == [pytest.approx(0.02, abs=1e-4), pytest.approx(0.01, abs=1e-4)]


def test_the_regime_describes_itself():
    assert REAL.describe() == "real time" and not REAL.emulated
    text = Regime(SLOW, Devices(slowdown={2: 3.0}, straggler=Straggler(5, every=10))).describe()
    assert text == "emulated: link 200 µs + bytes / (100 MB/s); devices: rank 2 3x slower, one step in 10 5x slower"
    assert "inside 5 µs + bytes / (10 GB/s)" in Regime(Nodes(4, FAST, SLOW)).describe()


@pytest.mark.parametrize(
    "make, fix",
    [
        (lambda: Link(-1e-6, 1e9), "latency=200e-6"),
        (lambda: Link(float("nan"), 1e9), "latency=200e-6"),
        (lambda: Link(1e-6, 0), "bandwidth=100e6"),
        (lambda: Link(1e-6, "fast"), "bandwidth=100e6"),
        (lambda: Nodes(0, FAST, SLOW), "ranks_per_node"),
        (lambda: Nodes(2, FAST, 1e9), "parlab.Link"),
        (lambda: Straggler(5), "either every=k"),
        (lambda: Straggler(5, every=0), "every must be a whole number"),
        (lambda: Straggler(5, probability=2), r"\[0, 1\]"),
        (lambda: Devices(slowdown={1: 0}), r"\{2: 3.0\}"),
        (lambda: Devices(slowdown=[1, 3]), "dict rank -> factor"),
        (lambda: Regime(network=100e6), "parlab.Link or parlab.Nodes"),
        (lambda: emulation.compute(-1), "seconds >= 0"),
        # Values in the wrong unit, which would otherwise sleep until the call's timeout:
        (lambda: Link(200, 100e6), r"latency is in seconds.*got 200: 200 µs is latency=200e-6"),
        (lambda: Link(200e-6, 100), r"bandwidth is in bytes per second.*got 100: 100 MB/s is bandwidth=100e6"),
        (lambda: Nodes(2, FAST, Link(50, 1e9)), r"50 µs is latency=50e-6"),
        (lambda: emulation.compute(20), r"at most 10 .*got 20: give each in seconds.*20 ms is 20e-3"),
        (lambda: Straggler(0.5, every=4), r"Straggler factor .*at least 1 .*factor=5"),
        (lambda: Straggler(500, every=4), r"Straggler factor .*at most 100"),
        (lambda: Devices(slowdown={1: 300}), r"slowdown of rank 1 .*at most 100"),
        (lambda: Devices(straggler_ranks=[1, -1]), r"straggler_ranks must list ranks"),
        (lambda: Devices(slowdown={5: 3.0}).check_ranks(2), r"names rank 5, but the cluster has 2 ranks \(0 to 1\)"),
        (lambda: Regime(devices=Devices(straggler=Straggler(5, every=2), straggler_ranks=(3,))).check_ranks(2),
         r"Devices\(straggler_ranks=...\) names rank 3"),
    ],
)
def test_learner_errors_say_what_to_change(make, fix):
    with pytest.raises(ValueError, match=fix):
        make()


def test_the_bounds_admit_every_link_and_device_a_lesson_declares():
    # The slowest and fastest values the bounds allow, and the lectures' own.
    assert Link(emulation.MAX_LATENCY_S, emulation.MIN_BANDWIDTH).time(0) == 1.0
    assert Link(0, 1e15).describe() == "0 µs + bytes / (1e+06 GB/s)"
    Devices(slowdown={0: 0.5, 3: 100}, straggler=Straggler(1, every=1), straggler_ranks=[0, 3]).check_ranks(4)
    assert Devices(straggler_ranks=[2]).straggler_ranks == (2,)
    Regime(SLOW).check_ranks(1)  # no devices: nothing to check
