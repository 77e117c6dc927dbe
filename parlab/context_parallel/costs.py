"""Bytes each rank sends for one attention, by method: the formulas of the methods' module
docstrings, which the trace of a run equals exactly (``tests/test_context_parallel_bytes.py``).

    method        forward                        backward
    all-gather    2 (cp - 1) b s h / cp          2 (cp - 1) b s h / cp        (reduce-scatter)
    ring          2 (cp - 1) b s h / cp          2 (2 cp - 1) b s h / cp      (K/V cp - 1 times, dK/dV cp times)
    ulysses       4 (cp - 1) b s h / cp^2        4 (cp - 1) b s h / cp^2

in elements, times e bytes an element; b s h / cp elements is one rank's Q, K or V. With
cp = 1 nothing is sent.
"""

from parlab._checks import whole_number

METHODS = ("all-gather", "ring", "ulysses")
PHASES = ("forward", "backward")


def bytes_per_rank(method, b, s, h, cp, element_bytes=4, phase="forward"):
    """Bytes one rank sends in ``phase`` ("forward" or "backward") of ``method`` ("all-gather",
    "ring" or "ulysses", ``METHODS``) for a micro-batch of b sequences of s positions, hidden
    size h, over cp ranks, e = ``element_bytes`` bytes an element (4 in fp32)."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {', '.join(map(repr, METHODS))}, got {method!r}: pick one of them.")
    if phase not in PHASES:
        raise ValueError(f"phase must be 'forward' or 'backward', got {phase!r}: pick one of them.")
    fix = "give sizes as whole numbers, as in b = 2, s = 16, h = 32, cp = 4, element_bytes = 4."
    b, s, h, cp, e = (whole_number(name, value, fix) for name, value in
                      (("b", b), ("s", s), ("h", h), ("cp", cp), ("element_bytes", element_bytes)))
    if s % cp:
        raise ValueError(f"s = {s} positions do not split over cp = {cp} ranks: choose s a multiple of {cp}.")
    shard = b * s * h // cp * e  # bytes of one rank's Q, K or V
    if method == "ulysses":
        return 4 * (cp - 1) * shard // cp
    if method == "ring" and phase == "backward" and cp > 1:
        return 2 * (2 * cp - 1) * shard
    return 2 * (cp - 1) * shard
