"""The memory of activations: what autograd saves for backward, per transformer layer,
measured exactly and put beside Korthikanti et al.'s formulas ("Reducing Activation
Recomputation in Large Transformer Models", 2022, Table 2).

Symbols (the glossary's): s sequence length, b micro-batch size, h hidden size, a heads,
t tensor-parallel degree, L layers. The paper counts bytes with 16-bit activations and
1-byte dropout masks, per layer:

    no parallelism                      s b h (34 + 5 a s / h)
    tensor parallel (TP)                s b h (10 + 24/t + 5 a s / (h t))
    TP + sequence parallel (SP)         s b h (34/t + 5 a s / (h t))
    TP, selective recompute             s b h (10 + 24/t)
    TP + SP, selective recompute        s b h (34/t)
    full recompute                      2 s b h          (only the layer's input is kept)

The 34 s b h are, in values (2 bytes each) and masks (1 byte): the inputs of the two
LayerNorms (2 sbh values), the inputs of the query/key/value and fc1 layers (2 sbh), q, k
and v (3 sbh), the input of proj (sbh), of gelu (4 sbh) and of fc2 (4 sbh), and the two
residual dropout masks (2 sbh masks): 16 sbh values and 2 sbh masks. The 5 a s^2 b are the
softmax's output and its dropout's output (2 a s^2 b values) and that dropout's mask
(a s^2 b masks): the (b, a, s, s) tensors of attention written out, as ``parlab.gpt`` writes
it. TP divides everything between f and g by t (12 sbh values and the attention's a s^2 b
terms); the LayerNorms, the inputs of the column layers and the residual masks stay whole:
10 sbh bytes. SP cuts those along s too. Selective recompute keeps everything but the
(b, a, s, s) tensors, which backward recomputes from q, k and v (``ParallelGPT(...,
recompute_attention=True)``); memory-efficient attention (FlashAttention and its kin) never
forms them at all: ``measure_attention_bytes`` shows what each kind of attention keeps.

``layer_saved_bytes`` lists the same items for parlab's layer (``parlab.gpt.Block``,
``parlab.tensor_parallel.model.ParallelBlock``) with the byte sizes as arguments, and the
two places where parlab's layer saves something else:

- LayerNorm also saves its mean and 1/std, b s numbers each (b s/t with SP), 4 b s numbers
  per layer that the paper leaves out as small;
- with SP, parlab's column layers save the all-gathered input (b, s, h) that they multiply,
  where Megatron saves the shard and all-gathers it again in backward: 2 s b h (1 - 1/t)
  values more;
- a dropout mask is 1 byte on a GPU (torch's fused dropout saves a bool mask) but on a CPU
  F.dropout multiplies by a scaled mask in the activations' dtype and saves that: pass
  ``mask_bytes=value_bytes`` there (``dropout_mask_bytes``).

``SavedBytes`` counts what autograd saves while it is active, each storage once (q, k and v
are views of their own tensors; a tensor two operations save counts once), leaving out
parameters and buffers (weights are not activations); it also follows the bytes still held
through backward, so its ``peak`` shows activation checkpointing's L/c + c.
"""

import math
import weakref

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from parlab.gpt import causal_attention
from parlab.memory import transformer_activation_bytes

__all__ = ["korthikanti_bytes", "layer_saved_bytes", "layer_bytes", "dropout_mask_bytes", "SavedBytes",
           "measure_saved_bytes", "measure_attention_bytes", "checkpoint_peak_units", "measure_checkpointed_chain",
           "recompute_kind"]


def recompute_kind(recompute):
    """None, "selective" or "full" for a ``recompute`` argument: False, None or "none" keep
    every activation, "selective" recomputes the attention's (b, a, s, s) tensors, True or
    "full" keeps only the layer's input."""
    if recompute is None or recompute is False or recompute == "none":
        return None
    if recompute is True or recompute == "full":
        return "full"
    if recompute == "selective":
        return "selective"
    raise ValueError(f'recompute must be False (keep everything), "selective" or True ("full"), got {recompute!r}.')


def korthikanti_bytes(s, b, h, a, t=1, sequence_parallel=False, recompute=False):
    """Bytes of activations per layer in Korthikanti et al.'s formulas (module docstring):
    ``parlab.memory.transformer_activation_bytes``, the one place they are written;
    ``recompute`` as ``recompute_kind`` reads it (True: full recompute)."""
    _check_sizes(s, b, h, a, t)
    return transformer_activation_bytes(s, b, h, a, 1, recompute_kind(recompute), t, sequence_parallel)


def layer_saved_bytes(s, b, h, a, t=1, sequence_parallel=False, recompute=False, value_bytes=4, mask_bytes=1,
                      dropout=True, statistics_bytes=None):
    """What parlab's layer saves for backward, item by item: {what: bytes}. ``recompute``: as
    ``recompute_kind`` reads it ("selective": without the attention's (b, a, s, s) tensors;
    True or "full": the layer's input only). ``value_bytes``: bytes of one activation value
    (4 for fp32, 2 for 16-bit); ``mask_bytes``: of one
    dropout mask entry (``dropout_mask_bytes``); ``dropout``: False when the layer's dropout
    probability is 0 (no masks saved, and attention saves the softmax's output only once);
    ``statistics_bytes``: of LayerNorm's mean and 1/std (default ``value_bytes``: a CPU keeps
    them in the activations' dtype; a GPU's 16-bit LayerNorm keeps them in fp32, 4)."""
    _check_sizes(s, b, h, a, t)
    kind = recompute_kind(recompute)
    sbh, sp = s * b * h, (t if sequence_parallel else 1)
    if kind == "full":
        return {"layer input (checkpoint)": sbh * value_bytes // sp}
    items = {
        "LayerNorm inputs (2)": 2 * sbh * value_bytes // sp,
        "LayerNorm mean and 1/std (2 x 2)": 2 * 2 * b * s * (statistics_bytes or value_bytes) // sp,
        "inputs of query/key/value and fc1": 2 * sbh * value_bytes,
        "q, k, v": 3 * sbh * value_bytes // t,
        "proj input": sbh * value_bytes // t,
        "gelu input": 4 * sbh * value_bytes // t,
        "fc2 input": 4 * sbh * value_bytes // t,
    }
    if kind is None:  # the (b, a, s, s) tensors of attention written out
        items["softmax output"] = a * s * s * b * value_bytes // t
        if dropout:
            items["attention dropout output"] = a * s * s * b * value_bytes // t
            items["attention dropout mask"] = a * s * s * b * mask_bytes // t
    if dropout:
        items["residual dropout masks (2)"] = 2 * sbh * mask_bytes // sp
    return items


def layer_bytes(*args, **kwargs):
    """The sum of ``layer_saved_bytes`` (same arguments): bytes one of parlab's layers saves."""
    return sum(layer_saved_bytes(*args, **kwargs).values())


def measure_saved_bytes(module, *inputs):
    """Bytes autograd saves in one forward of ``module`` on ``inputs`` (``SavedBytes``,
    parameters and buffers left out)."""
    with SavedBytes(exclude=module) as saved:
        module(*inputs)
    return saved.total


def measure_attention_bytes(s, b, h, a, memory_efficient=False):
    """Bytes autograd saves in one causal attention of q, k, v (b, s, h) with ``a`` heads, in
    fp32 and without dropout, on a CPU. Written out (``parlab.gpt.causal_attention``): q, k, v
    and the (b, a, s, s) softmax output. ``memory_efficient``: torch's fused kernel
    (``F.scaled_dot_product_attention`` on its flash backend), which never forms the scores:
    q, k, v, its output (b, s, h) and one fp32 log-sum-exp per head and position."""
    _check_sizes(s, b, h, a, 1)
    torch.manual_seed(0)
    q, k, v = (torch.randn(b, s, h, requires_grad=True) for _ in range(3))
    with SavedBytes() as saved:
        if memory_efficient:
            q, k, v = (x.view(b, s, a, h // a).transpose(1, 2) for x in (q, k, v))  # (b, a, s, h/a)
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            future = torch.ones(s, s, dtype=torch.bool).triu(1)
            causal_attention(q, k, v, h // a, torch.zeros(s, s).masked_fill(future, -math.inf))
    return saved.total


def dropout_mask_bytes(device, value_bytes):
    """Bytes per dropout mask entry that torch saves: 1 (a bool) where dropout is fused (CUDA),
    ``value_bytes`` on a CPU, where F.dropout multiplies by a mask in the activations' dtype."""
    return 1 if torch.device(device).type == "cuda" else value_bytes


def checkpoint_peak_units(L, c):
    """Activation checkpointing of a chain of L equal layers in segments of c layers (c
    divides L), in units of one layer's saved tensor: the L/c segment inputs kept through
    forward, plus the c layers of the segment being recomputed in backward. L/c + c is
    smallest at c = sqrt(L). (Chen et al. 2016, section 4.3, write n for L and k for the
    number of segments, L/c: their cost O(n/k) + O(k) is our c + L/c.)"""
    if not (isinstance(L, int) and isinstance(c, int) and 1 <= c <= L and L % c == 0):
        raise ValueError(f"segments of c = {c!r} layers must divide the L = {L!r} layers: choose c a divisor of L.")
    return L // c + c


def measure_checkpointed_chain(L, c, width=64, rows=8):
    """Peak bytes saved by a chain of L layers tanh(linear(x)) (x of ``rows`` x ``width``),
    checkpointed in segments of c (torch's reentrant checkpoint: forward keeps each segment's
    input, backward recomputes one segment at a time), in units of one layer's saved tensor
    (tanh's output, which the next linear also saves): compare ``checkpoint_peak_units(L, c)``."""
    from torch.utils.checkpoint import checkpoint

    checkpoint_peak_units(L, c)
    torch.manual_seed(0)
    layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(L))

    def segment(z, first):
        for layer in layers[first:first + c]:
            z = torch.tanh(layer(z))
        return z

    with SavedBytes(exclude=layers) as saved:
        z = torch.randn(rows, width, requires_grad=True)
        for first in range(0, L, c):
            z = checkpoint(segment, z, first, use_reentrant=True)
        z.sum().backward()
    return saved.peak / (rows * width * 4)


class SavedBytes:
    """Count the bytes autograd saves while active, each storage once and whole (a saved
    view holds its whole storage in memory).

        with SavedBytes(exclude=model) as saved:
            loss = model(x).sum()          # saved.total: bytes saved by this forward
            loss.backward()                # saved.live falls back towards 0; saved.peak

    ``exclude``: a module (its parameters and buffers) or tensors that are not activations.
    Attributes: ``total`` (every byte saved while active, each storage once), ``live``
    (bytes still held by autograd now), ``peak`` (the most ``live`` reached)."""

    def __init__(self, exclude=None):
        if isinstance(exclude, torch.nn.Module):
            exclude = [*exclude.parameters(), *exclude.buffers()]
        self.excluded = {_storage(x) for x in (exclude or [])}
        self.total = self.live = self.peak = 0
        self._holders = {}  # storage -> number of saved references to it
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def __enter__(self):
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)

    def _pack(self, tensor):
        key = _storage(tensor)
        if key in self.excluded:
            return tensor
        if not self._holders.get(key):
            nbytes = tensor.untyped_storage().nbytes()
            self.total += nbytes
            self.live += nbytes
            self.peak = max(self.peak, self.live)
        self._holders[key] = self._holders.get(key, 0) + 1
        return _Held(tensor, key, self)

    def _unpack(self, held):
        return held.tensor if isinstance(held, _Held) else held

    def _release(self, key, nbytes):
        self._holders[key] -= 1
        if not self._holders[key]:
            self.live -= nbytes


class _Held:
    """A saved tensor as autograd keeps it; when autograd frees it, its bytes leave ``live``."""

    def __init__(self, tensor, key, counter):
        self.tensor = tensor
        weakref.finalize(self, counter._release, key, tensor.untyped_storage().nbytes())


def _storage(tensor):
    return (tensor.untyped_storage().data_ptr(), tensor.device)


def _check_sizes(s, b, h, a, t):
    for name, value in (("s", s), ("b", b), ("h", h), ("a", a), ("t", t)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a whole number >= 1, got {value!r}.")
    if h % a or a % t:
        raise ValueError(f"h = {h} must split into a = {a} heads and the heads over t = {t} ranks: choose a "
                         "dividing h and t dividing a.")
