"""parlab.failures: an injected kill or hang is reported naming the rank (and the cluster works
after); a mismatched or missing collective shows in the stacks, TORCH_DISTRIBUTED_DEBUG=DETAIL's
fingerprint check and the flight recorder; Young's, Daly's and the exact interval, and the
measured best interval within the band the sampled failures allow."""

import math

import numpy as np
import pytest
import torch
import torch.distributed as dist

import parlab
from parlab.failures import hangs, young_daly
from parlab.failures.injection import Faults


def loop_with_faults(faults, steps=6):
    """An all-reduce per step, the faults injected before each."""
    tensor = torch.ones(4)
    for step in range(steps):
        faults.at(step)
        dist.all_reduce(tensor)
    return tensor.sum().item()


@pytest.mark.timeout(60)
def test_a_killed_rank_is_named_and_the_next_call_works(cluster4):
    with pytest.raises(parlab.RankError) as caught:
        cluster4.run(loop_with_faults, Faults(kill={2: 3}), timeout=20)
    message = str(caught.value)
    assert message.splitlines()[0].endswith(
        "rank 2's worker was killed by SIGKILL during the call (out of memory, or a kill -9?)")
    assert caught.value.dead == [2]
    assert "rank 2 killed itself with SIGKILL at step 3" in caught.value.failures[2]  # the injected line, not OOM
    # the survivors either lost their connection to it or were stopped where they waited
    for rank in (0, 1, 3):
        seen = caught.value.failures.get(rank, "") + caught.value.stuck.get(rank, "")
        assert "Connection" in seen or "all_reduce" in seen, seen
    assert cluster4.run(loop_with_faults, Faults(), timeout=20) == [4.0 ** 6 * 4] * 4


@pytest.mark.timeout(60)
def test_a_hung_rank_shows_in_the_timeout_stacks(cluster2):
    with pytest.raises(parlab.RankTimeout) as caught:
        cluster2.run(loop_with_faults, Faults(hang={1: 2}), timeout=3)
    stuck = caught.value.stuck
    assert sorted(stuck) == [0, 1]
    assert "in hang" in stuck[1] and "in at" in stuck[1] and "in loop_with_faults" in stuck[1]
    assert "in all_reduce" in stuck[0] and "in hang" not in stuck[0]
    assert cluster2.run(loop_with_faults, Faults(), timeout=20) == [2.0 ** 6 * 4] * 2


def test_faults_refuse_what_is_not_a_rank_and_a_step():
    with pytest.raises(ValueError, match="kill's step for rank 1"):
        Faults(kill={1: -1})
    with pytest.raises(ValueError, match="a dict"):
        Faults(hang=[1, 2])
    assert Faults(kill={0: 5}, hang={1: 3}).first_failure() == 3


@pytest.mark.timeout(60)
@pytest.mark.parametrize("collective", [hangs.mismatched_collective, hangs.missing_collective])
def test_a_collective_not_every_rank_calls_hangs_and_the_stack_names_the_line(cluster2, collective):
    with pytest.raises(parlab.RankTimeout) as caught:
        cluster2.run(collective, timeout=3)
    assert f"in {collective.__name__}" in caught.value.stuck[0] and "in all_reduce" in caught.value.stuck[0]
    if collective is hangs.mismatched_collective:
        assert "in broadcast" in caught.value.stuck[1]
    else:
        assert caught.value.finished == [1]


def mismatched_on_a_fingerprinted_group():
    return hangs.mismatched_collective(hangs.fingerprinted_group())


@pytest.mark.timeout(60)
def test_debug_detail_raises_on_the_mismatch_at_once(cluster2):
    with pytest.raises(parlab.RankError) as caught:
        cluster2.run(mismatched_on_a_fingerprinted_group, timeout=20)
    assert sorted(caught.value.failures) == [0, 1]
    assert "Detected mismatch between collectives" in str(caught.value)
    assert "OpType=ALLREDUCE" in str(caught.value) and "OpType=BROADCAST" in str(caught.value)


@pytest.mark.timeout(60)
def test_the_flight_recorder_shows_who_entered_a_collective_alone_on_gloo(cluster2):
    results = cluster2.run(hangs.unmatched_in_flight_recorder, 1.0, timeout=20)
    assert "Timed out" in results[0][0] and results[1][0] is None
    assert [entry["op"] for entry in results[0][1]] == ["gloo:all_reduce"] * 2
    unmatched = hangs.first_unmatched([entries for _, entries in results])
    assert unmatched == {"seq": results[0][1][1]["seq"], "entered": {0: "gloo:all_reduce"}, "missing": [1]}


def test_young_and_daly_intervals_match_the_papers():
    assert young_daly.young_interval(5, 1440) == pytest.approx(120)
    # Daly 2006, Figs. 3-5: delta = 5 min, Theta = 24 h, 6 h, 15 min -> 117, 57, 9.1 min
    assert [round(young_daly.daly_interval(5, theta), 1) for theta in (1440, 360, 15)] == [116.7, 56.7, 9.1]
    assert young_daly.daly_interval(5, 2) == 2  # delta >= 2 Theta
    for delta, theta in [(5, 1440), (5, 15), (1, 100)]:
        best = young_daly.optimum_interval(delta, theta)
        grid = [best * factor for factor in (0.9, 0.99, 1.01, 1.1)]
        assert all(young_daly.goodput(i, delta, 2, theta) < young_daly.goodput(best, delta, 2, theta) for i in grid)
    assert young_daly.daly_interval(5, 1440) == pytest.approx(young_daly.optimum_interval(5, 1440), rel=1e-4)
    with pytest.raises(ValueError, match="delta"):
        young_daly.young_interval(0, 100)


def test_measured_goodput_follows_the_model_and_peaks_in_its_band():
    delta, restart, theta = 1.0, 2.0, 100.0
    optimum = young_daly.optimum_interval(delta, theta)
    curve = young_daly.goodput_curve(delta, restart, theta, list(optimum * np.geomspace(0.25, 4, 13)), 2e5, seed=1)
    assert min(curve["failures"]) > 1000  # the error bars below come from that many failures
    for model, measured, error in zip(curve["model"], curve["measured"], curve["stderr"]):
        assert abs(measured - model) <= 4 * error
    assert curve["measured_best"] in curve["band"]
    # the band is narrower than the grid: a curve with its peak elsewhere would fail
    assert curve["intervals"][0] not in curve["band"] and curve["intervals"][-1] not in curve["band"]
    assert math.isclose(curve["daly"], optimum, rel_tol=1e-3)
