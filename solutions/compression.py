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
    # BEGIN SOLUTION: p, its top-k, what was dropped
    p = gamma * g + residual
    flat = p.reshape(-1)
    indices = flat.abs().topk(k).indices
    delta = torch.zeros_like(flat)
    delta[indices] = flat[indices]
    delta = delta.view_as(p)
    return delta, p - delta
    # END SOLUTION


def rand_k(x, k, generator):
    """Unbiased random-k of ``x`` (any shape, d elements): keep the k positions
    ``torch.randperm(d, generator=generator)[:k]`` of the flat x and zero the others, scaled
    so that E[C(x)] = x over the random positions. Returns C(x), shaped like x. (Ranks that
    share the generator's seed draw the same positions, so only the k values travel.)
    """
    # BEGIN SOLUTION: k random positions, scaled to stay unbiased
    flat = x.reshape(-1)
    d = flat.numel()
    indices = torch.randperm(d, generator=generator)[:k]
    kept = torch.zeros_like(flat)
    kept[indices] = flat[indices] * (d / k)
    return kept.view_as(x)
    # END SOLUTION


def orthogonalize(P):
    """Make the R columns of P (n x R, n >= R, full rank) orthonormal, in place, by
    Gram-Schmidt: column j becomes the unit vector along column j minus its parts along the
    columns before it, so that P^T P = I and the first j columns span what they spanned.
    Returns P."""
    # BEGIN SOLUTION: column by column
    for j in range(P.shape[1]):
        column = P[:, j]
        column /= column.norm()
        rest = P[:, j + 1 :]
        rest -= column[:, None] * (column @ rest)[None, :]
    return P
    # END SOLUTION


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
    # BEGIN SOLUTION: P, orthogonalized; Q; the approximation
    N = torch.distributed.get_world_size()
    P = all_reduce_sum(G @ Q)
    orthogonalize(P)
    Q = all_reduce_sum(G.T @ P) / N
    return P @ Q.T, Q
    # END SOLUTION


# --- Provided ------------------------------------------------------------------------------


def all_reduce_sum(tensor):
    """Sum a contiguous ``tensor`` over the ranks, in place, with parlab's ring all-reduce
    (traced); returns it."""
    return collectives.ring_all_reduce(tensor.contiguous(), check=False)


# BEGIN HINTS
HINTS = {
    "topk_error_feedback": (
        """
        Three lines of algebra: what goes into the compressor is not the gradient alone but
        the gradient plus what earlier steps left behind. What is left behind this time?
        """,
        """
        Form p = gamma * g + residual. Flatten it, find the positions of the k largest
        magnitudes (Tensor.abs().topk(k).indices), and build delta: zeros except p's values
        at those positions, shaped like g. The new residual is p - delta; return both.
        """,
        """
        p = gamma * g + residual
        flat = p.reshape(-1)
        indices = flat.abs().topk(k).indices
        delta = zeros like flat; delta[indices] = flat[indices]; delta = delta.view_as(p)
        return delta, p - delta

        Forget the residual and the small entries are never sent: the step is biased, and
        the grader sees a residual of norm 0.
        """,
    ),
    "rand_k": (
        """
        Each position is kept with probability k/d. What must a kept value be multiplied by
        so that its expectation over the draw is x_j?
        """,
        """
        Draw the positions with torch.randperm(d, generator=generator)[:k] on the flat x.
        Start from zeros, put x's values at those positions, multiplied by d / k, and
        reshape like x.
        """,
        """
        flat = x.reshape(-1); d = flat.numel()
        indices = torch.randperm(d, generator=generator)[:k]
        kept = zeros like flat; kept[indices] = flat[indices] * (d / k)
        return kept.view_as(x)

        Without d / k, E[C(x)] = (k/d) x: every step is k/d times too short.
        """,
    ),
    "orthogonalize": (
        """
        Go through the columns in order. Before column j is normalized, which directions must
        be taken out of it?
        """,
        """
        For j = 0 .. R - 1: divide column j by its norm; then from every later column
        subtract its component along column j (the dot product times column j). Work in place
        on P's columns (P[:, j], P[:, j + 1:]).
        """,
        """
        for j in range(R):
            column = P[:, j]; column /= column.norm()
            rest = P[:, j + 1:]
            rest -= column[:, None] * (column @ rest)[None, :]
        return P
        """,
    ),
    "powersgd_step": (
        """
        Two multiplications by G, two all-reduces, one orthogonalization in between. Which of
        P and Q needs summing, and which averaging?
        """,
        """
        P = all_reduce_sum(G @ Q), then orthogonalize(P) (its scale does not matter, which is
        why a sum will do). Q = all_reduce_sum(G.T @ P) / N: the mean over ranks of G_i^T P.
        The approximation of the mean gradient is P @ Q.T. Never all-reduce G itself.
        """,
        """
        N = torch.distributed.get_world_size()
        P = all_reduce_sum(G @ Q)
        orthogonalize(P)
        Q = all_reduce_sum(G.T @ P) / N
        return P @ Q.T, Q
        """,
    ),
}
# END HINTS
