"""The small GPT (``parlab.gpt``) split over a tensor-parallel group of t ranks, as Megatron-LM
splits GPT: attention by heads, the MLP by its 4h features, the embedding and the head by
vocabulary, and (optionally) everything between them along the sequence.

One layer on rank r, without sequence parallelism (every rank holds x, (b, s, h)):

    n = LayerNorm_1(x)                                    (b, s, h), replicated
    q, k, v = ColumnParallel(f(n))                        (b, s, h/t) each: a/t heads
    x = x + dropout(RowParallel(attention(q, k, v)))      g: all-reduce of (b, s, h)
    n = LayerNorm_2(x)
    x = x + dropout(RowParallel(gelu(ColumnParallel(f(n)))))   (b, s, 4h/t) between them; g

so per layer 2 all-reduces of b s h elements forward (the two g) and 2 backward (the two f).
With sequence parallelism x is (b, s/t, h), this rank's positions: LayerNorm, dropout and
the residual additions act on the shard, f becomes an all-gather along s and g a
reduce-scatter: per layer 2 all-gathers and 2 reduce-scatters forward and the same backward,
the bytes of the all-reduces they replace.

Parameters that every rank of the group keeps whole (LayerNorm weights, the row-parallel
biases, the position embedding) get the full gradient on every rank without sequence
parallelism; with it each rank's gradient covers only its s/t positions, and
``reduce_sequence_parallel_gradients`` sums them over the group after backward (one
all-reduce of a flat buffer), as Megatron does.

Dropout on t ranks draws its masks from each rank's own generator: seed the ranks of a
group alike so that the replicated regions drop the same elements (the equivalence tests
train with dropout 0).

Selective recompute (Korthikanti et al. 2022, section 5; Megatron-LM's
``--recompute-activations``), ``recompute_attention=True``: the attention core (scores,
softmax, dropout, times values) runs under ``torch.utils.checkpoint``, so forward keeps only
its inputs q, k and v, and backward runs it again (with the same dropout mask) to get the
(b, a/t, s, s) tensors that the rest of the layer would otherwise keep from forward. Full
recompute, ``recompute_layers=True`` (Chen et al. 2016; Megatron-LM's
``--recompute-granularity full``): every layer runs under ``torch.utils.checkpoint``, keeping
only its input; backward runs the whole layer again, its tensor-parallel collectives included.

A pipeline stage, ``stage=(i, K)``: this rank holds stage i of K of the model (``parlab.mesh``
puts tensor-parallel layers inside pipeline stages, as Megatron-LM): layers i L/K to
(i + 1) L/K - 1, the embeddings on stage 0, the final norm and the head on stage K - 1; the
other layers' places hold nothing, so the parameters keep the whole model's names. ``forward``
takes the tokens on stage 0 and the previous stage's output elsewhere, and returns the logits
on the last stage and its activation, (b, s, h) or (b, s/t, h), on the others.
"""

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from parlab import trace
from parlab.collectives import ring_all_reduce
from parlab.gpt import GPT, causal_attention
from parlab.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    parallel_cross_entropy,
)

__all__ = ["ParallelGPT", "ParallelMLP", "ParallelAttention"]


class ParallelAttention(nn.Module):
    """``parlab.gpt.CausalSelfAttention`` on a/t heads: query, key and value in one
    column-parallel layer (one f for the three), proj row-parallel; with
    ``recompute_attention`` the core between them is recomputed in backward (module docstring)."""

    def __init__(self, attention, group=None, sequence_parallel=False, recompute_attention=False):
        super().__init__()
        heads, t = attention.query.out_features // attention.head_size, dist.get_world_size(group)
        if heads % t:
            raise ValueError(f"attention splits by heads: a = {heads} heads do not split over t = {t} ranks; "
                             "choose a multiple of t heads.")
        self.head_size, self.dropout = attention.head_size, attention.dropout
        self.recompute_attention = recompute_attention
        self.register_buffer("causal_bias", attention.causal_bias.clone(), persistent=False)
        self.qkv = ColumnParallelLinear([attention.query, attention.key, attention.value], group, sequence_parallel)
        self.proj = RowParallelLinear(attention.proj, group, sequence_parallel)

    def forward(self, n):
        q, k, v = self.qkv(n).chunk(3, dim=-1)  # (b, s, h/t) each
        core = (q, k, v, self.head_size, self.causal_bias, self.dropout, self.training)
        if self.recompute_attention:  # keeps q, k, v; its forward runs again in backward, same RNG state
            y = checkpoint(causal_attention, *core, use_reentrant=True)
        else:
            y = causal_attention(*core)  # (b, s, h/t)
        return self.proj(y)


class ParallelMLP(nn.Module):
    """``parlab.gpt.MLP``: fc1 column-parallel (4h/t features per rank), gelu on them, fc2 row-parallel."""

    def __init__(self, mlp, group=None, sequence_parallel=False):
        super().__init__()
        self.fc1 = ColumnParallelLinear(mlp.fc1, group, sequence_parallel)
        self.fc2 = RowParallelLinear(mlp.fc2, group, sequence_parallel)

    def forward(self, n):
        return self.fc2(F.gelu(self.fc1(n)))  # (b, s, 4h/t) between the two


class ParallelBlock(nn.Module):
    def __init__(self, block, group=None, sequence_parallel=False, recompute_attention=False):
        super().__init__()
        self.norm1, self.norm2 = copy.deepcopy(block.norm1), copy.deepcopy(block.norm2)
        self.attention = ParallelAttention(block.attention, group, sequence_parallel, recompute_attention)
        self.mlp = ParallelMLP(block.mlp, group, sequence_parallel)
        self.dropout = block.dropout

    def forward(self, x):  # x: (b, s, h), or (b, s/t, h) with sequence parallelism
        x = x + F.dropout(self.attention(self.norm1(x)), self.dropout, self.training)
        return x + F.dropout(self.mlp(self.norm2(x)), self.dropout, self.training)


class ParallelGPT(nn.Module):
    """This rank's part of ``model`` (a ``parlab.gpt.GPT``, whose weights it copies) on the
    tensor-parallel ``group`` (None: all ranks). ``forward(tokens)`` returns this rank's
    logits (b, s, V/t); ``loss(tokens, targets)`` the same mean cross-entropy as the full
    model's, computed without gathering the logits (``parallel_cross_entropy``). Every rank
    of the group passes the same tokens. ``recompute_attention``: selective recompute in
    every layer; ``recompute_layers``: full recompute; ``stage=(i, K)``: pipeline stage i of
    K (module docstring)."""

    def __init__(self, model, group=None, sequence_parallel=False, recompute_attention=False, recompute_layers=False,
                 stage=(0, 1)):
        super().__init__()
        if not isinstance(model, GPT):
            raise ValueError(f"ParallelGPT splits a parlab.gpt.GPT, got {type(model).__name__}.")
        t, (i, K), L = dist.get_world_size(group), stage, model.config.L
        if sequence_parallel and model.config.s % t:
            raise ValueError(f"sequence parallelism cuts s = {model.config.s} positions into t = {t} parts: choose s "
                             f"a multiple of {t}.")
        if not 0 <= i < K or L % K:
            raise ValueError(f"stage={stage!r}: a pipeline of K stages cuts the L = {L} layers evenly, stage i "
                             f"holding L/K of them: choose K dividing {L} and 0 <= i < K.")
        self.config, self.group, self.sequence_parallel = model.config, group, sequence_parallel
        self.first, self.last, self.recompute_layers = i == 0, i == K - 1, recompute_layers
        self.token_embedding = VocabParallelEmbedding(model.token_embedding, group, sequence_parallel) \
            if self.first else None
        self.position_embedding = copy.deepcopy(model.position_embedding) if self.first else None
        mine = range(i * L // K, (i + 1) * L // K)
        self.blocks = nn.ModuleList(ParallelBlock(block, group, sequence_parallel, recompute_attention)
                                    if j in mine else nn.Identity() for j, block in enumerate(model.blocks))
        self.layers = [self.blocks[j] for j in mine]
        self.final_norm = copy.deepcopy(model.final_norm) if self.last else None
        self.head = ColumnParallelLinear(model.head, group, sequence_parallel) if self.last else None  # V/t logits

    def forward(self, tokens):
        x = self.embed(tokens) if self.first else tokens  # (b, s, h), or (b, s/t, h)
        for block in self.layers:
            x = checkpoint(block, x, use_reentrant=False) if self.recompute_layers else block(x)
        if not self.last:
            return x
        return self.head(self.final_norm(x))  # f (or the all-gather along s), then (b, s, V/t)

    def embed(self, tokens):
        """Token and position embeddings of ``tokens``: (b, s, h), or this rank's (b, s/t, h)."""
        s = tokens.shape[1]
        positions = self.position_embedding.weight[:s]  # (s, h)
        if self.sequence_parallel:
            positions = positions.chunk(dist.get_world_size(self.group))[dist.get_rank(self.group)]  # (s/t, h)
        return self.token_embedding(tokens) + positions

    def loss(self, tokens, targets):
        return parallel_cross_entropy(self(tokens), targets, self.group)

    def replicated_parameters(self):
        """The parameters every rank of the group keeps whole (LayerNorms, row biases, positions)."""
        sharded = {id(m.weight) for m in self.modules()
                   if isinstance(m, (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding))}
        sharded |= {id(m.bias) for m in self.modules() if isinstance(m, ColumnParallelLinear) and m.bias is not None}
        return [p for p in self.parameters() if id(p) not in sharded]

    def reduce_sequence_parallel_gradients(self):
        """With sequence parallelism: sum the replicated parameters' gradients over the group
        (each rank's covers its s/t positions). Without it: nothing to do."""
        if not self.sequence_parallel or dist.get_world_size(self.group) == 1:
            return
        params = [p for p in self.replicated_parameters() if p.grad is not None]
        with torch.no_grad(), trace.span("sequence-parallel gradients"):
            flat = torch.cat([p.grad.flatten() for p in params])
            ring_all_reduce(flat, check=False, group=self.group)
            for p, reduced in zip(params, flat.split([p.numel() for p in params])):
                p.grad.copy_(reduced.view_as(p))
