"""Expert parallelism: a training step of an MoE layer at each ep against a dense MLP of the
same FLOPs per token with tensor parallelism, on an emulated link.

On each N of ``--ep`` (one cluster of N ranks, the ``--link`` emulated) two layers take
training steps in turns (forward, backward, SGD; the input requires a gradient, as inside a
model, so backward sends it back):

    MoE, expert parallel     ``ExpertParallelMoE``: E experts (MLPs h -> 4h -> h), k per token,
                             E/N per rank; each rank routes its own T tokens
                             all-to-alls: dispatch and combine, then both again in backward
    dense, tensor parallel   the same MLP k x 4h wide (k experts' FLOPs per token), fc1
                             column- and fc2 row-parallel over the same N ranks
                             (``parlab.tensor_parallel``), on all N T tokens
                             all-reduces: g in forward, f in backward, of (N T, h)

Both do 16 k h^2 FLOPs per token in forward (the router's 2 h E aside), N T tokens a step;
a rank sends 4 T k h 4 (N-1)/N bytes a step in expert parallelism (balanced, nothing
dropped) and 4 (N-1) T h 4 in tensor parallelism: N / k times as much. Per layer: the median step time
(first rank's start to last rank's end) of ``--steps``; the collectives' time per step (each
call's shortest span over the ranks: the last rank to arrive waits for no one), summed over
the calls, and its share of the step; the bytes each rank sent in them in the last step,
from the trace and from the formulas (``parlab.experts.all_to_all_bytes`` for each rank's
dispatch and combine backward, what its peers sent it for combine and dispatch backward,
(N-1) E/N int64 counts; the ring's 2 (N-1)/N D per all-reduce); and the alpha-beta model's
prediction of the collectives: per all-to-all the busiest port's (N-1) alpha + bytes beta,
per all-reduce ``parlab.alpha_beta.cost_model("ring", ...)``. ``ratio``: the MoE's step
over the dense layer's at the same N (below 1: the MoE's is faster).

Both layers' collectives travel on parlab's point-to-point layer (the all-to-all is
``parlab.collectives.all_to_all``, the all-reduce parlab's ring), so the emulated link shapes
both alike.
"""

import os
import statistics

import torch
import torch.distributed as dist
from torch import nn

from parlab import runtime, trace
from parlab.alpha_beta import cost_model
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
from parlab.experts import ExpertParallelMoE, MoE, all_to_all_bytes, dispatch_order, experts_per_rank
from parlab.gpt import MLP, GPTConfig
from parlab.runtime.emulation import Link
from parlab.tensor_parallel.model import ParallelMLP

WARMUP_STEPS = 1
LR = 1e-3
DEFAULT_LINK = "100us,1GB/s"
REFERENCE = "the dense MLP of the same FLOPs per token, tensor parallel on the same ranks"
LAYERS = ("MoE, expert parallel", "dense, tensor parallel")
ALL_TO_ALLS = ("dispatch counts", "dispatch", "combine", "combine backward", "dispatch backward")
COUNT_BYTES = 8  # the counts' all-to-all sends int64 rows per expert


def add_arguments(parser):
    count = dict(type=positive_int, metavar="N")
    parser.add_argument("--ep", nargs="+", default=[2, 4], help="ranks N = ep = t (default: 2 4)", **count)
    parser.add_argument("--link", type=link_argument, default=link_argument(DEFAULT_LINK), metavar="LATENCY,BANDWIDTH",
                        help=f"the emulated link (default {DEFAULT_LINK})")
    parser.add_argument("--steps", default=5, help="timed steps per layer (default 5)", **count)
    parser.add_argument("--hidden", default=128, help="h (default 128)", **count)
    parser.add_argument("--experts", default=8, help="E (default 8)", **count)
    parser.add_argument("--k", default=2, help="experts per token (default 2)", **count)
    parser.add_argument("--tokens", default=256, help="T, tokens per rank (default 256)", **count)
    parser.add_argument("--capacity-factor", type=positive_number, default=1.25, metavar="F",
                        help="the MoE's capacity factor (default 1.25)")


def run(args):
    return bench_experts(args.link, args.ep, args.steps, args.hidden, args.experts, args.k, args.tokens,
                         args.capacity_factor)


def bench_experts(link, eps=(2, 4), steps=5, h=128, E=8, k=2, T=256, capacity_factor=1.25):
    """Measure both layers at each N of ``eps`` on ``link`` (a ``parlab.Link``); returns a
    JSON-ready dict (the module docstring) with one row per (N, layer)."""
    check_link(link)
    if link is None:
        raise ValueError("bench_experts compares measured collectives with the alpha-beta model of an emulated link: "
                         "pass one, e.g. parlab.Link(latency=100e-6, bandwidth=1e9).")
    check_arguments(eps=list(eps), steps=steps, h=h, E=E, k=k, T=T)
    for N in eps:
        experts_per_rank(E, N)
        if 4 * k * h % N:
            raise ValueError(f"the dense layer's k x 4h = {4 * k * h} features do not split over t = {N} ranks: "
                             "choose --hidden or --ep so that t divides them.")
    rows = []
    with progress_bar("experts", len(eps), unit="ep") as bar:
        for N in eps:
            bar.set_postfix_str(f"ep = t = {N}")
            with runtime.Cluster(N) as cluster, cluster.emulate(link=link):
                timeline = cluster.trace(train_layers, steps, h, E, k, T, capacity_factor)
            rows += measure(timeline, steps, link, h, E, T)
            bar.update()
    return {"bench": "experts", "torch_version": torch.__version__, "cpu_count": os.cpu_count(),
            "link": {"latency": link.latency, "bandwidth": link.bandwidth}, "regime": timeline.regime,
            "config": {"h": h, "E": E, "k": k, "T": T, "capacity_factor": capacity_factor}, "steps": steps,
            "ratio_means": ratio_header(REFERENCE), "rows": add_ratios(rows)}


def train_layers(steps, h, E, k, T, capacity_factor):
    """On every rank: WARMUP_STEPS + ``steps`` steps of each layer in turns, each in a span
    "step". Returns, per step, this rank's dispatch bytes (``all_to_all_bytes``) and the
    rows it kept for each expert."""
    N, r = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    moe = ExpertParallelMoE(MoE(h, E, k, capacity_factor))
    dense = ParallelMLP(dense_mlp(h, 4 * k * h))
    tokens = torch.randn(N * T, h, generator=torch.Generator().manual_seed(1))  # (N T, h): every rank's
    layers = [(moe, tokens[r * T:(r + 1) * T].clone()), (dense, tokens)]
    optimizers = [torch.optim.SGD(layer.parameters(), lr=LR) for layer, _ in layers]
    dispatched = []
    for _ in range(WARMUP_STEPS + steps):
        for (layer, x), optimizer in zip(layers, optimizers):
            x = x.clone().requires_grad_()
            dist.barrier()  # the ranks start each step together
            with trace.span("step"):
                optimizer.zero_grad()
                loss = layer(x).pow(2).mean()
                if layer is moe:
                    loss = loss + moe.aux_loss
                loss.backward()
                if layer is moe:
                    moe.average_gradients()
                optimizer.step()
        dispatched.append((all_to_all_bytes(moe.routing, r, N, h), dispatch_order(moe.routing)[1].tolist()))
    return dispatched


def dense_mlp(h, width):
    """``parlab.gpt``'s MLP, h -> width -> h (the experts' MLP is width 4h)."""
    mlp = MLP(GPTConfig(h=h, a=1))
    mlp.fc1, mlp.fc2 = nn.Linear(h, width), nn.Linear(width, h)
    return mlp


def measure(timeline, steps, link, h, E, T):
    """The two rows of one N from the traced ``train_layers``: times, bytes, prediction."""
    N = timeline.world_size
    rows = []
    for index, name in enumerate(LAYERS):
        windows = [timeline.window("step", (WARMUP_STEPS + step) * len(LAYERS) + index) for step in range(steps)]
        collectives = ALL_TO_ALLS if index == 0 else ("all-reduce",)
        comm = [collective_seconds(w, collectives) for w in windows]
        seconds = [w.duration for w in windows]
        last = windows[-1]
        if index == 0:
            sent = [sum(ev.nbytes for ev in last.select(rank=r, kind=trace.COMM, name="all_to_all send"))
                    for r in range(N)]
            dispatched, kept = zip(*(result[-1] for result in timeline.results))
            formula, predicted = all_to_all_step(list(dispatched), kept, N, h, E, link)
        else:
            sent = last.bytes_sent()
            D = N * T * h * 4  # the (N T, h) activation
            formula = [2 * 2 * (N - 1) * D // N] * N  # two ring all-reduces of D bytes
            predicted = 2 * cost_model("ring", D, N, link.latency, 1 / link.bandwidth)
        rows.append({"ep": N, "layer": name, "seconds": seconds, "median_s": statistics.median(seconds),
                     "comm_s": comm, "comm_median_s": statistics.median(comm),
                     "comm_share": statistics.median(comm) / statistics.median(seconds),
                     "sent_bytes": sent, "formula_bytes": formula, "predicted_comm_s": predicted,
                     "measured_over_predicted": statistics.median(comm) / predicted})
    return rows


def add_ratios(rows):
    """Give every MoE row ``ratio`` = its median step / the dense row's of the same N."""
    for row in rows:
        if row["layer"] == LAYERS[0]:
            dense = next(r for r in rows if (r["ep"], r["layer"]) == (row["ep"], LAYERS[1]))
            row["ratio"] = time_ratio(row["median_s"], dense["median_s"])
    return rows


def collective_seconds(window, names):
    """Seconds of the collectives named ``names`` in one step: each call's shortest span over
    the ranks (the rank that reaches it last waits for no one), summed over the calls."""
    per_rank = [[ev for ev in window.select(rank=r, kind=trace.COMPUTE) if ev.name in names]
                for r in range(window.world_size)]
    return sum(min(ev.duration for ev in same) for same in zip(*per_rank))


def all_to_all_step(dispatched, kept, N, h, E, link):
    """(bytes each rank sends in a step's five all-to-alls, their predicted seconds).

    dispatched[r]: ``all_to_all_bytes`` of rank r (what it sends in dispatch and again in
    combine backward); kept[r]: its kept rows per expert (E,), from which what its peers
    sent it (what it sends back in combine and in dispatch backward). Each all-to-all takes
    its busiest port's (N - 1) messages: (N - 1) alpha + max bytes beta."""
    held, row = E // N, h * 4
    to_rank = torch.tensor(kept).view(N, N, held).sum(2)       # (N, N): rows rank p sends rank q
    returned = ((to_rank.sum(0) - to_rank.diagonal()) * row).tolist()
    counts = (N - 1) * held * COUNT_BYTES
    sent = [2 * d + 2 * b + counts for d, b in zip(dispatched, returned)]
    busiest = max(dispatched + returned)
    alpha, beta = link.latency, 1 / link.bandwidth
    return sent, (N - 1) * (alpha + held * COUNT_BYTES * beta) + 4 * ((N - 1) * alpha + busiest * beta)


def format_report(result):
    config, link = result["config"], Link(**result["link"])
    rows = [[row["layer"], row["ep"], format_seconds(row["median_s"]), format_seconds(row["comm_median_s"]),
             f"{row['comm_share']:.0%}", f"{max(row['sent_bytes']):,}", f"{max(row['formula_bytes']):,}",
             format_seconds(row["predicted_comm_s"]), f"{row['measured_over_predicted']:.2f}",
             f"{row['ratio']:.2f}x" if "ratio" in row else ""] for row in result["rows"]]
    table = format_table(["layer", "N", "median step", "collectives", "share", "sent / rank", "formula",
                          "predicted", "measured / predicted", "step / dense"], rows)
    return (
        f"parlab bench experts: training step (forward, backward, SGD) of an MoE layer (E = {config['E']}, "
        f"k = {config['k']}, h = {config['h']}, capacity factor {config['capacity_factor']:g}, T = {config['T']} "
        f"tokens per rank) with expert parallelism against a dense MLP {config['k']} x 4h wide with tensor "
        f"parallelism; median of {result['steps']} steps; {result['regime']}; torch {result['torch_version']}, "
        f"{result['cpu_count']} CPU cores. Sent / rank: the busiest rank's bytes in the collectives, traced and "
        f"by the formula; predicted: the alpha-beta model on link {link.describe()}; both layers' messages pay "
        f"the emulated link.\n{result['ratio_means']}\n\n{table}"
    )
