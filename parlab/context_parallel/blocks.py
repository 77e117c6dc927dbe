"""One block of attention, its backward, and the merge of partial results: the arithmetic
that ring attention and the all-gather method share (no communication here).

    S   = Q K^T x scale                (b, a, n_q, n_k)    n_q queries against n_k keys
    lse = log sum_k exp(S)             (b, a, n_q)         the softmax's log-normaliser, per query
    out = exp(S - lse) V               (b, a, n_q, h/a)

A query's attention over all keys is the merge of its attention over any partition of them:
(out_1, lse_1) and (out_2, lse_2), over two sets of keys, give over their union

    m   = max(lse_1, lse_2)            the running max: no exponential overflows
    lse = m + log(exp(lse_1 - m) + exp(lse_2 - m))
    out = exp(lse_1 - lse) out_1 + exp(lse_2 - lse) out_2

(the online softmax of Milakov and Gimelshein 2018, FlashAttention's inner step). Backward
recomputes a block's probabilities from the whole row's lse, P = exp(S - lse): the block's
share of the full softmax, so its gradients need nothing of the other blocks but lse and
D = rowsum(dO * O) (FlashAttention's backward, Dao et al. 2022).
"""

import math

import torch


def attention_block(q, k, v, masked=False, scale=None):
    """(out, lse) of queries ``q`` (b, a, n_q, h/a) against keys ``k`` and values ``v``
    (b, a, n_k, h/a): out (b, a, n_q, h/a), lse (b, a, n_q). ``masked``: the causal mask of a
    diagonal block (n_q = n_k, query i sees keys 0 .. i). scale: default 1/sqrt(h/a)."""
    scores = q @ k.transpose(-2, -1) * _scale(q, scale)  # (b, a, n_q, n_k)
    if masked:
        scores = scores.masked_fill(_above_diagonal(scores), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # (b, a, n_q)
    return torch.exp(scores - lse[..., None]) @ v, lse


def merge_partial(out_a, lse_a, out_b, lse_b):
    """Merge two partial attention results over disjoint sets of keys into the result over
    both (module docstring): out_* (b, a, n_q, h/a), lse_* (b, a, n_q) -> (out, lse)."""
    m = torch.maximum(lse_a, lse_b)  # (b, a, n_q)
    lse = m + torch.log(torch.exp(lse_a - m) + torch.exp(lse_b - m))
    return torch.exp(lse_a - lse)[..., None] * out_a + torch.exp(lse_b - lse)[..., None] * out_b, lse


def accumulate(out, lse, task, q, k, v, scale=None):
    """The running (out, lse) of this rank's queries after one more block: ``task`` (a
    ``splits.BlockTask``) picks the rows of the queries and of the block's keys ``k``, ``v``;
    its result merges into those rows. ``out`` None: the first block, which covers all rows.
    Builds new tensors (no writes in place), so autograd can run through it."""
    n = q.shape[2]
    rows, keys = task.query_rows(n), task.key_rows(n)
    block_out, block_lse = attention_block(q[:, :, rows], k[:, :, keys], v[:, :, keys], task.masked, scale)
    if out is None:
        return block_out, block_lse
    merged_out, merged_lse = merge_partial(out[:, :, rows], lse[:, :, rows], block_out, block_lse)
    return _replace_rows(out, rows, merged_out), _replace_rows(lse, rows, merged_lse)


def attention_block_backward(task, q, k, v, lse, delta, grad_out, scale=None):
    """The gradients of one block, recomputed (module docstring): (dq, dk, dv) for the rows of
    ``task``, with lse (b, a, n) and delta = rowsum(dO * O) (b, a, n) of all the queries' rows:

        P = exp(S - lse),  dV = P^T dO,  dP = dO V^T,  dS = P * (dP - D),
        dQ = dS K x scale,  dK = dS^T Q x scale."""
    n, scale = q.shape[2], _scale(q, scale)
    rows, keys = task.query_rows(n), task.key_rows(n)
    q, k, v, grad_out = q[:, :, rows], k[:, :, keys], v[:, :, keys], grad_out[:, :, rows]
    scores = q @ k.transpose(-2, -1) * scale  # (b, a, n_q, n_k)
    if task.masked:
        scores = scores.masked_fill(_above_diagonal(scores), float("-inf"))
    p = torch.exp(scores - lse[:, :, rows, None])  # this block's share of the whole softmax
    grad_scores = p * (grad_out @ v.transpose(-2, -1) - delta[:, :, rows, None])
    return grad_scores @ k * scale, grad_scores.transpose(-2, -1) @ q * scale, p.transpose(-2, -1) @ grad_out


def _scale(q, scale):
    return 1 / math.sqrt(q.shape[-1]) if scale is None else scale


def _above_diagonal(scores):
    n_q, n_k = scores.shape[-2:]
    return torch.ones(n_q, n_k, dtype=torch.bool, device=scores.device).triu(1)


def _replace_rows(x, rows, new):
    """``x`` with its rows ``rows`` (along dim 2, the positions) replaced by ``new``."""
    return torch.cat([x[:, :, : rows.start], new, x[:, :, rows.stop :]], dim=2)
