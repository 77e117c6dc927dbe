"""Why one process per replica beats one thread per replica: the GIL, measured on the CPU.

``nn.DataParallel`` drives N_d model replicas from N_d threads of one Python process. Each
replica's training step spends much of its time in the Python interpreter (module calls,
autograd bookkeeping, the per-parameter optimizer loop), and only one thread at a time may
run Python bytecode: the global interpreter lock (GIL) serialises that part.
DistributedDataParallel runs one process per replica, each with its own interpreter and GIL.

This module measures that effect without a GPU. A *replica* trains its own copy of a model
of many tiny layers (``make_model``) for a fixed number of steps on one intra-op thread, so
a step costs mostly Python overhead rather than arithmetic. N_d replicas run either

- in N_d threads of this process (``threads_throughput``), or
- in N_d ranks of a ``parlab.Cluster``, one process each (``processes_throughput``),

and the result is the throughput: replica-steps per second of wall-clock time, from the
moment all replicas start their timed steps until the last one finishes. Ideal scaling is
N_d times the throughput of one replica, capped by the number of CPU cores.
"""

import threading
import time
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn

from parlab._checks import whole_number

DEPTH, WIDTH, BATCH = 48, 16, 8
WARMUP_STEPS = 5
LEARNING_RATE = 1e-3


def make_model(depth=DEPTH, width=WIDTH):
    """``depth`` blocks of Linear(width, width) + Tanh: many tiny layers, so Python dominates."""
    whole_number("depth", depth, f"give the number of blocks, e.g. {DEPTH}.")
    whole_number("width", width, f"give the features of each layer, e.g. {WIDTH}.")
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*layers)


def train_replica(steps, seed=0, start_together=None):
    """Train one replica for ``steps`` SGD steps on a random batch, after a short warm-up.

    ``start_together`` (a barrier's wait) is called between the warm-up and the timed steps,
    so that all replicas start timing at about the same moment. Returns ``(start_ns, end_ns)``
    of the timed steps on ``time.perf_counter_ns``: all processes of one host share that
    clock, so intervals measured on different ranks line up.
    """
    _check_steps(steps)
    generator = torch.Generator().manual_seed(seed)
    model = make_model()
    parameters = list(model.parameters())
    x = torch.randn(BATCH, WIDTH, generator=generator)
    y = torch.randn(BATCH, WIDTH, generator=generator)

    def step():
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        # Plain SGD, one parameter at a time in Python as torch.optim.SGD(foreach=False)
        # does; torch.optim itself is avoided because its first use imports torch._dynamo,
        # which costs seconds in every process.
        with torch.no_grad():
            for p in parameters:
                p -= LEARNING_RATE * p.grad
                p.grad = None

    with _one_intra_op_thread():
        for _ in range(WARMUP_STEPS):
            step()
        if start_together is not None:
            start_together()
        start = time.perf_counter_ns()
        for _ in range(steps):
            step()
        return start, time.perf_counter_ns()


def threads_throughput(replicas, steps):
    """Replica-steps per second for ``replicas`` threads of this process, each training its
    own replica for ``steps`` steps: the nn.DataParallel arrangement, without the
    scatter/replicate/gather that nn.DataParallel also pays every step."""
    whole_number("replicas", replicas, "give the number of threads, each training one replica, e.g. 2.")
    _check_steps(steps)
    intervals = [None] * replicas
    barrier = threading.Barrier(replicas)

    def worker(index):
        intervals[index] = train_replica(steps, seed=index, start_together=barrier.wait)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(replicas)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return _throughput(intervals, steps)


def processes_throughput(cluster, replicas, steps):
    """Replica-steps per second for ``replicas`` ranks of ``cluster`` (one process each:
    the DDP arrangement), each training its own replica for ``steps`` steps. Ranks at or
    above ``replicas`` sit the measurement out."""
    _check_steps(steps)
    if isinstance(replicas, bool) or not isinstance(replicas, int) or not 1 <= replicas <= cluster.world_size:
        raise ValueError(
            f"replicas={replicas} needs between 1 and world_size={cluster.world_size} ranks; "
            "ask for fewer replicas or start a larger cluster."
        )
    intervals = cluster.run(_train_on_rank, replicas, steps)
    return _throughput([interval for interval in intervals if interval is not None], steps)


def compare(cluster, replica_counts=(1, 2, 4), steps=20, repeats=4):
    """Measure both arrangements for each N_d in ``replica_counts``.

    Every measurement is repeated ``repeats`` times and the best kept (as ``timeit`` does):
    other programs on the machine can only slow a run down, never speed it up. The repeats
    take turns, one of each configuration per round, so that a burst of outside load cannot
    spoil all the runs of one configuration. Returns ``{"threads": [...], "processes": [...]}``:
    throughputs in replica-steps per second, one per N_d, in the order of ``replica_counts``.
    """
    whole_number("repeats", repeats, "measure each configuration at least once; the best run is kept.")
    best = {"threads": [0.0] * len(replica_counts), "processes": [0.0] * len(replica_counts)}
    for _ in range(repeats):
        for i, k in enumerate(replica_counts):
            best["threads"][i] = max(best["threads"][i], threads_throughput(k, steps))
            best["processes"][i] = max(best["processes"][i], processes_throughput(cluster, k, steps))
    return best


def speedups(throughput, replica_counts=(1, 2, 4)):
    """Each arrangement's throughputs (``compare``'s result) as speed-ups over one replica.

    One replica is the same work in either arrangement (one thread, or one process), so its
    throughput is the better of the two measurements of it: a burst of outside load during
    one of them then cannot make that arrangement's later runs look like gains."""
    if not replica_counts or replica_counts[0] != 1:
        raise ValueError(f"replica_counts={tuple(replica_counts)} must start with 1: the speed-ups are over one "
                         "replica, so measure N_d = 1 first, e.g. (1, 2, 4).")
    one = max(values[0] for values in throughput.values())
    return {arrangement: [v / one for v in values] for arrangement, values in throughput.items()}


def _check_steps(steps):
    whole_number("steps", steps, "time at least one training step per replica, e.g. 20.")


def _train_on_rank(replicas, steps):
    rank = dist.get_rank()
    if rank >= replicas:
        dist.barrier()
        return None
    # Every rank leaves the barrier at about the same moment: a common start.
    return train_replica(steps, seed=rank, start_together=dist.barrier)


@contextmanager
def _one_intra_op_thread():
    """Let torch ops use a single thread, so that a replica is one thread of work.

    With OpenMP the setting belongs to the thread that makes it: a new thread does not
    inherit it and would spread its ops over every core, so each replica's thread asks for
    itself (and gives the setting back afterwards)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _throughput(intervals, steps):
    start = min(interval[0] for interval in intervals)
    end = max(interval[1] for interval in intervals)
    return len(intervals) * steps / ((end - start) / 1e9)
