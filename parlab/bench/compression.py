"""Gradient compression: bytes and step time of each compressor beside dense, on emulated links.

Every compressor of ``COMPRESSORS`` trains the same MLP (``depth`` Linear layers of ``hidden``
x ``hidden``, tanh between them) to fit a fixed random teacher, with SGD through parlab's DDP
and the compressor as its comm hook (``parlab.compression.parlab_hook``), each step taking a
declared compute of ``--compute-ms`` (emulated: the CPU is released) beside its real
forward, backward and compression. Per compressor, in one run on one cluster, the
compressors taking their steps in turns: the bytes each rank sent in a step (counted in the
trace) over dense's, and the median step time (first rank's start to last rank's end) over
dense's, under each ``--links`` link, slow and fast, so the crossover shows: compression
pays when the link is the bottleneck, and costs its compute and extra messages when it is
not. Then the same steps in real time, beside
torch's own hooks on its DDP (fp16_compress_hook, powerSGD_hook; the rest of torch's hooks
do not run on gloo, see lecture 05), whose bytes come from their formulas (torch's
communication is not traced). ``final_loss`` is the loss on a fixed batch after the steps.

Ratios: for parlab's compressors, time of parlab with the compressor / time of parlab's
dense step (below 1: compression is faster); for torch's hooks, time of torch's hook / time of
torch's dense DDP, and parlab's matching compressor over torch's hook.
"""

import os
import statistics

import torch
import torch.distributed as dist
from torch import nn

from parlab import runtime, trace
from parlab.bench import (
    check_arguments,
    check_link,
    check_seconds,
    format_seconds,
    format_table,
    link_argument,
    positive_int,
    positive_number,
    progress_bar,
    ratio_header,
    time_ratio,
)
from parlab.compression import (
    FP16,
    QSGD,
    ErrorFeedback,
    Identity,
    PowerSGD,
    ScaledSign,
    TopK,
    costs,
    parlab_hook,
)
from parlab.ddp import DDP
from parlab.runtime.emulation import Link, compute

COMPRESSORS = {  # name -> a fresh compressor (state such as residuals lives in it)
    "dense": Identity,
    "fp16": FP16,
    "top-k 1% + EF": lambda: ErrorFeedback(TopK(0.01)),
    "QSGD q=4": lambda: QSGD(4),
    "scaled sign + EF": lambda: ErrorFeedback(ScaledSign()),
    "PowerSGD R=2 + EF": lambda: ErrorFeedback(PowerSGD(2)),
}
TORCH_HOOKS = {"torch fp16_compress_hook": "fp16", "torch powerSGD_hook R=2": "PowerSGD R=2 + EF"}
REFERENCE = "the dense step (parlab's DDP without compression; torch's hooks: torch's DDP)"
DEFAULT_LINKS = ["500us,10MB/s", "50us,1GB/s"]
LR, SEED, TEACHER_SEED, EVALUATION_SEED = 1.0, 0, 12345, 10**6


def add_arguments(parser):
    parser.add_argument("--links", type=link_argument, nargs="+", default=[link_argument(t) for t in DEFAULT_LINKS],
                        metavar="LATENCY,BANDWIDTH", help=f"emulated links (default: {' '.join(DEFAULT_LINKS)})")
    parser.add_argument("--world-size", type=positive_int, default=4, metavar="N", help="ranks (default 4)")
    parser.add_argument("--steps", type=positive_int, default=10, metavar="N", help="timed steps (default 10)")
    parser.add_argument("--hidden", type=positive_int, default=256, metavar="N", help="features (default 256)")
    parser.add_argument("--depth", type=positive_int, default=2, metavar="N", help="Linear layers (default 2)")
    parser.add_argument("--compute-ms", type=positive_number, default=10.0, metavar="MS",
                        help="declared compute of a step, in ms (default 10)")
    parser.add_argument("--compressors", nargs="+", choices=list(COMPRESSORS), default=list(COMPRESSORS),
                        metavar="NAME", help="the compressors to run (default: all of %(choices)s)")


def run(args):
    return bench_compression(args.links, args.world_size, args.steps, args.hidden, args.depth, args.compute_ms / 1e3,
                             args.compressors)


def mlp(hidden, depth):
    torch.manual_seed(SEED)
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(hidden, hidden), nn.Tanh()]
    return nn.Sequential(*layers[:-1])


def batches(hidden, batch_size, seed):
    """``batch_size`` random inputs (drawn from ``seed``) and their targets from one fixed
    teacher, the tanh of a random linear map."""
    teacher = torch.randn(hidden, hidden, generator=torch.Generator().manual_seed(TEACHER_SEED)) / hidden**0.5
    inputs = torch.randn(batch_size, hidden, generator=torch.Generator().manual_seed(seed))
    return inputs, torch.tanh(inputs @ teacher)


def train(names, steps, hidden=256, depth=2, batch_size=16, compute_s=0.0, engine="parlab", compressors=None):
    """On every rank: train a fresh MLP per compressor (by name, from ``compressors``, default
    ``COMPRESSORS``; or ``TORCH_HOOKS`` and "torch dense" with ``engine="torch"``), ``steps``
    steps each, a "step" span each. The runs take their steps in turns (step 1 of every name,
    then step 2, ...), so that whatever else loads the machine meanwhile falls on all of them
    alike and their ratios compare steps taken side by side. Returns {name: [the loss on a
    fixed batch of 256 after each step]}. Each rank draws a fresh batch of ``batch_size`` at
    each step (the same for every compressor)."""
    evaluation = batches(hidden, 256, EVALUATION_SEED)
    runs = {}
    for name in names:
        net = mlp(hidden, depth)
        runs[name] = net, _wrap(net, name, engine, compressors or COMPRESSORS), torch.optim.SGD(net.parameters(), lr=LR)
    losses = {name: [] for name in names}
    for step in range(steps):
        inputs, targets = batches(hidden, batch_size, seed=step * dist.get_world_size() + dist.get_rank())
        for name, (net, model, optimizer) in runs.items():
            dist.barrier()  # the ranks start each step together
            with trace.span("step"):
                compute(compute_s, step)
                loss = (model(inputs) - targets).pow(2).mean()
                optimizer.zero_grad()
                loss.backward()
                if engine == "parlab":
                    model.finish_gradient_synchronization()
                optimizer.step()
            with torch.no_grad():
                losses[name].append((net(evaluation[0]) - evaluation[1]).pow(2).mean().item())
    return losses


def _wrap(net, name, engine, compressors):
    if engine == "parlab":
        return DDP(net, comm_hook=parlab_hook(compressors[name](), net))
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    model = nn.parallel.DistributedDataParallel(net)
    if name == "torch fp16_compress_hook":
        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif name == "torch powerSGD_hook R=2":
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=2, start_powerSGD_iter=2)
        model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    return model


def measure(cluster, names, steps, hidden=256, depth=2, batch_size=16, compute_s=0.0, engine="parlab",
            compressors=None):
    """Train ``names`` on ``cluster`` in its current regime, their steps in turns (``train``);
    one dict per name: ``seconds`` (each step, first rank's start to last rank's end),
    ``median_s``, ``sent`` (bytes each rank sent in the last step, from the trace), ``losses``
    (after each step), ``times`` (the sum of its steps' times at the end of each step)."""
    timeline = cluster.trace(train, names, steps, hidden, depth, batch_size, compute_s, engine, compressors)
    rows = []
    for index, name in enumerate(names):
        windows = [timeline.window("step", step * len(names) + index) for step in range(steps)]
        seconds = [window.duration for window in windows]
        rows.append({"name": name, "seconds": seconds, "median_s": statistics.median(seconds),
                     "sent": max(windows[-1].bytes_sent()), "losses": timeline.results[0][name],
                     "times": _cumulative(seconds)})
    return rows


def predicted_step(compressor, N, link, hidden=256, depth=2, compute_s=0.0):
    """(bytes each rank sends, seconds) of one step of the bench's MLP with ``compressor`` on
    ``link`` at N ranks, by the alpha-beta model: the declared compute plus the compressor's
    collectives (``parlab.compression.costs.seconds``), one bucket of the parameters in
    reverse order, as parlab's DDP fills it. It leaves out this machine's CPU work: forward,
    backward, compressing, and the Python and gloo of each message."""
    shapes = [tuple(p.shape) for p in mlp(hidden, depth).parameters()][::-1]
    flat = torch.zeros(sum(torch.Size(s).numel() for s in shapes))
    collectives = compressor.collectives(flat, shapes)
    return costs.sent(collectives, N)[0], compute_s + costs.seconds(collectives, N, link.latency, link.bandwidth)


def _cumulative(seconds):
    total, out = 0.0, []
    for s in seconds:
        total += s
        out.append(total)
    return out


def bench_compression(links, world_size=4, steps=10, hidden=256, depth=2, compute_s=0.01, names=tuple(COMPRESSORS)):
    """Measure ``names`` (dense first) under each emulated link, then in real time beside
    torch's hooks; returns a JSON-ready dict (see the module's docstring)."""
    for link in links:
        check_link(link)
    if not links or None in links:
        raise ValueError("bench_compression compares emulated links: pass at least one parlab.Link.")
    check_arguments(world_size=world_size, steps=steps, hidden=hidden, depth=depth)
    check_seconds("compute_s", compute_s)
    names = ["dense", *(name for name in names if name != "dense")]
    regimes = []
    with runtime.Cluster(world_size) as cluster, progress_bar("compression", len(links) + 1, unit="regime") as bar:
        for link in links:
            bar.set_postfix_str(link.describe())
            with cluster.emulate(link=link):
                regimes.append({"link": {"latency": link.latency, "bandwidth": link.bandwidth},
                                "rows": add_ratios(measure(cluster, names, steps, hidden, depth, 16, compute_s))})
            bar.update()
        bar.set_postfix_str("real time, parlab and torch")
        real = add_ratios(measure(cluster, names, steps, hidden, depth, 16, compute_s))
        torch_rows = measure(cluster, ["torch dense", *TORCH_HOOKS], steps, hidden, depth, 16, compute_s, "torch")
        bar.update()
    shapes = [tuple(p.shape) for p in mlp(hidden, depth).parameters()]
    return {
        "bench": "compression", "torch_version": torch.__version__, "cpu_count": os.cpu_count(),
        "world_size": world_size, "steps": steps, "hidden": hidden, "depth": depth, "compute_s": compute_s,
        "parameters": sum(torch.Size(s).numel() for s in shapes), "ratio_means": ratio_header(REFERENCE),
        "regimes": regimes, "real": real, "torch": torch_ratios(torch_rows, real, shapes),
    }


def add_ratios(rows):
    """Give each row ``bytes_ratio`` and ``time_ratio`` against the first row (dense)."""
    dense = rows[0]
    for row in rows:
        row["bytes_ratio"] = row["sent"] / dense["sent"]
        row["time_ratio"] = time_ratio(row["median_s"], dense["median_s"])
    return rows


def torch_ratios(torch_rows, parlab_rows, shapes):
    """torch's hooks against torch's dense DDP (time), their bytes from their formulas (fp16:
    half; PowerSGD: ``PowerSGD.compression_sizes``, the counts of torch's compression_stats),
    and parlab's matching compressor (real time) over torch's hook."""
    dense, parlab = torch_rows[0], {row["name"]: row for row in parlab_rows}
    before, after = PowerSGD(2).compression_sizes(shapes)
    bytes_ratio = {"torch dense": 1.0, "torch fp16_compress_hook": 0.5, "torch powerSGD_hook R=2": after / before}
    for row in torch_rows:
        row["bytes_ratio"] = bytes_ratio[row["name"]]
        row["time_ratio"] = time_ratio(row["median_s"], dense["median_s"])
        match = parlab.get(TORCH_HOOKS.get(row["name"], "dense"))
        row["parlab_over_torch"] = None if match is None else time_ratio(match["median_s"], row["median_s"])
    return torch_rows


def format_report(result):
    sections = []
    for regime in result["regimes"]:
        link = Link(**regime["link"])
        sections.append(f"emulated: link {link.describe()}\n" + _table(regime["rows"]))
    sections.append("real time (loopback, ranks sharing the cores)\n" + _table(result["real"]))
    sections.append("torch's hooks on torch's DDP, real time\n" + format_table(
        ["hook", "bytes / dense", "median step", "/ dense", "parlab's / torch's", "final loss"],
        [[row["name"], f"{row['bytes_ratio']:.3f}", format_seconds(row["median_s"]), f"{row['time_ratio']:.2f}",
          "" if row["parlab_over_torch"] is None else f"{row['parlab_over_torch']:.2f}",
          f"{row['losses'][-1]:.4f}"] for row in result["torch"]]))
    return (
        f"parlab bench compression: bytes each rank sends per step and median step time of {result['steps']} steps "
        f"(SGD, lr {LR}) of an MLP of {result['depth']} x {result['hidden']} ({result['parameters']:,} parameters) "
        f"with {result['compute_s'] * 1e3:g} ms of declared compute per step, N = {result['world_size']}, through "
        f"parlab's DDP with each compressor as its comm hook; torch {result['torch_version']}, "
        f"{result['cpu_count']} CPU cores\n{result['ratio_means']}\n\n" + "\n\n".join(sections)
    )


def _table(rows):
    return format_table(
        ["compressor", "sent / rank", "bytes / dense", "median step", "/ dense", "final loss"],
        [[row["name"], f"{row['sent']:,}", f"{row['bytes_ratio']:.3f}", format_seconds(row["median_s"]),
          f"{row['time_ratio']:.2f}", f"{row['losses'][-1]:.4f}"] for row in rows])
