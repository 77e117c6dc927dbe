"""All-reduce bandwidth: parlab's naive, ring and butterfly algorithms beside dist.all_reduce.

For each world size and message size S (bytes), every algorithm reduces a float32 tensor of
S bytes in place on the same cluster, in one run; the time of one all-reduce is the slowest
rank's mean over the timed iterations. Bandwidths follow the nccl-tests definitions:

    algbw = S / t                      (what the application sees)
    busbw = algbw * 2 (N - 1) / N      (what each link carries in a bandwidth-optimal
                                        all-reduce; comparable across N)

``ratio`` is parlab's time over torch's (``dist.all_reduce`` on the same backend) at the same
N and S, as in every bench: below 1, parlab's algorithm is faster. (Bandwidths compare the
other way round: parlab's busbw / torch's = 1 / ratio.) parlab's collectives run with
``check=False`` so that the timing is the algorithm's alone.
"""

import argparse
import os
import time

import torch
import torch.distributed as dist

from parlab import collectives, runtime
from parlab.bench import (
    check_arguments,
    format_table,
    positive_int,
    progress,
    ratio_header,
    synchronise,
    time_ratio,
)

ALGORITHMS = {
    "torch": lambda x: dist.all_reduce(x),
    "naive": lambda x: collectives.naive_allreduce(x, check=False),
    "ring": lambda x: collectives.ring_allreduce(x, check=False),
    "butterfly": lambda x: collectives.butterfly_allreduce(x, check=False),
}
REFERENCE = "torch's dist.all_reduce"
DEFAULT_SIZES = [2**10 * 4**k for k in range(9)]  # 1 KiB to 64 MiB
# Enough repetitions that small messages are timed over milliseconds, few for large ones.
TIMED_BYTES = 256 * 2**20
MIN_ITERS, MAX_ITERS = 3, 200


def add_arguments(parser):
    parser.add_argument(
        "--world-sizes", type=positive_int, nargs="+", default=[2, 4], metavar="N", help="default: 2 4"
    )
    parser.add_argument(
        "--sizes", type=_size, nargs="+", default=DEFAULT_SIZES, metavar="BYTES",
        help="message sizes, e.g. 1K 4M 64M (default: 1K to 64M, powers of 4)",
    )
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where the tensors live")


def run(args):
    return bench_collectives(args.world_sizes, args.sizes, args.device)


def bench_collectives(world_sizes=(2, 4), sizes=DEFAULT_SIZES, device="cpu"):
    """Measure every algorithm at every (N, S); returns a JSON-ready dict with one row per
    (world_size, size, algorithm): seconds, algbw and busbw (bytes/s), and the time ratio to torch."""
    check_arguments(device, world_sizes=world_sizes, sizes=sizes)
    rows = []
    for world_size in world_sizes:
        with runtime.Cluster(world_size, device=device) as cluster:
            for size in sizes:
                progress("collectives", f"N={world_size}, {_human(size)} ...")
                seconds = cluster.run(time_algorithms, size)[0]
                rows.extend(bandwidth_rows(world_size, size, seconds))
    return {
        "bench": "collectives",
        "device": device,
        "backend": rows[0]["backend"] if rows else None,
        "torch_version": torch.__version__,
        "cpu_count": os.cpu_count(),
        "ratio_means": ratio_header(REFERENCE),
        "rows": rows,
    }


def time_algorithms(size):
    """On every rank: seconds per all-reduce of ``size`` bytes for each algorithm (the
    slowest rank's mean over the timed iterations, the same on every rank)."""
    # Zeros stay zeros under repeated in-place sums: no overflow to inf across iterations.
    tensor = torch.zeros(max(1, size // 4), dtype=torch.float32, device=runtime.device())
    iters = max(MIN_ITERS, min(MAX_ITERS, TIMED_BYTES // max(size, 1)))
    seconds = {}
    for name, all_reduce in ALGORITHMS.items():
        all_reduce(tensor)  # warm-up: connections, allocations
        synchronise(tensor.device)
        dist.barrier()
        start = time.perf_counter()
        for _ in range(iters):
            all_reduce(tensor)
        synchronise(tensor.device)
        elapsed = torch.tensor([(time.perf_counter() - start) / iters], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        seconds[name] = elapsed.item()
    return {"seconds": seconds, "backend": dist.get_backend(), "iters": iters}


def bandwidth_rows(world_size, size, measured):
    """The rows of one (N, S) from ``time_algorithms``' result: per algorithm its seconds,
    algbw, busbw and ratio = its seconds / torch's."""
    nbytes = max(1, size // 4) * 4
    rows = []
    for name, seconds in measured["seconds"].items():
        algbw = nbytes / seconds
        rows.append(
            {
                "world_size": world_size, "bytes": nbytes, "algorithm": name, "seconds": seconds,
                "algbw": algbw, "busbw": algbw * 2 * (world_size - 1) / world_size,
                "ratio": time_ratio(seconds, measured["seconds"]["torch"]),
                "iters": measured["iters"], "backend": measured["backend"],
            }
        )
    return rows


def format_report(result):
    table = format_table(
        ["N", "size", "algorithm", "time", "algbw GB/s", "busbw GB/s", "time / torch"],
        [
            [
                row["world_size"], _human(row["bytes"]), row["algorithm"], f"{row['seconds'] * 1e3:.3f} ms",
                f"{row['algbw'] / 1e9:.3f}", f"{row['busbw'] / 1e9:.3f}",
                f"{row['ratio']:.2f}",
            ]
            for row in result["rows"]
        ],
    )
    return (
        f"parlab bench collectives: all-reduce of float32 tensors over {result['backend']} on "
        f"{result['device']}, torch {result['torch_version']}, {result['cpu_count']} CPU cores\n"
        f"{ratio_header(REFERENCE)}; busbw compares the other way (higher is faster)\n\n{table}"
    )


def plot_busbw(result, ax=None):
    """busbw against message size, one line per algorithm and world size (log-log)."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(8, 4.5))
    styles = {"torch": "k-", "naive": "C3--", "ring": "C0-o", "butterfly": "C2-s"}
    world_sizes = sorted({row["world_size"] for row in result["rows"]})
    for world_size, alpha in zip(world_sizes, (1.0, 0.55, 0.35)):
        for name, style in styles.items():
            rows = [r for r in result["rows"] if r["world_size"] == world_size and r["algorithm"] == name]
            if rows:
                ax.plot([r["bytes"] for r in rows], [r["busbw"] / 1e9 for r in rows], style,
                        alpha=alpha, markersize=4, label=f"{name}, N={world_size}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("message size (bytes)")
    ax.set_ylabel("busbw (GB/s)")
    ax.set_title(f"all-reduce bus bandwidth ({result['backend']}, {result['device']})")
    ax.legend(fontsize=8, ncol=2)
    return ax


def _size(text):
    """argparse type: a byte count such as 4096, 1K, 4M or 1G (powers of 1024)."""
    units = {"K": 2**10, "M": 2**20, "G": 2**30}
    text = text.strip().upper().removesuffix("B")
    try:
        value = int(float(text[:-1]) * units[text[-1]]) if text and text[-1] in units else int(text)
    except (ValueError, OverflowError):  # OverflowError: "inf"
        value = 0
    if value < 4:
        raise argparse.ArgumentTypeError(f"expected a size of at least 4 bytes such as 4096, 1K or 4M, got {text!r}")
    return value


def _human(nbytes):
    for unit, scale in (("G", 2**30), ("M", 2**20), ("K", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:g}{unit}"
    return f"{nbytes}B"

