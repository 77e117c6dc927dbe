"""DiLoCo and Streaming DiLoCo on real ranks (2, 4 and 8), each against a one-process
reference that runs the N replicas one after another: H = 1 with SGD outer steps of lr 1 is
synchronous data parallelism; H > 1 with AdamW inside and Nesterov outside, and Streaming
DiLoCo's staggered, delayed, mixed fragments, equal the replicas simulated in one process
within the yardstick of the ring's summation orders; the bytes each rank sends per outer step
are the ring's 2 (N - 1)/N x the compressor's payload."""

import math

import pytest
import torch
import torch.distributed as dist

import parlab
from parlab import numerics
from parlab.async_sgd import local_sgd
from parlab.compression.compressors import FP16, Identity
from parlab.diloco import DiLoCo, costs, schedule

GAMMA = 0.1  # the inner learning rate


@pytest.fixture(params=[2, 4])
def cluster(request):
    return request.getfixturevalue(f"cluster{request.param}")


def make_model():
    """Four parameter tensors (W1 16, b1 4, W2 16, b2 4 elements), the same on every rank."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 4)).double()


def rank_loss(model, rank, step):
    """Replica ``rank``'s loss on its own batch ``step``."""
    generator = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(6, 4, generator=generator, dtype=torch.float64)
    y = torch.randn(6, 4, generator=generator, dtype=torch.float64)
    return (model(x) - y).pow(2).mean()


def make_inner(model, inner):
    if inner == "sgd":
        return torch.optim.SGD(model.parameters(), lr=GAMMA)
    return torch.optim.AdamW(model.parameters(), lr=GAMMA, weight_decay=0.01)


def on_ranks(steps, inner="sgd", variants=None):
    """Every variant {name: DiLoCo keyword arguments} trained from the same start on this rank's
    batches; returns {name: (global weights, this replica's weights)}, plus "ddp": SGD on
    gradients averaged every step."""
    rank, results = dist.get_rank(), {}
    for name, kwargs in (variants or {}).items():
        model = make_model()
        diloco = DiLoCo(make_inner(model, inner), **kwargs)
        for step in range(steps):
            rank_loss(model, rank, step).backward()
            diloco.step()
            diloco.zero_grad()
        diloco.wait()
        results[name] = ([w.clone() for w in diloco.global_parameters()], [p.detach() for p in model.parameters()])
    model = make_model()
    sgd = torch.optim.SGD(model.parameters(), lr=GAMMA)
    for step in range(steps):
        rank_loss(model, rank, step).backward()
        local_sgd.average_gradients(model.parameters())
        sgd.step()
        sgd.zero_grad()
    results["ddp"] = [p.detach() for p in model.parameters()]
    return results


def ddp_in_one_process(N, steps, order):
    """Synchronous data parallelism: SGD on the mean of the N replicas' gradients, summed in ``order``."""
    model = make_model()
    sgd = torch.optim.SGD(model.parameters(), lr=GAMMA)
    for step in range(steps):
        shards = [(r, step) for r in range(N)]
        numerics.backward_in_shards(lambda r, s: rank_loss(model, r, s), model.parameters(), shards, order)
        sgd.step()
    return [p.detach() for p in model.parameters()]


def diloco_in_one_process(N, steps, order, H, eta, nu, inner="sgd", F=1, tau=0, omega=0.0):
    """The N replicas one after another, each with its own inner optimizer, and the outer
    steps written out: fragment i (tensors i, i + F, ...) leaves after steps o_i + k H with
    o_i = (i + 1) H / F, its mean pseudo-gradient Delta (the replicas' summed in ``order``)
    is applied tau steps later as v <- nu v + Delta, w <- w - eta (Delta + nu v), and merged
    into each replica as omega w_r + (1 - omega) w."""
    replicas = [make_model() for _ in range(N)]
    inners = [make_inner(model, inner) for model in replicas]
    w = [p.detach().clone() for p in replicas[0].parameters()]
    v = [None] * len(w)
    sent = {}
    for step in range(1, steps + 1):
        for r, (model, optimizer) in enumerate(zip(replicas, inners)):
            rank_loss(model, r, step - 1).backward()
            optimizer.step()
            optimizer.zero_grad()
        for i in range(F):
            offset = (i + 1) * H // F
            tensors = range(i, len(w), F)
            if step >= offset and (step - offset) % H == 0:
                per_replica = [[w[j] - list(replicas[r].parameters())[j].detach() for j in tensors] for r in range(N)]
                sent[i] = [sum(per_replica[r][k] for r in order) / N for k in range(len(tensors))]
            if step - tau >= offset and (step - tau - offset) % H == 0:
                for j, delta in zip(tensors, sent.pop(i)):
                    if nu:
                        v[j] = delta.clone() if v[j] is None else nu * v[j] + delta
                        w[j] = w[j] - eta * (delta + nu * v[j])
                    else:
                        w[j] = w[j] - eta * delta
                    for model in replicas:
                        p = list(model.parameters())[j]
                        with torch.no_grad():
                            p.copy_(omega * p + (1 - omega) * w[j])
    return w, [[p.detach() for p in model.parameters()] for model in replicas]


def check_against_one_process(results, reference_of, N, what):
    """Every rank's result within the rounding band of the one-process reference summed in
    the natural order, the yardstick taken over the ring's orders."""
    reference = reference_of(list(range(N)))
    decomposed = [reference_of(order) for order in numerics.ring_orders(N)]

    def both(weights, rank):  # the global weights and replica ``rank``'s as one list of tensors
        return [*weights[0], *weights[1][rank]]

    for rank, (w, replica) in enumerate(results):
        numerics.assert_equivalent([*w, *replica], both(reference, rank), [both(d, rank) for d in decomposed],
                                   f"{what}, rank {rank}")


@pytest.mark.parametrize("N", [2, 4, 8])
def test_one_inner_step_and_outer_sgd_of_lr_1_is_synchronous_data_parallelism(request, N):
    cluster = request.getfixturevalue(f"cluster{N}")
    steps = 3
    plain = {"h1": dict(inner_steps=1, outer_lr=1.0, outer_momentum=0.0)}
    results = cluster.run(on_ranks, steps, "sgd", plain, timeout=120)
    reference = ddp_in_one_process(N, steps, list(range(N)))
    # the band: how far DiLoCo's arithmetic (w - (w - gamma g), summed in the ring's orders) strays from DDP's
    decomposed = [diloco_in_one_process(N, steps, order, H=1, eta=1.0, nu=0.0)[0] for order in numerics.ring_orders(N)]
    for rank, result in enumerate(results):
        numerics.assert_equivalent(result["h1"][0], reference, decomposed, f"DiLoCo H = 1, rank {rank}")
        numerics.assert_equivalent(result["ddp"], reference, decomposed, f"DDP, rank {rank}")
    # and a real difference is far outside it: one SGD step less
    band = numerics.rounding_band(reference, decomposed)[0]
    assert numerics.max_abs_difference(ddp_in_one_process(N, steps - 1, list(range(N))), reference) > 1e6 * band


def test_diloco_with_adamw_inside_and_nesterov_outside_equals_the_replicas_in_one_process(cluster):
    N, steps, H = cluster.world_size, 7, 3  # two outer steps and one inner step after them
    streaming = dict(inner_steps=H, fragments=1, delay=0, mixing=0.0, compressor=Identity())
    variants = {"diloco": dict(inner_steps=H), "streaming, F = 1, tau = 0": streaming}
    results = cluster.run(on_ranks, steps, "adamw", variants, timeout=60)
    check_against_one_process([result["diloco"] for result in results],
                              lambda order: diloco_in_one_process(N, steps, order, H, 0.7, 0.9, "adamw"), N,
                              "DiLoCo (global weights, replica)")
    for result in results:  # Streaming DiLoCo reduced to one fragment, no delay, no quantiser is DiLoCo
        for streaming, plain in zip(result["streaming, F = 1, tau = 0"], result["diloco"]):
            assert all(torch.equal(a, b) for a, b in zip(streaming, plain))


def test_streaming_diloco_equals_the_same_schedule_in_one_process(cluster):
    N, steps, H, F, tau, omega = cluster.world_size, 11, 4, 2, 1, 0.5
    variants = {"streaming": dict(inner_steps=H, fragments=F, delay=tau, mixing=omega)}
    results = cluster.run(on_ranks, steps, "sgd", variants, timeout=60)
    check_against_one_process([result["streaming"] for result in results],
                              lambda order: diloco_in_one_process(N, steps, order, H, 0.7, 0.9, F=F, tau=tau,
                                                                  omega=omega), N,
                              "Streaming DiLoCo (global weights, replica)")


def outer_traffic(H, F, tau, compressor):
    model = make_model()
    diloco = DiLoCo(make_inner(model, "sgd"), H, fragments=F, delay=tau, compressor=compressor)
    for step in range(H):
        rank_loss(model, dist.get_rank(), step).backward()
        diloco.step()
        diloco.zero_grad()
    diloco.wait()


@pytest.mark.parametrize("compressor", [Identity(), FP16()], ids=["fp64", "fp16"])
def test_bytes_per_outer_step_are_the_rings_share_of_the_payload(cluster, compressor):
    N, H, F = cluster.world_size, 4, 2
    timeline = cluster.trace(outer_traffic, H, F, 1, compressor, timeout=60)  # H steps: each fragment sent once
    fragments = schedule.strided_fragments(list(make_model().parameters()), F)  # 32 and 8 elements: N divides both
    payload = sum(compressor.bytes(torch.cat([p.detach().reshape(-1) for p in fragment])) for fragment in fragments)
    assert payload == (8 if isinstance(compressor, Identity) else 2) * 40
    assert timeline.bytes_sent() == [2 * (N - 1) * payload // N] * N


def test_learner_mistakes_are_refused_with_what_to_change():
    model = make_model()
    sgd = make_inner(model, "sgd")
    with pytest.raises(ValueError, match="fragments=4 or fewer"):
        DiLoCo(sgd, 8, fragments=5)
    with pytest.raises(ValueError, match="must be below inner_steps"):
        DiLoCo(sgd, 4, delay=4)
    with pytest.raises(ValueError, match="pass a number below 1"):
        DiLoCo(sgd, 4, mixing=1.0)
    with pytest.raises(ValueError, match="pass fragments <= inner_steps"):
        DiLoCo(sgd, 2, fragments=3)
    with pytest.raises(ValueError, match="must be a torch optimizer"):
        DiLoCo(model, 4)


def test_the_staggered_schedule():
    assert schedule.sync_offsets(8, 4) == [2, 4, 6, 8] and schedule.sync_offsets(5, 1) == [5]
    starts = {s: schedule.due(s, 8, 4) for s in range(1, 17)}
    assert [s for s, due in starts.items() if due] == [2, 4, 6, 8, 10, 12, 14, 16]
    assert starts[10] == [0] and schedule.due(11, 8, 4, delay=1) == [0]


def test_the_step_model_and_the_crossover_agree():
    link = parlab.Link(latency=0.03, bandwidth=10e6)
    P, N, t_c, H = 4 * 2**18, 4, 0.02, 8
    ring = 2 * (N - 1) * 0.03 + 2 * (N - 1) / N * P / 10e6
    assert costs.seconds_per_step("ddp", link, t_c, P, N) == pytest.approx(t_c + ring)
    assert costs.seconds_per_step("diloco", link, t_c, P, N, H) == pytest.approx(t_c + ring / H)
    assert costs.seconds_per_step("streaming", link, t_c, P, N, H, 1, 0) == costs.seconds_per_step(
        "diloco", link, t_c, P, N, H)
    # at the crossover bandwidth, 40 DDP steps and 100 DiLoCo steps take the same time
    bandwidth = costs.crossover(40, 100, H, P, N, t_c, 0.001)
    at = parlab.Link(latency=0.001, bandwidth=bandwidth)
    assert 40 * costs.seconds_per_step("ddp", at, t_c, P, N) == pytest.approx(
        100 * costs.seconds_per_step("diloco", at, t_c, P, N, H))
    assert costs.crossover(40, 100, H, P, N, t_c, 0.03) == math.inf  # 30 ms alone makes DiLoCo sooner
    assert costs.crossover(40, 400, H, P, N, t_c, 0.001) == 0.0
    points = [(0, 1.0), (8, 0.5), (16, 0.2)]
    assert costs.wall_time_to_loss(points, 0.3, "diloco", link, t_c, P, N, H) == pytest.approx(
        16 * (t_c + ring / H))
    assert costs.wall_time_to_loss(points, 0.1, "diloco", link, t_c, P, N, H) is None
