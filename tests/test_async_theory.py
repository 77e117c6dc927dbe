"""Lecture 06's numbers without ranks: gossip's mixing matrices and their golden values, the
consensus decay, delayed gradient descent's stability thresholds and the backup workers'
harmonic-number step time."""

import math
import random

import pytest
import torch

from parlab.async_sgd import gossip, local_sgd, theory


def test_one_ring_step_averages_each_rank_with_its_neighbours_and_keeps_the_mean():
    xs = [torch.tensor([float(i)]) for i in range(4)]
    mixed = torch.cat(gossip.gossip_all(gossip.ring(4), xs))
    # the golden values, given to 4 decimals: within half their last digit
    assert torch.allclose(mixed, torch.tensor([1.3333, 1.0, 2.0, 1.6667]), rtol=0, atol=5e-5)
    assert mixed.mean().item() == pytest.approx(1.5, abs=1e-15)


@pytest.mark.parametrize("N, expected", [(4, 1 / 3), (5, 0.5393), (6, 2 / 3), (8, 0.8047), (16, 0.9493)])
def test_rho_of_the_ring(N, expected):
    assert gossip.rho(gossip.ring(N)) == pytest.approx(expected, abs=5e-5)
    assert gossip.rho(gossip.ring(N)) == pytest.approx((1 + 2 * math.cos(2 * math.pi / N)) / 3, abs=1e-12)


def test_rho_of_the_torus_and_of_the_static_exponential_graph():
    assert gossip.rho(gossip.torus(3, 3)) == pytest.approx(0.4, abs=1e-12)
    assert gossip.rho(gossip.torus(4, 4)) == pytest.approx(0.6, abs=1e-12)
    for N in (4, 8, 16, 32):
        assert gossip.rho(gossip.exponential(N)) == pytest.approx(1 - 2 / (1 + math.log2(N)), abs=1e-12)


@pytest.mark.parametrize("topology", gossip.TOPOLOGIES)
@pytest.mark.parametrize("N", [2, 3, 4, 6, 8, 9])
def test_every_mixing_matrix_is_doubly_stochastic(topology, N):
    W = gossip.mixing_matrix(topology, N)
    ones = torch.ones(N, dtype=torch.float64)
    assert torch.allclose(W.sum(0), ones, atol=1e-12) and torch.allclose(W.sum(1), ones, atol=1e-12)
    assert (W >= 0).all()


@pytest.mark.parametrize("N", [8, 16])
def test_one_peer_exponential_averages_exactly_after_log2_n_rounds(N):
    xs = [torch.tensor([float(i * i)], dtype=torch.float64) for i in range(N)]
    mean = torch.stack(xs).mean()
    rounds = int(math.log2(N))
    for t in range(rounds):
        assert not all(torch.equal(x, xs[0]) for x in xs)  # not before the last round
        xs = gossip.gossip_all(gossip.one_peer_exponential(N, t), xs)
    assert all(torch.equal(x[0], mean) for x in xs)


@pytest.mark.parametrize("N", [3, 5, 6, 7, 12])
def test_one_peer_exponential_never_averages_exactly_when_n_is_not_a_power_of_two(N):
    period = gossip.one_peer_period(N)
    assert gossip.one_peer_rounds(N) == math.ceil(math.log2(N))
    assert gossip.rho(period) > 0.1  # 0.2165 at N = 6: far from the exact average, not a rounding
    xs = [torch.tensor([float(r)], dtype=torch.float64) for r in range(N)]
    for t in range(4 * gossip.one_peer_rounds(N)):  # four periods
        xs = gossip.gossip_all(gossip.one_peer_exponential(N, t), xs)
    assert gossip.consensus_distance(xs) > 0
    for M in (2, 4, 8, 16, 32):
        assert torch.equal(gossip.one_peer_period(M), torch.full((M, M), 1 / M, dtype=torch.float64))


def test_consensus_distance_shrinks_by_rho_squared_per_mixing_step():
    torch.manual_seed(0)
    W = gossip.ring(8)
    rho2 = gossip.rho(W) ** 2
    xs = list(torch.randn(8, 3, dtype=torch.float64))
    distances = [gossip.consensus_distance(xs)]
    for _ in range(60):
        xs = gossip.gossip_all(W, xs)
        distances.append(gossip.consensus_distance(xs))
    ratios = [b / a for a, b in zip(distances, distances[1:])]
    assert all(r <= rho2 * (1 + 1e-9) for r in ratios)  # never slower than rho^2 ...
    assert ratios[-1] == pytest.approx(rho2, rel=1e-6)  # ... and rho^2 once the slowest mode is left


def test_mixing_refuses_an_unknown_topology_saying_which_exist():
    with pytest.raises(ValueError, match="topology must be one of ring, torus, exponential, one-peer exponential"):
        gossip.mixing_matrix("star", 4)


@pytest.mark.parametrize("tau, threshold", [(0, 2.0), (1, 1.0), (2, 0.6180), (3, 0.4450), (4, 0.3473)])
def test_delayed_gradient_descent_is_stable_below_the_cosine_threshold(tau, threshold):
    assert theory.stability_threshold(tau) == pytest.approx(threshold, abs=5e-5)
    steps = 400  # enough for 2% either side to separate clearly (envelope below 0.3 / above 1.9 at tau = 4)
    converging = theory.delayed_gd(0.98 * theory.stability_threshold(tau), tau, steps)
    diverging = theory.delayed_gd(1.02 * theory.stability_threshold(tau), tau, steps)
    assert max(abs(x) for x in converging[-tau - 1:]) < 0.5
    assert max(abs(x) for x in diverging[-tau - 1:]) > 1.5


def test_expected_staleness_counts_the_others_gradients_during_one_period():
    assert theory.expected_staleness([0.06, 0.02, 0.02]) == pytest.approx([6, 4 / 3, 4 / 3])
    with_trip = theory.expected_staleness([0.062, 0.022, 0.022])  # a 2 ms round trip on every period
    assert with_trip[0] < 6 and with_trip[1] > 4 / 3  # the slow worker's tau falls, the fast ones' rises
    assert theory.expected_staleness([1.0] * 4) == [3.0] * 4
    with pytest.raises(ValueError, match="period"):
        theory.expected_staleness([0.02, 0])


def test_mean_and_error_is_the_mean_and_the_sample_deviation_over_root_n():
    mean, error = theory.mean_and_error([1.0, 2.0, 3.0, 4.0])
    assert mean == 2.5 and error == pytest.approx(math.sqrt(5 / 3) / 2)
    with pytest.raises(ValueError, match="at least 2 samples"):
        theory.mean_and_error([1.0])


def test_backup_workers_expected_step_time_matches_a_monte_carlo_order_statistic():
    rng, rate, trials = random.Random(1), 50.0, 20000
    for N, e in ((4, 0), (4, 1), (3, 2)):
        samples = [sorted(rng.expovariate(rate) for _ in range(N + e))[N - 1] for _ in range(trials)]
        mean = sum(samples) / trials
        sd = math.sqrt(sum((s - mean) ** 2 for s in samples) / (trials - 1))
        assert abs(mean - theory.expected_step_time(N, e, rate)) < 4 * sd / math.sqrt(trials)  # 4 standard errors
    assert theory.expected_step_time(4, 0, 1.0) == pytest.approx(1 + 1 / 2 + 1 / 3 + 1 / 4)


def test_periodic_averaging_follows_torch_s_schedule():
    assert local_sgd.averaging_steps(8, 4, 2) == [3, 7]
    assert local_sgd.averaging_steps(5, 1) == [1, 2, 3, 4, 5]
    with pytest.raises(ValueError, match="period"):
        local_sgd.PeriodicAverager(0)
