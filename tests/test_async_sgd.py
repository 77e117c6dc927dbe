"""Asynchronous, local and decentralised SGD on real ranks (2, 4, and 8 under emulated
devices), each against a one-process reference: exactly where the arithmetic is the same
operation for operation (gossip, the parameter server replayed from its log, synchronous
SGD with or without backups), within the numerics yardstick where sums run in another order
(local SGD against torch's PeriodicModelAverager at 4 and 8 ranks)."""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import PostLocalSGDState, post_localSGD_hook
from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
from torch.distributed.optim import PostLocalSGDOptimizer
from torch.nn.parallel import DistributedDataParallel

import parlab
from parlab import numerics, trace
from parlab.async_sgd import backup, gossip, local_sgd, parameter_server, theory, training
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


def recorded_server(seconds, updates):
    return parameter_server.parameter_server(initial_weights(), rank_gradient, 0.05, updates, seconds=seconds,
                                             record=True)


def test_server_periods_are_each_worker_s_time_between_its_gradients(cluster4):
    log = parameter_server.ServerLog(torch.zeros(1), workers=[1, 2, 1, 2, 1, 3],
                                     history=[(t, None) for t in (0.0, 0.1, 0.3, 0.2, 0.6, 0.7)])
    assert log.periods() == pytest.approx({1: 0.3, 2: 0.1})  # worker 3 applied one gradient: no period
    with cluster4.emulate(devices=parlab.Devices(slowdown={1: 3.0})):
        periods = cluster4.run(recorded_server, 0.01, 60, timeout=60)[0].periods()
    assert sorted(periods) == [1, 2, 3] and periods[1] >= 0.03  # worker 1 computes 3 x 10 ms
    assert all(0.01 <= periods[w] < 0.03 for w in (2, 3))  # the fast ones never wait for it
    with pytest.raises(ValueError, match="record=True"):
        cluster4.run(run_parameter_server, 0.05, 5, timeout=60)[0].periods()


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


def test_a_backup_worker_run_at_the_same_n_leaves_the_other_ranks_out_and_follows_its_draws(cluster4):
    # N = 2, e = 0 on workers 1 and 2 (rank 3 sits out), then N = 2, e = 1 on 1, 2 and 3: one
    # cluster compares the same batch with and without a backup, as Chen et al. 2016 do
    # draws at 10 per second (100 ms apart on average): far more than a busy machine delays a step
    draws = {r: backup.exponential_seconds(10, seed=3, rank=r) for r in (1, 2, 3)}
    for workers in ([1, 2], [1, 2, 3]):
        logs = cluster4.run(backup.synchronous_sgd, initial_weights(), rank_gradient, 0.05, 5, 2,
                            backup.exponential_seconds(10, seed=3), workers=workers, timeout=60)
        assert [log is None for log in logs[1:]] == [r not in workers for r in (1, 2, 3)]
        assert all(len(used) == 2 for used in logs[0].used)
        assert torch.equal(logs[0].weights, replay_synchronous(logs[0].used, 0.05))
        drawn = backup.drawn_step_seconds([draws[w] for w in workers], 2, 5)
        assert all(step >= seconds for step, seconds in zip(logs[0].step_seconds, drawn))  # no step beats its draw
        # the used workers are the two whose draws were smallest, where the second and third
        # draws lie further apart than that step ran late (the machine's own delay, measured)
        checked = 0
        for k, (used, step, seconds) in enumerate(zip(logs[0].used, logs[0].step_seconds, drawn)):
            ordered = sorted(workers, key=lambda w: draws[w](k))
            if len(ordered) > 2 and draws[ordered[2]](k) - draws[ordered[1]](k) <= step - seconds:
                continue
            assert used == sorted(ordered[:2]), k
            checked += 1
        assert checked >= 1, "every step ran later than its draws lie apart: nothing was checked"
    with pytest.raises(parlab.RankError, match="leave the server out of workers"):
        cluster4.run(backup.synchronous_sgd, initial_weights(), rank_gradient, 0.05, 1, workers=[0, 1], timeout=60)


def test_drawn_step_seconds_is_the_use_th_smallest_draw_of_each_step():
    draws = [lambda k: [3, 1][k], lambda k: [1, 5][k], lambda k: [2, 2][k]]
    assert backup.drawn_step_seconds(draws, 1, 2) == [1, 1]
    assert backup.drawn_step_seconds(draws, 2, 2) == [2, 2]
    assert backup.drawn_step_seconds(draws, 3, 2) == [3, 5]
    with pytest.raises(ValueError, match="use = 4 gradients per step needs as many workers"):
        backup.drawn_step_seconds(draws, 4, 2)


# --- local SGD ------------------------------------------------------------------------------


def local_sgd_on_ranks(engine, synchronous_warmup=False):
    """Local SGD for 8 steps, H = 4 after 2 warm-up steps, with parlab's averager or torch's
    ``PeriodicModelAverager``. ``synchronous_warmup``: post-local SGD, the warm-up's gradients
    all-reduced, by ``average_gradients`` or by torch's DDP with ``post_localSGD_hook`` (each
    rank its own node: a subgroup of one)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    forward = model
    if engine == "torch":
        averager = PeriodicModelAverager(period=4, warmup_steps=2)
        if synchronous_warmup:
            subgroup, _ = dist.new_subgroups(group_size=1)
            forward = DistributedDataParallel(model)
            forward.register_comm_hook(PostLocalSGDState(None, subgroup, start_localSGD_iter=2), post_localSGD_hook)
    else:
        averager = local_sgd.PeriodicAverager(4, 2)
    optimizer = PostLocalSGDOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), averager)
    history = []
    for step in range(8):
        x, y = local_batch(dist.get_rank(), step)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(forward(x), y).backward()
        if synchronous_warmup and engine == "parlab" and averager.in_warmup:
            local_sgd.average_gradients(model.parameters())
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


def test_post_local_sgd_s_warm_up_is_synchronous_as_torch_s_hook_makes_it(cluster):
    if cluster.world_size == 8:
        pytest.skip("DDP's own threads on 8 ranks of 2 cores: 2 and 4 ranks show it")
    N = cluster.world_size
    ours = cluster.run(local_sgd_on_ranks, "parlab", True, timeout=60)
    torchs = cluster.run(local_sgd_on_ranks, "torch", True, timeout=60)
    for step in range(8):  # identical replicas after the two warm-up steps and the averagings after 3 and 7
        agree = all(torch.equal(ours[r][step], ours[0][step]) for r in range(N))
        assert agree == (step + 1 in (1, 2, 3, 7)), step
        assert all(torch.equal(torchs[r][step], torchs[0][step]) for r in range(N)) == agree
    band = 64 * torch.finfo(torch.float32).eps * ours[0][-1].abs().max().item()  # sums in other orders, 8 steps
    assert (ours[0][-1] - torchs[0][-1]).abs().max().item() <= band
    if N == 2:  # a sum of two terms has one order: the same bits as torch's
        assert torch.equal(ours[0][-1], torchs[0][-1])


def test_average_gradients_all_reduces_the_gradients_once(cluster4):
    def run():
        model = torch.nn.Linear(3, 1)
        for p in model.parameters():
            p.grad = torch.full_like(p, float(dist.get_rank()))
        local_sgd.average_gradients(model.parameters())
        return [p.grad.clone() for p in model.parameters()]

    timeline = cluster4.trace(run, timeout=60)
    assert all(torch.equal(g, torch.full_like(g, 1.5)) for grads in timeline.results for g in grads)
    assert timeline.bytes_sent() == [2 * 3 * 1 * 4] * 4  # one ring of d = 4 values: 2 (N - 1) chunks of 1


def test_the_averager_is_in_its_warm_up_for_warmup_steps_calls():
    averager = local_sgd.PeriodicAverager(4, 2)
    warm = []
    for _ in range(4):
        warm.append(averager.in_warmup)
        averager.step += 1
    assert warm == [True, True, False, False]


def test_longest_waits_find_where_fast_ranks_wait_for_a_slow_one(cluster4):
    # t_c = 100 ms and rank 3 five times slower: a fast rank waits 4 t_c (400 ms) for rank 3's gradient,
    # so the split at 2 t_c leaves 200 ms each side for a busy machine's late wake-ups (CI once saw 100 ms)
    problem = training.LeastSquares(d=8, seconds=0.1)
    with cluster4.emulate(link=parlab.Link(latency=1e-3, bandwidth=1e9), devices=parlab.Devices(slowdown={3: 5.0})):
        timeline = cluster4.trace(training.train, "sync", problem, 3, timeout=60)
    waits = training.longest_waits(timeline.window("step"))
    assert [rank for rank, *_ in waits] == [0, 1, 2, 3]
    for rank, op, k, peer, seconds in waits:
        assert op in ("send", "isend", "recv", "irecv") and k >= 1 and peer in range(4)
        if rank != 3:
            assert seconds >= 0.2, (rank, op, k, seconds)
    assert waits[3][4] < 0.2  # rank 3 itself waits for nobody that long


def test_a_send_completed_during_a_receive_is_not_counted_as_a_second_wait():
    # a ring step: post the send, receive (blocked on the slow rank), then wait for the send,
    # which gloo had completed meanwhile: the wait is the receive's (times in ns)
    ms = 1_000_000
    events = [(0, COMM, "isend", 25 * ms, 67 * ms, 1, 8, None, None),
              (0, COMM, "recv", 27 * ms, 66 * ms, 3, 8, None, None),
              (1, COMM, "recv", 20 * ms, 25 * ms, 0, 8, None, None),
              (1, COMM, "isend", 21 * ms, 60 * ms, 2, 8, None, None)]
    timeline = trace.Timeline(events, 2)
    waits = training.longest_waits(timeline)
    assert [(rank, op, k, peer) for rank, op, k, peer, _ in waits] == [(0, "recv", 1, 3), (1, "isend", 1, 2)]
    assert [seconds for *_, seconds in waits] == pytest.approx([0.039, 0.035])
    # rank 1 waited 5 ms in its receive (started at 20 ms), then 35 ms more for its send (at 21 ms)
    assert training.waited_before(timeline, 0.0205) == pytest.approx([0.0, 0.005])
    assert training.waited_before(timeline, 0.028) == pytest.approx([0.039 + 0.001, 0.040])
