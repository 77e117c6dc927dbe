"""The alpha-beta cost model: predicted times by hand, the fit, the ping-pong measurement."""

import contextlib

import pytest

import parlab
from parlab.alpha_beta import ALL_REDUCE_ALGORITHMS, cost_model, fit_alpha_beta, fit_errors, measure_p2p, ping_pong


@pytest.mark.timeout(10)
def test_cost_model_matches_hand_computed_times():
    alpha, beta, D = 1e-5, 1e-9, 1e6  # 10 us per message, 1 GB/s, 1 MB
    assert cost_model("naive", D, 4, alpha, beta) == pytest.approx(6 * (1e-5 + 1e-3))
    assert cost_model("ring", D, 4, alpha, beta) == pytest.approx(6e-5 + 1.5e-3)
    assert cost_model("butterfly", D, 4, alpha, beta) == pytest.approx(4e-5 + 1.5e-3)
    assert cost_model("tree_broadcast", D, 4, alpha, beta) == pytest.approx(2 * (1e-5 + 1e-3))
    assert cost_model("ring", D, 3, alpha, beta) == pytest.approx(4e-5 + 4 / 3 * 1e-3)
    assert cost_model("butterfly", D, 3, alpha, beta) == pytest.approx(2e-5 + 1e-3 + 2 * (1e-5 + 1e-3))
    assert cost_model("tree_broadcast", D, 3, alpha, beta) == pytest.approx(2 * (1e-5 + 1e-3))
    assert cost_model("tree", D, 4, alpha, beta) == pytest.approx(4 * (1e-5 + 1e-3))
    assert [cost_model(a, D, 1, alpha, beta) for a in (*ALL_REDUCE_ALGORITHMS, "tree_broadcast")] == [0] * 5
    with pytest.raises(ValueError, match="'ring'"):
        cost_model("allreduce", D, 4, alpha, beta)


@pytest.mark.timeout(10)
def test_fit_alpha_beta_recovers_noiseless_parameters():
    alpha, beta = 2e-5, 3e-10
    sizes = [0, 1_000, 64_000, 1_000_000]
    alpha_fit, beta_fit = fit_alpha_beta(sizes, [alpha + D * beta for D in sizes])
    assert alpha_fit == pytest.approx(alpha, rel=1e-9)
    assert beta_fit == pytest.approx(beta, rel=1e-9)
    with pytest.raises(ValueError, match="two different sizes"):
        fit_alpha_beta([8, 8], [1e-5, 1e-5])


@pytest.mark.timeout(10)
def test_fit_alpha_beta_takes_alpha_from_the_small_messages_despite_noise_on_large_ones():
    alpha, beta = 5e-5, 5e-10  # 50 us, 2 GB/s
    sizes = [16, 1024, 65536, 2**20, 4 * 2**20]
    times = [alpha + D * beta for D in sizes]
    times[-2:] = [0.8 * times[-2], 1.1 * times[-1]]  # 1 MiB 20 % fast, 4 MiB 10 % slow
    alpha_fit, beta_fit = fit_alpha_beta(sizes, times)
    assert alpha_fit == pytest.approx(alpha, rel=0.01)  # unweighted least squares: 15 us
    assert beta_fit == pytest.approx(beta, rel=0.1)
    with pytest.raises(ValueError, match="above zero"):
        fit_alpha_beta([8, 16], [1e-5, 0.0])


@pytest.mark.timeout(30)
def test_measure_p2p_returns_increasing_sizes_with_positive_times(cluster2):
    pairs, other = cluster2.run(measure_p2p, [1024, 8, 65536], repeats=3)
    assert other is None
    assert [size for size, _ in pairs] == [8, 1024, 65536]
    assert all(seconds > 0 for _, seconds in pairs)


@pytest.mark.timeout(10)
def test_the_fit_recovers_a_declared_link_from_its_exact_times_with_no_scatter():
    link = parlab.Link(latency=200e-6, bandwidth=100e6)  # what the emulated regime declares
    sizes = [2**k for k in range(10, 23, 2)]
    seconds = [link.time(D) for D in sizes]
    alpha, beta = fit_alpha_beta(sizes, seconds)
    assert alpha == pytest.approx(link.latency, rel=1e-9) and beta == pytest.approx(1 / link.bandwidth, rel=1e-9)
    alpha_error, beta_error = fit_errors(sizes, seconds, alpha, beta)
    assert alpha_error < 1e-9 * alpha and beta_error < 1e-9 * beta  # points on the line: no scatter


@pytest.mark.timeout(10)
def test_fit_errors_grow_with_the_scatter_and_cover_the_truth():
    alpha, beta = 2e-4, 1e-8
    sizes = [2**k for k in range(10, 23, 2)]
    wobble = [1.03, 0.98, 1.01, 0.97, 1.02, 0.99, 1.03]  # a few per cent, as a loaded machine gives
    errors = []
    for scale in (1, 2):
        seconds = [(alpha + D * beta) * (1 + scale * (w - 1)) for D, w in zip(sizes, wobble)]
        alpha_fit, beta_fit = fit_alpha_beta(sizes, seconds)
        errors.append(fit_errors(sizes, seconds, alpha_fit, beta_fit))
        assert abs(alpha_fit - alpha) <= 3 * errors[-1][0] and abs(beta_fit - beta) <= 3 * errors[-1][1]
    assert errors[1][0] == pytest.approx(2 * errors[0][0], rel=0.1)  # twice the scatter, twice the error
    assert errors[1][1] == pytest.approx(2 * errors[0][1], rel=0.1)
    with pytest.raises(ValueError, match="at least three points"):
        fit_errors([8, 16], [1e-5, 2e-5], 0.0, 1e-6)


@pytest.mark.timeout(60)
def test_ping_pong_keeps_each_sizes_fastest_round_in_increasing_size_and_fits_them(cluster2):
    measured = ping_pong(cluster2, [1024, 8, 1024, 65536], repeats=2, rounds=2)
    assert measured.sizes == [8, 1024, 65536] and len(measured.seconds) == 3 and min(measured.seconds) > 0
    assert (measured.alpha, measured.beta) == fit_alpha_beta(measured.sizes, measured.seconds)
    assert (measured.alpha_error, measured.beta_error) == fit_errors(measured.sizes, measured.seconds,
                                                                     measured.alpha, measured.beta)
    link = parlab.Link(latency=2e-3, bandwidth=1e9)
    with cluster2.emulate(link=link):
        measured = ping_pong(cluster2, [8, 4096, 65536], repeats=1, rounds=1)
    assert all(t >= link.time(D) for D, t in zip(measured.sizes, measured.seconds))  # never early
    with pytest.raises(ValueError, match="rounds must be a whole number >= 1"):
        ping_pong(cluster2, [8, 16], rounds=0)


@pytest.mark.timeout(10)
def test_ping_pong_in_several_regimes_takes_turns_round_by_round():
    # A stand-in cluster that records the regime of every call: each round must measure
    # every regime once, so that a burst of load cannot fall on one regime's rounds alone.
    class Recorder:
        def __init__(self):
            self.regime, self.calls = None, []

        @contextlib.contextmanager
        def emulate(self, link=None):
            previous, self.regime = self.regime, link
            try:
                yield self
            finally:
                self.regime = previous

        def run(self, fn, sizes, repeats):
            self.calls.append(self.regime)
            per_byte = 1e-9 if self.regime is None else 1 / self.regime.bandwidth
            return [[(size, 1e-5 + size * per_byte + 1e-6 * len(self.calls)) for size in sorted(sizes)], None]

    slow = parlab.Link(latency=1e-3, bandwidth=1e6)
    cluster = Recorder()
    fits = ping_pong(cluster, [8, 4096, 65536], rounds=3, links={"slow": slow, "real": None})
    assert cluster.calls == [slow, None] * 3
    assert set(fits) == {"slow", "real"}
    # each size's fastest round is kept: here the first, the calls getting slower one by one
    assert fits["slow"].seconds == [1e-5 + size / 1e6 + 1e-6 for size in (8, 4096, 65536)]
    assert fits["real"].beta == pytest.approx(1e-9) and fits["slow"].beta == pytest.approx(1e-6)
