"""The ZeRO engines hide their communication behind compute, read from the trace of a step under
an emulated link, with layers of declared compute time (so the picture is the same on any
machine): ZeroDP's stage 0 all-reduces and stage 2 reduce-scatters a bucket while backward
computes the next layers' gradients, on the communication thread; FSDP unshards the next unit
while the current one computes, in forward and in backward, and reduce-scatters a unit's
gradient while the next unit's backward computes. Without the overlap (FSDP's prefetch=False)
the collectives run between the declared computes, never during one. And the collectives of
the communication thread and the main thread's (tensor parallelism) run side by side."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

import parlab
from parlab import collectives, trace
from parlab.runtime import emulation
from parlab.units import MIB
from parlab.zero import FSDP, ZeroDP

LINK = parlab.Link(latency=1e-3, bandwidth=20e6)  # a layer's bucket (16.6 kB): a few ms on it
WIDTH, LAYERS, BACKWARD_S = 64, 4, 0.03  # every layer's backward takes 30 ms, declared
LAYER_BYTES = (WIDTH + 1) * WIDTH * 4


class _DeclaredBackward(torch.autograd.Function):
    """Identity; its backward is declared compute, traced as a "backward compute" span."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        with trace.span("backward compute"):
            emulation.compute(BACKWARD_S)
        return grad


class DeclaredBackward(nn.Module):
    def forward(self, x):
        return _DeclaredBackward.apply(x)


def chain():
    """Linear layers, each behind a declared backward: the gradients of layer l are ready,
    then the backward of the layers before it takes BACKWARD_S each."""
    torch.manual_seed(0)
    return nn.Sequential(*[module for _ in range(LAYERS) for module in (DeclaredBackward(), nn.Linear(WIDTH, WIDTH))])


def zero_step(stage):
    engine = ZeroDP(chain(), torch.optim.SGD, stage=stage, bucket_cap_mb=LAYER_BYTES / MIB, lr=0.1)  # a bucket a layer
    # an input that wants its gradient: the first layer's backward computes too, after its bucket is launched
    x = torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(dist.get_rank())).requires_grad_()
    for step in range(2):  # the first step makes the ring's receive buffers; the second is traced
        engine.zero_grad()
        with trace.span("step", stage=step):
            engine(x).square().mean().backward()
            engine.step()


def by_unit(timeline, rank, name):
    """The last step's spans of ``name`` on ``rank``, {unit: [span, ...] in time order}."""
    step = timeline.select(rank=rank, name="step")[-1]
    spans = {}
    for span in timeline.select(rank=rank, name=name):
        if span.start >= step.start:
            spans.setdefault(span.stage, []).append(span)
    return spans


def overlapping(first, second):
    return first.start < second.end and second.start < first.end


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stage, collective", [(0, "all-reduce gradients"), (2, "reduce-scatter gradients")])
def test_zero_dp_reduces_a_bucket_while_backward_computes_the_next(cluster2, stage, collective):
    with cluster2.emulate(link=LINK):
        timeline = cluster2.trace(zero_step, stage, timeout=120)
    for rank in range(2):
        step = timeline.select(rank=rank, name="step")[-1]
        computes = [span for span in timeline.select(rank=rank, name="backward compute") if span.start >= step.start]
        reductions = [span for span in timeline.select(rank=rank, name=collective) if span.start >= step.start]
        sends = [ev for ev in timeline.select(rank=rank, kind="comm") if ev.name == "isend" and ev.start >= step.start]
        assert len(computes) == LAYERS and len(reductions) == LAYERS, (rank, computes, reductions)
        # the last layer's bucket goes first and is on the wire while the layers before it compute
        assert reductions[0].stage == 0 and reductions[0].start < computes[-1].end
        assert any(overlapping(send, compute) for send in sends for compute in computes), rank
        # every bucket is reduced once, in the order backward filled them (when each one runs beside
        # compute depends on how soon the CPU gives the communication thread its turn: not asserted)
        assert [reduction.stage for reduction in reductions] == list(range(LAYERS)), rank


class _AllReducedBackward(torch.autograd.Function):
    """Identity whose backward ring all-reduces the gradient over ``group`` on the main thread,
    as tensor parallelism's operators do, while ZeroDP's buckets are in flight."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        for _ in range(10):
            collectives.ring_all_reduce(grad, op="avg", check=False, group=ctx.group)
        return grad, None


class AllReducingChain(nn.Module):
    def __init__(self, group):
        super().__init__()
        self.group, self.layers = group, nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS))

    def forward(self, x):
        for layer in self.layers:
            x = _AllReducedBackward.apply(layer(x), self.group)
        return x


def stages_beside_main_thread_collectives():
    """On a 2 x 2 grid: ZeroDP over the column (ranks r, r + 2) while backward all-reduces over
    the row (ranks 2i, 2i + 1): stage 2's reduce-scatters and stage 0's all-reduces run on the
    communication thread while the main thread's run."""
    rank, groups = dist.get_rank(), [dist.new_group(ranks) for ranks in ([0, 1], [2, 3], [0, 2], [1, 3])]
    try:
        row, column = groups[rank // 2], groups[2 + rank % 2]
        results = {}
        for stage in (0, 1, 2):
            torch.manual_seed(0)
            engine = ZeroDP(AllReducingChain(row), torch.optim.SGD, stage=stage, lr=0.1, group=column,
                            **({} if stage == 1 else dict(bucket_cap_mb=LAYER_BYTES / MIB)))
            x = torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(rank // 2))
            for _ in range(3):
                engine.zero_grad()
                engine(x).square().mean().backward()
                engine.step()
            results[stage] = engine.full_parameters()
        return results
    finally:
        for group in groups:
            dist.destroy_process_group(group)


@pytest.mark.timeout(120)
def test_the_communication_thread_and_the_main_thread_run_collectives_side_by_side(cluster4):
    """Each thread has its own receive buffers (``parlab.collectives``): shared ones would mix
    the two collectives' partial sums, and stage 2 would drift from stage 1."""
    for rank, results in enumerate(cluster4.run(stages_beside_main_thread_collectives, timeout=120)):
        assert all(torch.equal(results[2][name], results[1][name]) for name in results[1]), rank
        assert all((results[0][name] - results[1][name]).abs().max() < 1e-5 for name in results[1]), rank


class _DeclaredCompute(torch.autograd.Function):
    """Identity; forward and backward are declared compute, traced as "forward compute" and
    "backward compute" spans of stage ``index`` (the FSDP unit they are in)."""

    @staticmethod
    def forward(ctx, x, index):
        ctx.index = index
        with trace.span("forward compute", stage=index):
            emulation.compute(BACKWARD_S / 2)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        with trace.span("backward compute", stage=ctx.index):
            emulation.compute(BACKWARD_S)
        return grad, None


class Block(nn.Module):
    """An FSDP unit: a Linear layer and then declared compute."""

    def __init__(self, index):
        super().__init__()
        self.index, self.linear = index, nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return _DeclaredCompute.apply(self.linear(x), self.index)


def fsdp_step(prefetch):
    torch.manual_seed(0)
    model = nn.Sequential(*[Block(index) for index in range(LAYERS)])
    engine = FSDP(model, torch.optim.SGD, wrap_policy=lambda module: isinstance(module, Block), prefetch=prefetch,
                  lr=0.1)
    x = torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(dist.get_rank()))
    for step in range(2):  # the first step learns the units' order and makes the receive buffers
        engine.zero_grad()
        with trace.span("step", stage=step):
            engine(x).square().mean().backward()
            engine.step()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("prefetch", [True, False])
def test_fsdp_gathers_the_next_unit_while_this_one_computes(cluster2, prefetch):
    with cluster2.emulate(link=LINK):
        timeline = cluster2.trace(fsdp_step, prefetch, timeout=120)
    for rank in range(2):
        gathers, reductions, forward, backward = (
            by_unit(timeline, rank, name) for name in ("all-gather", "reduce-scatter", "forward compute",
                                                       "backward compute"))
        assert sorted(gathers) == list(range(LAYERS)) and all(len(g) == 2 for g in gathers.values())  # fwd, bwd
        overlaps = {  # what runs while unit u computes: the next unit's gather, the last one's reduce-scatter
            "forward gathers": [overlapping(gathers[u + 1][0], forward[u][0]) for u in range(LAYERS - 1)],
            "backward gathers": [overlapping(gathers[u - 1][1], backward[u][0]) for u in range(1, LAYERS)],
            "reduce-scatters": [overlapping(reductions[u + 1][0], backward[u][0]) for u in range(LAYERS - 1)],
        }
        for what, seen in overlaps.items():
            # inline, a collective never runs during a compute; prefetched, they do (each one's exact
            # start is the CPU's choice on a shared machine, so: some of them, not every one)
            assert any(seen) if prefetch else not any(seen), (rank, what, seen)
