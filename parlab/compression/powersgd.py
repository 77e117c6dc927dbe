"""PowerSGD (Vogels et al., 2019): a rank-R approximation of each gradient matrix, found by
one step of power iteration per training step, warm-started from the last step's Q.

Each gradient tensor is viewed as a matrix G of n = shape[0] rows and m = numel / n columns
(as torch's ``powerSGD_hook``; the paper writes M for G and r for R, letters the glossary
gives to micro-batches and a rank's index). With R' = min(R, n, m), on every rank r:

    P_r = G_r Q            (n x R')   all-reduce #1: P = sum_r P_r
    P   = orthogonalize(P)            Gram-Schmidt on its R' columns
    Q_r = G_r^T P          (m x R')   all-reduce #2: Q = (1/N) sum_r Q_r
    C(G) = P Q^T           (n x m)    = P P^T mean_r G_r, the mean's projection on P's span

so (n + m) R' elements travel instead of n m. A tensor is sent uncompressed (with the P's, in
all-reduce #1) when it has one dimension or compression would not pay:
(n + m) R' x ``min_compression_rate`` >= n m, torch's rule (``compression_sizes`` reports
the same element counts as torch's ``PowerSGDState.compression_stats()``). Q is kept per
tensor and reused next step (the warm start), so over steps the power iteration converges.
PowerSGD is biased: wrap it in ``ErrorFeedback`` (torch's hook has it on by default).
"""

import functools

import torch

from parlab._checks import real_number, whole_number
from parlab.compression.communication import all_reduce_sum, place_in
from parlab.compression.compressors import gradient_shapes
from parlab.compression.costs import sent


def orthogonalize(P, eps=1e-8):
    """Make P's columns orthonormal in place (Gram-Schmidt, column by column); returns P.
    ``eps`` keeps an all-zero column (a zero gradient) from dividing by zero."""
    for i in range(P.shape[1]):
        column = P[:, i]
        column /= column.norm() + eps
        rest = P[:, i + 1 :]
        rest -= column[:, None] * (column @ rest)[None, :]  # remove column's part from the later ones
    return P


class PowerSGD:
    """PowerSGD of rank R = ``rank``: the approximation's rank, the columns of P and Q (the
    glossary's R, torch's ``matrix_approximation_rank``; not a process's rank r). ``seed``: the
    first Q's random values, the same on every rank. ``min_compression_rate``: torch's rule for
    which matrices are compressed (see the module's docstring).

    It takes ``shapes``, the shapes of the gradients that x holds (a DDP bucket holds several),
    as every compressor does (``parlab.compression.compressors``): it views each gradient as a
    matrix G; without them x is one gradient, G its own shape."""

    def __init__(self, rank=1, seed=0, min_compression_rate=2.0):
        whole_number("rank (R)", rank, "the approximation's rank: a whole number such as 1, 2 or 4.")
        real_number("min_compression_rate", min_compression_rate, "torch's default is 2.")
        self.rank, self.min_compression_rate = rank, min_compression_rate
        self.generator = torch.Generator().manual_seed(seed)
        self.warm = {}  # key -> the Q of each compressed matrix, from the last step

    def plan(self, shapes):
        """For each shape: (n, m, R') if it is compressed, None if it travels uncompressed."""
        plans = []
        for shape in shapes:
            shape = tuple(shape)
            numel = torch.Size(shape).numel()
            if len(shape) < 2 or numel == 0:
                plans.append(None)
                continue
            n, m = shape[0], numel // shape[0]
            r = min(self.rank, n, m)
            plans.append((n, m, r) if (n + m) * r * self.min_compression_rate < n * m else None)
        return plans

    def compression_sizes(self, shapes):
        """(elements before, elements after) for tensors of ``shapes``: what torch's
        ``PowerSGDState.compression_stats()`` counts for one compressed step."""
        before = sum(torch.Size(tuple(s)).numel() for s in shapes)
        after = sum(torch.Size(tuple(s)).numel() if p is None else (p[0] + p[1]) * p[2]
                    for s, p in zip(shapes, self.plan(shapes)))
        return before, after

    def __call__(self, x, key=0, shapes=None):
        """One rank's approximation (no communication): P Q^T of each matrix of ``x``."""
        return self._approximate(x, key, shapes, lambda tensor: tensor, 1)

    def aggregate(self, x, key=0, shapes=None, group=None):
        """(mean, mean): the approximation of the ranks' mean, the same on every rank, after
        the two all-reduces. Error feedback subtracts it whole (as torch's hook). ``group``:
        the ranks to average over (default: all), e.g. ``mesh.group("dp")``; N is its size."""
        _, N = place_in(group)
        mean = self._approximate(x, key, shapes, functools.partial(all_reduce_sum, group=group), N)
        return mean, mean

    def bytes(self, x, shapes=None):
        """Bytes of this rank's P's, Q's and uncompressed tensors (fp32): 4 times the elements
        after compression of ``compression_sizes``, (n + m) R' per compressed G."""
        return 4 * self.compression_sizes(gradient_shapes(x, shapes))[1]

    def collectives(self, x, shapes=None):
        """A ring all-reduce of the uncompressed tensors and the P's, then one of the Q's (none
        when nothing is compressed), as ``Compressor.collectives``."""
        shapes = gradient_shapes(x, shapes)
        plans = self.plan(shapes)
        first = sum(torch.Size(tuple(s)).numel() if p is None else p[0] * p[2] for s, p in zip(shapes, plans))
        second = sum(p[1] * p[2] for p in plans if p is not None)
        return [("all-reduce", first, 4)] + ([("all-reduce", second, 4)] if second else [])

    def sent_bytes(self, x, N, shapes=None):
        """Bytes each rank sends, per rank."""
        return sent(self.collectives(x, shapes), N)

    def _approximate(self, x, key, shapes, reduce, N):
        shapes = gradient_shapes(x, shapes)
        plans = self.plan(shapes)
        pieces = x.detach().reshape(-1).float().split([torch.Size(tuple(s)).numel() for s in shapes])
        matrices = [piece.view(p[0], p[1]) for piece, p in zip(pieces, plans) if p is not None]
        Qs = self._warm_start(key, plans)
        # all-reduce #1: the uncompressed tensors and every P_i = G_i Q (i: the i-th compressed G), in one buffer
        uncompressed = [piece for piece, p in zip(pieces, plans) if p is None]
        first = reduce(torch.cat(uncompressed + [(G @ Q).reshape(-1) for G, Q in zip(matrices, Qs)]))
        numels = [u.numel() for u in uncompressed] + [G.shape[0] * Q.shape[1] for G, Q in zip(matrices, Qs)]
        parts = list(first.split(numels))
        means = [part / N for part in parts[: len(uncompressed)]]
        Ps = [orthogonalize(part.view(G.shape[0], -1)) for part, G in zip(parts[len(uncompressed):], matrices)]
        # all-reduce #2: every Q_i = G_i^T P, averaged
        if matrices:
            second = reduce(torch.cat([(G.T @ P).reshape(-1) for G, P in zip(matrices, Ps)])) / N
            Qs = [q.view(G.shape[1], -1) for q, G in zip(second.split([G.shape[1] * P.shape[1]
                                                                         for G, P in zip(matrices, Ps)]), matrices)]
            self.warm[key] = [Q.clone() for Q in Qs]
        approximations = iter([P @ Q.T for P, Q in zip(Ps, Qs)])
        uncompressed_means = iter(means)
        out = [next(uncompressed_means) if p is None else next(approximations) for p in plans]
        return torch.cat([o.reshape(-1) for o in out]).to(x.dtype).view_as(x)

    def _warm_start(self, key, plans):
        shapes = [p for p in plans if p is not None]
        kept = self.warm.get(key)
        if kept is not None and [tuple(Q.shape) for Q in kept] == [(m, r) for _, m, r in shapes]:
            return kept
        return [torch.randn(m, r, generator=self.generator) for _, m, r in shapes]

    def __repr__(self):
        return f"PowerSGD(rank={self.rank})"
