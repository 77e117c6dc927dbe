"""Graded: column- and row-parallel linear layers with f and g, and a dynamic loss scaler
(``tensor_parallel.py``).

An MLP, ``RowParallelLinear(gelu(ColumnParallelLinear(x)))``, split over 2 and 4 ranks is
compared with the one-process MLP: the output, the input's gradient and every rank's weight
gradients (its slices of the full ones), within the rounding band of ``parlab.numerics`` (the
one-process MLP computing the row layer as t partial products summed in each ring order).
A wrong result is diagnosed: a partial sum where g's all-reduce is missing, the rank's own
part of the input's gradient where f's is, t times the gradient where g all-reduces in
backward too. The trace counts the all-reduces: one forward, one backward. The loss scaler's
scale after every update is compared with torch.amp.GradScaler's on the same overflows.
"""

import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from parlab import trace
from parlab.numerics import max_abs_difference, ring_orders, rounding_band

RUN_TIMEOUT_S = 20
WORLD_SIZES = [2, 4]
B, S, H = 2, 4, 8  # x is (b, s, h); the MLP's hidden layer has 4h features


def ranks(world_size):
    return f"{world_size} ranks"


@pytest.mark.task("column_row_linear")
class TestColumnRowLinear:
    @pytest.mark.points(1)
    @pytest.mark.parametrize("cluster", WORLD_SIZES, indirect=True, ids=ranks)
    def test_the_output_is_the_one_process_output(self, cluster, impl):
        t = cluster.world_size
        for rank, result in enumerate(cluster.run(mlp_on_rank, impl.ColumnParallelLinear, impl.RowParallelLinear,
                                                  timeout=RUN_TIMEOUT_S)):
            expected, band = one_process(t)["output"], bands(t)["output"]
            if max_abs_difference(result["output"], expected) <= band:
                continue
            hint = ""
            partial = one_process(t)["partial outputs"][rank]
            if max_abs_difference(result["output"], partial) <= band:
                hint = (": it is this rank's partial sum x_r A_r^T (+ c): g (ReduceFromParallel) must all-reduce "
                        "the row layer's output in forward")
            elif max_abs_difference(result["output"], expected + (t - 1) * one_process(t)["bias"]) <= band:
                hint = ": the bias was added t times; add it once, after g's sum"
            assert False, (f"{t} ranks, rank {rank}: the output differs from one process's by "
                           f"{max_abs_difference(result['output'], expected):.2e} (band {band:.2e}){hint}")

    @pytest.mark.points(1)
    @pytest.mark.parametrize("cluster", WORLD_SIZES, indirect=True, ids=ranks)
    def test_the_gradients_are_the_one_process_gradients(self, cluster, impl):
        t = cluster.world_size
        for rank, result in enumerate(cluster.run(mlp_on_rank, impl.ColumnParallelLinear, impl.RowParallelLinear,
                                                  timeout=RUN_TIMEOUT_S)):
            reference, band = one_process(t), bands(t)
            got = result["input gradient"]
            difference = max_abs_difference(got, reference["input gradient"])
            if difference > band["input gradient"]:
                hint = ""
                if max_abs_difference(got, reference["input gradient parts"][rank]) <= band["input gradient"]:
                    hint = (": it is only this rank's part of the sum; f (CopyToParallel) is missing its all-reduce "
                            "in backward: every rank reads the whole input, so its gradient is summed over the ranks")
                elif max_abs_difference(got, t * reference["input gradient"]) <= t * band["input gradient"]:
                    hint = (": it is t times too large; g (ReduceFromParallel) must pass the gradient through "
                            "unchanged in backward (identity), only f all-reduces it")
                assert False, (f"{t} ranks, rank {rank}: the input's gradient differs from one process's by "
                               f"{difference:.2e} (band {band['input gradient']:.2e}){hint}")
            for name in ("column weight", "column bias", "row weight", "row bias"):
                expected = reference["slices"][rank][name]
                difference = max_abs_difference(result[name], expected)
                hint = ""
                if max_abs_difference(result[name], t * expected) <= t * band[name]:
                    hint = (": t times too large; g (ReduceFromParallel) must pass the gradient through unchanged "
                            "in backward")
                assert difference <= band[name], (f"{t} ranks, rank {rank}: the gradient of the {name} differs "
                                                   f"from its slice of one process's by {difference:.2e} "
                                                   f"(band {band[name]:.2e}){hint}")

    @pytest.mark.points(1)
    def test_one_all_reduce_forward_and_one_backward(self, cluster2, impl):
        timeline = cluster2.trace(mlp_on_rank, impl.ColumnParallelLinear, impl.RowParallelLinear,
                                  timeout=RUN_TIMEOUT_S)
        for rank in range(2):
            counts = []
            for phase in ("forward", "backward"):
                outer = timeline.select(rank=rank, name=phase)[0]
                counts.append(sum(outer.start <= span.start <= outer.end
                                  for span in timeline.select(rank=rank, name="all-reduce")))
            assert counts == [1, 1], (
                f"rank {rank}: {counts[0]} all-reduces in forward and {counts[1]} in backward, expected 1 and 1: "
                "g all-reduces the row layer's output in forward, f the input's gradient in backward (use all_reduce)")


@pytest.mark.task("loss_scaler")
class TestLossScaler:
    @pytest.mark.points(1)
    def test_the_scale_follows_grad_scaler_on_the_same_overflows(self, impl):
        overflows = [False, False, True, False, False, False, True, True, False, False, False, False]
        for options in ({"init_scale": 2.0**16, "growth_interval": 3},
                        {"init_scale": 8.0, "growth_factor": 4.0, "backoff_factor": 0.25, "growth_interval": 2}):
            ours, theirs = scales(impl.DynamicLossScaler, overflows, options), grad_scaler_scales(overflows, options)
            assert ours == theirs, (f"with {options} and overflows at steps "
                                    f"{[i for i, o in enumerate(overflows) if o]}: your scales {ours}, "
                                    f"torch.amp.GradScaler's {theirs}")

    @pytest.mark.points(1)
    def test_a_good_step_unscales_and_a_bad_one_is_skipped(self, impl):
        scaler = impl.DynamicLossScaler(init_scale=1024.0)
        w = nn.Parameter(torch.tensor([1.0, 2.0]))
        optimizer = torch.optim.SGD([w], lr=0.5)
        scaler.scale_loss((w * torch.tensor([3.0, 4.0])).sum()).backward()
        assert torch.equal(w.grad, torch.tensor([3072.0, 4096.0])), f"scale_loss: gradients {w.grad.tolist()}"
        assert scaler.step(optimizer, [w]) is True, "a finite gradient: step must return True (step taken)"
        assert torch.equal(w.detach(), torch.tensor([-0.5, 0.0])), (
            f"after an unscaled step of lr 0.5 on gradients [3, 4] the weights are {w.detach().tolist()}, "
            "expected [-0.5, 0.0]: unscale_ divides each gradient by the scale before the step")
        w.grad = torch.tensor([float("inf"), 1.0])
        assert scaler.step(optimizer, [w]) is False, "a gradient holds inf: step must return False (skipped)"
        assert torch.equal(w.detach(), torch.tensor([-0.5, 0.0])), "an overflowing step must leave the weights"
        assert scaler.scale == 512.0, f"after an overflow the scale is {scaler.scale}, expected 1024 x 0.5"
        w.grad = torch.tensor([float("nan"), 1.0])
        assert scaler.step(optimizer, [w]) is False, "a nan counts as an overflow too"


def scales(DynamicLossScaler, overflows, options):
    """The learner's scale after each update, given gradients that overflow as ``overflows`` says."""
    scaler = DynamicLossScaler(**options)
    w = nn.Parameter(torch.ones(2))
    found, seen = [], []
    for overflow in overflows:
        w.grad = torch.tensor([float("inf") if overflow else 1.0, 1.0])
        found.append(scaler.unscale_([w]))
        scaler.update(found[-1])
        seen.append(float(scaler.scale))
    assert found == overflows, f"unscale_ reported overflows {found}, expected {overflows}"
    return seen


def grad_scaler_scales(overflows, options):
    """torch.amp.GradScaler's get_scale() after each update, on CPU, the same overflows."""
    scaler = torch.amp.GradScaler("cpu", **options)
    w = nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([w], lr=0.0)
    seen = []
    for overflow in overflows:
        optimizer.zero_grad()
        scaler.scale(w.sum()).backward()
        if overflow:
            w.grad[0] = float("inf")
        scaler.step(optimizer)
        scaler.update()
        seen.append(scaler.get_scale())
    return seen


# --- The MLP, one process's reference and the band ----------------------------------------


def build_mlp():
    torch.manual_seed(0)
    return nn.Linear(H, 4 * H), nn.Linear(4 * H, H)


def full_input():
    return torch.randn(B, S, H, generator=torch.Generator().manual_seed(1))


@functools.cache
def one_process(t, order=None):
    """The one-process MLP's output and gradients (of output.pow(2).sum() / 2); with
    ``order``, the row layer as t partial products summed in that order (the ranks'
    arithmetic). Also: each rank's partial output, each rank's part of the input's gradient,
    and each rank's slices of the parameter gradients."""
    fc1, fc2 = build_mlp()
    x = full_input().requires_grad_()
    hidden = F.gelu(fc1(x))
    parts = [F.linear(hr, wr) for hr, wr in zip(hidden.chunk(t, -1), fc2.weight.chunk(t, 1))]
    if order is None:
        out = fc2(hidden)
    else:
        out = functools.reduce(torch.add, [parts[r] for r in order]) + fc2.bias
    (out.pow(2).sum() / 2).backward()
    grad_out = out.detach()
    slices = [{"column weight": fc1.weight.grad.chunk(t)[r].clone(), "column bias": fc1.bias.grad.chunk(t)[r].clone(),
               "row weight": fc2.weight.grad.chunk(t, 1)[r].clone(), "row bias": fc2.bias.grad.clone()}
              for r in range(t)]
    input_parts = []
    for r in range(t):  # rank r's share of the input's gradient: through its own 4h/t features
        xr = full_input().requires_grad_()
        hr = F.gelu(F.linear(xr, fc1.weight.detach().chunk(t)[r], fc1.bias.detach().chunk(t)[r]))
        F.linear(hr, fc2.weight.detach().chunk(t, 1)[r]).backward(grad_out)
        input_parts.append(xr.grad)
    return {"output": out.detach(), "input gradient": x.grad, "partial outputs": [p.detach() + fc2.bias.detach()
                                                                                   for p in parts],
            "bias": fc2.bias.detach(), "input gradient parts": input_parts, "slices": slices}


@functools.cache
def bands(t):
    runs = [one_process(t, tuple(order)) for order in ring_orders(t)]
    reference = one_process(t)
    found = {name: rounding_band(reference[name], [run[name] for run in runs])[0]
             for name in ("output", "input gradient")}
    for name in ("column weight", "column bias", "row weight", "row bias"):
        found[name] = max(rounding_band(reference["slices"][r][name], [run["slices"][r][name] for run in runs])[0]
                          for r in range(t))
    return found


def mlp_on_rank(ColumnParallelLinear, RowParallelLinear):
    fc1, fc2 = build_mlp()
    column, row = ColumnParallelLinear(fc1), RowParallelLinear(fc2)
    x = full_input().requires_grad_()
    with trace.span("forward"):
        out = row(F.gelu(column(x)))
    with trace.span("backward"):
        (out.pow(2).sum() / 2).backward()
    return {"output": out.detach(), "input gradient": x.grad, "column weight": column.weight.grad,
            "column bias": column.bias.grad, "row weight": row.weight.grad, "row bias": row.bias.grad,
            "rank": dist.get_rank()}
