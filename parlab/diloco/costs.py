"""What a step of each method costs on a link, where DiLoCo overtakes DDP, and the wall time
to a target loss: the alpha-beta model of lecture 01 applied to lecture 10's methods.

Symbols: N replicas, a link of latency alpha and bandwidth 1/beta (a ``parlab.Link``), t_c
the compute of one inner step, P the bytes one all-reduce of the whole model carries (4 Psi
in fp32; a compressor's payload for Streaming DiLoCo), H inner steps per outer step, F
fragments, tau the inner steps a fragment's all-reduce overlaps. A ring all-reduce of D
bytes takes T(D) = 2 (N - 1) alpha + 2 (N - 1)/N D beta (``alpha_beta.cost_model``).
Seconds per inner step:

    ddp                  t_c + T(P)                        every step's gradient
    local, diloco        t_c + T(P) / H                    the weights (or their change) every H steps
    streaming            max(t_c + (F/H) max(0, T(P/F) - tau t_c),  (F/H) T(P/F))

Streaming DiLoCo sends a fragment of P/F bytes every H/F steps; tau steps of compute hide
that much of its all-reduce, and the rest blocks. Each fragment pays the ring's 2 (N - 1)
latencies, so F fragments pay F times the latency of one all-reduce. The second term: when
the link is busier than the compute (T(P/F) > (H/F) t_c), all-reduces queue on the rank's
communication thread and the link sets the pace.
"""

import math

from parlab import alpha_beta
from parlab._checks import real_number, whole_number

METHODS = ("ddp", "local", "diloco", "streaming")


def seconds_per_step(method, link, compute_s, payload_bytes, N, H=1, fragments=1, delay=0):
    """Predicted seconds per inner step of ``method`` (one of ``METHODS``) on ``link`` (with
    ``latency`` and ``bandwidth``): the table in the module's docstring."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {', '.join(METHODS)}; got {method!r}.")
    t_c = real_number("compute_s (t_c)", compute_s, "give the seconds of one inner step's compute, e.g. 0.02.")
    H = whole_number("H (inner steps per outer step)", H, "e.g. H=8; DDP takes H=1.")
    F = whole_number("fragments (F)", fragments, "e.g. fragments=1.") if method == "streaming" else 1
    tau = whole_number("delay (tau)", delay, "e.g. delay=0.", minimum=0) if method == "streaming" else 0

    def all_reduce(D):
        return alpha_beta.cost_model("ring", D, N, link.latency, 1 / link.bandwidth)

    if method == "ddp":
        return t_c + all_reduce(payload_bytes)
    if method in ("local", "diloco"):
        return t_c + all_reduce(payload_bytes) / H
    fragment = all_reduce(payload_bytes / F)
    return max(t_c + F / H * max(0.0, fragment - tau * t_c), F / H * fragment)


def crossover(steps_ddp, steps_diloco, H, payload_bytes, N, compute_s, latency):
    """The link bandwidth (bytes/s) below which DiLoCo, needing ``steps_diloco`` inner steps,
    reaches its target sooner than DDP needing ``steps_ddp``, at ``latency`` (alpha):
    S_ddp (t_c + T) = S_dil (t_c + T / H) at

        T* = t_c (S_dil - S_ddp) / (S_ddp - S_dil / H),   bandwidth* = 2 (N - 1)/N P / (T* - 2 (N - 1) alpha).

    math.inf where latency alone already makes DiLoCo sooner (T* <= 2 (N - 1) alpha, or
    S_dil <= S_ddp), 0.0 where it never is (S_dil >= H S_ddp: no fewer all-reduces)."""
    for name, value in (("steps_ddp", steps_ddp), ("steps_diloco", steps_diloco)):
        real_number(name, value, "give the inner steps each method needs to reach the target, e.g. 40.", above=True)
    H = whole_number("H (inner steps per outer step)", H, "e.g. H=8.")
    t_c = real_number("compute_s (t_c)", compute_s, "give the seconds of one inner step's compute, e.g. 0.02.")
    alpha = real_number("latency (alpha)", latency, "give the link's latency in seconds, e.g. 0.03.")
    if steps_diloco >= H * steps_ddp:
        return 0.0
    if steps_diloco <= steps_ddp:
        return math.inf
    T_star = t_c * (steps_diloco - steps_ddp) / (steps_ddp - steps_diloco / H)
    latencies = 2 * (N - 1) * alpha
    if T_star <= latencies:
        return math.inf
    return 2 * (N - 1) / N * payload_bytes / (T_star - latencies)


def steps_to_loss(points, target):
    """The first inner step at which a measured curve ``points`` [(inner step, loss)] is at or
    below ``target``; None if it never is."""
    return next((step for step, loss in sorted(points) if loss <= target), None)


def wall_time_to_loss(points, target, method, link, compute_s, payload_bytes, N, H=1, fragments=1, delay=0):
    """Predicted seconds to reach ``target`` loss: the inner steps a measured curve ``points``
    (of this method and H) needs, times ``seconds_per_step`` on ``link``; None if the curve
    never reaches it. The lecture's widget draws it against H and the link's bandwidth."""
    steps = steps_to_loss(points, target)
    if steps is None:
        return None
    return steps * seconds_per_step(method, link, compute_s, payload_bytes, N, H, fragments, delay)
