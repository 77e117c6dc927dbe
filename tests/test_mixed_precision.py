"""parlab.mixed_precision: the loss scaler follows torch.amp.GradScaler's scale sequence on the
same overflows; master weights train exactly like a hand-written fp16/bf16 loop with fp32
weights and keep the updates a 16-bit weight loses; the dtypes' edges are torch.finfo's and
behave as said (overflow to inf, underflow to 0)."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from parlab.mixed_precision import LossScaler, MasterWeights, edge_values

OVERFLOWS = [0, 0, 0, 1, 0, 0, 0, 0, "nan", 1, 0, 0, 0, 0, 0, 0, 1, 0, 0]  # 1: an inf in one gradient


def poison(parameter, kind):
    if kind:
        parameter.grad[0] = float("nan") if kind == "nan" else float("inf")


@pytest.mark.parametrize("options", [
    dict(init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5, growth_interval=3),
    dict(init_scale=1000.0, growth_factor=3.0, backoff_factor=0.3, growth_interval=2),  # roundings to fp32 matter
    dict(init_scale=2.0**100, growth_factor=2.0**20, backoff_factor=0.5, growth_interval=1),  # growth past fp32
])
def test_the_scale_sequence_is_grad_scalers_on_the_same_overflows(options):
    runs = {}
    for name, scaler in (("parlab", LossScaler(**options)), ("torch", torch.amp.GradScaler("cpu", **options))):
        torch.manual_seed(0)
        weight = nn.Parameter(torch.randn(4))
        optimizer = torch.optim.SGD([weight], lr=0.1)
        scales, weights = [], []
        for kind in OVERFLOWS:
            scales.append(scaler.scale_value if name == "parlab" else scaler.get_scale())
            scaler.scale((weight * torch.arange(4.0)).sum() * 1e-30).backward()
            poison(weight, kind)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
            weights.append(weight.detach().clone())
        runs[name] = scales, weights, scaler
    (scales, weights, ours), (torch_scales, torch_weights, _) = runs["parlab"], runs["torch"]
    assert scales == torch_scales
    assert ours.scale_history == scales and ours.skipped == [bool(kind) for kind in OVERFLOWS]
    assert all(torch.equal(a, b) for a, b in zip(weights, torch_weights))
    assert len(set(scales)) > 2  # the pattern both grew and backed off the scale


def test_step_reports_whether_it_stepped_and_a_skipped_step_leaves_the_weights():
    weight = nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([weight], lr=0.5)
    scaler = LossScaler(init_scale=4.0)
    scaler.scale(weight.sum()).backward()
    assert torch.equal(weight.grad, torch.full((2,), 4.0))
    poison(weight, 1)
    assert scaler.step(optimizer) is False and torch.equal(weight.detach(), torch.ones(2))
    scaler.update()
    assert scaler.scale_value == 2.0
    optimizer.zero_grad()
    scaler.scale(weight.sum()).backward()
    assert scaler.step(optimizer) is True and torch.equal(weight.detach(), torch.full((2,), 0.5))


def one_rank_overflows(group_all):
    weight = nn.Parameter(torch.ones(3))
    optimizer = torch.optim.SGD([weight], lr=0.5)
    scaler = LossScaler(init_scale=8.0, group=dist.group.WORLD if group_all else None)
    scaler.scale(weight.sum()).backward()
    poison(weight, dist.get_rank() == 1)
    stepped = scaler.step(optimizer)
    scaler.update()
    return stepped, scaler.scale_value


def test_with_sharded_gradients_one_ranks_overflow_skips_every_ranks_step(cluster2):
    assert cluster2.run(one_rank_overflows, True, timeout=60) == [(False, 4.0), (False, 4.0)]
    # without the group, each rank decides alone: the ranks' weights part ways
    assert cluster2.run(one_rank_overflows, False, timeout=60) == [(True, 8.0), (False, 4.0)]


def make_model():
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 2))


def batches(steps=5):
    generator = torch.Generator().manual_seed(11)
    return [(torch.randn(8, 5, generator=generator), torch.randn(8, 2, generator=generator)) for _ in range(steps)]


def hand_written(dtype, lr, scale=1.0):
    """fp32 master weights, a 16-bit copy made for each step, its gradients taken to fp32,
    unscaled and stepped by SGD's update p += -lr g."""
    master = [p.detach().clone() for p in make_model().parameters()]
    for x, y in batches():
        w1, b1, w2, b2 = [p.to(dtype).requires_grad_() for p in master]
        out = F.linear(torch.tanh(F.linear(x.to(dtype), w1, b1)), w2, b2)
        grads = torch.autograd.grad(F.mse_loss(out.float(), y) * scale, [w1, b1, w2, b2])
        for p, g in zip(master, grads):
            p.add_(g.float() * (1 / scale), alpha=-lr)
    return master


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("scale", [None, 2.0**10])
def test_master_weights_train_as_the_hand_written_loop(dtype, scale):
    model = MasterWeights(make_model(), dtype)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = None if scale is None else LossScaler(init_scale=scale)
    for x, y in batches():
        loss = F.mse_loss(model(x).float(), y)
        (loss if scaler is None else scaler.scale(loss)).backward()
        assert model.step(optimizer, scaler) is True
        if scaler is not None:
            scaler.update()
        model.zero_grad()
    reference = hand_written(dtype, lr=0.1, scale=scale or 1.0)
    assert all(torch.equal(m.detach(), r) for m, r in zip(model.parameters(), reference))
    assert all(p.dtype == dtype and torch.equal(p.detach(), r.to(dtype))
               for p, r in zip(model.module.parameters(), reference))


def test_master_weights_keep_updates_that_a_16_bit_weight_loses():
    plain = nn.Linear(1, 1, bias=False).half()
    mixed = MasterWeights(nn.Linear(1, 1, bias=False), torch.float16)
    for layer in (plain, mixed.module):
        layer.weight.data.fill_(1.0)
    mixed.master[0].data.fill_(1.0)
    plain_optimizer = torch.optim.SGD(plain.parameters(), lr=1e-4)
    mixed_optimizer = torch.optim.SGD(mixed.parameters(), lr=1e-4)
    one = torch.ones(1, 1)
    for _ in range(10):  # each step adds 1e-4 to the weight: below half of fp16's spacing at 1 (2^-11)
        (-plain(one.half()).float().sum()).backward()
        plain_optimizer.step()
        plain_optimizer.zero_grad()
        (-mixed(one).float().sum()).backward()
        mixed.step(mixed_optimizer)
        mixed.zero_grad()
    assert plain.weight.item() == 1.0  # every 1 + 1e-4 rounded back to 1
    master = mixed.master[0].item()
    assert abs(master - 1.001) < 1e-6  # fp32 sums ten steps of 1e-4 to within its rounding
    assert mixed.module.weight.item() == torch.tensor(master).half().item() > 1.0


def test_loss_scaling_keeps_a_gradient_that_underflows_in_fp16():
    def gradient(scaler):
        model = MasterWeights(nn.Linear(1, 1, bias=False), torch.float16)
        model.module.weight.data.fill_(1.0)
        loss = model(torch.full((1, 1), 1e-3)).float().sum() * 1e-5  # d loss / d weight = 1e-8 < 2^-25
        (loss if scaler is None else scaler.scale(loss)).backward()
        model.step(torch.optim.SGD(model.parameters(), lr=0.0), scaler)
        return model.master[0].grad.item()

    assert gradient(None) == 0.0
    rescued = gradient(LossScaler(init_scale=2.0**16))
    assert abs(rescued - 1e-8) <= 2 * edge_values(torch.float16).eps * 1e-8  # two fp16 roundings of 1e-8's factors


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_edge_values_are_finfos_and_behave_as_said(dtype):
    edges = edge_values(dtype)
    info = torch.finfo(dtype)
    assert (edges.largest, edges.smallest_normal, edges.eps) == (info.max, info.smallest_normal, info.eps)

    def rounded(value):
        return torch.tensor(value, dtype=torch.float64).to(dtype).item()

    assert rounded(edges.largest) == edges.largest and rounded(2 * edges.largest) == float("inf")
    assert rounded(edges.smallest_subnormal) == edges.smallest_subnormal > 0
    assert rounded(edges.smallest_subnormal / 2) == 0.0  # a tie, rounded to the even neighbour: 0
    assert rounded(edges.smallest_normal * (1 - edges.eps)) < edges.smallest_normal  # a subnormal exists below
    assert rounded(1 + edges.eps / 2) == 1.0 and rounded(1 + edges.eps) == 1 + edges.eps


def test_the_fp16_and_bf16_numbers_of_the_lecture():
    assert tuple(edge_values(torch.float16)) == (65504.0, 2.0**-14, 2.0**-24, 2.0**-10)
    assert tuple(edge_values(torch.bfloat16)) == ((2 - 2.0**-7) * 2.0**127, 2.0**-126, 2.0**-133, 2.0**-7)


@pytest.mark.parametrize("call, words", [
    (lambda: LossScaler(init_scale=0), "init_scale"),
    (lambda: LossScaler(growth_factor=1.0), "growth_factor"),
    (lambda: LossScaler(backoff_factor=1.5), "backoff_factor"),
    (lambda: LossScaler(growth_interval=0), "growth_interval"),
    (lambda: LossScaler().update(), "after step"),
    (lambda: edge_values("float16"), "torch.float16"),
    (lambda: MasterWeights(nn.Linear(2, 2), torch.float32), "16-bit"),
    (lambda: MasterWeights(nn.Linear(2, 2).half()), "fp32"),
    (lambda: MasterWeights("model"), "nn.Module"),
])
def test_bad_input_says_what_to_change(call, words):
    with pytest.raises(ValueError, match=words):
        call()


def test_unscaling_twice_or_in_fp16_is_refused():
    weight = nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([weight], lr=0.1)
    scaler = LossScaler()
    scaler.scale(weight.sum()).backward()
    scaler.unscale_(optimizer)
    with pytest.raises(ValueError, match="once"):
        scaler.unscale_(optimizer)
    half = nn.Parameter(torch.ones(2, dtype=torch.float16))
    half.grad = torch.ones(2, dtype=torch.float16)
    with pytest.raises(ValueError, match="master weights"):
        LossScaler().unscale_(torch.optim.SGD([half], lr=0.1))
