"""The alpha-beta cost model: a message of D bytes between two ranks takes alpha + D beta.

alpha (seconds) is the latency every message pays, however small: the call, the software
stack, the wire's round of handshakes. beta (seconds per byte) is the inverse of the link's
bandwidth. A collective is a sequence of messages, so its predicted time is a count of
messages times alpha plus a count of bytes on the busiest rank times beta:
``cost_model`` gives it for each of parlab's algorithms (symbols: N ranks, D bytes in the
tensor). ``measure_p2p`` measures point-to-point times on two real ranks (a ping-pong),
``fit_alpha_beta`` fits the model's two numbers to them and ``fit_errors`` says how well the
points pin them down; ``ping_pong`` does all three on a cluster, in one regime or several
taking turns.
"""

import contextlib
import math
import statistics
import time
from typing import NamedTuple

import torch
import torch.distributed as dist

from parlab import p2p, runtime
from parlab._checks import real_number, whole_number

# The all-reduce algorithms of the lecture; "tree" is tree_reduce followed by tree_broadcast.
ALL_REDUCE_ALGORITHMS = ("naive", "ring", "butterfly", "tree")


def cost_model(algorithm, D, N, alpha, beta):
    """Predicted seconds of one collective of D bytes on N ranks under the alpha-beta model
    (a message of D bytes takes alpha + D beta):

    ==================  =====================================================
    algorithm           predicted time
    ==================  =====================================================
    "naive"             2 (N - 1) (alpha + D beta)   (the root, serialised)
    "ring"              2 (N - 1) alpha + 2 (N - 1)/N D beta
    "butterfly"         2 log2(N) alpha + 2 (N - 1)/N D beta   (N = 2^k)
                        2 log2(P) alpha + 2 (P - 1)/P D beta + 2 (alpha + D beta)
                        otherwise, with P the largest power of two below N
    "tree"              2 ceil(log2 N) (alpha + D beta)   (reduce, then broadcast)
    "tree_broadcast"    ceil(log2 N) (alpha + D beta)
    "tree_reduce"       ceil(log2 N) (alpha + D beta)
    ==================  =====================================================
    """
    whole_number("N (the number of ranks)", N, "give the number of ranks as a count, such as N = 4.")
    real_number("D (bytes in the tensor)", D, "give the tensor's size in bytes, e.g. D = 4 * numel for float32.")
    real_number("alpha (seconds per message)", alpha, "give the latency in seconds, e.g. alpha = 1e-5.")
    real_number("beta (seconds per byte)", beta, "give the inverse bandwidth, e.g. beta = 1e-9 for 1 GB/s.")
    if algorithm == "naive":
        return 2 * (N - 1) * (alpha + D * beta)
    if algorithm == "ring":
        return 2 * (N - 1) * alpha + 2 * (N - 1) / N * D * beta
    if algorithm == "butterfly":
        P = 1 << (N.bit_length() - 1)
        fold = 0 if P == N else 2 * (alpha + D * beta)
        return 2 * math.log2(P) * alpha + 2 * (P - 1) / P * D * beta + fold
    if algorithm in ("tree_broadcast", "tree_reduce"):
        return math.ceil(math.log2(N)) * (alpha + D * beta)
    if algorithm == "tree":
        return 2 * math.ceil(math.log2(N)) * (alpha + D * beta)
    raise ValueError(
        f"unknown algorithm {algorithm!r}; choose one of 'naive', 'ring', 'butterfly', 'tree', "
        "'tree_broadcast', 'tree_reduce'."
    )


def fit_alpha_beta(sizes_bytes, seconds):
    """Least-squares fit of the point-to-point model t = alpha + D beta to measured pairs
    (D in ``sizes_bytes``, t in ``seconds``). Returns (alpha, beta) in seconds and
    seconds per byte.

    The residuals are relative, (t - alpha - D beta) / t: weights w = 1 / t^2, then
    beta = cov_w(D, t) / var_w(D) and alpha = mean_w(t) - beta mean_w(D). Sizes span many
    decades and a timing's noise grows with it; unweighted, the largest message's few
    per cent of noise would outweigh alpha itself, which the small messages measure.
    """
    sizes_bytes, seconds = list(sizes_bytes), list(seconds)
    weights, D_w, t_w, S_DD = _weighted(sizes_bytes, seconds)
    beta = sum(w * (D - D_w) * (t - t_w) for w, D, t in zip(weights, sizes_bytes, seconds)) / S_DD
    return t_w - beta * D_w, beta


def fit_errors(sizes_bytes, seconds, alpha, beta):
    """Standard errors (of alpha, of beta) of ``fit_alpha_beta``'s fit (alpha, beta) to these
    points, from its residuals: with relative residuals e = (t - alpha - D beta) / t over n
    points, s^2 = sum(e^2) / (n - 2), and

        se(beta) = s / sqrt(S),   se(alpha) = s sqrt(1 / sum(w) + mean_w(D)^2 / S)

    (weights w = 1 / t^2, S = sum w (D - mean_w(D))^2). A fitted value more than about three
    standard errors from a declared one is more than the points' scatter explains. Needs
    three points or more: two always fit exactly."""
    sizes_bytes, seconds = list(sizes_bytes), list(seconds)
    if len(seconds) < 3:
        raise ValueError(f"fit_errors needs at least three points, got {len(seconds)}: two points always lie on "
                         "a line, so they say nothing about the scatter; measure more message sizes.")
    weights, D_w, _, S_DD = _weighted(sizes_bytes, seconds)
    residuals = [w * (t - alpha - D * beta) ** 2 for w, D, t in zip(weights, sizes_bytes, seconds)]
    s = math.sqrt(sum(residuals) / (len(seconds) - 2))
    return s * math.sqrt(1 / sum(weights) + D_w**2 / S_DD), s / math.sqrt(S_DD)


def _weighted(sizes_bytes, seconds):
    """The weighted least-squares sums of the fit, checked: (weights 1 / t^2, mean_w(D),
    mean_w(t), sum w (D - mean_w(D))^2)."""
    if len(sizes_bytes) != len(seconds) or len(set(sizes_bytes)) < 2:
        raise ValueError(
            "fitting alpha and beta needs one time per size and at least two different sizes; "
            f"got {len(sizes_bytes)} sizes ({len(set(sizes_bytes))} different) and {len(seconds)} times: "
            "measure at least two message sizes and pass their times in the same order."
        )
    for D, t in zip(sizes_bytes, seconds):
        real_number("every size", D, "give message sizes in bytes.")
        real_number("every time", t, "the fit needs measured times above zero, in seconds.", above=True)
    weights = [1 / t**2 for t in seconds]
    D_w, t_w = (sum(w * x for w, x in zip(weights, xs)) / sum(weights) for xs in (sizes_bytes, seconds))
    return weights, D_w, t_w, sum(w * (D - D_w) ** 2 for w, D in zip(weights, sizes_bytes))


def measure_p2p(sizes, repeats=10):
    """Ping-pong between ranks 0 and 1: for each message size D (bytes) rank 0 sends D bytes,
    rank 1 sends them back, ``repeats`` times after one warm-up round trip. Returns on rank 0
    the list of (D, median half round trip in seconds) in increasing D, ready for
    ``fit_alpha_beta``; the other ranks return None (ranks 2 and up take no part).
    """
    if dist.get_world_size() < 2:
        raise ValueError("measure_p2p needs two ranks; run it on a cluster with world_size=2.")
    whole_number("repeats", repeats, "time each size at least once, e.g. repeats=10.")
    for size in sizes:
        whole_number("every size", size, "give message sizes as whole numbers of bytes, e.g. [8, 1024, 65536].",
                     minimum=0)
    rank = dist.get_rank()
    if rank > 1:
        return None
    pairs = []
    for size in sorted(sizes):
        message = torch.zeros(size, dtype=torch.uint8, device=runtime.device())
        times = []
        for _ in range(repeats + 1):
            start = time.perf_counter()
            if rank == 0:
                p2p.send(message, 1)
                p2p.recv(message, 1)
            else:
                p2p.recv(message, 0)
                p2p.send(message, 0)
            if message.is_cuda:
                torch.cuda.synchronize()  # NCCL returns before the bytes have moved
            times.append((time.perf_counter() - start) / 2)
        pairs.append((size, statistics.median(times[1:])))
    return pairs if rank == 0 else None


class PingPong(NamedTuple):
    """What ``ping_pong`` measured: message ``sizes`` (bytes, increasing), the ``seconds`` of
    one message of each, and the fit of alpha + D beta to them with its standard errors."""

    sizes: list
    seconds: list
    alpha: float
    beta: float
    alpha_error: float
    beta_error: float


def ping_pong(cluster, sizes, repeats=10, rounds=3, links=None):
    """``measure_p2p`` between ranks 0 and 1 of a running ``cluster``, ``rounds`` times, each
    size's fastest median kept, then ``fit_alpha_beta`` and ``fit_errors``: a ``PingPong``.
    Keeping the fastest of a few rounds filters out the moments another program held the
    cores. On an emulated link (``with cluster.emulate(link=...)``) it measures the link,
    plus what the emulation itself costs a message.

    ``links``: {name: a ``parlab.Link``, or None for real time} measures in each of these
    regimes instead of the cluster's own and returns {name: PingPong}. Each round measures
    every regime in turn, so a burst of load falls on all of them alike: a difference
    between two of the fits is the regimes', not the moment's (lecture 01 subtracts the free
    link's fit from the emulated link's to recover the declared alpha and beta)."""
    whole_number("rounds", rounds, "measure at least once, e.g. rounds=3.")
    regimes = {None: None} if links is None else dict(links)
    measured = {name: [] for name in regimes}
    for _ in range(rounds):
        for name, link in regimes.items():
            with contextlib.nullcontext() if links is None else cluster.emulate(link=link):
                measured[name].append(dict(cluster.run(measure_p2p, sizes, repeats)[0]))
    ordered = sorted(set(sizes))
    fits = {}
    for name, runs in measured.items():
        seconds = [min(times[size] for times in runs) for size in ordered]
        alpha, beta = fit_alpha_beta(ordered, seconds)
        fits[name] = PingPong(ordered, seconds, alpha, beta, *fit_errors(ordered, seconds, alpha, beta))
    return fits[None] if links is None else fits
