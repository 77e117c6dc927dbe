"""The communication of tensor parallelism as autograd functions: Megatron's conjugate
operators f and g, and sequence parallelism's all-gather / reduce-scatter pair.

A tensor-parallel group of t ranks computes one layer together. Between the layers every
rank holds the whole activation (b, s, h) (without sequence parallelism) or its s/t
positions of it (b, s/t, h) (with it). Two operators enter and leave a parallel region:

    operator           forward                          backward
    f                  identity                         all-reduce (sum) of the gradient
    g                  all-reduce (sum)                 identity
    gather_sequence    all-gather along s               reduce-scatter along s
    scatter_sequence   reduce-scatter along s           all-gather along s

f and g are conjugate: each one's backward is the other's forward. A column-parallel layer
starts with f (every rank reads the whole input, so the input's gradient is the sum of the
t ranks' parts); a row-parallel layer ends with g (each rank holds a partial sum of the
output). With sequence parallelism f becomes gather_sequence and g scatter_sequence: an
all-reduce is a reduce-scatter followed by an all-gather, so the bytes on the wire stay the
same and the activations between the regions are cut t ways.

Every collective runs on parlab's ring (``parlab.collectives``, ``group=`` the tensor-parallel
group), so the emulated link shapes it and ``cluster.trace`` sees every byte; each is marked
with a span named after it ("all-reduce", "all-gather", "reduce-scatter") for counting.
With t = 1 (or ``group`` None on a world of one) the operators are identities.
"""

import torch
import torch.distributed as dist

from parlab import trace
from parlab.collectives import ring_all_gather, ring_all_reduce, ring_reduce_scatter

__all__ = ["all_reduce", "all_gather_sequence", "copy_to_parallel", "gather_sequence", "reduce_from_parallel",
           "reduce_scatter_sequence", "scatter_sequence", "f", "g"]


def all_reduce(x, group=None, op="sum"):
    """``x`` reduced (``op``: "sum" or "max") over the group's ranks, as a new tensor (ring all-reduce)."""
    if dist.get_world_size(group) == 1:
        return x
    reduced = x.contiguous().clone()
    with trace.span("all-reduce"):
        ring_all_reduce(reduced, op, check=False, group=group)
    return reduced


def all_gather_sequence(x, group=None):
    """(b, s/t, ...) on each rank -> (b, s, ...): rank r's positions go to rows r s/t .. (r + 1) s/t - 1."""
    t, r = dist.get_world_size(group), dist.get_rank(group)
    if t == 1:
        return x
    chunks = torch.empty((t, *x.shape), dtype=x.dtype, device=x.device)  # (t, b, s/t, ...): chunk r is rank r's
    chunks[r] = x
    with trace.span("all-gather"):
        ring_all_gather(chunks, check=False, group=group)
    return chunks.transpose(0, 1).flatten(1, 2)  # (b, t, s/t, ...) -> (b, s, ...)


def reduce_scatter_sequence(x, group=None):
    """(b, s, ...) on each rank -> (b, s/t, ...): rank r gets rows r s/t .. (r + 1) s/t - 1 of the sum."""
    t, r = dist.get_world_size(group), dist.get_rank(group)
    if t == 1:
        return x
    if x.shape[1] % t:
        raise ValueError(f"sequence parallelism cuts the sequence into t = {t} equal parts, but s = {x.shape[1]}: "
                         f"choose a sequence length that is a multiple of {t}.")
    chunks = x.unflatten(1, (t, -1)).transpose(0, 1).contiguous()  # (t, b, s/t, ...): chunk r goes to rank r
    with trace.span("reduce-scatter"):
        ring_reduce_scatter(chunks, check=False, group=group)
    return chunks[r].clone()


class _CopyToParallel(torch.autograd.Function):
    """f: identity forward, all-reduce of the gradient backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return all_reduce(grad, ctx.group), None


class _ReduceFromParallel(torch.autograd.Function):
    """g: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        return all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherSequence(torch.autograd.Function):
    """Sequence parallelism's f: all-gather along s forward, reduce-scatter backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_gather_sequence(x, group)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter_sequence(grad, ctx.group), None


class _ScatterSequence(torch.autograd.Function):
    """Sequence parallelism's g: reduce-scatter along s forward, all-gather backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return reduce_scatter_sequence(x, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_sequence(grad, ctx.group), None


def copy_to_parallel(x, group=None):
    """f (module docstring): enter a column-parallel region."""
    return _CopyToParallel.apply(x, group)


def reduce_from_parallel(x, group=None):
    """g (module docstring): leave a row-parallel region, summing the ranks' partial outputs."""
    return _ReduceFromParallel.apply(x, group)


def gather_sequence(x, group=None):
    """Enter a parallel region from sequence-parallel activations: (b, s/t, h) -> (b, s, h)."""
    return _GatherSequence.apply(x, group)


def scatter_sequence(x, group=None):
    """Leave a parallel region into sequence-parallel activations: (b, s, h) partial sums -> (b, s/t, h)."""
    return _ScatterSequence.apply(x, group)


f, g = copy_to_parallel, reduce_from_parallel
