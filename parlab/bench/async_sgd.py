"""Sync, async, local and gossip SGD: time per epoch and final loss under a declared straggler and link.

One cluster runs the four methods of ``parlab.async_sgd.training`` one after another on the
same least-squares problem, each computing rank taking ``steps`` gradients (one epoch) of
``compute`` seconds of declared compute, in one regime: by default an emulated link (alpha +
bytes beta per message) and emulated devices on which a step straggles (``factor`` times
slower, with ``probability``); ``--real`` measures the same in real time instead. Each row:
the method's time for the epoch, its final loss (held-out batch, at the mean of the replicas)
and ``ratio`` = its time / sync's time in the same run (below 1: faster than synchronous SGD).
The async row has N - 1 workers (rank 0 serves), so it computes (N - 1) x steps gradients.
"""

import argparse
import os

import torch

from parlab import runtime
from parlab.async_sgd import training
from parlab.bench import (
    check_arguments,
    check_link,
    format_seconds,
    format_table,
    link_argument,
    positive_int,
    positive_number,
    progress_bar,
    ratio_header,
    time_ratio,
)
from parlab.runtime.emulation import Devices, Straggler

REFERENCE = "sync (synchronous SGD: parlab's ring all-reduce of every gradient)"
DEFAULT_LINK = "5ms,100MB/s"


def add_arguments(parser):
    parser.add_argument("--world-size", type=positive_int, default=4, help="ranks (default 4)")
    parser.add_argument("--steps", type=positive_int, default=24, help="gradients per computing rank (default 24)")
    parser.add_argument("--compute-ms", type=positive_number, default=20.0,
                        help="declared compute per gradient in ms (default 20)")
    parser.add_argument("--link", type=link_argument, default=DEFAULT_LINK, metavar="LATENCY,BANDWIDTH",
                        help=f"the emulated link (default {DEFAULT_LINK})")
    parser.add_argument("--straggler", type=_straggler, default="5,0.1", metavar="FACTOR,PROBABILITY",
                        help="each step of each rank FACTOR times slower with PROBABILITY (default 5,0.1)")
    parser.add_argument("--period", type=positive_int, default=4, help="H, local SGD's steps per averaging (default 4)")
    parser.add_argument("--real", action="store_true", help="measure in real time instead (no link, no straggler)")


def run(args):
    devices = None if args.real else Devices(straggler=args.straggler)
    return bench_async(args.world_size, args.steps, args.compute_ms / 1e3, None if args.real else args.link, devices,
                       args.period)


def bench_async(world_size=4, steps=24, compute_s=0.02, link=None, devices=None, period=4):
    """Train each of ``training.METHODS`` for ``steps`` gradients per computing rank on one
    cluster of ``world_size`` ranks in one regime; returns the JSON-ready result."""
    check_arguments(world_size=world_size, steps=steps, period=period)
    check_link(link)
    if world_size < 2:
        raise ValueError("the methods need at least 2 ranks (async: a server and a worker); pass world_size=2 or more.")
    problem = training.LeastSquares(seconds=compute_s)
    rows = []
    with runtime.Cluster(world_size, device="cpu", timeout=600, link=link, devices=devices) as cluster:
        regime = cluster.regime.describe()
        with progress_bar("async", len(training.METHODS), unit="method") as bar:
            for method in training.METHODS:
                bar.set_postfix_str(method)
                curve = training.curve_of(cluster.run(training.train, method, problem, steps, period), problem)
                rows.append(method_row(method, curve, world_size, steps))
                bar.update()
    return {"torch_version": torch.__version__, "cpu_count": os.cpu_count(), "world_size": world_size,
            "steps": steps, "compute_s": compute_s, "period": period, "regime": regime,
            "ratio_means": ratio_header(REFERENCE), "rows": add_ratios(rows)}


def method_row(method, curve, world_size, steps):
    """One method's row from its curve [(seconds, step, loss)]."""
    workers = world_size - 1 if method == "async" else world_size
    return {"method": method, "workers": workers, "gradients": workers * steps, "seconds": curve[-1][0],
            "final_loss": curve[-1][2], "losses": [loss for _, _, loss in curve], "times": [t for t, _, _ in curve]}


def add_ratios(rows):
    """Each row's ratio = its seconds / the sync row's."""
    sync = next(row for row in rows if row["method"] == "sync")
    return [dict(row, ratio=time_ratio(row["seconds"], sync["seconds"])) for row in rows]


def format_report(result):
    rows = [[row["method"], row["workers"], row["gradients"], format_seconds(row["seconds"]),
             f"{row['final_loss']:.4f}", f"{row['ratio']:.2f}"] for row in result["rows"]]
    header = (f"parlab bench async: {result['world_size']} ranks, {result['steps']} gradients per computing rank of "
              f"{format_seconds(result['compute_s'])} declared compute, H = {result['period']}, torch "
              f"{result['torch_version']}, {result['cpu_count']} CPU cores\n"
              f"regime: {result['regime']}\n{ratio_header(REFERENCE)}")
    table = format_table(["method", "workers", "gradients", "time per epoch", "final loss", "ratio"], rows)
    return f"{header}\n\n{table}"


def _straggler(text):
    try:
        factor, probability = (float(part) for part in text.split(","))
        return Straggler(factor=factor, probability=probability, seed=1)
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"expected FACTOR,PROBABILITY such as 5,0.1, got {text!r} ({error})") from None
