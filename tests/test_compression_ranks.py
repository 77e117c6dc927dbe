"""parlab.compression on real ranks (2 and 4): each compressor's aggregate is the mean of the
ranks' reconstructions and its traced bytes are exactly the formulas; the DDP hooks in
parlab's DDP and in torch's (identity = plain DDP exactly, FP16 = torch's
fp16_compress_hook within fp16 rounding, PowerSGD's sizes = torch's compression_stats); what
torch's own hooks do on CPU/gloo today; signSGD's majority vote stalls on a convex problem
where error feedback converges."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from parlab import trace
from parlab.bench.compression_experiments import SIGN_METHODS, sign_descent, torch_hooks_on_gloo
from parlab.collectives import ring_all_reduce
from parlab.compression import (
    BF16,
    FP8,
    FP16,
    QSGD,
    ErrorFeedback,
    Identity,
    PowerSGD,
    RandK,
    ScaledSign,
    SignSGD,
    TernGrad,
    TopK,
    parlab_hook,
    torch_hook,
)
from parlab.ddp import DDP

D, K = 48, 4  # 2 and 4 divide both: the ring's chunks are even and the formulas exact
COMPRESSORS = {
    "Identity": Identity, "FP16": FP16, "BF16": BF16, "FP8": FP8, "RandK": lambda: RandK(K, seed=3),
    "TopK": lambda: TopK(K), "QSGD": lambda: QSGD(4), "TernGrad": TernGrad, "ScaledSign": ScaledSign,
    "SignSGD": SignSGD,
    "PowerSGD": lambda: PowerSGD(2, min_compression_rate=1), "EF(TopK)": lambda: ErrorFeedback(TopK(K)),
}


def cluster_of(world_size, request):
    return request.getfixturevalue(f"cluster{world_size}")


def gradient(rank):
    return torch.randn(D, generator=torch.Generator().manual_seed(100 + rank)).view(8, 6)


def aggregate_each(names):
    """On every rank: each compressor's (mean, own) in a span of its own, and every rank's
    gradient (to compute the expected mean)."""
    out = {}
    for name in names:
        compressor = COMPRESSORS[name]()
        with trace.span(name):
            out[name] = compressor.aggregate(gradient(dist.get_rank()))
    return out


def traced_sent(timeline, span):
    return timeline.window(span, 0).bytes_sent()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [2, 4])
def test_aggregate_is_the_mean_of_the_reconstructions_and_its_traffic_the_formula(world_size, request):
    names = list(COMPRESSORS)
    timeline = cluster_of(world_size, request).trace(aggregate_each, names)
    N, x = world_size, gradient(0)
    formulas = {
        "Identity": 2 * (N - 1) * 4 * D // N, "FP16": 2 * (N - 1) * 2 * D // N, "BF16": 2 * (N - 1) * 2 * D // N,
        "RandK": 2 * (N - 1) * 4 * K // N, "TopK": (N - 1) * K * (4 + 8), "QSGD": (N - 1) * (4 + D),
        "TernGrad": (N - 1) * (4 + D), "ScaledSign": (N - 1) * (4 + D), "FP8": (N - 1) * (4 + D),
        "SignSGD": 2 * (N - 1) * D // N,
        "PowerSGD": 2 * (N - 1) * 4 * (8 + 6) * 2 // N, "EF(TopK)": (N - 1) * K * (4 + 8),
    }
    for name in names:
        assert traced_sent(timeline, name) == [formulas[name]] * N, name
        assert COMPRESSORS[name]().sent_bytes(x, N) == [formulas[name]] * N, name
    means = [{name: result[0] for name, result in rank.items()} for rank in timeline.results]
    owns = {name: [rank[name][1] for rank in timeline.results] for name in names}
    for name in names:
        assert all(torch.equal(means[r][name], means[0][name]) for r in range(N)), f"{name}: the ranks differ"
    eps = torch.finfo(torch.float32).eps
    for name in ("Identity", "TopK", "RandK", "QSGD", "TernGrad", "ScaledSign", "FP8", "EF(TopK)"):
        expected = sum(owns[name]) / N
        # the ring sums in other orders than this sum (at most N - 1 roundings of the sum of
        # magnitudes) and random-k scales by d/k after the sum instead of before (two more)
        band = (N + 1) * eps * sum(own.abs() for own in owns[name]) / N
        assert ((means[0][name] - expected).abs() <= band).all(), name
    assert torch.equal(means[0]["SignSGD"], sum(owns["SignSGD"]).sign())
    assert torch.equal(means[0]["TopK"] != 0, sum(own != 0 for own in owns["TopK"]) > 0)


def train(steps, hook=None, engine="parlab", all_reduce=None, seed=0):
    """An MLP 16-16-4 trained with SGD on each rank's shard; returns its parameters after
    ``steps`` (and with a PowerSGD torch hook, torch's state)."""
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))
    if engine == "parlab":
        model = DDP(net, comm_hook=hook, all_reduce=all_reduce)
    else:
        model = nn.parallel.DistributedDataParallel(net)
        if hook is not None:
            model.register_comm_hook(*hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(7 + dist.get_rank())
    for _ in range(steps):
        x = torch.randn(8, 16, generator=generator)
        loss = (model(x) - x[:, :4]).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        if engine == "parlab":
            model.finish_gradient_synchronization()
        optimizer.step()
    return [p.detach().clone() for p in net.parameters()]


def identity_runs():
    return {
        "parlab ring": train(4, all_reduce=ring_all_reduce),
        "parlab identity hook": train(4, hook=parlab_hook(Identity())),
        "torch": train(4, engine="torch"),
        "torch identity hook": train(4, engine="torch", hook=torch_hook(Identity())),
    }


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [2, 4])
def test_the_identity_compressor_is_plain_ddp_exactly(world_size, request):
    for runs in cluster_of(world_size, request).run(identity_runs):
        # the same ring, the same division by N: bit for bit
        assert all(map(torch.equal, runs["parlab identity hook"], runs["parlab ring"]))
        if world_size == 2:  # two ranks' sum a + b is one rounding in any order: torch's gloo sum too
            assert all(map(torch.equal, runs["torch identity hook"], runs["torch"]))


def fp16_runs():
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return {
        "torch fp16 hook": train(6, engine="torch", hook=(None, default_hooks.fp16_compress_hook)),
        "parlab FP16 in torch's DDP": train(6, engine="torch", hook=torch_hook(FP16())),
        "parlab FP16 in parlab's DDP": train(6, hook=parlab_hook(FP16())),
    }


def fp16_gradients():
    """One step's averaged gradients with torch's fp16 hook and with parlab's FP16 in torch's
    DDP, and every rank's own gradient (to bound the rounding)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    averaged = {}
    for name, hook in (("torch", (None, default_hooks.fp16_compress_hook)), ("parlab", torch_hook(FP16()))):
        torch.manual_seed(0)
        model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4)))
        model.register_comm_hook(*hook)
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(dist.get_rank()))
        model(x).pow(2).mean().backward()
        averaged[name] = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    torch.manual_seed(0)
    local = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))
    local(x).pow(2).mean().backward()
    mine = torch.cat([p.grad.reshape(-1) for p in local.parameters()])
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    return averaged, everyone


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [2, 4])
def test_fp16_averages_as_torchs_fp16_compress_hook_within_fp16_rounding(world_size, request):
    N, unit = world_size, torch.finfo(torch.float16).eps / 2  # fp16's unit roundoff, 2^-11
    for averaged, everyone in cluster_of(world_size, request).run(fp16_gradients):
        # Both round each g_i / N to fp16 alike, then sum N of them in fp16 in their own
        # orders (the ring's, gloo's): each order's N - 1 additions err by at most
        # (N - 1) u sum_i |g_i / N|, so the two sums differ by at most twice that
        terms = sum((g.half() / N).float().abs() for g in everyone)
        band = 2 * (N - 1) * unit * terms
        assert ((averaged["parlab"] - averaged["torch"]).abs() <= band).all()
        assert (averaged["torch"] - sum(everyone) / N).abs().max() > 0  # fp16 did round


@pytest.mark.timeout(120)
def test_fp16_trains_exactly_as_torchs_fp16_compress_hook_on_two_ranks(cluster2):
    # two fp16 values have one sum in either order: the same rounding, bit for bit, step after step
    for runs in cluster2.run(fp16_runs):
        for name in ("parlab FP16 in torch's DDP", "parlab FP16 in parlab's DDP"):
            assert all(map(torch.equal, runs[name], runs["torch fp16 hook"])), name


def powersgd_runs():
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))
    model = nn.parallel.DistributedDataParallel(net)
    state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=2, start_powerSGD_iter=2)
    model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    for _ in range(3):  # two plain steps, then one compressed
        model(torch.randn(4, 64)).sum().backward()
    ours = PowerSGD(2)
    net = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))
    shapes = [p.shape for p in net.parameters()]
    with trace.span("parlab"):  # the same MLP in parlab's DDP with parlab's PowerSGD
        ddp = DDP(net, comm_hook=parlab_hook(ours, net))
        ddp(torch.randn(4, 64)).sum().backward()
        ddp.finish_gradient_synchronization()
    return state.compression_stats()[1:], ours.compression_sizes(shapes), ours.sent_bytes(
        torch.zeros(4680), dist.get_world_size(), shapes[::-1])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [2, 4])
def test_powersgd_sizes_are_torchs_compression_stats_and_its_traffic_two_all_reduces(world_size, request):
    timeline = cluster_of(world_size, request).trace(powersgd_runs)
    for torch_stats, ours, sent in timeline.results:
        assert torch_stats == ours == (4680, 472)
        # the uncompressed biases and the P's (8 + 64 + 64 x 2 + 8 x 2 = 216), then the Q's (2 x 64 x 2 = 256)
        N = world_size
        assert sent == [2 * (N - 1) * 4 * 216 // N + 2 * (N - 1) * 4 * 256 // N] * N
    step = timeline.window("parlab", 0)
    assert step.bytes_sent() == timeline.results[0][2]  # the trace counts what the formula says
    assert len({ev.nbytes for ev in step.select(rank=0, name="isend")}) >= 2


@pytest.mark.timeout(120)
def test_what_torchs_own_hooks_do_on_gloo(cluster2):
    """The lecture's statements: on CPU/gloo (torch 2.13) fp16 and powerSGD work, the bf16 hook
    refuses (it wants CUDA and NCCL), both quantization hooks fail inside their callbacks, and
    batched powerSGD fails once it starts compressing (after start_powerSGD_iter)."""
    for found in cluster2.run(torch_hooks_on_gloo):
        assert found == {"fp16": "ok", "bf16": "TypeError", "quantization per tensor": "RuntimeError",
                         "quantization per channel": "RuntimeError", "powerSGD": "ok",
                         "batched powerSGD": found["batched powerSGD"]}
        assert found["batched powerSGD"] != "ok"


@pytest.mark.timeout(120)
def test_signsgd_majority_vote_and_averaged_signs_stall_where_error_feedback_converges(cluster4):
    optimum = torch.tensor([3.0, -1.5])
    gamma, steps = 0.05, 400
    (vote, _), (averaged, no_residual), (with_ef, residual) = [
        cluster4.run(sign_descent, steps, gamma, method)[0] for method in SIGN_METHODS]
    # the vote follows the three ranks that agree: it ends within one step of their (0, 0)
    assert vote.abs().max() <= gamma
    assert (vote - optimum).norm() >= optimum.norm() - gamma * 2**0.5
    # averaged scaled signs: every rank's sign is +-(1, -1) here, so x stays on the diagonal x2 = -x1 and
    # ends where it passes nearest the optimum, (2.25, -2.25), |3 - 1.5| / sqrt(2) away
    diagonal = optimum.sum().abs() / 2**0.5
    assert averaged[0] == -averaged[1] and no_residual == 0.0
    assert (averaged - optimum).norm() >= diagonal * (1 - 4 * torch.finfo(torch.float32).eps)
    assert torch.allclose(averaged, torch.tensor([2.25, -2.25]), atol=1e-4)
    # with error feedback, x - mean(e) takes exact gradient steps, so x ends within the
    # ranks' mean residual of the optimum, twice over (the residual, and the lag it causes)
    assert (with_ef - optimum).norm() <= 2 * residual + gamma < diagonal


def test_sign_descent_refuses_an_unknown_method():
    with pytest.raises(ValueError, match="method must be one of"):
        sign_descent(1, 0.1, "median")


def biased_compressors_in_torchs_ddp():
    """torch's DDP with parlab's biased compressors as its hook: parameters after 4 steps and
    the bytes this rank sent in the last step (the hook's messages are parlab's, traced)."""
    out = {}
    for name, compressor in (("top-k + EF", ErrorFeedback(TopK(0.1))), ("PowerSGD + EF", ErrorFeedback(PowerSGD(1)))):
        with trace.span(name):
            out[name] = train(4, engine="torch", hook=torch_hook(compressor))
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [2, 4])
def test_parlabs_compressors_drive_torchs_ddp_and_keep_the_replicas_equal(world_size, request):
    timeline = cluster_of(world_size, request).trace(biased_compressors_in_torchs_ddp)
    first = timeline.results[0]
    for rank, results in enumerate(timeline.results):
        for name, parameters in results.items():
            # every rank steps with the same aggregate, bit for bit: the replicas stay equal
            assert all(map(torch.equal, parameters, first[name])), (name, rank)
    # the MLP 16-16-4 (340 parameters, one bucket): top-k keeps 34 of them, sent by all-gather
    N = world_size
    assert timeline.window("top-k + EF").bytes_sent() == [(N - 1) * 34 * (4 + 8) * 4] * N  # 4 steps
    assert min(timeline.window("PowerSGD + EF").bytes_sent()) > 0
