"""fp8 numerics in one process: the formats' edges against torch.finfo and the paper's
Table 1, what a cast does out of range, rounding within u, per-tensor and delayed scales,
fp8 matmul within the error bound its unit roundoffs give (and worse than bf16's), the fp8
linear layer's three matmuls, and the small GPT's loss in fp8 within u of fp32's."""

import math

import pytest
import torch

from parlab import fp8
from parlab.fp8 import E4M3, E5M2
from parlab.mixed_precision import edge_values

# Micikevicius et al. 2022 (arXiv 2209.05433), Table 1: largest, smallest normal, smallest subnormal, eps
TABLE_1 = {E4M3: (448.0, 2.0**-6, 2.0**-9, 2.0**-3), E5M2: (57344.0, 2.0**-14, 2.0**-16, 2.0**-2)}


@pytest.mark.parametrize("dtype", fp8.FORMATS)
def test_the_formats_edges_are_the_papers(dtype):
    info, edges = torch.finfo(dtype), edge_values(dtype)
    assert tuple(edges) == TABLE_1[dtype]
    assert (info.max, info.smallest_normal, info.eps) == (edges.largest, edges.smallest_normal, edges.eps)
    assert fp8.unit_roundoff(dtype) == edges.eps / 2
    tiny = edges.smallest_subnormal  # representable; below half of it everything rounds to 0
    assert torch.tensor([tiny, 0.49 * tiny]).to(dtype).float().tolist() == [tiny, 0.0]


def test_out_of_range_e4m3_saturates_and_e5m2_overflows_to_inf():
    x = torch.tensor([464.0, 1000.0, math.inf, -math.inf, math.nan])
    assert fp8.to_fp8(x, E4M3, 1.0)[0].float()[:4].tolist() == [448.0, 448.0, 448.0, -448.0]
    assert fp8.to_fp8(x, E4M3, 1.0)[0].float()[4].isnan()
    y = torch.tensor([57344.0, 61439.0, 61440.0, math.inf])
    assert fp8.to_fp8(y, E5M2, 1.0)[0].float().tolist() == [57344.0, 57344.0, math.inf, math.inf]


@pytest.mark.parametrize("dtype", fp8.FORMATS)
def test_rounding_in_the_normal_range_is_within_u(dtype):
    edges, u = edge_values(dtype), fp8.unit_roundoff(dtype)
    x = torch.logspace(math.log10(edges.smallest_normal), math.log10(edges.largest / 2), 5000, dtype=torch.float64)
    relative = ((x.to(dtype).double() - x).abs() / x).max().item()
    assert 0.8 * u < relative <= u  # the worst, u / (1 + u), just above a power of 2


def test_a_per_tensor_scale_keeps_small_values_apart():
    x = torch.randn(1000, generator=torch.Generator().manual_seed(0)) * 1e-4  # gradients' size
    assert (x.to(E4M3).float() == 0).float().mean() > 0.9  # unscaled: below 2^-9, almost all gone
    q, inverse = fp8.to_fp8(x, E4M3)
    assert q.float().abs().max().item() == 448.0  # the largest element at the top of the format
    back = fp8.from_fp8(q, inverse)
    subnormal_error = edge_values(E4M3).smallest_subnormal / 2 * inverse.item()
    assert ((back - x).abs() <= fp8.unit_roundoff(E4M3) * x.abs() + subnormal_error).all()


def test_delayed_scaling_takes_the_history_max_and_counts_a_spike():
    recipe = fp8.DelayedScaling(E4M3, history=4)
    ones, spike = torch.ones(8), torch.full((8,), 10.0)
    scales = [recipe.scale(ones).item() for _ in range(3)]
    assert scales == [1.0, 448.0, 448.0] and recipe.overflows == 0  # 1 before any amax is known
    scale = recipe.scale(spike)  # made from amaxes of 1: 10 x 448 is past E4M3's largest
    assert scale.item() == 448.0 and recipe.overflows == 1
    assert fp8.from_fp8(*fp8.to_fp8(spike, E4M3, scale)).tolist() == [1.0] * 8  # clipped to 448 / 448
    after = [recipe.scale(ones).item() for _ in range(5)]  # the spike stays 4 steps in the history
    assert after == [pytest.approx(44.8)] * 4 + [448.0] and recipe.overflows == 1
    with_margin = fp8.DelayedScaling(E4M3, history=4, margin=1)
    with_margin.scale(ones), with_margin.scale(ones)
    assert with_margin.scale(2 * ones).item() == 224.0 and with_margin.overflows == 0  # headroom 2^margin
    assert with_margin.scale(5 * ones).item() == 112.0 and with_margin.overflows == 1  # 5 > 2 x 2^1


def matmul_error_bound(a, b, u, tiny_a, tiny_b):
    """|C' - C| <= sum_k (u|a| + tiny_a)((1 + u)|b| + tiny_b) + |a|(u|b| + tiny_b) + (k + 3) u_32 |a'||b'|:
    each operand within u relative (tiny: half a subnormal step, unscaled, below the normal
    range), then fp32's accumulation of k products and the two roundings of the rescale."""
    a, b = a.double().abs(), b.double().abs()
    k, u32 = a.shape[1], fp8.unit_roundoff(torch.float32)
    products = (u * a + tiny_a) @ ((1 + u) * b + tiny_b) + a @ (u * b + tiny_b)
    return products + (k + 3) * u32 * ((1 + u) * a + tiny_a) @ ((1 + u) * b + tiny_b)


def test_fp8_matmul_is_within_its_bound_and_worse_than_bf16():
    generator = torch.Generator().manual_seed(0)
    a, b = torch.randn(64, 256, generator=generator), torch.randn(256, 32, generator=generator)
    exact = a.double() @ b.double()
    magnitude = a.double().abs() @ b.double().abs()
    errors = {}
    for name, (dtype_a, dtype_b) in {"E4M3": (E4M3, E4M3), "E5M2 x E4M3": (E5M2, E4M3)}.items():
        product = fp8.fp8_matmul(a, b, dtype_a, dtype_b)
        half_step = [edge_values(d).smallest_subnormal / 2 / fp8.scale_for(fp8.amax(x), d).item()
                     for d, x in ((dtype_a, a), (dtype_b, b))]
        u = max(fp8.unit_roundoff(dtype_a), fp8.unit_roundoff(dtype_b))
        error = (product.double() - exact).abs()
        assert (error <= matmul_error_bound(a, b, u, *half_step)).all(), name
        errors[name] = (error / magnitude).max().item()
    bf16 = (a.bfloat16().float() @ b.bfloat16().float()).double()
    errors["bf16"] = ((bf16 - exact).abs() / magnitude).max().item()
    assert errors["bf16"] < errors["E4M3"] < errors["E5M2 x E4M3"], errors


def test_float8_linear_runs_its_three_matmuls_in_fp8():
    generator = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    layer = fp8.to_float8_linears(torch.nn.Sequential(torch.nn.Linear(16, 8)))[0]
    assert isinstance(layer, fp8.Float8Linear)
    x = torch.randn(2, 5, 16, generator=generator, requires_grad=True)  # (b, s, h_in)
    g = torch.randn(2, 5, 8, generator=generator) * 1e-3  # (b, s, h_out)
    y = layer(x)
    assert torch.equal(y, (fp8.fp8_matmul(x.reshape(10, 16), layer.weight.t()) + layer.bias).reshape(2, 5, 8))
    y.backward(g)
    qg, qx, qw = fp8.to_fp8(g.reshape(10, 8), E5M2), fp8.to_fp8(x.reshape(10, 16), E4M3), fp8.to_fp8(layer.weight)
    expected_x = (qg[0].float() @ qw[0].float()) * (qg[1] * qw[1])
    expected_w = (qg[0].float().t() @ qx[0].float()) * (qg[1] * qx[1])
    assert torch.equal(x.grad, expected_x.reshape(2, 5, 16)) and torch.equal(layer.weight.grad, expected_w)
    assert torch.equal(layer.bias.grad, g.sum((0, 1)))


@pytest.mark.timeout(60)
def test_the_gpt_in_fp8_stays_within_u_of_fp32():
    curves = fp8.precision_curves(steps=30)
    fp32, bf16, e4m3 = curves["fp32"], curves["bf16"], curves["fp8"]
    assert fp32[-1] < 0.75 * fp32[0]  # it trains
    gap = (e4m3 - fp32).abs()
    # every element of every fp8 matmul is within u = 2^-4 relative: the loss within u of fp32's
    assert (gap <= fp8.unit_roundoff(E4M3) * fp32).all(), (gap / fp32).max()
    assert (bf16 - fp32).abs().max() < gap.max()  # bf16 rounds 16 times finer


def test_learner_mistakes_are_refused():
    with pytest.raises(ValueError, match="E4M3 for weights"):
        fp8.to_fp8(torch.ones(2), torch.float16)
    with pytest.raises(ValueError, match="history"):
        fp8.DelayedScaling(history=0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="tests the refusal on a machine without CUDA")
def test_the_gpu_throughput_says_it_needs_a_gpu():
    with pytest.raises(ValueError, match="needs a CUDA GPU with fp8 tensor cores"):
        fp8.scaled_mm_throughput()
