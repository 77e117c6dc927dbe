"""A small GPT, the model of lectures 07 and 08: L transformer layers of causal self-attention
and an MLP on a character-level text shipped with parlab.

Symbols (the glossary's): b sequences of s tokens, hidden size h, a attention heads of
h/a features each, L layers, V characters in the vocabulary. Every tensor between the layers
is (b, s, h). One layer (pre-LayerNorm, as GPT-2):

    x = x + dropout(proj(attention(query(n), key(n), value(n))))      n = LayerNorm_1(x)
    x = x + dropout(fc2(gelu(fc1(LayerNorm_2(x)))))                    fc1: h -> 4h, fc2: 4h -> h

Query, key and value are three h x h linear layers (heads are consecutive blocks of h/a
output features), and attention reshapes with h/a features per head and as many heads as
the tensor it gets: so ``parlab.tensor_parallel`` and torch's ``parallelize_module`` can
give each rank a/t whole heads by splitting those layers by rows, without changing this code.
Attention is written out (scores, causal mask, softmax, dropout, times values) so that what
autograd saves is Korthikanti et al.'s list (``parlab.tensor_parallel.activations``), the
(b, a, s, s) tensors included: memory-efficient attention (FlashAttention) never stores those.

``load_text()`` is a short original text about training in parallel; ``CharDataset`` turns it
into (input, target) sequences of s characters, the target shifted by one. ``batches`` draws the
batches every rank (and the reference) reads; ``train_in_one_process`` is the one-process
reference every parallel run of the GPT is compared with.
"""

import math
from dataclasses import dataclass
from importlib import resources

import torch
import torch.nn.functional as F
from torch import nn

from parlab.numerics import backward_in_shards

__all__ = ["GPT", "GPTConfig", "CharDataset", "causal_attention", "load_text"]


@dataclass(frozen=True)
class GPTConfig:
    """V characters, s positions, h hidden, a heads, L layers, dropout probability."""

    V: int = 64
    s: int = 64
    h: int = 128
    a: int = 4
    L: int = 2
    dropout: float = 0.0

    def __post_init__(self):
        for name in ("V", "s", "h", "a", "L"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"GPTConfig.{name} must be a whole number >= 1, got {value!r}.")
        if self.h % self.a:
            raise ValueError(f"h = {self.h} does not split into a = {self.a} heads: choose h a multiple of a.")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"dropout is a probability in [0, 1), got {self.dropout!r}.")


class CausalSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        h = config.h
        self.head_size = h // config.a
        self.query, self.key, self.value = nn.Linear(h, h), nn.Linear(h, h), nn.Linear(h, h)
        self.proj = nn.Linear(h, h)
        self.dropout = config.dropout
        # 0 on and below the diagonal, -inf above: added to the scores, it saves nothing for backward.
        future = torch.ones(config.s, config.s, dtype=torch.bool).triu(1)
        self.register_buffer("causal_bias", torch.zeros(config.s, config.s).masked_fill(future, -math.inf),
                             persistent=False)

    def forward(self, n):
        q, k, v = self.query(n), self.key(n), self.value(n)  # (b, s, h) each
        return self.proj(causal_attention(q, k, v, self.head_size, self.causal_bias, self.dropout, self.training))


def causal_attention(q, k, v, head_size, causal_bias, dropout=0.0, training=False):
    """Causal attention of q, k, v (b, s, heads x head_size), for any number of heads:
    softmax(q k^T / sqrt(head_size) + causal_bias) v per head, returned as (b, s, heads x head_size)."""
    b, s, width = q.shape
    q, k, v = (x.view(b, s, -1, head_size).transpose(1, 2) for x in (q, k, v))  # (b, heads, s, h/a)
    # the mask in the scores' dtype: an fp32 bias would promote bf16 scores to fp32, and p @ v fail
    scores = (q @ k.transpose(-2, -1)) * (1 / math.sqrt(head_size)) + causal_bias[:s, :s].to(q.dtype)
    p = F.dropout(scores.softmax(-1), dropout, training)  # (b, heads, s, s)
    return (p @ v).transpose(1, 2).reshape(b, s, width)


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(config.h, 4 * config.h), nn.Linear(4 * config.h, config.h)

    def forward(self, n):
        return self.fc2(F.gelu(self.fc1(n)))


class Block(nn.Module):
    """One transformer layer (module docstring)."""

    def __init__(self, config):
        super().__init__()
        self.norm1, self.attention = nn.LayerNorm(config.h), CausalSelfAttention(config)
        self.norm2, self.mlp = nn.LayerNorm(config.h), MLP(config)
        self.dropout = config.dropout

    def forward(self, x):
        x = x + F.dropout(self.attention(self.norm1(x)), self.dropout, self.training)
        return x + F.dropout(self.mlp(self.norm2(x)), self.dropout, self.training)


class GPT(nn.Module):
    """Token and position embeddings, L ``Block``s, a final LayerNorm and a linear head to V
    logits. ``forward(tokens)`` takes (b, s) character indices and returns (b, s, V) logits;
    ``loss(tokens, targets)`` the mean cross-entropy over the b s positions."""

    def __init__(self, config=GPTConfig()):
        super().__init__()
        self.config = config
        self.token_embedding = nn.Embedding(config.V, config.h)
        self.position_embedding = nn.Embedding(config.s, config.h)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.L))
        self.final_norm = nn.LayerNorm(config.h)
        self.head = nn.Linear(config.h, config.V, bias=False)

    def forward(self, tokens):
        s = tokens.shape[1]
        if s > self.config.s:
            raise ValueError(f"a sequence of {s} tokens is longer than the model's s = {self.config.s}: "
                             "cut it, or build the model with a larger GPTConfig.s.")
        x = self.token_embedding(tokens) + self.position_embedding.weight[:s]  # (b, s, h)
        for block in self.blocks:
            x = block(x)
        return self.head(self.final_norm(x))  # (b, s, V)

    def loss(self, tokens, targets):
        return F.cross_entropy(self(tokens).flatten(0, 1), targets.flatten())


def load_text():
    """The text shipped with parlab (parlab/data/parallel.txt), as one string."""
    return resources.files("parlab").joinpath("data", "parallel.txt").read_text(encoding="utf-8")


class CharDataset:
    """Characters as integers, and random batches of (input, target) sequences of s of them.

    ``vocabulary`` is the sorted set of the text's characters (V = its length); ``encode`` and
    ``decode`` map between strings and (n,) int64 tensors; ``batch(b, s, generator)`` draws b
    starting positions and returns inputs (b, s) and targets (b, s), the targets one
    character later."""

    def __init__(self, text=None):
        self.text = load_text() if text is None else text
        self.vocabulary = sorted(set(self.text))
        self.index = {c: i for i, c in enumerate(self.vocabulary)}
        self.data = self.encode(self.text)

    @property
    def V(self):
        return len(self.vocabulary)

    def encode(self, text):
        return torch.tensor([self.index[c] for c in text], dtype=torch.int64)

    def decode(self, tokens):
        return "".join(self.vocabulary[i] for i in tokens.tolist())

    def batch(self, b, s, generator=None):
        if len(self.data) <= s:
            raise ValueError(f"the text has {len(self.data)} characters, too few for sequences of s = {s}.")
        starts = torch.randint(len(self.data) - s, (b,), generator=generator)
        window = torch.arange(s + 1)
        chunk = self.data[starts[:, None] + window]  # (b, s + 1)
        return chunk[:, :-1], chunk[:, 1:]


def batches(B, s, count, seed=0):
    """``count`` batches of B sequences of s characters, (tokens, targets) each, drawn from
    ``CharDataset`` with a generator seeded ``seed``: the same list on every rank."""
    data, generator = CharDataset(), torch.Generator().manual_seed(seed)
    return [data.batch(B, s, generator) for _ in range(count)]


def train_in_one_process(config, batches, lr, shards=1, order=None, device="cpu"):
    """The reference of every parallel run of the GPT: ``GPT(config)`` (seed 0) trained with
    Adam on ``batches`` in one process on ``device``. Returns (the full batch's mean loss
    before each step, float32; the gradients of the first step by name). With ``shards``, each
    gradient is computed as that many ranks do, summed in ``order``
    (``parlab.numerics.backward_in_shards``: the yardstick's runs)."""
    torch.manual_seed(0)
    model = GPT(config).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    losses, first = [], None
    for tokens, targets in batches:
        tokens, targets = tokens.to(device), targets.to(device)
        with torch.no_grad():
            losses.append(model.loss(tokens, targets))
        parts = list(zip(tokens.tensor_split(shards), targets.tensor_split(shards)))
        backward_in_shards(model.loss, model.parameters(), parts, order)
        first = first or {name: p.grad.clone() for name, p in model.named_parameters()}
        optimizer.step()
    return torch.stack(losses).cpu(), first
