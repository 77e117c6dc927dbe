# Generated from solutions/compression.py by `python -m parlab.course.exercises build`.
# Write your code where it raises NotImplementedError, then run `parlab grade compression`.
# parlab-generated sha256=91870c54043b07673f9353af1d6e9b5adaf8680fb4a60e1da2d4bf8526745276
"""Exercise: gradient compression, the three ideas of lecture 05.

Data-parallel ranks step with w_{t+1} = w_t - gamma (1/N) sum_r C(g_r): each of the N ranks
compresses its gradient g_r (d elements) before it travels. Three compressors to write:

- top-k with error feedback (``topk_error_feedback``): top-k keeps the k entries of largest
  magnitude, a biased choice; error feedback keeps what it dropped in a residual epsilon and
  adds it back next step, p = gamma g + epsilon, delta = C(p), epsilon = p - delta, so nothing is lost;
- unbiased random-k (``rand_k``): k random positions, scaled so that E[C(x)] = x;
- PowerSGD (``orthogonalize``, ``powersgd_step``): a rank-R approximation P Q^T of the ranks'
  mean gradient matrix from one step of power iteration, with two all-reduces of
  (n + m) R elements in all instead of n m.

Communicate only with ``all_reduce_sum`` below (parlab's ring, traced: the grader counts your
bytes). Symbols: N ranks, d elements, k the budget, gamma the learning rate, G an n x m
gradient matrix, R the rank of the approximation (the PowerSGD paper's M and r).

Stuck? ``parlab.hint("compression.rand_k")`` in a notebook (or ``parlab hint
compression.rand_k``) opens a hint, one level at a time. Grade your work with
``parlab grade compression`` (or ``parlab.check("compression.rand_k")``).
"""

import torch

from parlab import collectives


def topk_error_feedback(g, residual, gamma, k):
    """One step of top-k with error feedback on this rank.

    g: the gradient (any shape, d elements); residual: epsilon, shaped like g (zeros at the first
    step); gamma: the learning rate; k: elements kept, 1 <= k <= d.
    Returns (delta, new_residual), both shaped like g:

        p = gamma g + epsilon;   delta = top_k(p);   new_residual = p - delta

    where top_k(p) keeps the k entries of p of largest magnitude and zeroes the others. The
    caller steps with w <- w - delta.
    """
    raise NotImplementedError("topk_error_feedback is not implemented yet: p, its top-k, what was dropped")


def rand_k(x, k, generator):
    """Unbiased random-k of ``x`` (any shape, d elements): keep the k positions
    ``torch.randperm(d, generator=generator)[:k]`` of the flat x and zero the others, scaled
    so that E[C(x)] = x over the random positions. Returns C(x), shaped like x. (Ranks that
    share the generator's seed draw the same positions, so only the k values travel.)
    """
    raise NotImplementedError("rand_k is not implemented yet: k random positions, scaled to stay unbiased")


def orthogonalize(P):
    """Make the R columns of P (n x R, n >= R, full rank) orthonormal, in place, by
    Gram-Schmidt: column j becomes the unit vector along column j minus its parts along the
    columns before it, so that P^T P = I and the first j columns span what they spanned.
    Returns P."""
    raise NotImplementedError("orthogonalize is not implemented yet: column by column")


def powersgd_step(G, Q):
    """One PowerSGD step on this rank's gradient matrix G (n x m), from Q (m x R), the same on
    every rank (the last step's Q: the warm start). On every rank:

        P = sum_i G_i Q               all-reduce #1 (n x R)
        P = orthogonalize(P)
        Q = (1/N) sum_i G_i^T P       all-reduce #2 (m x R)

    Returns (P Q^T, Q): the approximation of the ranks' mean gradient (n x m) and the new Q
    for the next step, the same on every rank. Communicate with ``all_reduce_sum`` only, on
    P and Q: each rank then sends 2 (N - 1)/N (n + m) R 4 bytes, not the 2 (N - 1)/N n m 4
    of the whole gradient.
    """
    raise NotImplementedError("powersgd_step is not implemented yet: P, orthogonalized; Q; the approximation")


# --- Provided ------------------------------------------------------------------------------


def all_reduce_sum(tensor):
    """Sum a contiguous ``tensor`` over the ranks, in place, with parlab's ring all-reduce
    (traced); returns it."""
    return collectives.ring_all_reduce(tensor.contiguous(), check=False)
