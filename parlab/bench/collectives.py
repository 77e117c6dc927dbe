"""All-reduce bandwidth: parlab's naive, ring and butterfly algorithms beside dist.all_reduce.

For each world size N and message size D (bytes), every algorithm reduces a float32 tensor of
D bytes in place on the same cluster, in one run; the time of one all-reduce is the slowest
rank's mean over the timed iterations. Bandwidths follow the nccl-tests definitions:

    algbw = D / t                      (what the application sees)
    busbw = algbw * 2 (N - 1) / N      (what each link carries in a bandwidth-optimal
                                        all-reduce; comparable across N)

Real time: ``ratio`` is parlab's time over torch's (``dist.all_reduce`` on the same backend)
at the same N and D, as in every bench: below 1, parlab's algorithm is faster. (Bandwidths
compare the other way round: parlab's busbw / torch's = 1 / ratio.) parlab's collectives run
with ``check=False`` so that the timing is the algorithm's alone.

Emulated link (``--link 200us,100MB/s``): parlab's algorithms are timed a second time with
every message taking alpha + n beta (``parlab.Link``; torch's all_reduce is not shaped, so it
stays the real reference), beside the alpha-beta model's prediction
(``parlab.alpha_beta.cost_model``): ``model_ratio`` = emulated time / predicted time. The
emulation never lets a message finish early, so 1 is the model exactly and the excess is
what the model leaves out: the CPU work of each message and each reduction, which ranks
sharing a few cores do one after another. ``free_seconds`` measures that work: the same
all-reduce on ``FREE_LINK`` (no latency, unlimited bandwidth), where the emulation's path
takes no time of its own. The report ends with the targets the emulated ring must meet: within
10% of the alpha-beta model from 1 to 64 MiB, and at least 2x faster than naive at 16 MiB on
4 ranks.
"""

import math
import os
import time

import torch
import torch.distributed as dist

from parlab import collectives, runtime
from parlab.alpha_beta import cost_model
from parlab.bench import (
    byte_size,
    check_arguments,
    check_link,
    format_bytes,
    format_table,
    link_argument,
    positive_int,
    progress_bar,
    ratio_header,
    synchronise,
    time_ratio,
)
from parlab.runtime.emulation import Link, Regime

ALGORITHMS = {
    "torch": lambda x: dist.all_reduce(x),
    "naive": lambda x: collectives.naive_all_reduce(x, check=False),
    "ring": lambda x: collectives.ring_all_reduce(x, check=False),
    "butterfly": lambda x: collectives.butterfly_all_reduce(x, check=False),
}
PARLAB_ALGORITHMS = ("naive", "ring", "butterfly")  # the ones an emulated link shapes
FREE_LINK = Link(latency=0, bandwidth=1e15)  # 64 MiB in 67 ns: the emulated path's own cost alone
REFERENCE = "torch's dist.all_reduce"
MODEL_RATIO = "time / model = emulated time / the alpha-beta model's (1: the model exactly; never below)"
FREE_LINK_MEANS = "free link = the same all-reduce at no latency and unlimited bandwidth: the work the model leaves out"
DEFAULT_SIZES = [2**10 * 4**k for k in range(9)]  # 1 KiB to 64 MiB
DEFAULT_WORLD_SIZES = [2, 4]
# Under an emulated link: the sizes and world sizes at which the report's targets are stated.
LINK_SIZES = [2**20 * 4**k for k in range(4)]  # 1 MiB to 64 MiB
LINK_WORLD_SIZES = [4, 8]
# Enough repetitions that small messages are timed over milliseconds, few for large ones.
TIMED_BYTES = 256 * 2**20
MIN_ITERS, MAX_ITERS = 3, 200
# Emulated time is slept, not computed: a few repetitions over half a second suffice, and
# each one costs its full emulated time (64 MiB through a naive root on 8 ranks: 9 s).
EMULATED_S, MIN_EMULATED_ITERS = 0.5, 2


def add_arguments(parser):
    parser.add_argument(
        "--world-sizes", type=positive_int, nargs="+", metavar="N",
        help=f"default: {' '.join(map(str, DEFAULT_WORLD_SIZES))}; with --link "
             f"{' '.join(map(str, LINK_WORLD_SIZES))}",
    )
    parser.add_argument(
        "--sizes", type=byte_size, nargs="+", metavar="BYTES",
        help="message sizes, e.g. 1K 4M 64M (default: 1K to 64M, powers of 4; with --link 1M to 64M)",
    )
    parser.add_argument(
        "--link", type=link_argument, metavar="LATENCY,BANDWIDTH",
        help="also time parlab's algorithms on an emulated link, e.g. 200us,100MB/s, beside the alpha-beta model",
    )
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where the tensors live")


def run(args):
    return bench_collectives(args.world_sizes, args.sizes, args.device, args.link)


def bench_collectives(world_sizes=None, sizes=None, device="cpu", link=None):
    """Measure every algorithm at every (N, D) in real time and, given a ``parlab.Link``,
    parlab's algorithms again on that emulated link; returns a JSON-ready dict whose rows are
    those of ``measure_all_reduce`` and, with a link, the ``targets`` the emulated ring must meet.
    Defaults: N in 2 4 and D from 1 KiB to 64 MiB; with a link, N in 4 8 and D from 1 to 64 MiB."""
    world_sizes = list(world_sizes or (LINK_WORLD_SIZES if link else DEFAULT_WORLD_SIZES))
    sizes = list(sizes or (LINK_SIZES if link else DEFAULT_SIZES))
    check_arguments(device, world_sizes=world_sizes, sizes=sizes)
    check_link(link)
    rows = []
    with progress_bar("collectives", len(world_sizes) * len(sizes), unit="size") as bar:
        for world_size in world_sizes:
            with runtime.Cluster(world_size, device=device) as cluster:
                rows += measure_all_reduce(cluster, sizes, link, bar)
    return {
        "bench": "collectives",
        "device": device,
        "backend": rows[0]["backend"] if rows else None,
        "torch_version": torch.__version__,
        "cpu_count": os.cpu_count(),
        "ratio_means": ratio_header(REFERENCE),
        "link": None if link is None else {"latency_s": link.latency, "bandwidth_bytes_per_s": link.bandwidth},
        "regime": Regime(link).describe(),
        "model_ratio_means": MODEL_RATIO if link else None,
        "rows": rows,
        "targets": targets(rows) if link else [],
    }


def measure_all_reduce(cluster, sizes, link=None, bar=None):
    """On a running cluster, for each size: every algorithm in real time (``bandwidth_rows``)
    and, given a ``link``, parlab's algorithms on it and on ``FREE_LINK`` (``emulated_rows``);
    rows in that order. ``bar``: a progress bar to count the sizes on."""
    check_link(link)
    world_size, rows = cluster.world_size, []
    for size in sizes:
        if bar is not None:
            bar.set_postfix_str(f"N={world_size}, {format_bytes(size)}")
        rows += bandwidth_rows(world_size, size, cluster.run(time_algorithms, size)[0])
        if link is not None:
            iters = {name: emulated_iters(cost_model(name, _nbytes(size), world_size, link.latency, 1 / link.bandwidth))
                     for name in PARLAB_ALGORITHMS}
            measured = {}
            for name, emulated in (("link", link), ("free", FREE_LINK)):
                with cluster.emulate(link=emulated):
                    # The real timing just ran the same sizes on the same ranks: no warm-up needed.
                    measured[name] = cluster.run(time_algorithms, size, iters, warm_up=False, alone=True)[0]
            rows += emulated_rows(world_size, size, measured["link"], link, measured["free"])
        if bar is not None:
            bar.update()
    return rows


def emulated_iters(model_seconds):
    """Timed repetitions under an emulated link: about ``EMULATED_S`` of predicted time."""
    return max(MIN_EMULATED_ITERS, min(MAX_ITERS, math.ceil(EMULATED_S / model_seconds)))


def time_algorithms(size, iters=None, warm_up=True, alone=False):
    """On every rank: seconds per all-reduce of ``size`` bytes for each algorithm, the same on
    every rank. ``iters``: the repetitions of each algorithm to time, {name: count} (only
    those run); default every algorithm, enough repetitions to move ``TIMED_BYTES``.

    Back to back (default): the slowest rank's mean over the repetitions, as nccl-tests times.
    ``alone``: each repetition starts after a barrier and counts the slowest rank's time, the
    mean over repetitions; what the alpha-beta model predicts, one all-reduce on idle links.
    (Back to back, the naive root already receives the next all-reduce's tensors while it
    still sends this one's results: on an emulated link it beats the model by a third.)"""
    # Zeros stay zeros under repeated in-place sums: no overflow to inf across iterations.
    tensor = torch.zeros(max(1, size // 4), dtype=torch.float32, device=runtime.device())
    if iters is None:
        iters = dict.fromkeys(ALGORITHMS, max(MIN_ITERS, min(MAX_ITERS, TIMED_BYTES // max(size, 1))))
    seconds = {}
    for name, count in iters.items():
        all_reduce = ALGORITHMS[name]
        if warm_up:
            all_reduce(tensor)  # connections, allocations
        elapsed = torch.zeros(count if alone else 1, dtype=torch.float64)
        for repetition in range(count if alone else 1):
            synchronise(tensor.device)
            dist.barrier()
            start = time.perf_counter()
            for _ in range(1 if alone else count):
                all_reduce(tensor)
            synchronise(tensor.device)
            elapsed[repetition] = (time.perf_counter() - start) / (1 if alone else count)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        seconds[name] = elapsed.mean().item()
    return {"seconds": seconds, "backend": dist.get_backend(), "iters": iters}


def bandwidth_rows(world_size, size, measured):
    """The real-time rows of one (N, D) from ``time_algorithms``' result: per algorithm its
    seconds, algbw, busbw and ratio = its seconds / torch's."""
    return [
        {**_bandwidths(world_size, size, name, seconds, measured), "regime": "real",
         "ratio": time_ratio(seconds, measured["seconds"]["torch"])}
        for name, seconds in measured["seconds"].items()
    ]


def emulated_rows(world_size, size, measured, link, free=None):
    """The rows of one (N, D) timed on an emulated ``link``: per algorithm its seconds,
    algbw, busbw, the alpha-beta model's seconds, model_ratio = seconds / model's, and
    free_seconds, its time on ``FREE_LINK`` (from ``free``, timed alike; None without)."""
    rows = []
    for name, seconds in measured["seconds"].items():
        model = cost_model(name, _nbytes(size), world_size, link.latency, 1 / link.bandwidth)
        rows.append({**_bandwidths(world_size, size, name, seconds, measured), "regime": "emulated",
                     "model_seconds": model, "model_ratio": seconds / model,
                     "free_seconds": None if free is None else free["seconds"][name]})
    return rows


def targets(rows):
    """The report's targets, read from emulated rows: the ring within 10% of the alpha-beta
    model at every size from 1 to 64 MiB (for each N measured), and the ring at least 2x
    faster than naive at 16 MiB on 4 ranks. A list of {target, value, met}; a target whose
    rows were not measured is left out."""
    emulated = {(r["world_size"], r["bytes"], r["algorithm"]): r for r in rows if r["regime"] == "emulated"}
    found = []
    for world_size in sorted({n for n, _, _ in emulated}):
        ring = [r for (n, size, name), r in emulated.items()
                if n == world_size and name == "ring" and 2**20 <= size <= 64 * 2**20]
        if ring:
            worst = max(ring, key=lambda r: abs(r["model_ratio"] - 1))
            found.append({"target": f"ring within 10% of the alpha-beta model, 1-64 MiB, N = {world_size} "
                                    f"(the farthest: {format_bytes(worst['bytes'])})",
                          "value": worst["model_ratio"], "met": abs(worst["model_ratio"] - 1) <= 0.10})
    pair = emulated.get((4, 16 * 2**20, "naive")), emulated.get((4, 16 * 2**20, "ring"))
    if None not in pair:
        speedup = pair[0]["seconds"] / pair[1]["seconds"]
        found.append({"target": "ring at least 2x faster than naive at 16 MiB, N = 4 (naive / ring)",
                      "value": speedup, "met": speedup >= 2})
    return found


def format_report(result):
    emulated = rows_of(result, "emulated")
    report = (
        f"parlab bench collectives: all-reduce of float32 tensors over {result['backend']} on "
        f"{result['device']}, torch {result['torch_version']}, {result['cpu_count']} CPU cores\n"
        f"{ratio_header(REFERENCE)}; busbw compares the other way (higher is faster)\n\n"
        f"real time:\n{real_table(rows_of(result, 'real'))}"
    )
    if emulated:
        lines = [f"{'met' if t['met'] else 'NOT met':>7}  {t['value']:.2f}  {t['target']}" for t in result["targets"]]
        report += (f"\n\n{result['regime']}\n{MODEL_RATIO}\n{FREE_LINK_MEANS}\n\n{emulated_table(emulated)}"
                   "\n\ntargets: the emulated ring against the alpha-beta model and against naive\n" + "\n".join(lines))
    return report


def rows_of(result, regime):
    """The rows of a result measured in ``regime``: "real" or "emulated"."""
    return [row for row in result["rows"] if row.get("regime", "real") == regime]


def real_table(rows):
    """The real-time rows as a table: time, algbw, busbw and the time over torch's."""
    return format_table(
        ["N", "size", "algorithm", "time", "algbw GB/s", "busbw GB/s", "time / torch"],
        [[row["world_size"], format_bytes(row["bytes"]), row["algorithm"], f"{row['seconds'] * 1e3:.3f} ms",
          f"{row['algbw'] / 1e9:.3f}", f"{row['busbw'] / 1e9:.3f}", f"{row['ratio']:.2f}"] for row in rows],
    )


def emulated_table(rows):
    """The emulated rows as a table: time, busbw, the model's time, time / model and the
    time on the free link."""
    return format_table(
        ["N", "size", "algorithm", "time", "busbw MB/s", "model", "time / model", "free link"],
        [[row["world_size"], format_bytes(row["bytes"]), row["algorithm"], f"{row['seconds'] * 1e3:.1f} ms",
          f"{row['busbw'] / 1e6:.1f}", f"{row['model_seconds'] * 1e3:.1f} ms", f"{row['model_ratio']:.2f}",
          "-" if row["free_seconds"] is None else f"{row['free_seconds'] * 1e3:.1f} ms"] for row in rows],
    )


def plot_busbw(result, ax=None, regime="real"):
    """busbw against message size, one line per algorithm and world size (log-log), of the
    rows measured in ``regime`` ("real" or "emulated")."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(8, 4.5))
    styles = {"torch": "k-", "naive": "C3--", "ring": "C0-o", "butterfly": "C2-s"}
    rows = rows_of(result, regime)
    world_sizes = sorted({row["world_size"] for row in rows})
    for world_size, alpha in zip(world_sizes, (1.0, 0.55, 0.35)):
        for name, style in styles.items():
            line = [r for r in rows if r["world_size"] == world_size and r["algorithm"] == name]
            if line:
                ax.plot([r["bytes"] for r in line], [r["busbw"] / 1e9 for r in line], style,
                        alpha=alpha, markersize=4, label=f"{name}, N={world_size}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("message size (bytes)")
    ax.set_ylabel("busbw (GB/s)")
    where = result["regime"] if regime == "emulated" else f"real time, {result['backend']}, {result['device']}"
    ax.set_title(f"all-reduce bus bandwidth ({where})")
    ax.legend(fontsize=8, ncol=2)
    return ax


def _bandwidths(world_size, size, name, seconds, measured):
    """The columns every row has; ``measured["iters"]`` is one count for all or {name: count}."""
    nbytes, iters = _nbytes(size), measured["iters"]
    algbw = nbytes / seconds
    return {"world_size": world_size, "bytes": nbytes, "algorithm": name, "seconds": seconds, "algbw": algbw,
            "busbw": algbw * 2 * (world_size - 1) / world_size,
            "iters": iters[name] if isinstance(iters, dict) else iters, "backend": measured["backend"]}


def _nbytes(size):
    """Bytes of the float32 tensor that stands for ``size``: whole elements, at least one."""
    return max(1, size // 4) * 4
