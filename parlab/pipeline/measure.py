"""A pipeline step measured on a cluster beside the simulator's: the bubble of stages that
only sleep, and the step time as the micro-batches shrink.

    measure_bubble(cluster, schedule, t_f, t_b, t_w, activation_bytes)    a BubbleMeasurement
    microbatch_sweep(cluster, microbatches, t_0, t_1, batch, sample_bytes)  GPipe at each M, stages of declared
                                                                          t(b) = t_0 + t_1 b per micro-batch of b
    one_stage_costs(stage, inputs, targets, microbatches)     t(b) of a real stage alone in this process
    fit_microbatch_cost(costs, batch)                         t_0 and t_1 of t(b) = t_0 + t_1 b, least squares
    gpipe_step_times(cluster, build_stages, inputs, targets, microbatches)   real GPipe steps, per M

The model. The simulator (``simulate``) places every action at the time its rank is free
and its inputs have arrived: ``t_comm`` after the producer ended when it ran on another
rank. On a cluster with an emulated link, t_comm is that link's time for one activation,
alpha + activation_bytes beta (0 in real time). Its bubble differs from the closed form
(K - 1) / (v M + K - 1) only by the link's time on the critical path.

What the simulator leaves out, and the yardstick for it. On the ranks, each action also
costs time outside its declared sleep: posting its messages, waking up when one arrives or
when its sleep ends, the Python of the executor (under a millisecond on a quiet core, a few
when the machine's cores are shared with other work). This cost is measured in the same
run, just before the step: the same schedule with stages ``YARDSTICK_SHORTER`` times
shorter runs the same actions along the same critical path, so what its step takes beyond
its own simulation (``overhead_s``) is that cost, paid once per action on the critical path
whatever the stages' length (the shorter step keeps the ranks busier, so if anything it
overstates the cost). It lengthens the measured step by about ``overhead_s``, and so raises
the bubble by at most (1 - bubble) overhead_s / T (the simulated bubble and step time T:
the ranks' busy time stays, the makespan grows). Allowed: twice each, as the load of a
shared machine changes between the two steps. A step that misses its allowance is measured
once more, yardstick and all (``attempts`` says how many were taken): another program
taking the cores for a few milliseconds can make one step miss, while a real defect (a rank
that waits for more than its inputs) misses by far more, every time.
"""

import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from parlab import trace
from parlab._checks import whole_number
from parlab.pipeline.executor import PipelineExecutor, sleep_pipeline_step
from parlab.pipeline.schedule import Schedule, gpipe, make_schedule
from parlab.pipeline.simulate import action_makespan, bubble_formula, bubble_fraction, simulate
from parlab.runtime.emulation import Link, Nodes

YARDSTICK_SHORTER = 4  # the yardstick's stages are this many times shorter than the measured step's


@dataclass(frozen=True)
class BubbleMeasurement:
    """One traced step of sleeping stages (``timeline``) and the simulator's step for the same
    times and the link's ``t_comm`` (``simulation``); ``overhead_s``, the yardstick (module
    docstring). Numbers: ``measured`` and ``simulated`` bubble, ``formula`` (K - 1) / (vM + K - 1),
    ``measured_step`` and ``simulated_step`` in seconds, and the allowed differences
    ``bubble_tolerance`` and ``step_tolerance`` (twice the yardstick's effect); ``attempts``,
    the steps measured to get this one."""

    schedule: Schedule
    timeline: object
    simulation: object
    t_comm: float
    overhead_s: float
    attempts: int = 1

    @property
    def measured(self):
        return bubble_fraction(self.timeline)

    @property
    def simulated(self):
        return float(self.simulation.bubble_fraction)

    @property
    def formula(self):
        return bubble_formula(self.schedule.num_ranks, self.schedule.num_microbatches, self.schedule.stages_per_rank)

    @property
    def measured_step(self):
        return action_makespan(self.timeline)

    @property
    def simulated_step(self):
        return float(self.simulation.step_time)

    @property
    def step_tolerance(self):
        return 2 * self.overhead_s

    @property
    def bubble_tolerance(self):
        return 2 * (1 - self.simulated) * self.overhead_s / self.simulated_step

    @property
    def within_tolerance(self):
        """The step and its bubble each within their allowance of the simulator's."""
        return (abs(self.measured_step - self.simulated_step) <= self.step_tolerance
                and abs(self.measured - self.simulated) <= self.bubble_tolerance)

    def __str__(self):
        s = self.schedule
        v = f", v = {s.stages_per_rank}" if s.stages_per_rank > 1 else ""
        again = f" ({self.attempts} attempts)" if self.attempts > 1 else ""
        return (f"{s.name}, K = {s.num_ranks}, M = {s.num_microbatches}{v}: bubble measured {self.measured:.3f}, "
                f"simulated {self.simulated:.3f} (t_comm {self.t_comm * 1e3:.2f} ms), (K-1)/(vM+K-1) "
                f"{self.formula:.3f}, allowed +-{self.bubble_tolerance:.3f}; step measured "
                f"{self.measured_step * 1e3:.1f} ms, simulated {self.simulated_step * 1e3:.1f} ms, allowed "
                f"+-{self.step_tolerance * 1e3:.1f} ms{again}")


def measure_bubble(cluster, schedule, t_f, t_b, t_w=0.0, activation_bytes=4, attempts=2, timeout=120):
    """Trace one step of ``schedule`` on ``cluster`` (K ranks, already warmed up: a cluster's
    first step pays for imports and connections) with stages that sleep t_f, t_b and t_w
    seconds and send activations of ``activation_bytes``, in the cluster's regime, after
    the yardstick's step; up to ``attempts`` times while the step misses its allowance
    (module docstring). Returns the last ``BubbleMeasurement``."""
    if cluster.world_size != schedule.num_ranks:
        raise ValueError(f"the cluster has {cluster.world_size} ranks and the schedule K = {schedule.num_ranks}: make "
                         f"the schedule for K = {cluster.world_size}.")
    if cluster.regime.devices is not None:
        raise ValueError("the simulator gives every stage its declared time, but this cluster emulates slower or "
                         "straggling devices: measure outside `with cluster.emulate(devices=...)`, or on a cluster "
                         "without devices=.")
    whole_number("attempts", attempts, "give how many steps may be measured, at least 1, e.g. 2.")
    t_comm = link_time(cluster.regime.network, activation_bytes)
    times = (t_f, t_b, t_w)
    short = tuple(t / YARDSTICK_SHORTER for t in times)
    simulation, short_step = simulate(schedule, *times, t_comm=t_comm), simulate(schedule, *short, t_comm=t_comm)
    for attempt in range(1, attempts + 1):
        yardstick = cluster.trace(sleep_pipeline_step, schedule, *short, activation_bytes=activation_bytes,
                                  timeout=timeout)
        timeline = cluster.trace(sleep_pipeline_step, schedule, *times, activation_bytes=activation_bytes,
                                 timeout=timeout)
        overhead_s = action_makespan(yardstick) - float(short_step.step_time)
        measurement = BubbleMeasurement(schedule, timeline, simulation, t_comm, overhead_s, attempt)
        if measurement.within_tolerance:
            break
    return measurement


def link_time(network, nbytes):
    """Seconds one message of ``nbytes`` takes on the cluster's emulated ``network`` (its
    ``regime.network``): alpha + n beta on a Link, 0 in real time (None)."""
    if network is None:
        return 0.0
    if isinstance(network, Nodes) or not isinstance(network, Link):
        raise ValueError(f"the simulator charges one link's time per message, got {network!r}: measure on a cluster "
                         "with link=parlab.Link(latency, bandwidth), or in real time.")
    return network.time(nbytes)


def microbatch_sweep(cluster, microbatches, t_0, t_1, batch, sample_bytes, tb_over_tf=2.0, attempts=2):
    """GPipe on the cluster's K ranks for each M of ``microbatches``, with emulated stages
    whose forward and backward of a micro-batch of b = ``batch`` / M samples take
    t(b) = t_0 + t_1 b seconds together (t_0 a fixed cost per micro-batch, t_1 the cost per
    sample), split 1 : ``tb_over_tf``, and whose activations are
    b x ``sample_bytes`` bytes (``measure_bubble``, ``attempts`` times at most). Returns a
    ``BubbleMeasurement`` per M, in order."""
    measurements = []
    for M in microbatches:
        if batch % M:
            raise ValueError(f"a batch of {batch} samples does not split into M = {M} micro-batches: use values "
                             f"of M that divide {batch}.")
        b = batch // M
        t = t_0 + t_1 * b
        schedule = make_schedule("gpipe", cluster.world_size, M)
        measurements.append(measure_bubble(cluster, schedule, t / (1 + tb_over_tf), t * tb_over_tf / (1 + tb_over_tf),
                                           activation_bytes=b * sample_bytes, attempts=attempts))
    return measurements


def one_stage_costs(stage, inputs, targets, microbatches, repeats=5):
    """t(b) of a real ``stage`` (a module) alone in this process: for each M of
    ``microbatches``, the executor runs GPipe with K = 1 (no messages) on the batch
    ``inputs``, ``targets`` cut into M micro-batches, on one thread like a rank of the
    cluster; the fastest of ``repeats`` steps divided by M is the forward and backward of
    one micro-batch of b = B / M samples. Returns {M: seconds}."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        costs = {}
        for M in microbatches:
            executor = PipelineExecutor(gpipe(1, M), {0: stage}, F.mse_loss)
            seconds = []
            for _ in range(repeats):
                start = time.perf_counter()
                executor.step(inputs, targets)
                seconds.append(time.perf_counter() - start)
            costs[M] = min(seconds) / M
        return costs
    finally:
        torch.set_num_threads(threads)


def fit_microbatch_cost(costs, batch):
    """(t_0, t_1) of the straight line t(b) = t_0 + t_1 b through ``costs`` ({M: t(B / M)}, as
    ``one_stage_costs`` gives), by least squares."""
    t_1, t_0 = statistics.linear_regression([batch // M for M in costs], list(costs.values()))
    return t_0, t_1


def gpipe_step_times(cluster, build_stages, inputs, targets, microbatches, steps=2):
    """Real GPipe steps on the cluster's K ranks, for each M of ``microbatches``: each rank
    builds its stage as ``build_stages()[rank]`` (K stages, the same on every rank) and runs
    ``steps`` steps on the batch (``inputs``, ``targets``), each marked with
    ``trace.span("step")``; the last one is read with ``Timeline.window``. Returns a dict per
    M: ``step`` (``action_makespan``), ``t_f`` and ``t_b`` (the median forward and backward
    spans) and its ``timeline``."""
    rows = []
    for M in microbatches:
        traced = cluster.trace(_gpipe_steps, build_stages, M, inputs, targets, steps)
        last = traced.window("step")
        spans = {name: [ev.duration for ev in last.select(name=name)] for name in ("forward", "backward")}
        rows.append({"M": M, "step": action_makespan(last), "t_f": statistics.median(spans["forward"]),
                     "t_b": statistics.median(spans["backward"]), "timeline": last})
    return rows


def _gpipe_steps(build_stages, M, inputs, targets, steps):
    rank = dist.get_rank()
    stage = build_stages()[rank]
    executor = PipelineExecutor(gpipe(dist.get_world_size(), M), {rank: stage}, F.mse_loss)
    for _ in range(steps):
        stage.zero_grad()
        dist.barrier()  # all ranks start the step together
        with trace.span("step"):
            executor.step(inputs, targets)
