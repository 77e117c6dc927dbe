"""The timed simulator of a pipeline schedule, the closed forms of its bubble, and the bubble
of any timeline, simulated or measured.

    simulate(schedule, t_f, t_b, t_w, t_comm)   start and end of every action; a Timeline
    bubble_fraction(timeline)                   idle fraction of a Timeline's actions
    action_makespan(timeline)                   the step time of a traced step
    bubble_formula(K, M, v)                     (K - 1) / (v M + K - 1)   (the lecture's form)
    bubble_ratio_playbook(K, M, v)              (K - 1) / (v M)           (Ultra-Scale Playbook)

Each rank runs its action list in order; an action starts when its rank is free and every
action it depends on (``parlab.pipeline.schedule.dependencies``) has ended, plus ``t_comm``
when that action ran on another rank. Times are per stage (per model chunk: for an
interleaved schedule pass t / v). Any number type works: with ``fractions.Fraction`` times
the results are exact.

Units: the simulator's times go into its Timeline as seconds (one unit = 1 s, stored as
integer nanoseconds), so a simulation with times in seconds lines up with a measured
timeline of the same schedule; ``Simulation.plot`` labels its axis in the simulator's units.
"""

from dataclasses import dataclass

from parlab._checks import real_number
from parlab.pipeline.schedule import check_sizes, dependencies, dependency_order, validate
from parlab.trace import COMPUTE, Timeline

NS_PER_UNIT = 10**9
EVENT_NAMES = {"F": "forward", "B": "backward", "W": "weight"}


@dataclass(frozen=True)
class Simulation:
    """The simulated step of ``schedule``: ``times`` maps each Action to (start, end);
    ``step_time`` is the last end (the first action starts at 0); ``busy[r]`` the compute
    time of rank r; ``bubble_fraction`` = 1 - sum(busy) / (K step_time);
    ``peak_activations[r]`` the most (stage, micro-batch) activations rank r holds at once:
    F done and the backward not yet complete, that is B not yet run, or W where the schedule
    splits the backward (W still reads the layer inputs that F saved; Qi et al. 2023 count a
    micro-batch in flight until its W). For an interleaved schedule each is one chunk, 1/v of
    the rank's layers. ``timeline``: one COMPUTE event per action, a ``parlab.trace.Timeline``."""

    schedule: object
    times: dict
    step_time: object
    busy: list
    bubble_fraction: object
    peak_activations: list
    timeline: Timeline

    def plot(self, ax=None, title=None):
        """Gantt chart of the simulated step (``Timeline.plot``): one row per
        rank, a block per action labelled with its kind and micro-batch, time in the
        simulator's units. Returns the axes."""
        from matplotlib.ticker import FuncFormatter

        s = self.schedule
        title = title or (f"{s.name}: K = {s.num_ranks}, M = {s.num_microbatches}"
                          + (f", v = {s.stages_per_rank}" if s.stages_per_rank > 1 else "")
                          + f", bubble {float(self.bubble_fraction):.1%} (simulated)")
        ax = self.timeline.plot(ax=ax, title=title)
        # a Timeline draws milliseconds; one simulator unit is one second of the Timeline.
        ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x / 1e3:g}"))
        ax.set_xlabel("time (simulator units, those of t_f and t_b)")
        return ax


def simulate(schedule, t_f=1.0, t_b=2.0, t_w=0, t_comm=0):
    """Run ``schedule`` (validated first) on the clock: F costs ``t_f``, B ``t_b``, W ``t_w``
    (only a schedule with W actions may have t_w > 0: otherwise B is the whole backward),
    and a result crossing ranks arrives ``t_comm`` after its producer ends. Returns a
    ``Simulation``."""
    validate(schedule)
    for name, time, meaning, above in (("t_f", t_f, "a forward", True), ("t_b", t_b, "a backward", True),
                                       ("t_w", t_w, "a weight-gradient step", False),
                                       ("t_comm", t_comm, "a message between ranks", False)):
        real_number(f"{name} (the time of {meaning})", time, f"give {name} as a number of time units, e.g. "
                    f"{name} = {1 if above else 0}.", above=above)
    if t_w and not schedule.has_weight_actions:
        raise ValueError(f"{schedule.name} has no W actions, so its B is the whole backward: add the weight-gradient "
                         f"time to t_b and leave t_w = 0.")
    cost = {"F": t_f, "B": t_b, "W": t_w}
    K = schedule.num_ranks
    free, times = [0] * K, {}
    # dependency_order lists every action after all it depends on and in its rank's order,
    # so one pass settles each start time.
    for action in dependency_order(schedule):
        rank = schedule.rank_of(action.stage)
        start = free[rank]
        for needed in dependencies(schedule, action):
            delay = t_comm if schedule.rank_of(needed.stage) != rank else 0
            start = max(start, times[needed][1] + delay)
        times[action] = (start, start + cost[action.kind])
        free[rank] = start + cost[action.kind]
    busy = [sum(cost[a.kind] for a in row) for row in schedule.actions]
    step_time = max(end for _, end in times.values())
    events = [(schedule.rank_of(a.stage), COMPUTE, EVENT_NAMES[a.kind], round(start * NS_PER_UNIT),
               round(end * NS_PER_UNIT), None, 0, a.stage, a.microbatch) for a, (start, end) in times.items()]
    return Simulation(schedule, times, step_time, busy, idle_fraction(busy, step_time),
                      [_peak_activations(row, schedule.has_weight_actions) for row in schedule.actions],
                      Timeline(events, K, regime="simulated"))


def bubble_fraction(timeline):
    """The bubble of any ``parlab.trace.Timeline`` (simulated or measured), from the spans of
    the schedule's actions only (compute events named forward, backward or weight: a span
    such as "step" around them is not work): 1 - (sum over the K ranks of their busy time)
    / (K x makespan), the makespan running from the first action's start to the last
    action's end on any rank (``action_makespan``)."""
    spans = action_spans(timeline)
    busy = [sum(ev.duration for ev in spans if ev.rank == r) for r in range(timeline.world_size)]
    return idle_fraction(busy, action_makespan(timeline))


def action_makespan(timeline):
    """Seconds from the first action's start to the last action's end, on any rank: the
    step time of a traced pipeline step (a Simulation's ``step_time`` when simulated)."""
    spans = action_spans(timeline)
    return max(ev.end for ev in spans) - min(ev.start for ev in spans)


def action_spans(timeline):
    """The COMPUTE events of ``timeline`` that are actions of a schedule (forward, backward,
    weight), in start order."""
    if not isinstance(timeline, Timeline):
        raise ValueError(f"bubble_fraction reads a parlab.trace.Timeline, got {type(timeline).__name__}: pass what "
                         "cluster.trace(...) returns, or a Simulation's .timeline.")
    spans = [ev for ev in timeline.select(kind=COMPUTE) if ev.name in EVENT_NAMES.values()]
    if not spans:
        raise ValueError("the timeline has no forward, backward or weight spans: trace a pipeline step, which marks "
                         "them.")
    return spans


def idle_fraction(busy, makespan):
    """1 - sum(busy) / (K makespan), K = len(busy): the share of K ranks' time spent idle."""
    if not busy:
        raise ValueError("busy must hold one busy time per rank, got none: pass a list with a time for each rank.")
    real_number("makespan (the time from the first start to the last end)", makespan,
                "a bubble needs work that takes time: give the ranks' compute spans durations above 0.", above=True)
    return 1 - sum(busy) / (len(busy) * makespan)


def bubble_formula(K, M, v=1):
    """Idle fraction of a GPipe/1F1B step (v = 1) or interleaved 1F1B step (v chunks of time
    t / v) with equal stages: (K - 1) / (v M + K - 1). Each rank idles (K - 1)(t_f + t_b) / v
    out of a step of M (t_f + t_b) + (K - 1)(t_f + t_b) / v."""
    check_sizes(K, M, v)
    return (K - 1) / (v * M + K - 1)


def bubble_ratio_playbook(K, M, v=1):
    """The Ultra-Scale Playbook's bubble: idle time over ideal time, r = (K - 1) / (v M).
    It is the same bubble as ``bubble_formula``: f = r / (1 + r)."""
    check_sizes(K, M, v)
    return (K - 1) / (v * M)


def _peak_activations(row, split_backward):
    # A micro-batch's activations are freed by the action that ends its backward: W when the
    # backward is split (B leaves W the layer inputs and output gradients), B otherwise.
    release = {"F": 1, "B": 0, "W": -1} if split_backward else {"F": 1, "B": -1}
    held = peak = 0
    for action in row:
        held += release[action.kind]
        peak = max(peak, held)
    return peak
