"""How often to checkpoint: Young's and Daly's intervals, the goodput model, and runs with
failures drawn at a declared MTBF to measure it.

Symbols (any one unit of time): I, the compute time between two checkpoints; delta, the
time to write one; t_R, the time to restart after a failure (new processes, rendezvous,
reading the checkpoint); Theta, the job's mean time between failures. Failures arrive as a
Poisson process of rate 1/Theta (exponential times between them, memoryless), also during
checkpoints and restarts.

The goodput model. A segment is I of compute then delta of checkpoint: it needs I + delta
seconds without a failure. An attempt fails with probability 1 - exp(-(I + delta)/Theta),
so a segment takes exp((I + delta)/Theta) - 1 failures on average; each costs the time it
struck after (on average, an exponential's time cut at I + delta) plus a restart, itself
retried when struck. Summed (Daly 2006's complete cost function, per segment):

    E[segment wall time] = Theta exp(t_R/Theta) (exp((I + delta)/Theta) - 1)
    goodput(I) = I / E[segment wall time]            useful compute per second of wall time

The optimum. t_R only scales the wall time (exp(t_R/Theta)), so it does not move the best
I. Setting d goodput / dI = 0 with u = I/Theta and d = delta/Theta gives
(1 - u) exp(u + d) = 1, whose root in (0, 1) is I* = Theta (1 + W(-exp(-1 - delta/Theta)))
(W: Lambert's function, the branch W >= -1); ``optimum_interval`` finds it by bisection
(the left side falls from exp(d) > 1 at u = 0 to 0 at u = 1).

- Young (1974), "A first order approximation to the optimum checkpoint interval", CACM 17(9):
  I = sqrt(2 delta Theta), from a first-order model (at most one failure per segment,
  delta << Theta).
- Daly (2006), "A higher order estimate of the optimum checkpoint interval for restart dumps",
  FGCS 22(3), its higher-order estimate: I = sqrt(2 delta Theta) [1 + (1/3) sqrt(delta/(2 Theta)) + (1/9)
  delta/(2 Theta)] - delta for delta < 2 Theta, else I = Theta: a perturbation solution of the
  model above. (Its Figs. 3-5 give 117, 57 and 9.1 min for delta = 5 min and Theta = 24 h,
  6 h, 15 min; ``daly_interval`` reproduces them.)

Measured goodput (``simulate``): a discrete-event run of ``work`` of compute in segments of I,
with failure times drawn from an exponential of mean Theta (seeded): the wall time it took
and the failures it met. With n segments of independent wall times, the measured mean has
a standard error s / sqrt(n) (s: the segments' sample deviation, all of it made by the
failures sampled: a run without failure has s = 0), which ``goodput_curve`` turns into each
point's error bar and into the band of intervals the measured best may fall in.
"""

import math
import random

from parlab._checks import real_number, whole_number


def young_interval(delta, theta):
    """Young (1974): sqrt(2 delta Theta)."""
    return math.sqrt(2 * _positive("delta", delta) * _positive("Theta", theta))


def daly_interval(delta, theta):
    """Daly (2006): sqrt(2 delta Theta) [1 + sqrt(x)/3 + x/9] - delta with
    x = delta / (2 Theta), for delta < 2 Theta; Theta otherwise."""
    delta, theta = _positive("delta", delta), _positive("Theta", theta)
    if delta >= 2 * theta:
        return theta
    x = delta / (2 * theta)
    return math.sqrt(2 * delta * theta) * (1 + math.sqrt(x) / 3 + x / 9) - delta


def segment_time(interval, delta, restart, theta):
    """Expected wall time of one segment (I of compute + delta of checkpoint), failures and
    restarts included: Theta exp(t_R/Theta) (exp((I + delta)/Theta) - 1)."""
    return theta * math.exp(restart / theta) * math.expm1((interval + delta) / theta)


def goodput(interval, delta, restart, theta):
    """Useful compute per unit of wall time at interval I: I / ``segment_time``."""
    _positive("I (the interval)", interval)
    return interval / segment_time(interval, _positive("delta", delta), _nonnegative("t_R", restart),
                                   _positive("Theta", theta))


def optimum_interval(delta, theta, iterations=100):
    """The I that maximises ``goodput``: the root u in (0, 1) of (1 - u) exp(u + delta/Theta)
    = 1, times Theta (bisection; independent of t_R)."""
    d = _positive("delta", delta) / _positive("Theta", theta)
    low, high = 0.0, 1.0
    for _ in range(iterations):
        u = (low + high) / 2
        low, high = (u, high) if (1 - u) * math.exp(u + d) > 1 else (low, u)
    return theta * (low + high) / 2


def simulate(interval, delta, restart, theta, work, seed=0):
    """Run ``work`` of compute in segments of I (the last one shorter) with failures at the
    times of a Poisson process of mean gap Theta (``random.Random(seed)``). Returns {"goodput":
    work / wall time, "failures": failures met, "segments": n, "stderr": the standard error
    of the goodput from the segments' spread}."""
    rng = random.Random(seed)
    times, failures, left = [], 0, _positive("work", work)
    while left > 0:
        compute = min(interval, left)
        left -= compute
        spent = 0.0
        # memoryless: a fresh exponential draw at every attempt is the time to the next failure
        while (strike := rng.expovariate(1 / theta)) < compute + delta:
            spent, failures = spent + strike, failures + 1
            while (strike := rng.expovariate(1 / theta)) < restart:  # a restart is struck too
                spent, failures = spent + strike, failures + 1
            spent += restart
        times.append(spent + compute + delta)
    n, wall = len(times), sum(times)
    mean = wall / n
    spread = math.sqrt(sum((t - mean) ** 2 for t in times) / max(1, n - 1))
    return {"goodput": work / wall, "failures": failures, "segments": n,
            "stderr": work / wall * spread / mean / math.sqrt(n)}


def goodput_curve(delta, restart, theta, intervals, work, seed=0, z=4.0):
    """What the lecture's widget draws: at each I of ``intervals``, the model's goodput and
    one simulated run's (its own seed, seed + index), with Young's, Daly's and the exact
    optimum. ``band`` holds the intervals whose model goodput lies within z combined standard
    errors of the best model goodput on the grid: where the measured best may fall by chance
    (z = 4: a point drawn outside is a 4-sigma event).

    Returns {"intervals", "model", "measured", "stderr", "failures", "young", "daly",
    "optimum", "measured_best", "band"}."""
    whole_number("the number of intervals", len(intervals), "give at least two intervals to compare.", minimum=2)
    model = [goodput(i, delta, restart, theta) for i in intervals]
    runs = [simulate(i, delta, restart, theta, work, seed + k) for k, i in enumerate(intervals)]
    measured = [run["goodput"] for run in runs]
    stderr = [run["stderr"] for run in runs]
    best_model = max(range(len(intervals)), key=model.__getitem__)
    best_measured = max(range(len(intervals)), key=measured.__getitem__)
    band = [i for k, i in enumerate(intervals)
            if model[k] >= model[best_model] - z * math.hypot(stderr[k], stderr[best_model])]
    return {"intervals": list(intervals), "model": model, "measured": measured, "stderr": stderr,
            "failures": [run["failures"] for run in runs], "young": young_interval(delta, theta),
            "daly": daly_interval(delta, theta), "optimum": optimum_interval(delta, theta),
            "measured_best": intervals[best_measured], "band": band}


def _positive(name, value):
    return real_number(name, value, "give a time above 0, in the same unit as the others.", above=True)


def _nonnegative(name, value):
    return real_number(name, value, "give a time of at least 0, in the same unit as the others.")
