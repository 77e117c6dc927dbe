"""Graded: top-k with error feedback, unbiased random-k and PowerSGD (``compression.py``).

``topk_error_feedback`` is compared with golden cases computed here; a residual left out is
found by its norm. ``rand_k`` is sampled 4000 times: its mean must be x within five standard
errors of the sample (plus what a value too rare to be drawn could move it), and a mean of
k/d x names the missing scale. ``orthogonalize`` must give P^T P = I and keep each leading
span. ``powersgd_step`` runs at 2 and 4 ranks against one process's computation from every
rank's matrix (within the rounding band of ``parlab.numerics``: twice what the same
computation in fp32 differs from fp64, plus 16 roundings of the largest value), and its
traffic is read from the trace: two all-reduces, of P and of Q.
"""

import math

import pytest
import torch
import torch.distributed as dist

from parlab.numerics import max_abs_difference, ring_orders, rounding_band

RUN_TIMEOUT_S = 10
WORLD_SIZES = [2, 4]
SAMPLES, SIGMAS = 4000, 5
N_ROWS, M_COLS, R = 12, 8, 2  # G is 12 x 8, Q 8 x 2: 2 and 4 divide n R = 24 and m R = 16
EPS = torch.finfo(torch.float32).eps


def ranks(world_size):
    return f"{world_size} ranks"


def vector(seed, d=20):
    return torch.randn(d, generator=torch.Generator().manual_seed(seed))


def reference_topk_ef(g, residual, gamma, k):
    p = gamma * g + residual
    delta = torch.zeros_like(p)
    indices = p.abs().topk(k).indices
    delta[indices] = p[indices]
    return delta, p - delta


@pytest.mark.task("topk_error_feedback")
class TestTopKErrorFeedback:
    @pytest.mark.points(1)
    def test_keeps_the_k_largest_of_gamma_g_plus_e(self, impl):
        g, residual = vector(0), 0.1 * vector(1)
        for k in (1, 5, 20):
            delta, _ = impl.topk_error_feedback(g, residual, 0.5, k)
            expected, _ = reference_topk_ef(g, residual, 0.5, k)
            assert tuple(delta.shape) == tuple(g.shape), f"delta has shape {tuple(delta.shape)}, expected g's"
            if torch.equal(delta != 0, expected != 0):
                assert torch.allclose(delta, expected, rtol=0, atol=4 * EPS * float(expected.abs().max())), (
                    f"k = {k}: the kept values differ from p = gamma g + e at those positions")
                continue
            hint = ""
            if torch.equal(delta != 0, reference_topk_ef(g, torch.zeros_like(g), 0.5, k)[0] != 0):
                hint = ": those are the largest of gamma g; compress p = gamma g + e, the residual added back"
            elif (delta != 0).sum() != k:
                hint = f": {int((delta != 0).sum())} entries kept, expected k = {k}"
            assert False, f"k = {k}: top-k kept the wrong positions{hint}"

    @pytest.mark.points(1)
    def test_the_residual_keeps_what_was_dropped(self, impl):
        g, gamma, k = vector(2), 0.5, 4
        residual = torch.zeros_like(g)
        for step in range(3):
            expected_delta, expected_residual = reference_topk_ef(g, residual, gamma, k)
            delta, new_residual = impl.topk_error_feedback(g, residual, gamma, k)
            size, expected_size = float(torch.as_tensor(new_residual).norm()), float(expected_residual.norm())
            assert size > 0 or expected_size == 0, (
                f"step {step}: the residual's norm is {size:.3g}, expected {expected_size:.3g}: the residual is "
                "missing; keep what top-k dropped, e = p - C(p), so that it is sent at a later step")
            band = 8 * EPS * float((gamma * g + residual).abs().max())
            assert torch.allclose(new_residual, expected_residual, rtol=0, atol=band), (
                f"step {step}: the residual differs from e = p - C(p) by "
                f"{max_abs_difference(new_residual, expected_residual):.3g}")
            assert torch.allclose(delta, expected_delta, rtol=0, atol=band), (
                f"step {step}: delta differs from top-k of p = gamma g + e")
            residual = new_residual


def rand_k_samples(impl, x, k, seed):
    generator = torch.Generator().manual_seed(seed)
    return torch.stack([impl.rand_k(x, k, generator) for _ in range(SAMPLES)]).double()


def within_sampling(draws, target, spacing):
    """Whether each coordinate's sample mean is within SIGMAS standard errors of ``target``
    (plus what a value too rare to be drawn could move it, SIGMAS / n x spacing, plus fp32
    rounding)."""
    standard_error = draws.std(dim=0) / math.sqrt(draws.shape[0])
    allowance = SIGMAS * standard_error + SIGMAS / draws.shape[0] * spacing + 4 * EPS * target.abs()
    return bool(((draws.mean(dim=0) - target).abs() <= allowance).all())


@pytest.mark.task("rand_k")
class TestRandK:
    @pytest.mark.points(1)
    def test_keeps_k_positions_scaled_by_d_over_k(self, impl):
        x, k = vector(3).abs() + 1, 5  # no zeros: every kept position shows
        out = impl.rand_k(x, k, torch.Generator().manual_seed(0))
        assert tuple(out.shape) == tuple(x.shape), f"C(x) has shape {tuple(out.shape)}, expected x's"
        kept = out != 0
        assert int(kept.sum()) == k, f"{int(kept.sum())} positions kept, expected k = {k}"
        expected_positions = torch.randperm(x.numel(), generator=torch.Generator().manual_seed(0))[:k]
        assert bool(kept[expected_positions].all()), (
            "the kept positions are not torch.randperm(d, generator=generator)[:k]: ranks sharing a seed "
            "would keep different positions")
        ratio = out[kept] / x[kept]
        if torch.allclose(ratio, torch.ones_like(ratio)):
            assert False, f"the kept values are x_j: the d/k = {x.numel() / k:g} scale is missing"
        assert torch.allclose(ratio, torch.full_like(ratio, x.numel() / k)), (
            f"the kept values are {ratio.tolist()} times x_j, expected d/k = {x.numel() / k:g}")

    @pytest.mark.points(1)
    def test_is_unbiased_by_sampling(self, impl):
        x, k = vector(4).double(), 5
        d = x.numel()
        draws = rand_k_samples(impl, x.float(), k, seed=1)
        if within_sampling(draws, x, d / k * x.abs()):
            return
        if within_sampling(draws, k / d * x, x.abs()):
            assert False, (f"the mean over {SAMPLES} draws is k/d x, not x: the d/k scale is missing, so every "
                           "step is k/d times too short")
        assert False, f"the mean over {SAMPLES} draws is not x within {SIGMAS} standard errors: C(x) is biased"


@pytest.mark.task("orthogonalize")
class TestOrthogonalize:
    @pytest.mark.points(1)
    def test_orthonormal_columns_with_the_same_leading_spans(self, impl):
        generator = torch.Generator().manual_seed(5)
        original = torch.randn(N_ROWS, 3, generator=generator)
        P = impl.orthogonalize(original.clone())
        gram = P.T @ P
        band = 4 * N_ROWS * EPS
        assert (gram - torch.eye(3)).abs().max() <= band, (
            f"P^T P differs from the identity by {float((gram - torch.eye(3)).abs().max()):.3g}: "
            "columns must be unit length and orthogonal to each other")
        for j in range(3):
            # column j of the original lies in the span of the first j + 1 columns of P
            leading = P[:, : j + 1]
            left = original[:, j] - leading @ (leading.T @ original[:, j])
            assert left.norm() <= band * original[:, j].norm(), (
                f"column {j} left the span of the original's first {j + 1} columns: go through the "
                "columns in order, each one taking out its parts along the columns before it")


def powersgd_on_rank(powersgd_step, seed):
    from parlab import trace

    rank = dist.get_rank()
    G = torch.randn(N_ROWS, M_COLS, generator=torch.Generator().manual_seed(seed + rank))
    Q = torch.randn(M_COLS, R, generator=torch.Generator().manual_seed(seed))
    with trace.span("step"):
        approximation, new_Q = powersgd_step(G, Q.clone())
    return G, Q, approximation, new_Q


def reference_powersgd(Gs, Q, dtype):
    Gs, Q = [G.to(dtype) for G in Gs], Q.to(dtype)
    P = sum(G @ Q for G in Gs)
    for j in range(P.shape[1]):
        P[:, j] /= P[:, j].norm()
        P[:, j + 1 :] -= P[:, j : j + 1] * (P[:, j] @ P[:, j + 1 :])[None, :]
    new_Q = sum(G.T @ P for G in Gs) / len(Gs)
    return P @ new_Q.T, new_Q


@pytest.mark.task("powersgd_step")
class TestPowerSGDStep:
    @pytest.mark.points(1)
    @pytest.mark.parametrize("cluster", WORLD_SIZES, indirect=True, ids=ranks)
    def test_approximates_the_mean_like_one_process(self, cluster, impl):
        per_rank = cluster.run(powersgd_on_rank, impl.powersgd_step, 10, timeout=RUN_TIMEOUT_S)
        Gs, Q = [result[0] for result in per_rank], per_rank[0][1]
        exact = reference_powersgd(Gs, Q, torch.float64)
        # the yardstick: the same computation in fp32, the matrices summed in each ring order
        in_fp32 = [reference_powersgd([Gs[i] for i in order], Q, torch.float32) for order in ring_orders(len(Gs))]
        mean = sum(Gs) / len(Gs)
        for rank, (_, _, approximation, new_Q) in enumerate(per_rank):
            for index, (name, got) in enumerate((("P Q^T", approximation), ("the new Q", new_Q))):
                want = exact[index]
                band, _, _ = rounding_band(want, [result[index] for result in in_fp32])
                difference = max_abs_difference(got.double(), want)
                hint = ""
                if name == "P Q^T" and max_abs_difference(approximation.double(), mean.double()) <= band:
                    hint = ": that is the mean gradient itself, uncompressed; approximate it as P Q^T"
                assert difference <= band, (
                    f"rank {rank}: {name} differs from one process's by {difference:.3g}, more than rounding "
                    f"({band:.3g}){hint}")

    @pytest.mark.points(1)
    def test_sends_two_all_reduces_of_p_and_q(self, cluster2, impl):
        timeline = cluster2.trace(powersgd_on_rank, impl.powersgd_step, 11, timeout=RUN_TIMEOUT_S)
        N = 2
        expected = 2 * (N - 1) * 4 * (N_ROWS + M_COLS) * R // N
        sent = timeline.window("step").bytes_sent()
        if sent == [expected] * N:
            return
        whole = 2 * (N - 1) * 4 * N_ROWS * M_COLS // N
        hint = ""
        if any(s >= whole for s in sent):
            hint = ": at least the whole gradient's all-reduce; send P (n x r) and Q (m x r) only"
        elif sent == [2 * (N - 1) * 4 * N_ROWS * R // N] * N:
            hint = ": that is P's all-reduce alone; Q = (1/N) sum_i G_i^T P needs the second"
        elif sent == [0] * N:
            hint = ": nothing was sent; communicate with all_reduce_sum"
        assert False, (f"each rank sent {sent} bytes in a step, expected {expected} (two ring all-reduces, of P "
                       f"{N_ROWS} x {R} and Q {M_COLS} x {R}){hint}")
