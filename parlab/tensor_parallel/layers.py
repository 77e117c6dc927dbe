"""Megatron's tensor-parallel layers: column- and row-parallel linear, the vocabulary-parallel
embedding and a cross-entropy that never gathers the logits.

A linear layer Y = X A^T + c with A of shape (out, in) splits two ways over t ranks:

- by columns of A^T (rows of A, output features): rank r holds A_r, out/t rows, and
  computes Y_r = X A_r^T + c_r, its out/t output features, from the whole input X. Every
  rank reads X, so X's gradient is the sum of the ranks' parts: X enters through f.
- by rows of A^T (columns of A, input features): rank r holds A_r, in/t columns, and
  computes the partial sum X_r A_r^T from its in/t input features X_r. The output is the
  sum over the ranks: it leaves through g, and the bias c is added once, after the sum.

Column then row (the MLP's fc1 then fc2, attention's query/key/value then proj) needs no
message in between: the column layer leaves each rank exactly the features its row layer
reads. With sequence parallelism f is ``gather_sequence`` and g ``scatter_sequence``
(``parlab.tensor_parallel.operators``). Each layer is built from a full ``nn.Linear`` or
``nn.Embedding`` and keeps this rank's slice of its parameters (a copy), so a tensor-parallel
model starts from exactly the one-process model's weights.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from parlab.tensor_parallel.operators import (
    all_reduce,
    copy_to_parallel,
    gather_sequence,
    reduce_from_parallel,
    scatter_sequence,
)

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "parallel_cross_entropy",
           "shard"]


def shard(tensor, dim, group=None, what="a tensor"):
    """This rank's 1/t of ``tensor`` along ``dim`` (a copy), t the group's size, r its rank."""
    t, r = dist.get_world_size(group), dist.get_rank(group)
    if tensor.shape[dim] % t:
        raise ValueError(f"{what} has {tensor.shape[dim]} rows along dimension {dim}, which do not split into "
                         f"t = {t} equal parts: choose sizes that are multiples of t (heads a, hidden h, V).")
    return tensor.detach().chunk(t, dim)[r].clone()


class ColumnParallelLinear(nn.Module):
    """Y_r = f(X) A_r^T + c_r for one or more full linear layers that read the same input
    (attention's query, key and value): rank r keeps rows r out/t .. (r + 1) out/t - 1 of each
    layer's A and c, stacked, so its output (..., sum of out/t) holds its slice of each layer's
    output, one after the other. ``sequence_parallel``: X is this rank's (b, s/t, in) and is
    all-gathered along s first (reduce-scattered in backward) instead of passing through f."""

    def __init__(self, linears, group=None, sequence_parallel=False):
        super().__init__()
        linears = [linears] if isinstance(linears, nn.Linear) else list(linears)
        self.group, self.sequence_parallel = group, sequence_parallel
        self.weight = nn.Parameter(torch.cat([shard(lin.weight, 0, group, "a column-parallel weight")
                                              for lin in linears]))  # (sum out / t, in)
        biases = [lin.bias for lin in linears]
        self.bias = None if biases[0] is None else nn.Parameter(torch.cat([shard(c, 0, group) for c in biases]))

    def forward(self, x):
        x = gather_sequence(x, self.group) if self.sequence_parallel else copy_to_parallel(x, self.group)
        return F.linear(x, self.weight, self.bias)  # (b, s, out/t)


class RowParallelLinear(nn.Module):
    """Y = g(X_r A_r^T) + c: rank r keeps columns r in/t .. (r + 1) in/t - 1 of the full
    layer's A and the whole bias c, reads its in/t input features X_r (what a column-parallel
    layer left it) and the ranks' partial sums are all-reduced. ``sequence_parallel``: they
    are reduce-scattered along s instead, and each rank gets its (b, s/t, out)."""

    def __init__(self, linear, group=None, sequence_parallel=False):
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel
        self.weight = nn.Parameter(shard(linear.weight, 1, group, "a row-parallel weight"))  # (out, in / t)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone())

    def forward(self, x):
        partial = F.linear(x, self.weight)  # (b, s, out), this rank's share of the sum
        leave = scatter_sequence if self.sequence_parallel else reduce_from_parallel
        y = leave(partial, self.group)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """The embedding table split by rows (vocabulary entries): rank r keeps entries
    r V/t .. (r + 1) V/t - 1, looks up the tokens it holds, writes zeros for the others, and
    the ranks' outputs are summed (g; reduce-scattered along s with ``sequence_parallel``)."""

    def __init__(self, embedding, group=None, sequence_parallel=False):
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel
        self.weight = nn.Parameter(shard(embedding.weight, 0, group, "the embedding table (V rows)"))  # (V/t, h)
        self.first = dist.get_rank(group) * self.weight.shape[0]

    def forward(self, tokens):
        local = tokens - self.first
        elsewhere = (local < 0) | (local >= self.weight.shape[0])
        partial = F.embedding(local.masked_fill(elsewhere, 0), self.weight).masked_fill(elsewhere[..., None], 0)
        if self.sequence_parallel:
            return scatter_sequence(partial, self.group)  # (b, s/t, h)
        return reduce_from_parallel(partial, self.group)  # (b, s, h)


def parallel_cross_entropy(logits, targets, group=None):
    """Mean cross-entropy of logits split by vocabulary, (b, s, V/t) on rank r holding entries
    r V/t .. (r + 1) V/t - 1, against targets (b, s), without gathering the (b, s, V) logits:

        loss = log sum_v exp(z_v - m) - (z_target - m),   m = max_v z_v

    Three all-reduces of b s numbers each: the maximum m (no gradient: the loss does not
    depend on it), the sum of exponentials and the target's logit (each rank holds a part of
    each sum; through g, so that in backward each rank receives the gradient of its own part:
    softmax(z) - onehot(target) on its V/t entries)."""
    V_local = logits.shape[-1]
    first = dist.get_rank(group) * V_local
    m = all_reduce(logits.detach().amax(-1), group, op="max")  # (b, s)
    shifted = logits - m[..., None]
    sum_exp = reduce_from_parallel(shifted.exp().sum(-1), group)  # (b, s)
    local = targets - first
    mine = (local >= 0) & (local < V_local)
    target_logit = shifted.gather(-1, local.clamp(0, V_local - 1)[..., None])[..., 0].masked_fill(~mine, 0)
    return (sum_exp.log() - reduce_from_parallel(target_logit, group)).mean()
