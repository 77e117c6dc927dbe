"""DDP, local SGD, DiLoCo and Streaming DiLoCo: time to a target loss under two declared WAN links.

For each link, one cluster with that emulated link (alpha + bytes beta per message) runs the
four methods of ``parlab.diloco.training`` one after another on the same noisy quadratic of
d fp32 weights, ``steps`` inner steps each of ``compute`` seconds of declared compute. Each
row: the inner step at which the global model's loss first reaches ``target`` and the wall
time to it, the final loss, the share of the time not in declared compute, the measured
seconds per step beside the alpha-beta model's (``parlab.diloco.costs.seconds_per_step``),
and ``ratio`` = the method's time to the target / DDP's on the same link (below 1: sooner
than DDP; none where either never reaches it). Streaming DiLoCo sends fp16 pseudo-gradients
(``compression.compressors.FP16``) in F fragments, each overlapped with tau inner steps.
"""

import os

import torch

from parlab import runtime
from parlab.bench import (
    check_arguments,
    check_link,
    check_seconds,
    format_seconds,
    format_table,
    link_argument,
    parse_link,
    positive_int,
    positive_number,
    progress_bar,
    ratio_header,
    time_ratio,
)
from parlab.compression.compressors import FP16
from parlab.diloco import costs, training

REFERENCE = "DDP (synchronous data parallelism: parlab's ring all-reduce of every gradient), to the same loss"
DEFAULT_LINKS = ("30ms,100MB/s", "30ms,10MB/s")


def add_arguments(parser):
    parser.add_argument("--world-size", type=positive_int, default=4, help="ranks, N (default 4)")
    parser.add_argument("--steps", type=positive_int, default=32, help="inner steps per method (default 32)")
    parser.add_argument("--compute-ms", type=positive_number, default=20.0,
                        help="declared compute per inner step in ms, t_c (default 20)")
    parser.add_argument("--d", type=positive_int, default=2**18, help="fp32 weights of the problem (default 2^18)")
    parser.add_argument("--H", type=positive_int, default=8, help="inner steps per outer step (default 8)")
    parser.add_argument("--fragments", type=positive_int, default=2, help="Streaming DiLoCo's F (default 2)")
    parser.add_argument("--delay", type=int, default=4, help="Streaming DiLoCo's tau, overlapped steps (default 4)")
    parser.add_argument("--mixing", type=float, default=0.5, help="Streaming DiLoCo's omega (default 0.5)")
    parser.add_argument("--target", type=positive_number, default=0.03, help="the target loss (default 0.03)")
    parser.add_argument("--links", type=link_argument, nargs="+", default=[parse_link(text) for text in
                        DEFAULT_LINKS], metavar="LATENCY,BANDWIDTH",
                        help=f"the emulated links (default {' '.join(DEFAULT_LINKS)})")


def run(args):
    return bench_diloco(args.world_size, args.steps, args.compute_ms / 1e3, args.links, args.d, args.H,
                        args.fragments, args.delay, args.mixing, args.target)


def bench_diloco(world_size=4, steps=32, compute_s=0.02, links=None, d=2**18, H=8, fragments=2, delay=4, mixing=0.5,
                 target=0.03):
    """Train each of ``costs.METHODS`` for ``steps`` inner steps on a cluster of ``world_size``
    ranks per link in ``links`` (default: ``DEFAULT_LINKS``); returns the JSON-ready result."""
    check_arguments(world_size=world_size, steps=steps, d=d, H=H, fragments=fragments)
    check_seconds("compute_s", compute_s)
    if world_size < 2:
        raise ValueError("the methods communicate between replicas: pass world_size=2 or more.")
    if not (isinstance(delay, int) and 0 <= delay < H and 0 <= mixing < 1):
        raise ValueError(f"Streaming DiLoCo needs 0 <= delay (tau) < H = {H} and 0 <= mixing (omega) < 1, got delay "
                         f"{delay!r} and mixing {mixing!r}: e.g. delay=4, mixing=0.5.")
    links = [parse_link(text) for text in DEFAULT_LINKS] if links is None else list(links)
    for link in links:
        check_link(link)
    problem = training.NoisyQuadratic(d=d, seconds=compute_s)
    streaming = dict(fragments=fragments, delay=delay, mixing=mixing, compressor=FP16())
    payload = {"ddp": 4 * d, "local": 4 * d, "diloco": 4 * d, "streaming": 2 * d}  # bytes of one whole all-reduce
    regimes = []
    with progress_bar("diloco", len(links) * len(costs.METHODS), unit="method") as bar:
        for link in links:
            rows = []
            with runtime.Cluster(world_size, device="cpu", timeout=600, link=link) as cluster:
                for method in costs.METHODS:
                    bar.set_postfix_str(f"{method}, {link.describe()}")
                    curve = training.curve_of(cluster.run(training.train, method, problem, steps, H,
                                                          **(streaming if method == "streaming" else {})))
                    predicted = costs.seconds_per_step(method, link, compute_s, payload[method], world_size, H,
                                                       fragments, delay)
                    rows.append(method_row(method, curve, target, compute_s, predicted))
                    bar.update()
                regime = cluster.regime.describe()
            regimes.append({"link": {"latency": link.latency, "bandwidth": link.bandwidth}, "regime": regime,
                            "rows": add_ratios(rows)})
    return {"torch_version": torch.__version__, "cpu_count": os.cpu_count(), "world_size": world_size, "steps": steps,
            "compute_s": compute_s, "d": d, "H": H, "fragments": fragments, "delay": delay, "mixing": mixing,
            "target": target, "ratio_means": ratio_header(REFERENCE), "regimes": regimes}


def method_row(method, curve, target, compute_s, predicted_s):
    """One method's row from its curve [(seconds, inner step, loss)]."""
    reached = training.time_to_loss(curve, target)
    return {"method": method, "seconds": curve[-1][0], "time_to_target": reached[0], "steps_to_target": reached[1],
            "final_loss": curve[-1][2], "communication_share": training.communication_share(curve, compute_s),
            "seconds_per_step": curve[-1][0] / curve[-1][1], "predicted_seconds_per_step": predicted_s,
            "losses": [loss for _, _, loss in curve], "times": [t for t, _, _ in curve]}


def add_ratios(rows):
    """Each row's ratio = its time to the target / DDP's; None where either never reaches it."""
    ddp = next(row for row in rows if row["method"] == "ddp")["time_to_target"]
    return [dict(row, ratio=None if row["time_to_target"] is None or ddp is None
                 else time_ratio(row["time_to_target"], ddp)) for row in rows]


def format_report(result):
    header = (f"parlab bench diloco: {result['world_size']} ranks, {result['steps']} inner steps of "
              f"{format_seconds(result['compute_s'])} declared compute, d = {result['d']} fp32 weights, "
              f"H = {result['H']}; streaming: F = {result['fragments']}, tau = {result['delay']}, "
              f"omega = {result['mixing']}, fp16; target loss {result['target']}; torch {result['torch_version']}, "
              f"{result['cpu_count']} CPU cores\n{ratio_header(REFERENCE)}")
    tables = []
    for regime in result["regimes"]:
        rows = [[row["method"], "-" if row["steps_to_target"] is None else row["steps_to_target"],
                 "-" if row["time_to_target"] is None else format_seconds(row["time_to_target"]),
                 f"{row['final_loss']:.4f}", f"{row['communication_share']:.0%}",
                 format_seconds(row["seconds_per_step"]), format_seconds(row["predicted_seconds_per_step"]),
                 "-" if row["ratio"] is None else f"{row['ratio']:.2f}"] for row in regime["rows"]]
        table = format_table(["method", "steps to target", "time to target", "final loss", "not computing",
                              "per step", "model", "ratio"], rows)
        tables.append(f"regime: {regime['regime']}\n{table}")
    return "\n\n".join([header, *tables])
