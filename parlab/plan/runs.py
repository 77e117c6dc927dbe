"""What each rank runs for ``parlab.plan.measure``: the small GPT with its layers' compute
declared (``parlab.emulated.ComputeTime``), wrapped in the engine of the plan's row of
``measure``'s table, trained on the same batches as every other rank.

``train_plan(layout, B, forward_s, steps)`` is the function ``run_plan`` ships to the ranks;
``forward_s = 0`` and no emulated link train in real time (the equivalence runs of the tests
and of ``parlab doctor --gpu``), on each rank's device (``runtime.device()``: a GPU where the
cluster places ranks on GPUs). ``one_process`` is the reference they are compared with.
"""

import time
from contextlib import contextmanager, nullcontext

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from parlab import runtime
from parlab.emulated import ComputeTime
from parlab.gpt import GPT, CharDataset, GPTConfig
from parlab.memory import measure_model_state
from parlab.numerics import backward_in_shards

CONFIG = GPTConfig(L=4)
LR = 1e-3
DDP_BUCKET_MB = 1  # about a layer per bucket: backward hides all but the last


def train_plan(layout, B, forward_s, steps):
    """One rank's part: build the GPT, declare its layers' compute, wrap it in the layout's
    engine, train ``steps`` + 1 steps on the same batches as every rank; return this rank's
    step times (the first, a warm-up that skips the declared compute, dropped), its
    model-state bytes in the last step, read when the gradients are synchronized, before the
    optimizer's step (all model states alive; Adam's step counters, 4 bytes per parameter
    tensor, left out), and the full batch's mean loss at every step (the same on every rank).
    On a GPU also ``peak_bytes``, the most memory the rank's process held at once
    (``torch.cuda.max_memory_allocated``); None on a CPU."""
    N_d, t, K, zero, b, M, recompute = layout
    device = runtime.device()
    torch.manual_seed(0)
    gpt = GPT(CONFIG).to(device)
    data, generator = CharDataset(), torch.Generator().manual_seed(0)
    on_gpu = device.type == "cuda"
    if on_gpu:
        torch.cuda.reset_peak_memory_stats(device)
    step, model = _engine(gpt, N_d, t, K, zero, M, recompute, forward_s)
    declared = [m for m in model.modules() if isinstance(m, ComputeTime)]
    times, losses = [], []
    for i in range(steps + 1):
        tokens, targets = (part.to(device) for part in data.batch(B, CONFIG.s, generator))
        dist.barrier()
        start = time.perf_counter()
        with _undeclared(declared) if i == 0 else nullcontext():  # the warm-up, not timed: no need to wait
            state_bytes, loss_sum = step(tokens, targets)
        if on_gpu:
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
        losses.append(torch.tensor(float(loss_sum), dtype=torch.float64, device=device))
    total = torch.stack(losses)
    dist.all_reduce(total)  # every sample's loss counted once, by the rank that owns it
    return {"times": times[1:], "state_bytes": state_bytes, "losses": (total / B).tolist(),
            "peak_bytes": torch.cuda.max_memory_allocated(device) if on_gpu else None}


def one_process(B, steps, shards=1, order=None, device="cpu"):
    """The reference of ``train_plan``: the full batch's mean loss (float32) before each of the
    ``steps`` + 1 Adam steps of the small GPT in one process on ``device``. With ``shards``,
    the gradient is computed as that many ranks do, summed in ``order`` (``parlab.numerics``'
    yardstick runs)."""
    torch.manual_seed(0)
    gpt = GPT(CONFIG).to(device)
    optimizer = torch.optim.Adam(gpt.parameters(), lr=LR)
    data, generator = CharDataset(), torch.Generator().manual_seed(0)
    losses = []
    for _ in range(steps + 1):
        tokens, targets = (part.to(device) for part in data.batch(B, CONFIG.s, generator))
        with torch.no_grad():
            losses.append(_loss(gpt(tokens), targets))
        parts = list(zip(tokens.tensor_split(shards), targets.tensor_split(shards)))
        backward_in_shards(lambda x, y: _loss(gpt(x), y), gpt.parameters(), parts, order)
        optimizer.step()
    return torch.stack(losses).cpu()


@contextmanager
def _undeclared(declared):
    """The ``ComputeTime`` layers of ``declared`` take no time inside the block."""
    kept = [(m.forward_s, m.backward_s) for m in declared]
    for m in declared:
        m.forward_s = m.backward_s = 0.0
    try:
        yield
    finally:
        for m, (forward_s, backward_s) in zip(declared, kept):
            m.forward_s, m.backward_s = forward_s, backward_s


class _Timed(nn.Module):
    """A layer behind its declared compute time, recomputed in backward if asked."""

    def __init__(self, layer, forward_s, recompute):
        super().__init__()
        self.inner, self.recompute = nn.Sequential(ComputeTime(forward_s, 2 * forward_s), layer), recompute

    def forward(self, x):
        if self.recompute:
            return torch.utils.checkpoint.checkpoint(self.inner, x, use_reentrant=False)
        return self.inner(x)


def _time_layers(blocks, forward_s, recompute):
    for i, block in enumerate(blocks):
        blocks[i] = _Timed(block, forward_s, recompute)


def _adam_states(optimizer):
    return [v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v)]


def _states(params, grads, optimizer):
    return measure_model_state(params, grads, _adam_states(optimizer)).total - _step_counter_bytes(optimizer)


def _step_counter_bytes(optimizer):
    return sum(state["step"].nbytes for state in optimizer.state.values() if torch.is_tensor(state.get("step")))


def _engine(gpt, N_d, t, K, zero, M, recompute, forward_s):
    """(step, model): step(tokens, targets) of the layout's engine (module table), which returns
    the rank's model-state bytes read before the optimizer's step and the sum of the losses of
    the samples this rank owns (each sample's loss is owned by one rank); model holds the
    rank's layers, their ``ComputeTime`` included."""
    if t > 1:
        return _tensor_parallel(gpt, N_d, zero, recompute, forward_s)
    if K > 1:
        return _pipeline(gpt, N_d, K, M, forward_s)
    _time_layers(gpt.blocks, forward_s, recompute)
    replica = dist.get_rank()

    def shards(tokens, targets):  # this replica's B / N_d samples in M micro-batches
        return zip(*(batch.tensor_split(N_d)[replica].tensor_split(M) for batch in (tokens, targets)))

    if zero == 0:
        from parlab.ddp import DDP

        engine = DDP(gpt, bucket_cap_mb=DDP_BUCKET_MB)
        optimizer = torch.optim.Adam(engine.parameters(), lr=LR)

        def step(tokens, targets):
            optimizer.zero_grad()
            loss_sum = 0.0
            for m, (x, y) in enumerate(shards(tokens, targets)):
                with engine.no_sync() if m < M - 1 else nullcontext():
                    loss = _loss(engine(x), y)
                    (loss / M).backward()
                loss_sum += loss.item() * len(x)
            engine.finish_gradient_synchronization()
            ddp = engine.model_state_bytes()  # the buckets' copies of the gradients included
            state_bytes = ddp.params + ddp.grads + _states([], [], optimizer)
            optimizer.step()
            return state_bytes, loss_sum

        return step, gpt
    if zero == 3:
        from parlab.zero import FSDP

        engine = FSDP(gpt, torch.optim.Adam, wrap_policy=lambda m: isinstance(m, _Timed), lr=LR)  # the root: the rest
    else:
        from parlab.zero import ZeroDP

        buckets = {"bucket_cap_mb": 1024} if zero == 2 else {}  # one bucket: the planner's one flat buffer
        engine = ZeroDP(gpt, torch.optim.Adam, stage=zero, lr=LR, **buckets)

    def step(tokens, targets):
        engine.zero_grad()
        loss_sum = 0.0
        for x, y in shards(tokens, targets):
            loss = _loss(engine(x), y)
            (loss / M).backward()
            loss_sum += loss.item() * len(x)
        engine.finish_gradient_synchronization()
        state_bytes = engine.model_state_bytes().total - _step_counter_bytes(engine.optimizer)
        engine.step()
        return state_bytes, loss_sum

    return step, gpt


def _tensor_parallel(gpt, N_d, zero, recompute, forward_s):
    from parlab.tensor_parallel.grid import TensorDataParallel

    grid = TensorDataParallel(gpt, N_d, sequence_parallel=True)
    _time_layers(grid.model.blocks, forward_s, recompute)
    params = list(grid.model.parameters())
    optimizer = torch.optim.Adam(params, lr=LR)

    def step(tokens, targets):
        loss = grid.step(tokens, targets)
        state_bytes = _states(params, [p.grad for p in params], optimizer)
        optimizer.step()
        optimizer.zero_grad()
        owner = grid.tensor_parallel_ranks[0] == dist.get_rank()  # the row's ranks share the replica's loss
        return state_bytes, loss.item() * len(tokens) / N_d if owner else 0.0

    return step, grid.model


def _pipeline(gpt, N_d, K, M, forward_s):
    from parlab.pipeline import one_f_one_b
    from parlab.pipeline.grid import PipelineDataParallel

    _time_layers(gpt.blocks, forward_s, False)
    per_stage, r = len(gpt.blocks) // K, dist.get_rank() % K
    layers = [*gpt.blocks[r * per_stage:(r + 1) * per_stage]]
    stage = nn.Sequential(*([_Embedding(gpt)] if r == 0 else []), *layers,
                          *([gpt.final_norm, gpt.head] if r == K - 1 else []))
    grid = PipelineDataParallel(one_f_one_b(K, M), {r: stage}, _loss, N_d)
    params = list(stage.parameters())
    optimizer = torch.optim.Adam(params, lr=LR)

    def step(tokens, targets):
        losses = grid.step(tokens, targets)  # the M micro-batches' losses on the last stage, None elsewhere
        state_bytes = _states(params, [p.grad for p in params], optimizer)
        optimizer.step()
        optimizer.zero_grad()
        return state_bytes, sum(loss.item() for loss in losses) * len(tokens) / (N_d * M) if losses else 0.0

    return step, stage


class _Embedding(nn.Module):
    """The GPT's token and position embeddings as the first stage's first layer."""

    def __init__(self, gpt):
        super().__init__()
        self.token_embedding, self.position_embedding = gpt.token_embedding, gpt.position_embedding

    def forward(self, tokens):
        return self.token_embedding(tokens) + self.position_embedding.weight[:tokens.shape[1]]


def _loss(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())
