"""Graded: a gossip step on a ring, a parameter-server worker that records staleness, and
backup workers' aggregation (``async_sgd.py``).

Gossip values are integers, so every order of the sum is exact; the one freedom left is
dividing by 3 or multiplying by 1/3, which differ by at most an ulp or two (the band below).
A wrong value is compared with the classic wrong steps (a neighbour or x_r left out, / 2, the
gradient's sign or point) so the reason names the likely mistake. The worker runs against
parlab's own server (``parlab.async_sgd.parameter_server.serve``), whose log a one-process
replay turns into the weights exactly: a push with the wrong version, gradient or layout
changes them.
"""

import pytest
import torch
import torch.distributed as dist

from parlab.async_sgd import gossip
from parlab.async_sgd.parameter_server import serve

RUN_TIMEOUT_S = 10
WORLD_SIZES = [2, 3, 4]
D = 6


def ranks(world_size):
    return f"{world_size} ranks"


def start_values(rank):
    return torch.arange(D, dtype=torch.float32) * (rank + 1) + 3 * rank  # (D,) integers, different on every rank


def rank_gradient(x):
    return x * 0.5 + dist.get_rank()


def gossip_on_rank(step, with_gradient):
    x = start_values(dist.get_rank())
    out = step(x, rank_gradient, 0.25) if with_gradient else step(x)
    return out is x, x


def check_gossip(cluster, impl, with_gradient):
    N = cluster.world_size
    results = cluster.run(gossip_on_rank, impl.gossip_ring_step, with_gradient, timeout=RUN_TIMEOUT_S)
    before = [start_values(r) for r in range(N)]
    expected = gossip.gossip_all(gossip.ring(N), before)
    if with_gradient:
        expected = [m - 0.25 * (x * 0.5 + r) for r, (m, x) in enumerate(zip(expected, before))]
    got = [x for _, x in results]
    assert all(same for same, _ in results), "return the tensor x you were given, updated in place"
    band = 8 * torch.finfo(torch.float32).eps * max(e.abs().max().item() for e in expected)  # / 3 or * (1/3)
    mean_before, mean_after = torch.stack(before).mean(0), torch.stack(got).mean(0)
    if not with_gradient and not torch.allclose(mean_after, mean_before, rtol=0, atol=band):
        mistake = likely_gossip_mistake(got[0], before, 0, with_gradient, band)
        pytest.fail(f"{N} ranks: the mean over ranks changed from {numbers(mean_before)} to {numbers(mean_after)}: "
                    "a gossip step must keep it, so the weights of x_(r-1), x_r and x_(r+1) must sum to 1 "
                    f"(1/3 each); {mistake or 'check your weights'}")
    for r in range(N):
        if not (got[r] - expected[r]).abs().max().item() <= band:
            mistake = likely_gossip_mistake(got[r], before, r, with_gradient, band)
            pytest.fail(f"{N} ranks: rank {r} holds {numbers(got[r])}, expected {numbers(expected[r])} "
                        f"(x_r <- (x_(r-1) + x_r + x_(r+1)) / 3{' - lr g(x_r)' if with_gradient else ''}, "
                        f"the neighbours' values from before the step){': ' + mistake if mistake else ''}")


def numbers(tensor):
    """A tensor's values as a learner reads them: [3.667, 7, 10.33], not float32's 3.6666667461395264."""
    return "[" + ", ".join(f"{value:.4g}" for value in tensor.tolist()) + "]"


def likely_gossip_mistake(got, before, r, with_gradient, band):
    """The classic mistake that gives rank r's ``got`` from the values ``before`` the step, in
    words, or None. Each candidate is a wrong gossip step computed here."""
    N = len(before)
    x, left, right = before[r], before[(r - 1) % N], before[(r + 1) % N]
    mixed = (left + x + right) / 3

    def gradient(v):
        return v * 0.5 + r

    def step(m):
        return m - 0.25 * gradient(x) if with_gradient else m

    candidates = [("your x is unchanged: write the result into x, in place", x)]
    if N == 2:
        candidates.append(("at N = 2 both neighbours are the same rank: count its value twice, "
                           "(2 x_other + x_r) / 3", step((left + x) / 2)))
    candidates += [
        ("your own x_r is left out: average x_(r-1), x_r and x_(r+1)", step((left + right) / 2)),
        ("only x_(r-1) is averaged in: receive from both neighbours, r - 1 and r + 1 mod N", step((left + x) / 2)),
        ("only x_(r+1) is averaged in: receive from both neighbours, r - 1 and r + 1 mod N", step((x + right) / 2)),
        ("the sum of three values is divided by 2: divide by 3", step((left + x + right) / 2)),
    ]
    if with_gradient:
        candidates += [
            ("the gradient step is missing: subtract lr * gradient(x)", mixed),
            ("the gradient step is added: subtract lr * gradient(x)", mixed + 0.25 * gradient(x)),
            ("the gradient is taken at the mixed x: call gradient(x) on the x you were given, before mixing "
             "(that also lets it overlap the messages)", mixed - 0.25 * gradient(mixed)),
        ]
    return next((words for words, wrong in candidates if (got - wrong).abs().max().item() <= band), None)


@pytest.mark.task("gossip_ring_step")
class TestGossipRingStep:
    @pytest.mark.points(1)
    @pytest.mark.parametrize("cluster", WORLD_SIZES, indirect=True, ids=ranks)
    def test_averages_with_both_neighbours_and_keeps_the_mean(self, cluster, impl):
        check_gossip(cluster, impl, with_gradient=False)

    @pytest.mark.points(1)
    @pytest.mark.parametrize("cluster", [3, 4], indirect=True, ids=ranks)
    def test_subtracts_the_gradient_at_the_old_x(self, cluster, impl):
        check_gossip(cluster, impl, with_gradient=True)

    @pytest.mark.points(1)
    @pytest.mark.parametrize("cluster", [2, 4], indirect=True, ids=ranks)
    def test_sends_one_message_to_each_neighbour(self, cluster, impl):
        N = cluster.world_size
        timeline = cluster.trace(gossip_on_rank, impl.gossip_ring_step, True, timeout=RUN_TIMEOUT_S)
        messages = min(2, N - 1)
        sent = timeline.bytes_sent()
        assert sent == [messages * D * 4] * N, (
            f"{N} ranks: each rank sent {sent} bytes; a ring step sends x ({D * 4} bytes) once to each of its "
            f"{messages} distinct neighbours, through parlab.p2p")


def worker_run(worker_loop, updates):
    rank = dist.get_rank()
    if rank == 0:
        return serve(torch.zeros(D, dtype=torch.float64), list(range(1, dist.get_world_size())), 0.1, updates)

    def gradient(w, step):
        return least_squares_gradient(w, rank, step)

    return worker_loop(gradient, D, torch.float64, 0)


def least_squares_gradient(w, worker, step):
    generator = torch.Generator().manual_seed(100 * worker + step)
    A = torch.randn(4, D, generator=generator, dtype=torch.float64)  # (m, d)
    y = torch.randn(4, generator=generator, dtype=torch.float64)
    return A.T @ (A @ w - y) / 4


def replayed_weights(log):
    versions, steps = [torch.zeros(D, dtype=torch.float64)], {}
    for worker, tau in zip(log.workers, log.staleness):
        step = steps.get(worker, 0)
        steps[worker] = step + 1
        g = least_squares_gradient(versions[-1 - tau], worker, step)
        versions.append(versions[-1].clone().add_(g, alpha=-0.1))
    return versions[-1]


@pytest.mark.task("parameter_server_worker")
class TestParameterServerWorker:
    @pytest.mark.points(1)
    @pytest.mark.parametrize("cluster", [3, 4], indirect=True, ids=ranks)
    def test_pushes_the_gradient_of_the_version_it_read(self, cluster, impl):
        log = cluster.run(worker_run, impl.parameter_server_worker, 12, timeout=RUN_TIMEOUT_S)[0]
        assert torch.equal(log.weights, replayed_weights(log)), (
            "the server's weights differ from its log's replay: push [g, v, GRADIENT] with g = gradient(w, step) "
            "computed at the weights w of version v you received, and step counting your own gradients from 0")

    @pytest.mark.points(1)
    @pytest.mark.parametrize("cluster", [3, 4], indirect=True, ids=ranks)
    def test_records_the_staleness_of_each_gradient(self, cluster, impl):
        results = cluster.run(worker_run, impl.parameter_server_worker, 12, timeout=RUN_TIMEOUT_S)
        log = results[0]
        for w in range(1, cluster.world_size):
            expected = [tau for worker, tau in zip(log.workers, log.staleness) if worker == w]
            assert results[w] == expected, (
                f"worker {w} recorded staleness {results[w]}, the server applied its gradients with {expected}: "
                "tau = (the reply's version - 1) - the version the gradient was computed at, one per push")


@pytest.mark.task("first_n_average")
class TestFirstNAverage:
    ARRIVALS = [(3, 4, torch.tensor([8.0])), (1, 5, torch.tensor([2.0])), (4, 5, torch.tensor([6.0])),
                (2, 4, torch.tensor([100.0])), (2, 5, torch.tensor([10.0])), (3, 5, torch.tensor([40.0]))]

    @pytest.mark.points(1)
    def test_uses_the_first_n_gradients_of_this_step(self, impl):
        mean, workers = impl.first_n_average(self.ARRIVALS, 3, 5)
        assert workers == [1, 2, 4], f"used workers {workers}: the first 3 gradients computed at step 5 are 1, 4, 2"
        assert torch.equal(mean, torch.tensor([6.0])), f"mean {mean.tolist()}, expected (2 + 10 + 6) / 3 = [6.0]"

    @pytest.mark.points(1)
    def test_drops_late_gradients_and_refuses_too_few(self, impl):
        mean, workers = impl.first_n_average(self.ARRIVALS, 2, 4)
        assert workers == [2, 3] and torch.equal(mean, torch.tensor([54.0])), (
            f"step 4 with N = 2 used {workers}, mean {mean.tolist()}; expected workers [2, 3], mean [54.0]")
        with pytest.raises(ValueError):
            impl.first_n_average(self.ARRIVALS, 5, 5)
