"""Context parallelism: causal attention over a sequence split across cp ranks, ring vs
all-gather vs Ulysses beside one process, on an emulated link.

On each cp of ``--world-sizes`` (one cluster of cp ranks, the link ``--link`` emulated) and
each s of ``--seqs``: b = ``--batch-size`` sequences of s positions, h = ``--hidden``
features in a = ``--heads`` heads, each rank holding its zig-zag positions of q, k, v
(b, a, s/cp, h/a). The three methods of ``parlab.context_parallel`` take their forward and
backward in turns (a barrier before each), and so does the reference, one process: torch's
``scaled_dot_product_attention`` (causal) on the whole sequence on rank 0 while the others
wait. Per method, in one run:

- time: forward + backward, first rank's start to last rank's end, the median of
  ``--steps`` (after one warm-up round); ``ratio`` = its time / one process's (below 1:
  parlab's context parallelism is faster). The link is emulated, the compute is real: the
  cp ranks share this machine's cores, so on a 2-core laptop 4 ranks compute at about half
  speed each, and the ring's and the all-gather's blocks are plain matmuls where SDPA's CPU
  kernel is fused;
- memory: the bytes autograd saves for backward on a rank (the most over the ranks,
  ``parlab.tensor_parallel.activations.SavedBytes``), over one process's (below 1: a rank
  holds less). Ring attention saves q, k, v, out and lse of its s/cp positions; the
  all-gather method keeps the gathered K, V and every block's probabilities; Ulysses keeps
  q, k, v and out of a/cp heads over all s, and the all-to-alls' inputs;
- bytes: what each rank sent in forward and in backward, counted in the trace, beside
  ``bytes_per_rank`` (equal);
- overlap (ring attention's forward): each K/V message is posted before the block it
  overlaps is computed and waited for after it, so in the trace its interval runs from the
  post to the later of its arrival and the wait, max(t_c, t_x) long, t_c the block's compute
  (its "attention" span) and t_x = alpha + 2 b (s/cp) h e / beta the transfer on the link.
  Measured: the share of the messages' intervals covered by compute, and the time a rank
  waited for K/V after computing (exposed, per rank and round). Model: the same from each
  block's measured t_c and the link's t_x, hidden when t_c >= t_x: sum t_c / sum max(t_c,
  t_x) and sum max(0, t_x - t_c). The model assumes every rank posts its message when its
  neighbour does; on ranks sharing cores one is often late (descheduled, or still on its
  previous block), and the measured wait holds that lateness too.
"""

import os
import statistics

import torch
import torch.distributed as dist
import torch.nn.functional as F

from parlab import runtime, trace
from parlab.bench import (
    check_arguments,
    check_link,
    format_bytes,
    format_seconds,
    format_table,
    link_argument,
    positive_int,
    progress_bar,
    ratio_header,
    time_ratio,
)
from parlab.context_parallel import ATTENTION, METHODS, bytes_per_rank, shard_sequence
from parlab.runtime.emulation import Link
from parlab.tensor_parallel.activations import SavedBytes

ONE_PROCESS = "one process"
REFERENCE = "one process (torch's scaled_dot_product_attention on the whole sequence, one rank)"
# Slow for a network, but against one CPU core it keeps a GPU's balance of compute and link:
# a core's fp32 matmul at ~2e10 FLOP/s (22.7 GFLOP/s measured on a 512^3 matmul on one thread
# of the 2-core development machine) over 1e7 bytes/s is ~2000 FLOPs a byte; an H100 SXM's
# 989 dense BF16 TFLOP/s over NVLink's 450 GB/s a direction (900 GB/s both ways) is ~2200. So
# the crossover the lecture draws (compute ~ s^2, a K/V block ~ s) falls inside the default s.
DEFAULT_LINK = "100us,10MB/s"
ELEMENT_BYTES = 4  # fp32
WARMUP_ROUNDS = 1
SENDS = ("send", "isend")


def add_arguments(parser):
    count = dict(type=positive_int, metavar="N")
    parser.add_argument("--world-sizes", nargs="+", default=[2, 4], help="values of cp (default: 2 4)", **count)
    parser.add_argument("--seqs", nargs="+", default=[512, 1024, 2048], help="values of s (default: 512 1024 2048)",
                        **count)
    parser.add_argument("--batch-size", default=1, help="b, sequences (default 1)", **count)
    parser.add_argument("--hidden", default=128, help="h (default 128)", **count)
    parser.add_argument("--heads", default=8, help="a (default 8)", **count)
    parser.add_argument("--steps", default=3, help="timed rounds per size (default 3)", **count)
    parser.add_argument("--link", type=link_argument, default=link_argument(DEFAULT_LINK),
                        metavar="LATENCY,BANDWIDTH", help=f"the emulated link (default: {DEFAULT_LINK})")


def run(args):
    return bench_context_parallel(args.link, args.world_sizes, args.seqs, args.batch_size, args.hidden, args.heads,
                                  args.steps)


def bench_context_parallel(link, world_sizes=(2, 4), seqs=(512, 1024, 2048), b=1, h=128, a=8, steps=3):
    """Measure every method at every (cp, s) on ``link`` (a ``parlab.Link``); returns a
    JSON-ready dict with one row per (cp, s, method or "one process") (module docstring)."""
    check_link(link)
    if link is None:
        raise ValueError("bench_context_parallel emulates a link: pass a parlab.Link, e.g. "
                         "parlab.Link(latency=100e-6, bandwidth=1e9).")
    check_arguments(world_sizes=world_sizes, seqs=seqs, b=b, h=h, a=a, steps=steps)
    if h % a:
        raise ValueError(f"h = {h} does not split into a = {a} heads: choose h a multiple of a.")
    for cp in world_sizes:
        bad = [s for s in seqs if s % (2 * cp)]
        if a % cp or bad:
            raise ValueError(f"cp = {cp} needs a multiple of cp heads (Ulysses; a = {a}) and each s a multiple of "
                             f"2 cp = {2 * cp} (the zig-zag split; got {bad or seqs}): choose other sizes.")
    rows = []
    with progress_bar("context_parallel", len(world_sizes) * len(seqs), unit="size") as bar:
        for cp in world_sizes:
            with runtime.Cluster(cp) as cluster, cluster.emulate(link=link):
                for s in seqs:
                    bar.set_postfix_str(f"cp={cp}, s={s}")
                    timeline = cluster.trace(attend_in_turns, b, s, h, a, steps)
                    saved = cluster.run(saved_bytes, b, s, h, a)
                    rows += measured_rows(timeline, saved, link, cp, b, s, h, steps)
                    bar.update()
    return {"bench": "context_parallel", "torch_version": torch.__version__, "cpu_count": os.cpu_count(),
            "link": {"latency": link.latency, "bandwidth": link.bandwidth}, "b": b, "h": h, "a": a, "steps": steps,
            "ratio_means": ratio_header(REFERENCE), "memory_ratio_means": "saved bytes per rank / one process's "
            "(below 1: a rank holds less)", "rows": rows}


def inputs(b, s, h, a):
    """q, k, v and the output's gradient, (b, a, s, h/a) each, the same on every rank."""
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(b, a, s, h // a, generator=generator) for _ in range(4)]


def attend_in_turns(b, s, h, a, steps):
    """On every rank: ``WARMUP_ROUNDS + steps`` rounds; in each, every method's forward and
    backward (spans ``span_name(method)``, "forward" and "backward" inside), then one
    process on rank 0 (span "one process")."""
    r, cp = dist.get_rank(), dist.get_world_size()
    whole = inputs(b, s, h, a)
    mine = [shard_sequence(x, cp, r, "zigzag") for x in whole]  # (b, a, s/cp, h/a)
    for _ in range(WARMUP_ROUNDS + steps):
        for method in METHODS:
            q, k, v = (x.clone().requires_grad_() for x in mine[:3])
            dist.barrier()  # the ranks start together
            with trace.span(span_name(method)):
                with trace.span("forward"):
                    out = ATTENTION[method](q, k, v, causal=True, split="zigzag")
                with trace.span("backward"):
                    out.backward(mine[3])
        dist.barrier()
        if r == 0:
            q, k, v = (x.clone().requires_grad_() for x in whole[:3])
            with trace.span(ONE_PROCESS):
                F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(whole[3])
        dist.barrier()


def saved_bytes(b, s, h, a):
    """On every rank: {method or "one process": bytes autograd saves for its backward} (one
    process on rank 0 only)."""
    r, cp = dist.get_rank(), dist.get_world_size()
    whole = inputs(b, s, h, a)
    calls = {method: (ATTENTION[method], [shard_sequence(x, cp, r, "zigzag") for x in whole[:3]],
                      dict(causal=True, split="zigzag")) for method in METHODS}
    if r == 0:
        calls[ONE_PROCESS] = F.scaled_dot_product_attention, whole[:3], dict(is_causal=True)
    found = {}
    for name, (attention, tensors, options) in calls.items():
        q, k, v = (x.clone().requires_grad_() for x in tensors)
        with SavedBytes() as saved:
            out = attention(q, k, v, **options)
        found[name] = saved.peak
        out.sum().backward()  # the methods' backward talks: every rank runs it
    return found


def measured_rows(timeline, saved, link, cp, b, s, h, steps):
    """One row per method and one for one process, from a traced ``attend_in_turns`` and the
    ranks' ``saved_bytes``."""
    one_s = statistics.median(ev.duration for ev in timeline.select(rank=0, name=ONE_PROCESS)[WARMUP_ROUNDS:])
    one_saved = saved[0][ONE_PROCESS]
    rows = [{"cp": cp, "s": s, "method": ONE_PROCESS, "seconds_median": one_s, "ratio": 1.0,
             "saved_bytes": one_saved, "memory_ratio": 1.0}]
    for method in METHODS:
        rounds = [[timeline.select(rank=rank, name=span_name(method))[i] for rank in range(cp)]
                  for i in range(WARMUP_ROUNDS, WARMUP_ROUNDS + steps)]
        seconds = [max(ev.end for ev in spans) - min(ev.start for ev in spans) for spans in rounds]
        median = statistics.median(seconds)
        most_saved = max(by_rank[method] for by_rank in saved)
        row = {"cp": cp, "s": s, "method": method, "seconds": seconds, "seconds_median": median,
               "ratio": time_ratio(median, one_s), "saved_bytes": most_saved, "memory_ratio": most_saved / one_saved}
        for phase in ("forward", "backward"):
            row[f"{phase}_bytes"] = [sent_in(timeline, rank, method, phase) for rank in range(cp)]
            row[f"{phase}_bytes_formula"] = bytes_per_rank(method, b, s, h, cp, ELEMENT_BYTES, phase)
        row["bytes_equal_formula"] = all(sent == row[f"{phase}_bytes_formula"] for phase in ("forward", "backward")
                                         for sent in row[f"{phase}_bytes"])
        if method == "ring":
            row["overlap"] = ring_overlap(timeline, rounds, link, b, s, h, cp)
        rows.append(row)
    return rows


def span_name(method):
    """The span around a method's forward and backward: "ring attention", ... (the all-gather
    method marks its collective "all-gather" inside)."""
    return f"{method} attention"


def inside(ev, span):
    return span.start <= ev.start <= span.end


def phase_span(timeline, rank, method_span, phase):
    """``rank``'s span ``phase`` ("forward" or "backward") inside ``method_span``."""
    return next(ev for ev in timeline.select(rank=rank, name=phase) if inside(ev, method_span))


def sent_in(timeline, rank, method, phase):
    """Bytes ``rank`` sent in ``phase`` of the last round of ``method``."""
    span = phase_span(timeline, rank, timeline.select(rank=rank, name=span_name(method))[-1], phase)
    return sum(ev.nbytes for ev in timeline.select(rank=rank, kind=trace.COMM) if ev.name in SENDS and inside(ev, span))


def ring_overlap(timeline, rounds, link, b, s, h, cp):
    """Ring attention's forward K/V messages against the blocks computed meanwhile, measured
    in the trace and modelled (module docstring), over every rank and timed round."""
    transfer_s = link.time(2 * b * (s // cp) * h * ELEMENT_BYTES)  # one K/V block
    interval = covered = exposed = model_interval = model_exposed = computed = 0.0
    for spans in rounds:
        for rank, ring in enumerate(spans):
            forward = phase_span(timeline, rank, ring, "forward")
            arriving = [ev for ev in timeline.select(rank=rank, name="irecv") if inside(ev, forward)]
            blocks = [ev for ev in timeline.select(rank=rank, name="attention") if inside(ev, forward)]
            for message, block in zip(arriving, blocks):  # message i travels while block i is computed
                interval += message.duration
                covered += max(0.0, min(message.end, block.end) - max(message.start, block.start))
                exposed += max(0.0, message.end - block.end)
                computed += block.duration
                model_interval += max(block.duration, transfer_s)
                model_exposed += max(0.0, transfer_s - block.duration)
    count = len(rounds) * cp * (cp - 1)
    return {"transfer_s": transfer_s, "block_compute_s": computed / count,
            "hidden_fraction": covered / interval, "hidden_fraction_model": computed / model_interval,
            "exposed_s": exposed / (len(rounds) * cp), "exposed_s_model": model_exposed / (len(rounds) * cp)}


def format_report(result):
    link = Link(**result["link"])
    table = []
    for row in result["rows"]:
        sent = "" if row["method"] == ONE_PROCESS else (
            format_bytes(max(row["forward_bytes"]) + max(row["backward_bytes"]))
            + (" =" if row["bytes_equal_formula"] else " != formula"))
        table.append([row["method"], row["cp"], row["s"], format_seconds(row["seconds_median"]), f"{row['ratio']:.2f}",
                      format_bytes(row["saved_bytes"]), f"{row['memory_ratio']:.2f}", sent, *_overlap_cells(row)])
    headers = ["attention", "cp", "s", "fwd+bwd", "/ one", "saved/rank", "/ one", "sent/rank",
               "K/V hidden (model)", "exposed (model)", "t_c / t_x"]
    return (
        f"parlab bench context_parallel: causal attention forward + backward, b = {result['b']}, h = {result['h']}, "
        f"a = {result['a']}, fp32, zig-zag split; median of {result['steps']} rounds, first rank's start to last "
        f"rank's end; link {link.describe()} (emulated), real compute on ranks sharing {result['cpu_count']} CPU "
        f"cores; torch {result['torch_version']}\n{result['ratio_means']}\nmemory: {result['memory_ratio_means']}; "
        "sent: forward + backward, counted in the trace ('=': equal to bytes_per_rank)\nK/V hidden, exposed: ring "
        "attention's forward messages, measured in the trace / the model (hidden when a block's compute t_c >= its "
        f"transfer t_x); exposed: a rank's wait for K/V after computing, per round\n\n"
        + format_table(headers, table)
    )


def _overlap_cells(row):
    """Ring attention's measured / modelled overlap as three cells (blank for the others)."""
    overlap = row.get("overlap")
    if overlap is None:
        return ["", "", ""]
    pairs = [(overlap["exposed_s"], overlap["exposed_s_model"]), (overlap["block_compute_s"], overlap["transfer_s"])]
    return [f"{overlap['hidden_fraction']:.0%} / {overlap['hidden_fraction_model']:.0%}",
            *(f"{format_seconds(x)} / {format_seconds(y)}" for x, y in pairs)]
