"""Lecture 10: what an fp8 all-gather buys an FSDP step on a slow link, measured and modelled.

    rows = gather_step_times(cluster, parlab.Link(latency=100e-6, bandwidth=20e6))

times FSDP FULL_SHARD steps (bf16 compute, ``prefetch=False``: every collective on the
critical path) with the parameters gathered in bf16 and in fp8 (``FSDP(...,
all_gather_dtype=torch.float8_e4m3fn)``), under the emulated link, beside the alpha-beta model
of the step's communication plus the step's measured time outside its collectives
(``step_model``).

The fp8 step makes every unit's scales once per forward with one all-gather of the amaxes,
N - 1 messages (``parlab.zero.flat_unit.make_fp8_scales``, as torchao's
``precompute_float8_dynamic_scale_for_fsdp``), which the model counts once per step.

An emulated message takes at least its real time: where the machine's own step (no link
emulated: N ranks' arithmetic, casts and wake-ups sharing the cores) is slower than the
model's link time, the measured step shows the machine, not the bytes. Compare ``median_s``
with the same call on a cluster without a link before reading the rows as the link's.
"""

import statistics

import torch
import torch.distributed as dist
from torch import nn

from parlab import _checks, trace
from parlab.fp8 import E4M3
from parlab.memory import ring_communication_seconds
from parlab.trace import COMPUTE
from parlab.zero.fsdp import FSDP

GATHERS = {"bf16": None, "fp8 E4M3": E4M3}
COLLECTIVES = ("all-gather", "reduce-scatter", "amax")  # the engine's spans of its collectives


def gather_step_times(cluster, link, hidden=256, depth=4, batch_size=4, steps=3, timeout=120):
    """Step times of FSDP with each all-gather dtype (``GATHERS``) on ``cluster`` under
    ``link`` (entered here: ``with cluster.emulate(link=link)``): an MLP of ``depth`` Linear
    layers of ``hidden`` x ``hidden`` (a unit each), Adam, ``batch_size`` samples per rank; the
    two engines take their steps in turn, one to warm up and ``steps`` timed ones each.
    Returns one dict per gather: ``gather``, ``seconds`` (each step from the first rank's start
    to the last rank's end), ``median_s``, ``sent`` (bytes each rank sent in the last step),
    ``compute_s`` (the median over the steps of the longest time a rank spent outside the
    collectives' spans: forward and backward arithmetic, the optimizer, Python),
    ``model_s`` (``step_model`` with that compute) and ``padded_numels`` (the units')."""
    for name, value in dict(hidden=hidden, depth=depth, batch_size=batch_size, steps=steps).items():
        _checks.whole_number(name, value, "pass a small whole number, e.g. the default.")
    with cluster.emulate(link=link):
        timeline = cluster.trace(_steps_in_turn, hidden, depth, batch_size, 1 + steps, timeout=timeout)
    rows = []
    for index, name in enumerate(GATHERS):
        windows = [timeline.window("step", step * len(GATHERS) + index) for step in range(1, 1 + steps)]
        seconds = [window.duration for window in windows]
        compute = statistics.median(max(_outside_collectives(window, rank) for rank in range(cluster.world_size))
                                    for window in windows)
        padded = timeline.results[0]
        rows.append({"gather": name, "seconds": seconds, "median_s": statistics.median(seconds),
                     "sent": windows[-1].bytes_sent(), "padded_numels": padded, "compute_s": compute,
                     "model_s": step_model(padded, cluster.world_size, link, name, compute)})
    return rows


def _outside_collectives(window, rank):
    """Seconds of ``rank``'s step span in ``window`` not inside one of its collectives' spans."""
    spans = window.select(rank=rank, kind=COMPUTE)
    step = next(span.duration for span in spans if span.name == "step")
    return step - sum(span.duration for span in spans if span.name in COLLECTIVES)


def _steps_in_turn(hidden, depth, batch_size, steps):
    engines = []
    for dtype in GATHERS.values():
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(hidden, hidden) for _ in range(depth)])
        engines.append(FSDP(model, torch.optim.Adam, wrap_policy="per_layer", mixed_precision=torch.bfloat16,
                            prefetch=False, all_gather_dtype=dtype, lr=1e-4))
    x = torch.randn(batch_size, hidden, generator=torch.Generator().manual_seed(dist.get_rank()))
    for _ in range(steps):
        for engine in engines:
            dist.barrier()  # the ranks start each step together
            with trace.span("step"):
                engine(x).float().square().mean().backward()
                engine.step()
                engine.zero_grad()
    return [unit.layout.padded_numel for unit in engines[0].units]


def step_model(padded_numels, N, link, gather="bf16", compute_s=0.0):
    """The time of one FULL_SHARD step whose collectives run one after another: per unit of
    Psi_u padded elements, two all-gathers (``gather``: "bf16", 2 bytes per element, or
    "fp8 E4M3", 1) and one reduce-scatter in bf16 (2 bytes), each (N - 1)(alpha + Psi_u / N x
    bytes x beta) (``ring_communication_seconds``); an fp8 gather adds the one all-gather of
    all units' amaxes at the start of the forward (``make_fp8_scales``), N - 1 messages
    counted at alpha each (4 bytes per parameter tensor: a few bytes each). Plus ``compute_s``, the
    step's time outside its collectives (``gather_step_times`` measures it): the model times
    the link, not the arithmetic."""
    fp8 = GATHERS[gather] is not None
    gathers = 2 / 3 * ring_communication_seconds(padded_numels, N, 1 if fp8 else 2, 3, link.latency, link.bandwidth)
    reduce = 1 / 3 * ring_communication_seconds(padded_numels, N, 2, 3, link.latency, link.bandwidth)
    scales = (N - 1) * link.latency if fp8 else 0.0
    return gathers + reduce + scales + compute_s
