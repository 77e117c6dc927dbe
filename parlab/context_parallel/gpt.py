"""The small GPT (``parlab.gpt``) with its sequences split over the cp ranks of a group: each
rank holds its positions of every sequence (the zig-zag split by default) and runs every
layer on them alone, except attention, whose keys and values come from the whole sequence.

One layer on rank r, x (b, s/cp, h) its positions (``sequence_indices(s, cp, r, split)``):

    n = LayerNorm_1(x)                                         (b, s/cp, h)   local
    q, k, v = query(n), key(n), value(n) -> (b, a, s/cp, h/a)  local: heads split out
    y = attention(q, k, v, causal=True, split, group)          the only communication
    x = x + proj(y)                                            local
    x = x + fc2(gelu(fc1(LayerNorm_2(x))))                     local

LayerNorm, the linear layers, the MLP and the head act on each position alone, so they need
no other rank's positions; the embedding adds the position embeddings of this rank's
positions, ``position_embedding.weight[positions]``, where the one-process GPT adds
``weight[:s]``. ``attention`` is any of the package's three methods (``ring_attention`` by
default, ``all_gather_attention``, ``ulysses_attention``: ``ATTENTION[method]``), or a
learner's own with their signature; each returns what the GPT's written-out attention gives.

The loss of this rank is the sum of its tokens' cross-entropies divided by the count of all
the tokens of the step (``tokens_in_batch``: B s over every rank of the data axes), so that
the ranks' losses, and their gradients, sum to the whole batch's mean and its gradient.

Every parameter is the GPT's, under the GPT's name, whole on every rank: context parallelism
splits activations, never weights. A parameter's gradient on one rank covers only that
rank's positions; summed over the cp group (and the dp group beside it,
``parlab.context_parallel.training``) it is the whole batch's.

Dropout is refused: the three attentions drop no probabilities (the lectures train with
dropout 0).
"""

import copy

import torch.nn.functional as F
from torch import nn

from parlab.context_parallel.communication import place_in_cp_group
from parlab.context_parallel.ring import ring_attention
from parlab.context_parallel.splits import _check_split, sequence_indices
from parlab.gpt import GPT

__all__ = ["ContextParallelAttention", "ContextParallelGPT", "check_attention", "context_parallel_attention"]


class ContextParallelAttention(nn.Module):
    """``parlab.gpt.CausalSelfAttention`` on this rank's positions: the same query, key,
    value and proj layers (shared with ``layer``, not copied), the attention itself by
    ``attend`` (e.g. ``ring_attention``) over ``group``."""

    def __init__(self, layer, group=None, attend=ring_attention, split="zigzag"):
        super().__init__()
        self.query, self.key, self.value, self.proj = layer.query, layer.key, layer.value, layer.proj
        self.head_size, self.group, self.attend, self.split = layer.head_size, group, attend, split

    def forward(self, n):  # (b, s/cp, h)
        q, k, v = (layer(n) for layer in (self.query, self.key, self.value))  # (b, s/cp, h) each
        return self.proj(context_parallel_attention(q, k, v, self.head_size, self.attend, self.split, self.group))


class ContextParallelGPT(nn.Module):
    """This rank's view of ``model`` (a ``parlab.gpt.GPT``, whose weights it copies) on the
    context-parallel ``group`` of cp ranks (None: all ranks; on a mesh, ``mesh.group("cp")``).

    ``forward(tokens)``: ``tokens`` (b, s/cp) are this rank's positions of b sequences of s,
    cut by ``split`` ("zigzag" or "contiguous"; ``shard_sequence(tokens, cp, r, split, dim=1)``);
    returns their logits (b, s/cp, V). ``loss(tokens, targets, tokens_in_batch)``: the sum of
    this rank's cross-entropies over ``tokens_in_batch`` (module docstring). ``attention``:
    ``ring_attention`` (default), ``all_gather_attention`` or ``ulysses_attention``."""

    def __init__(self, model, group=None, attention=ring_attention, split="zigzag"):
        super().__init__()
        if not isinstance(model, GPT):
            raise ValueError(f"ContextParallelGPT splits a parlab.gpt.GPT, got {type(model).__name__}.")
        check_attention(attention, model.config.dropout)
        _check_split(split)
        self.rank, self.cp = place_in_cp_group(group)
        self.config, self.group, self.split = model.config, group, split
        # the GPT's modules under the GPT's names, so that parameters and gradients compare by name
        self.token_embedding = copy.deepcopy(model.token_embedding)
        self.position_embedding = copy.deepcopy(model.position_embedding)
        self.blocks = copy.deepcopy(model.blocks)
        for block in self.blocks:  # Block.forward runs as it is; only its attention changes
            block.attention = ContextParallelAttention(block.attention, group, attention, split)
        self.final_norm, self.head = copy.deepcopy(model.final_norm), copy.deepcopy(model.head)

    def positions(self, s):
        """The positions of a sequence of s that this rank holds, increasing."""
        if s > self.config.s:
            raise ValueError(f"a sequence of {s} tokens is longer than the model's s = {self.config.s}: cut it, or "
                             "build the model with a larger GPTConfig.s.")
        return sequence_indices(s, self.cp, self.rank, self.split)

    def forward(self, tokens):
        s = tokens.shape[1] * self.cp
        positions = self.positions(s).to(tokens.device)
        x = self.token_embedding(tokens) + self.position_embedding.weight[positions]  # (b, s/cp, h)
        for block in self.blocks:
            x = block(x)
        return self.head(self.final_norm(x))  # (b, s/cp, V)

    def loss(self, tokens, targets, tokens_in_batch):
        """This rank's share of the batch's mean loss: sum of its cross-entropies / ``tokens_in_batch``."""
        logits = self(tokens)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum") / tokens_in_batch


def context_parallel_attention(q, k, v, head_size, attend=ring_attention, split="zigzag", group=None):
    """Causal attention of this rank's s/cp positions on its heads (all a, or a tensor-parallel
    rank's a/t), the keys and values of the other positions coming from the cp ranks of
    ``group`` by ``attend``: q, k, v (b, s/cp, width) -> (b, s/cp, width), width = heads x
    ``head_size``, as the GPT's written-out attention on the whole sequence gives."""
    b, n, width = q.shape
    q, k, v = (x.view(b, n, -1, head_size).transpose(1, 2) for x in (q, k, v))  # (b, heads, s/cp, h/a)
    y = attend(q, k, v, causal=True, split=split, group=group)  # (b, heads, s/cp, h/a)
    return y.transpose(1, 2).reshape(b, n, width)  # (b, s/cp, width)


def check_attention(attention, dropout):
    """A ValueError saying what to change unless ``attention`` is a function and the GPT's
    ``dropout`` is 0: what a context-parallel GPT (this one, or ``ParallelGPT`` with a
    ``context_group``) needs."""
    if not callable(attention):
        raise ValueError(f"attention must be a function such as ring_attention (ATTENTION[method]), got "
                         f"{attention!r}: pass one of parlab.context_parallel's methods.")
    if dropout:
        raise ValueError(f"context-parallel attention drops no probabilities, but the GPT has dropout = "
                         f"{dropout}: build it with GPTConfig(dropout=0.0).")
