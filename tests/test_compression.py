"""parlab.compression in one process: the statistics of each compressor checked by sampling
(tolerances are a few standard errors of the sample, computed from it), the exact message
sizes, where top-k stops paying, PowerSGD's sizes against torch's rule, and the mistakes a
learner can make. The ranks' side (traffic, hooks, torch) is in test_compression_ranks.py."""

import math

import pytest
import torch

import parlab.compression
from parlab import fp8
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
    orthogonalize,
    parlab_hook,
    topk_pays,
    torch_hook,
)
from parlab.compression.communication import pack, unpack
from parlab.compression.costs import all_gather_sent, ring_all_reduce_sent, seconds, sent

D, SAMPLES = 24, 4000
SIGMAS = 5  # a 5-standard-error miss happens about once in 1.7 million: a failure means a bug


def vector(seed=0, d=D):
    return torch.randn(d, generator=torch.Generator().manual_seed(seed))


def samples(compressor, x, n=SAMPLES):
    return torch.stack([compressor(x) for _ in range(n)]).double()  # (n, d), statistics in float64


def assert_unbiased(draws, x, spacing):
    """Each coordinate's sample mean within SIGMAS standard errors of x (the standard error
    from the sample's own spread). Two allowances where that spread says too little: a value
    drawn with a probability p too small to show up in n draws (p < SIGMAS / n) moves the mean
    by up to p ``spacing`` (the distance between a coordinate's two possible values); and a
    coordinate that never varies must equal x up to the fp32 rounding of the reconstruction."""
    x, n = x.double(), draws.shape[0]
    standard_error = draws.std(dim=0) / math.sqrt(n)
    unseen = SIGMAS / n * spacing
    rounding = 4 * torch.finfo(torch.float32).eps * x.abs()
    assert ((draws.mean(dim=0) - x).abs() <= SIGMAS * standard_error + unseen + rounding).all()


def mean_and_error(values):
    """The sample mean of ``values`` and SIGMAS of its standard errors."""
    return values.mean().item(), SIGMAS * values.std().item() / math.sqrt(values.numel())


def squared_errors(draws, x):
    return ((draws - x.double()) ** 2).sum(dim=1)


def test_random_k_is_unbiased_with_variance_d_over_k_minus_1():
    x, k = vector(), 6
    draws = samples(RandK(k, seed=1), x)
    assert_unbiased(draws, x, D / k * x.abs())
    assert ((draws != 0).sum(dim=1) == k).all()
    mean, error = mean_and_error(squared_errors(draws, x))
    assert abs(mean - (D / k - 1) * x.double().norm() ** 2) <= error


def test_a_missing_d_over_k_scale_is_caught_by_the_mean():
    x = vector().abs() + 1  # positive, so an unscaled random-k's mean, k/d x, is far below x
    unscaled = samples(RandK(6, seed=1), x) * 6 / D
    with pytest.raises(AssertionError):
        assert_unbiased(unscaled, x, D / 6 * x.abs())


@pytest.mark.parametrize("k", [1, 5, 12, D])
def test_top_k_keeps_the_largest_and_contracts(k):
    for seed in range(20):
        x = vector(seed)
        kept = TopK(k)(x)
        assert (kept != 0).sum() == k and torch.equal(kept[kept != 0], x[kept != 0])
        assert torch.equal(kept[kept != 0].abs().sort().values, x.abs().topk(k).values.sort().values)
        x, kept = x.double(), kept.double()
        assert ((x - kept) ** 2).sum() <= (1 - k / D) * (x**2).sum()


@pytest.mark.parametrize("levels", [1, 2, 8])
def test_qsgd_is_unbiased_with_variance_at_most_min_d_over_s2_sqrt_d_over_s(levels):
    x = vector(1)
    draws = samples(QSGD(levels, seed=2), x)
    assert_unbiased(draws, x, x.norm() / levels)
    mean, error = mean_and_error(squared_errors(draws, x))
    assert mean <= min(D / levels**2, math.sqrt(D) / levels) * x.double().norm() ** 2 + error


def test_terngrad_is_unbiased_with_variance_s_l1_minus_l2_squared():
    g = vector(2)
    draws = samples(TernGrad(seed=3), g)
    assert_unbiased(draws, g, g.abs().max())
    s = g.abs().max()
    assert set(draws.unique().tolist()) <= {-s.item(), 0.0, s.item()}
    g, s = g.double(), s.double()
    mean, error = mean_and_error(squared_errors(draws, g))
    assert abs(mean - (s * g.abs().sum() - g.norm() ** 2)) <= error


def test_signs_and_half_precision_reconstruct_what_they_say():
    x = vector(3).float()
    assert torch.equal(ScaledSign()(x), x.abs().mean() * x.sign())
    assert torch.equal(SignSGD()(x), x.sign())
    assert torch.equal(FP16()(x), x.half().float()) and torch.equal(BF16()(x), x.bfloat16().float())
    assert torch.equal(Identity()(x), x)
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):  # one scale: max|x| lands on the format's largest
        u, largest = fp8.unit_roundoff(dtype), torch.finfo(dtype).max
        smallest_normal = torch.finfo(dtype).smallest_normal * x.abs().max() / largest
        error = (FP8(dtype)(x) - x).abs()
        assert (error <= torch.maximum(u * x.abs(), smallest_normal)).all()  # u relative, absolute below normal
        assert FP8(dtype)(x).abs().max() == x.abs().max() and not torch.equal(FP8(dtype)(x), x)


def test_message_bytes_are_the_formulas():
    x, d, k = torch.zeros(1000), 1000, 10
    assert Identity().bytes(x) == 4 * d and FP16().bytes(x) == BF16().bytes(x) == 2 * d
    assert RandK(k).bytes(x) == 4 * k and TopK(k).bytes(x) == (4 + 8) * k and TopK(0.01).bytes(x) == 12 * k
    assert QSGD(4).bytes(x) == TernGrad().bytes(x) == ScaledSign().bytes(x) == FP8().bytes(x) == 4 + d
    assert SignSGD().bytes(x) == d and ErrorFeedback(TopK(k)).bytes(x) == 12 * k


@pytest.mark.parametrize("N", [2, 4])
def test_bytes_each_rank_sends_are_the_formulas(N):
    x, d, k = torch.zeros(1000), 1000, 12
    dense = 2 * (N - 1) * 4 * d // N
    assert Identity().sent_bytes(x, N) == [dense] * N
    assert FP16().sent_bytes(x, N) == [dense // 2] * N and SignSGD().sent_bytes(x, N) == [dense // 4] * N
    assert RandK(k).sent_bytes(x, N) == [2 * (N - 1) * 4 * k // N] * N
    assert TopK(k).sent_bytes(x, N) == [(N - 1) * k * (4 + 8)] * N
    assert QSGD(4).sent_bytes(x, N) == FP8().sent_bytes(x, N) == [(N - 1) * (4 + d)] * N
    # PowerSGD: (n + m) r elements of a 40 x 25 matrix in two ring all-reduces (N divides n r and m r)
    assert PowerSGD(4).sent_bytes(x.view(40, 25), N) == [2 * (N - 1) * 4 * (40 + 25) * 4 // N] * N


def test_uneven_rings_and_gathers_count_each_ranks_chunks():
    assert ring_all_reduce_sent(10, 4, 4) == [4 * (20 - 3 - 3), 4 * (20 - 3 - 2), 4 * (20 - 2 - 2), 4 * (20 - 2 - 3)]
    assert all_gather_sent(7, 3) == [14, 14, 14]


def test_top_k_pays_below_2d_over_3N_with_int64_and_d_over_N_with_int32():
    d, N = 1200, 4
    assert topk_pays(199, d, N) and not topk_pays(200, d, N)  # 2 d / (3 N) = 200
    assert topk_pays(299, d, N, index_bytes=4) and not topk_pays(300, d, N, index_bytes=4)  # d / N = 300


def test_pack_and_unpack_round_trip():
    values, indices = torch.randn(5), torch.arange(5)
    packed = pack(values, indices)
    assert packed.dtype == torch.uint8 and packed.numel() == 5 * 4 + 5 * 8
    out = unpack(torch.stack([packed, packed]), [(5, torch.float32), (5, torch.int64)])
    assert torch.equal(out[0][1], values) and torch.equal(out[1][0], indices)
    with pytest.raises(ValueError, match="layout describes 20 bytes but the buffer holds 60"):
        unpack(packed, [(5, torch.float32)])


def test_error_feedback_keeps_what_the_compressor_dropped():
    ef, g = ErrorFeedback(TopK(2)), vector(4)
    delta = ef(g, gamma=0.5)
    assert torch.equal(delta + ef.residuals[0], 0.5 * g)  # e = p - C(p), p = gamma g at first
    second = ef(g, gamma=0.5)
    assert torch.equal(second + ef.residuals[0], 0.5 * g + (0.5 * g - delta))
    # nothing is lost: the steps sent so far plus the residual are all the gradients, gamma sum_t g
    ef, steps = ErrorFeedback(TopK(2)), 50
    sent = sum(ef(g) for _ in range(steps))
    # each of the 2 additions per step rounds a value no larger than steps max |g|
    rounding = 2 * steps * torch.finfo(torch.float32).eps * steps * g.abs().max()
    assert ((sent + ef.residuals[0] - steps * g).abs() <= rounding).all()


def test_powersgd_sizes_are_torchs_rule():
    # the MLP 64-64-8 of the issue: torch's compression_stats() counts 4680 before, 472 after at rank 2
    shapes = [(64, 64), (64,), (8, 64), (8,)]
    assert PowerSGD(2).compression_sizes(shapes) == (4680, 472)
    assert PowerSGD(2).plan(shapes) == [(64, 64, 2), None, (8, 64, 2), None]
    assert PowerSGD(4).plan([(8, 8)]) == [None]  # (8 + 8) 4 x 2 >= 64: not worth it, sent whole
    assert PowerSGD(2).bytes(torch.zeros(4680), shapes) == 4 * 472


# one of each compressor class that parlab.compression exports (the abstract Compressor aside)
EVERY_COMPRESSOR = {
    "BF16": BF16, "FP8": FP8, "FP16": FP16, "Identity": Identity, "QSGD": lambda: QSGD(4), "RandK": lambda: RandK(10),
    "ScaledSign": ScaledSign, "SignSGD": SignSGD, "TernGrad": TernGrad, "TopK": lambda: TopK(10),
    "PowerSGD": lambda: PowerSGD(2), "ErrorFeedback": lambda: ErrorFeedback(TopK(10)),
}
BUCKET = [(64, 64), (64,), (8, 64), (8,)]  # an MLP 64-64-8's parameters, as a DDP bucket holds them


def test_every_exported_compressor_is_in_the_signature_test():
    exported = {name for name in parlab.compression.__all__
                if isinstance(getattr(parlab.compression, name), type) and name != "Compressor"}
    assert exported == set(EVERY_COMPRESSOR)


@pytest.mark.parametrize("name", sorted(EVERY_COMPRESSOR))
def test_every_compressor_takes_shapes_by_position_or_by_name(name):
    x = torch.zeros(math.prod(BUCKET[0]) + 64 + math.prod(BUCKET[2]) + 8)
    make = EVERY_COMPRESSOR[name]
    for shapes in ([tuple(x.shape)], BUCKET):
        by_name, by_position = make().bytes(x, shapes=shapes), make().bytes(x, shapes)
        assert by_name == by_position and by_name > 0
        assert make().collectives(x, shapes=shapes) == make().collectives(x, shapes)
        assert make().sent_bytes(x, 4, shapes=shapes) == make().sent_bytes(x, 4, shapes)
    if name != "PowerSGD":  # elementwise: a bucket is one vector of d elements, whatever it holds
        assert make().bytes(x) == make().bytes(x, shapes=BUCKET) == make().bytes(x, [tuple(x.shape)])
        assert make().collectives(x) == make().collectives(x, shapes=BUCKET)
        assert make().sent_bytes(x, 4) == make().sent_bytes(x, 4, shapes=BUCKET)


def test_powersgd_bytes_are_its_formula_and_error_feedback_forwards_the_shapes():
    # 4 bytes per element: (n + m) R for each compressed G, the 1-D biases whole
    x, R = torch.zeros(4680), 2
    formula = 4 * ((64 + 64) * R + 64 + (8 + 64) * R + 8)
    assert PowerSGD(R).bytes(x, shapes=BUCKET) == ErrorFeedback(PowerSGD(R)).bytes(x, shapes=BUCKET) == formula
    assert ErrorFeedback(PowerSGD(R)).sent_bytes(x, 4, shapes=BUCKET) == PowerSGD(R).sent_bytes(x, 4, BUCKET)
    # without shapes x is one gradient: a 40 x 25 matrix is G itself, a vector travels whole
    matrix = torch.zeros(40, 25)
    assert PowerSGD(R).bytes(matrix) == PowerSGD(R).bytes(matrix, [(40, 25)]) == 4 * (40 + 25) * R
    assert PowerSGD(R).bytes(matrix.reshape(-1)) == 4 * 1000


def test_powersgd_finds_a_low_rank_matrix_and_orthogonalizes():
    generator = torch.Generator().manual_seed(5)
    M = torch.randn(30, 2, generator=generator) @ torch.randn(2, 20, generator=generator)
    approximation = PowerSGD(2)(M)
    # one power iteration recovers a rank-2 matrix up to fp32 rounding of its entries
    assert (approximation - M).norm() <= 100 * torch.finfo(torch.float32).eps * M.norm()
    P = orthogonalize(torch.randn(30, 3, generator=generator))
    assert (P.T @ P - torch.eye(3)).abs().max() <= 10 * torch.finfo(torch.float32).eps


@pytest.mark.parametrize("call, message", [
    (lambda: TopK(0)(torch.zeros(4)), "k must be a whole number of elements from 1 to d = 4"),
    (lambda: RandK(5)(torch.zeros(4)), "k must be a whole number"),
    (lambda: QSGD(200), "pick q from 1 to 127"),
    (lambda: RandK(2, seed=-1), "seed"),
    (lambda: ErrorFeedback(lambda x: x), "ErrorFeedback wraps a compressor"),
    (lambda: ErrorFeedback(TopK(1))(torch.ones(2), gamma=0), "gamma"),
    (lambda: PowerSGD(0), "rank"),
    (lambda: PowerSGD(1).bytes(torch.zeros(10), [(3, 3)]), "do not add up to the 10 elements"),
    (lambda: TopK(2).bytes(torch.zeros(10), shapes=[(3, 3)]), "do not add up to the 10 elements"),
    # one shape where a list of them is expected (x.shape, or a single (n, m))
    (lambda: PowerSGD(1).bytes(torch.zeros(12), torch.Size([3, 4])), r"shapes must be a list of the shapes"),
    (lambda: TopK(2).sent_bytes(torch.zeros(12), 4, shapes=(3, 4)), r"e.g. \[p.shape for p in model.parameters\(\)\]"),
    (lambda: ErrorFeedback(PowerSGD(1)).collectives(torch.zeros(12), shapes="3x4"), "shapes must be a list"),
    (lambda: FP16().aggregate(torch.zeros(12), shapes=[(3, 4.0)]), "shapes must be a list"),
    (lambda: parlab_hook(lambda x: x), "a comm hook needs a compressor"),
    (lambda: torch_hook("fp16"), "a comm hook needs a compressor"),
])
def test_learner_mistakes_are_explained(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_the_alpha_beta_time_of_each_compressors_collectives():
    x, alpha, bandwidth = torch.zeros(1000), 1e-3, 1e6
    assert seconds(Identity().collectives(x), 4, alpha, bandwidth) == pytest.approx(6 * (alpha + 250 * 4 / bandwidth))
    assert seconds(TopK(10).collectives(x), 4, alpha, bandwidth) == pytest.approx(3 * (alpha + 120 / bandwidth))
    # uneven chunks: a ring step lasts as long as its largest chunk, ceil(1001 / 4) = 251 elements
    assert seconds(FP16().collectives(torch.zeros(1001)), 4, alpha, bandwidth) == pytest.approx(
        6 * (alpha + 251 * 2 / bandwidth))
    # PowerSGD at rank 2 on a 40 x 25 matrix: all-reduces of P (80 elements) and Q (50)
    assert PowerSGD(2).collectives(x.view(40, 25)) == [("all-reduce", 80, 4), ("all-reduce", 50, 4)]
    assert seconds(PowerSGD(2).collectives(x.view(40, 25)), 2, alpha, bandwidth) == pytest.approx(
        2 * (alpha + 40 * 4 / bandwidth) + 2 * (alpha + 25 * 4 / bandwidth))
    assert sent(PowerSGD(2).collectives(x.view(40, 25)), 2) == [4 * 80 + 4 * 50] * 2
    assert seconds(Identity().collectives(x), 1, alpha, bandwidth) == 0  # one rank sends nothing



def test_parlabs_hook_walks_the_buckets_of_the_module_it_was_given():
    # parlab's DDP fills buckets with the trainable parameters in reverse order and launches them in
    # order: a bucket of the last two (bias 4, weight 4 x 3), then the first two (bias 3, weight 3 x 2)
    module = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Linear(3, 4))
    hook = parlab_hook(PowerSGD(1), module)
    assert hook._bucket_shapes(4 + 12) == [(4,), (4, 3)]
    assert hook._bucket_shapes(3 + 6) == [(3,), (3, 2)]
    assert hook._bucket_shapes(16) == [(4,), (4, 3)]  # the next step starts again from the last layer
    with pytest.raises(ValueError, match="does not match the parameters of the module given to the hook"):
        hook._bucket_shapes(5)
