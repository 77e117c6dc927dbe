"""One spelling for "start the replicas from rank 0": every engine that replicates or shards a
model copies rank 0's initial values with ``parlab.p2p.broadcast``, which the trace records
as one "broadcast" event per tensor (peer: the source rank, bytes: the tensor's), and sends
nothing else while it is built."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from parlab import trace
from parlab.ddp import DDP
from parlab.pipeline import PipelineDataParallel, gpipe, partition
from parlab.zero import FSDP, ZeroDP

pytestmark = pytest.mark.timeout(60)


class WithFrozenAndBuffer(nn.Module):
    """Linear(3, 5) -> frozen Linear(5, 4) x buffer (4): 20 trainable elements, 24 frozen, 4 of buffer."""

    def __init__(self):
        super().__init__()
        self.first = nn.Linear(3, 5)
        self.frozen = nn.Linear(5, 4).requires_grad_(False)
        self.register_buffer("scale", torch.randn(4))

    def forward(self, x):
        return self.frozen(self.first(x)) * self.scale


def build(name):
    torch.manual_seed(dist.get_rank())  # every rank different: only the broadcast makes them equal
    if name == "DDP":
        return DDP(WithFrozenAndBuffer())
    if name == "ZeroDP":
        return ZeroDP(WithFrozenAndBuffer(), torch.optim.SGD, stage=1, lr=0.1)
    model = nn.Sequential(nn.Linear(3, 5), nn.Linear(5, 2))  # FSDP shards trainable parameters only
    if name == "FSDP":
        return FSDP(model, torch.optim.SGD, wrap_policy="per_layer", lr=0.1)
    return PipelineDataParallel(gpipe(1, 1), dict(enumerate(partition(model, 1))), nn.functional.mse_loss, 2)


def start(name):
    """What this rank holds after construction, by name."""
    with trace.span("construction"):
        engine = build(name)
    if name == "FSDP":
        return {key: value.tolist() for key, value in engine.full_parameters().items()}
    module = engine.executor.stages[0] if name == "grid" else engine.module
    return {key: value.tolist() for key, value in module.state_dict().items()}


# name -> the bytes of each broadcast, in order: 4-byte elements
BROADCASTS = {
    "DDP": [4 * n for n in (15, 5, 20, 4, 4)],  # each parameter and buffer: tensors as they are
    "ZeroDP": [4 * n for n in (20, 20, 4, 4)],  # one flat buffer of the trainable ones, then the rest
    "FSDP": [4 * n for n in (20, 12)],  # each unit's flat parameter (padded to a multiple of 2)
    "grid": [4 * n for n in (15, 5, 10, 2)],  # the stage's DDP engine over its column: each parameter as it is
}


@pytest.mark.parametrize("name", list(BROADCASTS))
def test_replicas_start_from_rank_0_by_traced_broadcasts(cluster2, name):
    timeline = cluster2.trace(start, name, timeout=60)
    assert timeline.results[0] == timeline.results[1] and timeline.results[0]
    for rank in range(2):
        broadcasts = timeline.select(rank=rank, name="broadcast")
        assert [ev.nbytes for ev in broadcasts] == BROADCASTS[name], (name, rank)
        assert {ev.peer for ev in broadcasts} == {0}
        (built,) = timeline.select(rank=rank, name="construction")
        assert [ev for ev in timeline.select(rank=rank, kind="comm") if ev.start < built.end] == broadcasts
