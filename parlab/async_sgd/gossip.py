"""Gossip: decentralised SGD (D-PSGD) on a graph, without any all-reduce.

Each rank r keeps its own weights x_r and, at every step, averages them with its neighbours'
while it computes its gradient:

    x_r <- sum_j W[r, j] x_j - gamma g_r(x_r)

W is the N x N mixing matrix of the graph: W[r, j] > 0 when r hears from j, each row sums
to 1 and (for the mean to be kept) so does each column. One step sends one message per
neighbour, 2 on a ring whatever N is, where a ring all-reduce sends 2 (N - 1): gossip swaps
the all-reduce's latency, 2 (N - 1) alpha, for 2 alpha, and pays with replicas that only
agree on average. How far they are from agreeing is the consensus distance

    Xi = (1/N) sum_r ||x_r - x_bar||^2,

which one mixing step without gradients shrinks at least by rho^2, rho = ||W - 11^T/N||_2 (the
spectral norm; the second-largest |eigenvalue| for a symmetric W). Papers differ in the letter:
some write rho or beta for this norm, others work with its square (the consensus distance's
factor per step, 1 - p in Koloskova et al.'s notation). Graphs (``mixing_matrix``):

- ring: (x_{r-1} + x_r + x_{r+1}) / 3. rho = (1 + 2 cos(2 pi / N)) / 3: 1/3 at N = 4, 0.9493 at 16;
- torus (2-D, rows x cols): self and 4 neighbours, 1/5 each: rho 0.4 (3 x 3), 0.6 (4 x 4);
- exponential (static): r hears from r + 2^0, r + 2^1, ... (log2 N of them at N a power of 2),
  all weights 1/(1 + log2 N): rho = 1 - 2/(1 + log2 N) at N a power of 2. It still creeps
  towards 1 as N grows: 1 - rho shrinks like 1/log2 N, where the ring's shrinks like 1/N^2;
- one-peer exponential: at round t, r averages with r + 2^(t mod p) only, weights 1/2, over a
  period of p = ceil(log2 N) rounds. One message per step. When N is a power of 2, one period
  averages exactly: W_{p-1} ... W_0 = 11^T/N (Ying et al. 2021). For any other N it never
  does (``one_peer_period``: at N = 6 a period multiplies the disagreement by up to
  rho = 0.2165, and never by 0).

A neighbour that appears twice (the ring at N = 2, a torus 2 wide) adds its weights: one
message, weight 2/3. Seeds and papers write n for N, and the ring all-reduce's latency term
O(K) uses K for our N (K here counts pipeline stages).
"""

import math

import torch
import torch.distributed as dist

from parlab import p2p
from parlab._checks import whole_number

TOPOLOGIES = ("ring", "torus", "exponential", "one-peer exponential")


def ring(N):
    """The ring's mixing matrix: weight 1/3 on r - 1, r and r + 1 (float64, N x N)."""
    N = _ranks(N)
    W = torch.zeros(N, N, dtype=torch.float64)
    for r in range(N):
        for j in (r - 1, r, r + 1):
            W[r, j % N] += 1 / 3
    return W


def torus(rows, cols):
    """The 2-D torus of rows x cols ranks (rank r at row r // cols, column r % cols): weight
    1/5 on itself and its 4 neighbours, wrapping around (float64)."""
    rows = whole_number("rows", rows, "a torus has rows x cols ranks, e.g. torus(3, 3).")
    cols = whole_number("cols", cols, "a torus has rows x cols ranks, e.g. torus(3, 3).")
    W = torch.zeros(rows * cols, rows * cols, dtype=torch.float64)
    for r in range(rows * cols):
        i, j = divmod(r, cols)
        for di, dj in ((0, 0), (-1, 0), (1, 0), (0, -1), (0, 1)):
            W[r, ((i + di) % rows) * cols + (j + dj) % cols] += 1 / 5
    return W


def exponential(N):
    """The static exponential graph: r hears from r + 2^m (mod N) for every 2^m < N, each of
    them and r itself weighted 1/(1 + their number) (float64)."""
    N = _ranks(N)
    peers = [2**m for m in range(max(N - 1, 1).bit_length()) if 2**m < N]
    W = torch.zeros(N, N, dtype=torch.float64)
    for r in range(N):
        for hop in (0, *peers):
            W[r, (r + hop) % N] += 1 / (1 + len(peers))
    return W


def one_peer_exponential(N, round):
    """Round ``round`` of the one-peer exponential graph: r averages with r + 2^(round mod
    ceil(log2 N)), weights 1/2 (float64; the identity for N = 1)."""
    N = _ranks(N)
    round = whole_number("round", round, "rounds count steps from 0.", minimum=0)
    W = torch.zeros(N, N, dtype=torch.float64)
    hop = 2 ** (round % one_peer_rounds(N)) % N
    for r in range(N):
        W[r, r] += 1 / 2
        W[r, (r + hop) % N] += 1 / 2
    return W


def one_peer_rounds(N):
    """p = ceil(log2 N): the rounds of one period of the one-peer exponential graph (1 at N = 1)."""
    return max(math.ceil(math.log2(_ranks(N))), 1)


def one_peer_period(N):
    """The product W_{p-1} ... W_0 of one period of the one-peer exponential graph, p =
    ceil(log2 N) rounds (float64, N x N): 11^T/N exactly when N is a power of 2, so rho of
    it is 0; another N leaves rho > 0 after every period, and the graph never averages
    exactly. Multiplying by 1/2 is exact in binary, so a power of 2 gives exact zeros."""
    N = _ranks(N)
    product = torch.eye(N, dtype=torch.float64)
    for t in range(one_peer_rounds(N)):
        product = one_peer_exponential(N, t) @ product
    return product


def mixing_matrix(topology, N, round=0):
    """W for ``topology`` (one of ``TOPOLOGIES``) on N ranks; the torus takes the most square
    rows x cols = N, the one-peer exponential graph its matrix at ``round``."""
    N = _ranks(N)
    if topology == "ring":
        return ring(N)
    if topology == "torus":
        rows = max(d for d in range(1, math.isqrt(N) + 1) if N % d == 0)
        return torus(rows, N // rows)
    if topology == "exponential":
        return exponential(N)
    if topology == "one-peer exponential":
        return one_peer_exponential(N, round)
    raise ValueError(f"topology must be one of {', '.join(TOPOLOGIES)}; got {topology!r}.")


def rho(W):
    """||W - 11^T/N||_2: the factor by which one mixing step shrinks the distance to the mean
    (at worst); 0 averages at once, near 1 barely mixes."""
    N = W.shape[0]
    return torch.linalg.matrix_norm(W.double() - 1 / N, ord=2).item()


def step_seconds(W, nbytes, alpha, beta):
    """One mixing step's time in the alpha-beta model: every rank sends x (``nbytes``) to each
    rank that hears from it and receives from each rank it hears from, one message at a
    time on each port, so the busiest port takes max(sends, receives) (alpha + nbytes beta).
    On a ring (N >= 3): 2 (alpha + D beta), whatever N is; a ring all-reduce takes
    2 (N - 1) alpha + 2 (N - 1)/N D beta."""
    others = W.clone().fill_diagonal_(0) != 0
    busiest = max(int(others.sum(0).max().item()), int(others.sum(1).max().item()))
    return busiest * (alpha + nbytes * beta)


def consensus_distance(xs):
    """Xi = (1/N) sum_r ||x_r - x_bar||^2 of the N replicas ``xs`` (a list of tensors, or a
    tensor whose first dimension is N)."""
    X = torch.stack([x.reshape(-1).double() for x in xs])  # (N, d)
    return (X - X.mean(0)).pow(2).sum(1).mean().item()


def mix(row, values):
    """sum_j row[j] values[j] over the j with row[j] != 0, in ascending j: the arithmetic of a
    gossip step, shared by the ranks and the one-process reference so that they agree to the
    bit. ``values`` maps j to a tensor."""
    terms = [values[j] * row[j].item() for j in range(len(row)) if row[j] != 0]
    total = terms[0]
    for term in terms[1:]:
        total = total + term
    return total


def gossip_all(W, xs):
    """One mixing step of N replicas in one process: [sum_j W[r, j] xs[j] for each r]."""
    values = dict(enumerate(xs))
    return [mix(W[r], values) for r in range(len(xs))]


def gossip_step(x, W, gradient=None, lr=0.0):
    """One D-PSGD step on this rank r, in place: x <- sum_j W[r, j] x_j - lr gradient(x).

    Sends x to every rank that hears from r (W[j, r] != 0) and receives from every rank r hears
    from, all started before ``gradient(x)`` is computed, so the exchanges overlap it; then
    mixes (``mix``) and subtracts the step. Every rank calls it with the same W. Returns x."""
    rank, N = dist.get_rank(), dist.get_world_size()
    if W.shape != (N, N):
        raise ValueError(f"W must be N x N = {N} x {N} (one row per rank), got {tuple(W.shape)}.")
    hears_from = [j for j in range(N) if j != rank and W[rank, j] != 0]
    heard_by = [j for j in range(N) if j != rank and W[j, rank] != 0]
    values = {j: torch.empty_like(x) for j in hears_from}
    requests = [p2p.isend(x, j) for j in heard_by] + [p2p.irecv(values[j], j) for j in hears_from]
    g = gradient(x) if gradient is not None else None  # overlaps the messages in flight
    p2p.wait_all(requests)
    values[rank] = x
    mixed = mix(W[rank], values)
    if g is not None:
        mixed = mixed - lr * g
    return x.copy_(mixed)


def _ranks(N):
    return whole_number("N (the number of ranks)", N, "a graph needs at least one rank, e.g. 4.")
