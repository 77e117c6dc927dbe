"""Asynchronous, local and decentralised SGD on real ranks (2, 4, and 8 under emulated
devices), each against a one-process reference: exactly where the arithmetic is the same
operation for operation (gossip, the parameter server replayed from its log, synchronous
SGD with or without backups), within the numerics yardstick where sums run in another order
(local SGD against torch's PeriodicModelAverager at 4 and 8 ranks)."""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
from torch.distributed.optim import PostLocalSGDOptimizer

import parlab
from parlab import numerics, trace
from parlab.async_sgd import backup, gossip, local_sgd, parameter_server, theory
from parlab.trace import COMM

D = 5  # weights of the least-squares problems below
STRAGGLING = parlab.Devices(straggler=parlab.Straggler(factor=3, every=4))


@pytest.fixture(scope="module")
def cluster8():
    with parlab.Cluster(world_size=8, timeout=120, devices=STRAGGLING) as cluster:
        yield cluster


@pytest.fixture(params=[2, 4, 8])
def cluster(request):
    return request.getfixturevalue(f"cluster{request.param}")


def least_squares_gradient(w, worker, step):
    """The gradient at w of worker ``worker``'s ``step``-th batch, (1/m) A^T (A w - y): data
    drawn from a generator seeded by (worker, step), so a one-process replay recomputes it."""
    generator = torch.Generator().manual_seed(1000 * worker + step)
    A = torch.randn(8, w.numel(), generator=generator, dtype=w.dtype)  # (m, d)
    y = torch.randn(8, generator=generator, dtype=w.dtype)
    return A.T @ (A @ w - y) / 8


def rank_gradient(w, step):
    return least_squares_gradient(w, dist.get_rank(), step)


def initial_weights():
    return torch.linspace(-1, 1, D, dtype=torch.float64)


# --- gossip -----------------------------------------------------------------------------


def gossip_on_ranks(topology, steps, lr):
    N, rank = dist.get_world_size(), dist.get_rank()
    x = initial_weights() * (rank + 1)
    history = []
    for t in range(steps):
        W = gossip.mixing_matrix(topology, N, round=t)
        gossip.gossip_step(x, W, lambda v, t=t: least_squares_gradient(v, rank, t), lr)
        history.append(x.clone())
    return history


@pytest.mark.parametrize("topology", ["ring", "one-peer exponential"])
def test_gossip_steps_on_ranks_equal_one_process_mixing_exactly(cluster, topology):
    N, steps, lr = cluster.world_size, 3, 0.1
    timeline = cluster.trace(gossip_on_ranks, topology, steps, lr, timeout=60)
    xs = [initial_weights() * (r + 1) for r in range(N)]
    for t in range(steps):
        gradients = [least_squares_gradient(x, r, t) for r, x in enumerate(xs)]
        mixed = gossip.gossip_all(gossip.mixing_matrix(topology, N, round=t), xs)
        xs = [m - lr * g for m, g in zip(mixed, gradients)]
        for r in range(N):
            assert torch.equal(timeline.results[r][t], xs[r]), (topology, N, t, r)
    # the traffic: one message of D values to each neighbour per step, whatever N is
    per_step = min(2, N - 1) if topology == "ring" else 1  # at N = 2 both ring neighbours are one rank
    assert timeline.bytes_sent() == [steps * per_step * D * 8] * N


def gossip_with_a_marked_gradient():
    x = initial_weights() * (dist.get_rank() + 1)

    def gradient(v):
        with trace.span("gradient"):
            return least_squares_gradient(v, dist.get_rank(), 0)

    return gossip.gossip_step(x, gossip.ring(dist.get_world_size()), gradient, 0.1)


def test_a_gossip_step_starts_its_exchanges_before_the_gradient(cluster4):
    # The overlap is structural: every send and receive is posted before the gradient span
    # opens and waited for after it closes (what a blocking exchange first would not do).
    timeline = cluster4.trace(gossip_with_a_marked_gradient, timeout=60)
    for rank in range(4):
        (span,) = timeline.select(rank=rank, name="gradient")
        exchanges = [ev for ev in timeline.select(rank=rank, kind=COMM) if ev.name in ("isend", "irecv")]
        assert len(exchanges) == 4
        assert all(ev.start <= span.start and ev.end >= span.end for ev in exchanges), rank


# --- the parameter server -----------------------------------------------------------------


def replay(logs, lr, servers=1):
    """The weights a server's log says it computed, in one process: each applied gradient
    recomputed at the version it read (version - tau), from its worker's next batch."""
    versions, steps = [initial_weights()], {}
    for worker, tau in zip(logs[0].workers, logs[0].staleness):
        step = steps.get(worker, 0)
        steps[worker] = step + 1
        g = least_squares_gradient(versions[-1 - tau], worker, step)
        versions.append(versions[-1].clone().add_(g, alpha=-lr))
    return versions[-1]


def run_parameter_server(lr, updates, servers=(0,), order="arrival", bound=None, seconds=0.0):
    return parameter_server.parameter_server(initial_weights(), rank_gradient, lr, updates, servers, order, bound,
                                             seconds)


def test_cyclic_parameter_server_has_staleness_w_minus_1_and_replays_exactly(cluster):
    N = cluster.world_size
    logs = cluster.run(run_parameter_server, 0.05, 12, order="cyclic", timeout=60)
    workers = N - 1
    assert logs[0].staleness == [min(t, workers - 1) for t in range(12 + workers - 1)]
    assert logs[0].workers == [1 + t % workers for t in range(12 + workers - 1)]
    assert torch.equal(logs[0].weights, replay(logs, 0.05))
    for w in range(1, N):  # each worker learned its staleness from the replies
        assert logs[w].staleness == [tau for v, tau in zip(logs[0].workers, logs[0].staleness) if v == w]


def quadratic_on_ranks(gamma_mu, updates):
    # f = mu x^2 / 2 with mu = 1: the gradient is x itself, so the server's step is x - gamma mu x_{t - tau}
    log = parameter_server.parameter_server(torch.ones(1, dtype=torch.float64), lambda w, step: w, gamma_mu, updates,
                                            order="cyclic")
    return log.weights.item() if dist.get_rank() == 0 else None


def test_async_ranks_with_a_forced_delay_are_stable_just_below_the_threshold_and_not_above(cluster):
    tau = cluster.world_size - 2  # N_w = N - 1 workers served in turn: tau = N_w - 1
    threshold = theory.stability_threshold(tau)
    for factor, stable in ((0.98, True), (1.02, False)):
        ranks = cluster.run(quadratic_on_ranks, factor * threshold, 400, timeout=60)[0]
        simulated = theory.delayed_gd(factor * threshold, tau, 400 + tau)
        assert ranks == pytest.approx(simulated[-1], rel=1e-9)  # the same recurrence (python floats there)
        # the trajectory oscillates: judge its envelope, the last tau + 1 values
        envelope = max(abs(x) for x in simulated[-tau - 1:])
        assert (envelope < 0.5) == stable and (envelope > 1.5) == (not stable), (tau, factor, envelope)


def test_arrival_order_server_records_staleness_and_replays_exactly(cluster4):
    with cluster4.emulate(devices=parlab.Devices(slowdown={1: 4.0})):
        logs = cluster4.run(run_parameter_server, 0.05, 30, seconds=2e-3, timeout=60)
    assert 30 <= len(logs[0].staleness) <= 32
    assert max(logs[0].staleness) >= 1  # the slow worker's gradients arrive late
    assert torch.equal(logs[0].weights, replay(logs, 0.05))
    for w in (1, 2, 3):
        assert logs[w].staleness == [tau for v, tau in zip(logs[0].workers, logs[0].staleness) if v == w]


def clock_gaps(log, updates):
    """For each gradient applied before ``updates``: its worker's pushes applied before it
    minus the fewest of any worker's, i.e. how far ahead of the slowest it ran."""
    clocks, gaps = dict.fromkeys(sorted(set(log.workers)), 0), []
    for worker in log.workers[:updates]:
        gaps.append(clocks[worker] - min(clocks.values()))
        clocks[worker] += 1
    return gaps


def test_bounded_staleness_keeps_fast_workers_within_the_bound(cluster4):
    with cluster4.emulate(devices=parlab.Devices(slowdown={1: 10.0})):
        free = cluster4.run(run_parameter_server, 0.05, 24, seconds=2e-3, timeout=60)
        bounded = cluster4.run(run_parameter_server, 0.05, 24, bound=1, seconds=2e-3, timeout=60)
    assert max(clock_gaps(free[0], 24)) > 1  # without a bound the fast workers run ahead (10x faster)
    assert max(clock_gaps(bounded[0], 24)) <= 1
    assert torch.equal(bounded[0].weights, replay(bounded, 0.05))


def test_sharded_servers_apply_the_same_gradients_and_their_traffic_is_counted_exactly(cluster4):
    timeline = cluster4.trace(run_parameter_server, 0.05, 10, servers=(0, 1), order="cyclic", timeout=60)
    logs = timeline.results
    assert logs[0].workers == logs[1].workers and logs[0].staleness == logs[1].staleness == [0] + [1] * 10
    assert torch.equal(torch.cat([logs[0].weights, logs[1].weights]), replay(logs, 0.05))
    shards = (3, 2)  # chunk_bounds(5, 2)
    applied = len(logs[0].staleness)
    # each server: the first weights and one reply per applied gradient, [w_s, version, stop, tau]
    assert timeline.bytes_sent()[:2] == [(applied + 2) * (s + 3) * 8 for s in shards]
    # each worker: [g_s, version, kind] to both servers per push, then "leave" to server 1
    for w in (2, 3):
        pushes = logs[w].steps
        assert timeline.bytes_sent()[w] == pushes * (3 + 2 + 2 + 2) * 8 + (2 + 2) * 8


def test_parameter_server_refuses_bad_servers_saying_what_to_change(cluster2):
    with pytest.raises(parlab.RankError, match="servers must name 1 to N - 1 = 1 ranks"):
        cluster2.run(run_parameter_server, 0.1, 5, servers=(0, 1), timeout=30)


# --- synchronous SGD and backup workers ----------------------------------------------------


def run_synchronous(steps, use=None, seconds=0.0):
    return backup.synchronous_sgd(initial_weights(), rank_gradient, 0.05, steps, use, seconds)


def replay_synchronous(used, lr):
    w = initial_weights()
    for k, workers in enumerate(used):
        gradients = [least_squares_gradient(w, worker, k) for worker in workers]
        total = gradients[0].clone()
        for g in gradients[1:]:
            total += g
        w = w.clone().sub_(total / len(workers), alpha=lr)
    return w


def test_synchronous_sgd_equals_the_one_process_average_of_all_workers(cluster):
    N = cluster.world_size
    logs = cluster.run(run_synchronous, 4, timeout=60)
    assert logs[0].used == [list(range(1, N))] * 4
    assert torch.equal(logs[0].weights, replay_synchronous(logs[0].used, 0.05))
    assert all(counts.pushed == 4 and counts.abandoned == 0 for counts in logs[1:])


def test_backup_workers_use_the_first_n_and_the_late_ones_give_up(cluster):
    N = cluster.world_size
    logs = cluster.run(run_synchronous, 6, N - 2 if N > 2 else 1, backup.exponential_seconds(500), timeout=60)
    use = max(N - 2, 1)
    assert all(len(used) == use for used in logs[0].used)
    assert torch.equal(logs[0].weights, replay_synchronous(logs[0].used, 0.05))
    assert all(counts.pushed + counts.abandoned == 6 for counts in logs[1:])


# --- local SGD ------------------------------------------------------------------------------


def local_sgd_on_ranks(averager_name):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    averager = (local_sgd.PeriodicAverager(4, 2) if averager_name == "parlab"
                else PeriodicModelAverager(period=4, warmup_steps=2))
    optimizer = PostLocalSGDOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), averager)
    history = []
    for step in range(8):
        x, y = local_batch(dist.get_rank(), step)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        history.append(torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()]))
    return history


def local_batch(rank, step):
    generator = torch.Generator().manual_seed(100 * rank + step)
    return torch.randn(4, 3, generator=generator), torch.randn(4, 1, generator=generator)


def local_sgd_in_one_process(N, order):
    """The N replicas' local SGD in one process, averaged (each divided by N, then summed in
    ``order``) after optimizer steps 3 and 7."""
    models = []
    for _ in range(N):
        torch.manual_seed(0)
        models.append(torch.nn.Linear(3, 1))
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
    for step in range(8):
        for r, (model, optimizer) in enumerate(zip(models, optimizers)):
            x, y = local_batch(r, step)
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
        if step + 1 in (3, 7):
            flats = [torch.cat([p.detach().reshape(-1) for p in m.parameters()]) / N for m in models]
            total = flats[order[0]].clone()
            for r in order[1:]:
                total += flats[r]
            for model in models:
                torch.nn.utils.vector_to_parameters(total.clone(), model.parameters())
    return torch.cat([p.detach().reshape(-1) for p in models[0].parameters()])


def test_local_sgd_equals_torch_s_periodic_model_averager(cluster):
    N = cluster.world_size
    ours = cluster.run(local_sgd_on_ranks, "parlab", timeout=60)
    torchs = cluster.run(local_sgd_on_ranks, "torch", timeout=60)
    for step in range(8):  # replicas agree to the bit exactly after the averaging steps 3 and 7
        agree = all(torch.equal(ours[r][step], ours[0][step]) for r in range(N))
        assert agree == (step + 1 in (3, 7)), step
        assert all(torch.equal(torchs[r][step], torchs[0][step]) for r in range(N)) == agree
    if N == 2:  # a sum of two terms has one order: the same bits as torch's
        assert torch.equal(ours[0][-1], torchs[0][-1])
    reference = local_sgd_in_one_process(N, list(range(N)))
    decomposed = [local_sgd_in_one_process(N, order) for order in numerics.ring_orders(N)]
    numerics.assert_equivalent(ours[0][-1], reference, decomposed, "parlab's local SGD")
    numerics.assert_equivalent(torchs[0][-1], reference, decomposed, "torch's PeriodicModelAverager")


def test_local_sgd_all_reduces_only_at_the_averaging_steps(cluster4):
    timeline = cluster4.trace(local_sgd_on_ranks, "parlab", timeout=60)
    d, N = 4, 4  # Linear(3, 1): 3 weights and a bias; a ring moves 2 (N - 1) chunks of d / N = 1 value
    assert timeline.bytes_sent() == [2 * 2 * (N - 1) * (d // N) * 4] * N
