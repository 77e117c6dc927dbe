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

Context parallelism beside it, ``context_group`` (cp ranks, on a mesh ``mesh.group("cp")``;
lecture 09, ``parlab.context_parallel``): every rank of a tp group holds the same s/cp
positions of each sequence (``split``, zig-zag by default) and its a/t heads. Everything but
attention acts on one position at a time, so the layer above runs as it is on (b, s/cp, h),
or (b, s/(cp t), h) with sequence parallelism, its tp collectives in the tp group; the
embedding adds the position embeddings of the rank's positions (``sequence_indices``), and
the attention core takes the other positions' keys and values from the cp group:

    q, k, v (b, s/cp, h/t) -> (b, a/t, s/cp, h/a)                    heads split out
    y = attention(q, k, v, causal=True, split, group=context_group)  the cp messages
    y (b, a/t, s/cp, h/a) -> (b, s/cp, h/t)                          into RowParallel(proj)

so a rank's ring carries K/V blocks of h/t features a position: 1/t of the cp-only GPT's.
``loss`` with cp is the sum of the rank's cross-entropies over ``tokens_in_batch`` tokens,
so that the gradients summed over the cp (and dp) ranks are the batch mean's. Dropout and
selective recompute are refused with cp (the cp attentions drop no probabilities, and
replace the core that ``recompute_attention`` checkpoints); so are pipeline stages.
"""

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from parlab import trace
from parlab.collectives import ring_all_reduce
from parlab.context_parallel.gpt import check_attention, context_parallel_attention
from parlab.context_parallel.ring import ring_attention
from parlab.context_parallel.splits import sequence_indices
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
    ``recompute_attention`` the core between them is recomputed in backward; with a
    ``context_group`` of cp > 1 ranks the core is ``attend`` (``ring_attention``) over it, on
    the rank's positions (module docstring)."""

    def __init__(self, attention, group=None, sequence_parallel=False, recompute_attention=False,
                 context_group=None, attend=ring_attention, split="zigzag"):
        super().__init__()
        heads, t = attention.query.out_features // attention.head_size, dist.get_world_size(group)
        if heads % t:
            raise ValueError(f"attention splits by heads: a = {heads} heads do not split over t = {t} ranks; "
                             "choose a multiple of t heads.")
        self.head_size, self.dropout = attention.head_size, attention.dropout
        self.recompute_attention = recompute_attention
        self.context_group, self.attend, self.split = _context(context_group), attend, split
        if self.context_group is not None:
            check_attention(attend, self.dropout)
            if recompute_attention:
                raise ValueError("recompute_attention checkpoints the written-out attention core, which context "
                                 "parallelism replaces (ring attention recomputes its blocks in backward anyway): "
                                 "leave recompute_attention=False, or recompute whole layers with "
                                 "recompute_layers=True.")
        self.register_buffer("causal_bias", attention.causal_bias.clone(), persistent=False)
        self.qkv = ColumnParallelLinear([attention.query, attention.key, attention.value], group, sequence_parallel)
        self.proj = RowParallelLinear(attention.proj, group, sequence_parallel)

    def forward(self, n):
        q, k, v = self.qkv(n).chunk(3, dim=-1)  # (b, s, h/t) each; with cp (b, s/cp, h/t)
        if self.context_group is not None:
            return self.proj(context_parallel_attention(q, k, v, self.head_size, self.attend, self.split,
                                                        self.context_group))
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
    """One layer (module docstring); ``context``: ``ParallelAttention``'s context-parallel options."""

    def __init__(self, block, group=None, sequence_parallel=False, recompute_attention=False, **context):
        super().__init__()
        self.norm1, self.norm2 = copy.deepcopy(block.norm1), copy.deepcopy(block.norm2)
        self.attention = ParallelAttention(block.attention, group, sequence_parallel, recompute_attention, **context)
        self.mlp = ParallelMLP(block.mlp, group, sequence_parallel)
        self.dropout = block.dropout

    def forward(self, x):  # x: (b, s, h), or (b, s/t, h) with sequence parallelism; s/cp for s with cp
        x = x + F.dropout(self.attention(self.norm1(x)), self.dropout, self.training)
        return x + F.dropout(self.mlp(self.norm2(x)), self.dropout, self.training)


class ParallelGPT(nn.Module):
    """This rank's part of ``model`` (a ``parlab.gpt.GPT``, whose weights it copies) on the
    tensor-parallel ``group`` (None: all ranks). ``forward(tokens)`` returns this rank's
    logits (b, s, V/t); ``loss(tokens, targets)`` the same mean cross-entropy as the full
    model's, computed without gathering the logits (``parallel_cross_entropy``). Every rank
    of the group passes the same tokens. ``recompute_attention``: selective recompute in
    every layer; ``recompute_layers``: full recompute; ``stage=(i, K)``: pipeline stage i of
    K. ``context_group``: the cp ranks that split each sequence (None: no context
    parallelism); then ``tokens`` are this rank's (b, s/cp) positions, cut by ``split``
    (``shard_sequence(tokens, cp, r, split, dim=1)``), the logits (b, s/cp, V/t), and
    ``attention`` the cp attention (``ring_attention``, or any of
    ``parlab.context_parallel.ATTENTION``) (module docstring)."""

    def __init__(self, model, group=None, sequence_parallel=False, recompute_attention=False, recompute_layers=False,
                 stage=(0, 1), context_group=None, attention=ring_attention, split="zigzag"):
        super().__init__()
        if not isinstance(model, GPT):
            raise ValueError(f"ParallelGPT splits a parlab.gpt.GPT, got {type(model).__name__}.")
        t, (i, K), L = dist.get_world_size(group), stage, model.config.L
        self.context_group, self.split = _context(context_group), split
        self.cp = 1 if self.context_group is None else dist.get_world_size(self.context_group)
        parts = f"cp x t = {self.cp} x {t}" if self.cp > 1 else f"t = {t}"
        if sequence_parallel and model.config.s % (self.cp * t):
            raise ValueError(f"sequence parallelism cuts s = {model.config.s} positions into {parts} parts: choose s "
                             f"a multiple of {self.cp * t}.")
        if not 0 <= i < K or L % K:
            raise ValueError(f"stage={stage!r}: a pipeline of K stages cuts the L = {L} layers evenly, stage i "
                             f"holding L/K of them: choose K dividing {L} and 0 <= i < K.")
        if self.cp > 1 and K > 1:
            raise ValueError(f"with a context_group of cp = {self.cp} ranks ParallelGPT holds the whole model, not "
                             f"pipeline stage {stage!r}: pass stage=(0, 1), or train stages without cp "
                             "(parlab.mesh_training on dp, tp and pp).")
        self.config, self.group, self.sequence_parallel = model.config, group, sequence_parallel
        self.first, self.last, self.recompute_layers = i == 0, i == K - 1, recompute_layers
        self.token_embedding = VocabParallelEmbedding(model.token_embedding, group, sequence_parallel) \
            if self.first else None
        self.position_embedding = copy.deepcopy(model.position_embedding) if self.first else None
        mine = range(i * L // K, (i + 1) * L // K)
        context = dict(context_group=self.context_group, attend=attention, split=split)
        self.blocks = nn.ModuleList(ParallelBlock(block, group, sequence_parallel, recompute_attention, **context)
                                    if j in mine else nn.Identity() for j, block in enumerate(model.blocks))
        self.layers = [self.blocks[j] for j in mine]
        self.final_norm = copy.deepcopy(model.final_norm) if self.last else None
        self.head = ColumnParallelLinear(model.head, group, sequence_parallel) if self.last else None  # V/t logits

    def forward(self, tokens):
        x = self.embed(tokens) if self.first else tokens  # (b, s, h), or (b, s/t, h); s/cp for s with cp
        for block in self.layers:
            x = checkpoint(block, x, use_reentrant=False) if self.recompute_layers else block(x)
        if not self.last:
            return x
        return self.head(self.final_norm(x))  # f (or the all-gather along s), then (b, s, V/t)

    def embed(self, tokens):
        """Token and position embeddings of ``tokens``: (b, s, h), or this rank's (b, s/t, h);
        with cp, ``tokens`` (b, s/cp) are this rank's positions, and s/cp takes the place of s."""
        n = tokens.shape[1]
        if n * self.cp > self.config.s:
            raise ValueError(f"a sequence of {n * self.cp} tokens is longer than the model's s = {self.config.s}: "
                             "cut it, or build the model with a larger GPTConfig.s.")
        if self.context_group is None:
            positions = self.position_embedding.weight[:n]  # (s, h)
        else:  # this rank's positions of the whole sequence of cp n, as parlab.context_parallel cuts it
            mine = sequence_indices(n * self.cp, self.cp, dist.get_rank(self.context_group), self.split)
            positions = self.position_embedding.weight[mine.to(tokens.device)]  # (s/cp, h)
        if self.sequence_parallel:
            positions = positions.chunk(dist.get_world_size(self.group))[dist.get_rank(self.group)]  # (s/t, h)
        return self.token_embedding(tokens) + positions

    def loss(self, tokens, targets, tokens_in_batch=None):
        """The sum of the cross-entropies of this rank's ``targets`` ((b, s), or (b, s/cp) with
        cp) divided by ``tokens_in_batch``; by default the b sequences' tokens, b s: their mean,
        or with cp this rank's share of it (the cp ranks' losses sum to the mean). A trainer
        passes all the tokens of its step, so that the gradients summed over the data axes
        are the batch mean's."""
        count = targets.numel()
        total = count * self.cp if tokens_in_batch is None else tokens_in_batch
        mean = parallel_cross_entropy(self(tokens), targets, self.group)  # over this rank's count tokens
        return mean if total == count else mean * (count / total)  # its sum of cross-entropies / total

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


def _context(group):
    """The context-parallel group where it has cp > 1 ranks, else None: one rank splits nothing."""
    return group if group is not None and dist.get_world_size(group) > 1 else None

