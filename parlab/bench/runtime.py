"""Dispatch cost: one call on a persistent parlab.Cluster vs a fresh torch.multiprocessing.spawn.

A notebook cell that spawned its ranks afresh would pay, every time, for starting
``world_size`` Python processes, importing torch in each and joining a process group. A
Cluster pays that once (``cluster_start_s``); after that a call only ships the function to
the ranks and collects their answers. Both sides run the same trivial function on ranks
joined in a gloo process group on the CPU, so the difference is the runtime alone.

Result (seconds): ``cluster_median_s`` and ``cluster_p90_s`` over ``repeats`` calls after
``WARMUP_CALLS`` unmeasured ones; ``spawn_median_s`` over ``spawn_repeats`` spawns, process
group set-up included; ``ratio = cluster_median_s / spawn_median_s``, parlab's time over the
reference's as in every bench (below 1, the cluster is faster).
"""

import os
import statistics
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import parlab
from parlab.bench import (
    check_arguments,
    format_seconds,
    format_table,
    percentile,
    positive_int,
    progress_bar,
    ratio_header,
    time_ratio,
)

# The first calls on a new cluster are slower (first unpickling, lazy imports on the ranks).
WARMUP_CALLS = 3
REFERENCE = "a fresh torch.multiprocessing.spawn"
STORE_TIMEOUT = timedelta(seconds=60)


def add_arguments(parser):
    count = dict(type=positive_int, metavar="N")
    parser.add_argument("--world-size", default=4, help="number of ranks (default 4)", **count)
    parser.add_argument("--repeats", default=50, help="measured calls on the cluster (default 50)", **count)
    parser.add_argument("--spawn-repeats", default=3, help="measured fresh spawns (default 3)", **count)


def run(args):
    return bench_runtime(args.world_size, args.repeats, args.spawn_repeats)


def bench_runtime(world_size=4, repeats=50, spawn_repeats=3):
    """Time a trivial function on ``world_size`` ranks, dispatched to a persistent Cluster
    and run by a fresh ``torch.multiprocessing.spawn``, in one run; returns the result dict
    described in the module docstring. Progress shows as a bar (``progress_bar``)."""
    check_arguments(repeats=repeats, spawn_repeats=spawn_repeats)
    with progress_bar("runtime", repeats + spawn_repeats, unit="run") as bar:
        cluster_start, cluster_times = _time_cluster(world_size, repeats, bar)
        spawn_times = _time_spawn(world_size, spawn_repeats, bar)
    return {
        "bench": "runtime",
        "world_size": world_size,
        "backend": "gloo",
        "repeats": repeats,
        "spawn_repeats": spawn_repeats,
        "torch_version": torch.__version__,
        "cpu_count": os.cpu_count(),
        "ratio_means": ratio_header(REFERENCE),
        **summarise(cluster_start, cluster_times, spawn_times),
    }


def summarise(cluster_start, cluster_times, spawn_times):
    """The timings of a result from the measured seconds: the cluster's start-up, median and
    p90 per call, the spawn's median, and ratio = the cluster's median / the spawn's."""
    cluster_median, spawn_median = statistics.median(cluster_times), statistics.median(spawn_times)
    return {
        "cluster_start_s": cluster_start,
        "cluster_median_s": cluster_median,
        "cluster_p90_s": percentile(cluster_times, 90),
        "spawn_median_s": spawn_median,
        "ratio": time_ratio(cluster_median, spawn_median),
    }


def format_report(result):
    table = format_table(
        ["trivial function on every rank", "median", "p90", "runs"],
        [
            [
                "persistent parlab.Cluster.run",
                format_seconds(result["cluster_median_s"]),
                format_seconds(result["cluster_p90_s"]),
                result["repeats"],
            ],
            [
                "fresh torch.multiprocessing.spawn",
                format_seconds(result["spawn_median_s"]),
                "-",
                result["spawn_repeats"],
            ],
        ],
    )
    return (
        f"parlab bench runtime: {result['world_size']} ranks over {result['backend']} on the CPU, "
        f"torch {result['torch_version']}, {result['cpu_count']} CPU cores\n{ratio_header(REFERENCE)}\n\n"
        f"{table}\n\n"
        f"ratio, cluster call / fresh spawn: {result['ratio']:.2g}; "
        f"the cluster started once, in {format_seconds(result['cluster_start_s'])}."
    )


def trivial_work():
    """The function both sides run on every rank: next to nothing, so only dispatch counts."""
    return dist.get_rank()


def _time_cluster(world_size, repeats, bar):
    """(start-up time, per-call times) of a persistent Cluster on the CPU."""
    bar.set_postfix_str(f"starting a {world_size}-rank parlab.Cluster")
    start = time.perf_counter()
    with parlab.Cluster(world_size, device="cpu") as cluster:
        start_up = time.perf_counter() - start
        bar.set_postfix_str("calls on the cluster")
        for _ in range(WARMUP_CALLS):
            cluster.run(trivial_work)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            cluster.run(trivial_work)
            times.append(time.perf_counter() - start)
            bar.update()
    return start_up, times


def _time_spawn(world_size, spawn_repeats, bar):
    """Per-run times of spawning ``world_size`` fresh processes that join a gloo process
    group and run ``trivial_work``. The rendezvous store lives in this process on a port the
    OS picks, as in a Cluster, so runs never collide on a port. On a loaded machine a fresh
    gloo group now and then fails to connect its mesh: such a run measures nothing, so it is
    reported and run again, once per requested run at most."""
    times, failures = [], 0
    while len(times) < spawn_repeats:
        bar.set_postfix_str(f"fresh spawn of {world_size} processes, {len(times) + 1}/{spawn_repeats}")
        start = time.perf_counter()
        store = dist.TCPStore(
            "127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False, timeout=STORE_TIMEOUT
        )
        try:
            mp.spawn(_spawned_rank, args=(world_size, store.port), nprocs=world_size)
        except mp.ProcessRaisedException as error:
            failures += 1
            if failures > spawn_repeats:
                raise
            bar.write("parlab bench runtime: a spawned process group failed to start; running it again: "
                      + str(error).strip().splitlines()[-1], file=sys.stderr)
            continue
        times.append(time.perf_counter() - start)
        bar.update()
    return times


def _spawned_rank(rank, world_size, store_port):
    store = dist.TCPStore("127.0.0.1", store_port, world_size, is_master=False, timeout=STORE_TIMEOUT)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    trivial_work()
    dist.destroy_process_group()

