"""parlab.pipeline.measure on real ranks: a measured step beside the simulator's with the
link's time per message, its yardstick and allowances; the micro-batch sweep's declared
costs; one real stage's t(b) and its fit; real GPipe steps read through Timeline.window.
Nothing here asserts on speed: only what the arithmetic and the schedules fix."""

from fractions import Fraction

import pytest
import torch
from torch import nn

import parlab
from parlab.pipeline import gpipe, one_f_one_b, partition, simulate
from parlab.pipeline.measure import (
    BubbleMeasurement,
    fit_microbatch_cost,
    gpipe_step_times,
    link_time,
    measure_bubble,
    microbatch_sweep,
    one_stage_costs,
)

pytestmark = pytest.mark.timeout(120)
LINK = parlab.Link(latency=1e-3, bandwidth=1e9)


def test_the_simulator_is_charged_the_links_time_for_one_activation():
    assert link_time(None, 4096) == 0.0
    assert link_time(LINK, 4096) == pytest.approx(1e-3 + 4096 / 1e9)
    nodes = parlab.Nodes(2, inside=LINK, between=LINK)
    with pytest.raises(ValueError, match="one link's time per message"):
        link_time(nodes, 4096)


def test_allowances_follow_from_the_yardstick():
    # A made-up measurement: the simulated step of GPipe K = 2, M = 2 with t_f = t_b = 1
    # is 6 s with bubble 1/3; a yardstick of 0.3 s allows 0.6 s on the step and
    # 2 (1 - 1/3) 0.3 / 6 = 1/15 on the bubble.
    schedule = gpipe(2, 2)
    simulation = simulate(schedule, 1.0, 1.0)
    timeline = simulation.timeline  # as if measured exactly
    measurement = BubbleMeasurement(schedule, timeline, simulation, 0.0, 0.3)
    assert measurement.simulated_step == 6 and measurement.measured_step == pytest.approx(6)
    assert measurement.simulated == pytest.approx(1 / 3) and measurement.formula == pytest.approx(1 / 3)
    assert measurement.step_tolerance == pytest.approx(0.6)
    assert measurement.bubble_tolerance == pytest.approx(1 / 15)
    assert measurement.within_tolerance and measurement.attempts == 1
    late = simulate(schedule, 1.0, 1.0, t_comm=0.5).timeline  # a step 1 s longer than the model's
    assert not BubbleMeasurement(schedule, late, simulation, 0.0, 0.3).within_tolerance
    assert "bubble measured 0.333, simulated 0.333" in str(measurement)


def test_a_measured_step_on_an_emulated_link(cluster2):
    with cluster2.emulate(link=LINK):
        measurement = measure_bubble(cluster2, one_f_one_b(2, 4), 0.004, 0.008, activation_bytes=2048)
    assert measurement.t_comm == pytest.approx(1e-3 + 2048 / 1e9)
    expected = simulate(one_f_one_b(2, 4), 0.004, 0.008, t_comm=measurement.t_comm)
    assert measurement.simulation.step_time == expected.step_time
    assert measurement.simulated == pytest.approx(float(expected.bubble_fraction))
    assert 1 <= measurement.attempts <= 2
    assert "emulated: link 1 ms" in measurement.timeline.regime
    sends = [ev.nbytes for ev in measurement.timeline.select(rank=0, name="isend")]
    assert sends == [2048] * 4  # the step's own activations: the yardstick's step is not in it
    # sleeps never end early and emulated messages never arrive early: the yardstick's step
    # cannot beat its simulation, nor the measured step its own (1 µs: times are stored in ns)
    assert measurement.overhead_s >= -1e-6 and measurement.measured_step >= measurement.simulated_step - 1e-6
    with pytest.raises(ValueError, match="the cluster has 2 ranks and the schedule K = 4"):
        measure_bubble(cluster2, gpipe(4, 4), 0.001, 0.001)
    with pytest.raises(ValueError, match="attempts must be a whole number >= 1"):
        measure_bubble(cluster2, gpipe(2, 2), 0.001, 0.001, attempts=0)
    with cluster2.emulate(devices=parlab.Devices(slowdown={1: 3.0})):
        with pytest.raises(ValueError, match="emulates slower or straggling devices"):
            measure_bubble(cluster2, gpipe(2, 2), 0.001, 0.001)


def test_the_sweep_declares_t_of_b_and_the_activation_of_b_samples(cluster2):
    with cluster2.emulate(link=LINK):
        sweep = microbatch_sweep(cluster2, (1, 2, 4), t_0=0.003, t_1=0.0005, batch=8, sample_bytes=64, attempts=1)
    for M, measurement in zip((1, 2, 4), sweep):
        b = 8 // M
        t = 0.003 + 0.0005 * b
        assert measurement.schedule == gpipe(2, M)
        assert measurement.t_comm == pytest.approx(1e-3 + b * 64 / 1e9)
        expected = simulate(gpipe(2, M), t / 3, 2 * t / 3, t_comm=measurement.t_comm)
        assert measurement.simulated_step == pytest.approx(float(expected.step_time))
    with pytest.raises(ValueError, match="does not split into M = 3"):
        microbatch_sweep(cluster2, (3,), 0.001, 0.001, 8, 4)


def test_the_fit_recovers_a_straight_line():
    costs = {M: 0.002 + 0.0001 * (256 // M) for M in (1, 2, 4, 8, 16, 32)}
    t_0, t_1 = fit_microbatch_cost(costs, 256)
    assert t_0 == pytest.approx(0.002) and t_1 == pytest.approx(0.0001)
    assert fit_microbatch_cost({1: Fraction(3), 2: Fraction(2)}, 4) == (1, Fraction(1, 2))


def test_one_stage_costs_one_entry_per_m_and_leave_the_threads_as_they_were():
    threads = torch.get_num_threads()
    stage = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    costs = one_stage_costs(stage, torch.randn(8, 4), torch.randn(8, 4), (1, 2, 8), repeats=2)
    assert list(costs) == [1, 2, 8] and all(seconds > 0 for seconds in costs.values())
    assert torch.get_num_threads() == threads


def build_stages():
    torch.manual_seed(0)
    return partition(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4)), 2)


def test_real_steps_are_read_from_the_last_step_span(cluster2):
    inputs, targets = torch.randn(8, 4), torch.randn(8, 4)
    rows = gpipe_step_times(cluster2, build_stages, inputs, targets, (2, 4), steps=3)
    assert [row["M"] for row in rows] == [2, 4]
    for row in rows:
        last = row["timeline"]
        # the window holds one step: each rank's M forwards and M backwards, no others
        for rank in range(2):
            spans = [(ev.name, ev.microbatch) for ev in last.select(rank=rank) if ev.name in ("forward", "backward")]
            assert sorted(spans) == sorted((name, m) for name in ("forward", "backward") for m in range(row["M"]))
        assert row["step"] > 0 and row["t_f"] > 0 and row["t_b"] > 0
