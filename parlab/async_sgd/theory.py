"""The numbers lecture 06 measures against, computed without ranks.

Delayed gradient descent. Asynchronous SGD applies at step t a gradient read tau steps
earlier: w_{t+1} = w_t - gamma grad f(w_{t - tau}). On the quadratic f(x) = mu x^2 / 2 that is
the linear recurrence x_{t+1} = x_t - gamma mu x_{t - tau}, stable iff

    0 < gamma mu < 2 cos(tau pi / (2 tau + 1))        (2, 1, 0.6180, 0.4450, 0.3473 for tau = 0..4)

(the roots of z^{tau+1} - z^tau + gamma mu = 0 stay inside the unit circle up to that bound;
Levin & May 1976, and Kuruklis 1994's criterion for y_{n+1} - a y_n + b y_{n-k} = 0 at a = 1).
So staleness forces a smaller step: 2 cos(tau pi / (2 tau + 1)) = 2 sin(pi / (2 (2 tau + 1))),
about pi / (2 tau + 1) for large tau.

Staleness of a parameter server. A worker whose gradient takes P_w seconds from pull to
push (its compute plus a round trip to the server) sees, while it computes, the gradients
that every other worker o applies at the rate 1/P_o: on average

    tau_w = sum over o != w of P_w / P_o                 (``expected_staleness``)

With 3 workers of periods 3 t_c, t_c, t_c: tau = 6 for the slow one, 1 + 1/3 for a fast one.
A round trip delta added to every period moves the fast workers' tau up and the slow one's
down, towards N_w - 1 (every worker alike).

Backup workers. A synchronous step waits for its slowest worker. Run N + e workers and use
the first N gradients: with i.i.d. exponential compute times of rate lambda, the N-th
fastest of N + e takes on average

    E[step] = (Hn(N + e) - Hn(e)) / lambda,     Hn(n) = 1 + 1/2 + ... + 1/n (harmonic numbers)

(the k-th gap between order statistics of exponentials is exponential with rate
(N + e - k) lambda). With e = 0 it is Hn(N) / lambda, about ln(N) / lambda: the straggler's
price grows with N.
"""

import math

from parlab._checks import real_number, whole_number


def stability_threshold(tau):
    """The largest stable gamma mu of delayed gradient descent with staleness ``tau``:
    2 cos(tau pi / (2 tau + 1)). stability_threshold(0) == 2, (1) == 1, (2) == 0.618..."""
    tau = whole_number("tau (the staleness)", tau, "count the steps between reading and applying, 0, 1, 2...",
                       minimum=0)
    return 2 * math.cos(tau * math.pi / (2 * tau + 1))


def delayed_gd(gamma_mu, tau, steps, x0=1.0):
    """The trajectory x_0 .. x_steps of x_{t+1} = x_t - gamma_mu x_{max(t - tau, 0)}: delayed
    gradient descent on f = mu x^2 / 2 whose first tau gradients read x_0 (the weights every
    worker starts from), as a parameter server with tau + 1 workers served in turn applies
    them. Returns a list of floats."""
    real_number("gamma mu (step size times curvature)", gamma_mu, "e.g. 0.5.")
    tau = whole_number("tau (the staleness)", tau, "e.g. 2.", minimum=0)
    steps = whole_number("steps", steps, "e.g. 100.", minimum=0)
    xs = [float(x0)]
    for t in range(steps):
        xs.append(xs[t] - gamma_mu * xs[max(t - tau, 0)])
    return xs


def expected_staleness(periods):
    """The mean staleness of each worker of an asynchronous parameter server whose workers
    take ``periods`` (seconds from pull to push, one per worker): tau_w = sum over o != w of
    P_w / P_o. Returns a list, one per worker."""
    periods = [real_number("period (seconds per gradient)", p, "e.g. 0.02.", above=True) for p in periods]
    return [sum(p / q for j, q in enumerate(periods) if j != i) for i, p in enumerate(periods)]


def mean_and_error(samples):
    """(mean, standard error of the mean) of a list of numbers: sample standard deviation / sqrt(n)."""
    n = len(samples)
    if n < 2:
        raise ValueError(f"a standard error needs at least 2 samples, got {n}.")
    mean = math.fsum(samples) / n
    return mean, math.sqrt(math.fsum((x - mean) ** 2 for x in samples) / (n - 1) / n)


def harmonic(n):
    """Hn(n) = 1 + 1/2 + ... + 1/n (Hn(0) = 0)."""
    n = whole_number("n", n, "harmonic numbers count terms: 0, 1, 2...", minimum=0)
    return math.fsum(1 / k for k in range(1, n + 1))


def expected_step_time(N, e, rate):
    """Expected time of a synchronous step that uses the first ``N`` of ``N + e`` workers whose
    compute times are i.i.d. exponential with ``rate`` lambda (per second):
    (Hn(N + e) - Hn(e)) / lambda."""
    N = whole_number("N (gradients used per step)", N, "e.g. 4.")
    e = whole_number("e (backup workers)", e, "e.g. 1; 0 for plain synchronous SGD.", minimum=0)
    rate = real_number("rate (lambda, per second)", rate, "e.g. 100 for a mean of 10 ms.", above=True)
    return (harmonic(N + e) - harmonic(e)) / rate
