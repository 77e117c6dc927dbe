"""ZeroDP(offload=True), ZeRO-Offload: the optimizer's shard and state live on the host. At 2 and
4 ranks, stages 1 and 2: the same parameters as without offload, bit for bit (the same
operations on a host copy); the bytes moved per step are the formula's; the device keeps no
optimizer state and the host holds the shard, its gradient and the state; checkpoints resume
an offloaded engine exactly. On a GPU (skipped without one): device memory from torch's
allocator, offload against no offload, differs by the optimizer state (and stage 2's gradient
shard) that moved to the host."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import parlab
from parlab import runtime
from parlab.zero import ZeroDP, checkpoint
from parlab.zero.formulas import offload_bytes_per_step, offload_state_bytes

SIZES, BATCH, STEPS = (6, 9, 5), 16, 4  # 63 + 50 = 113 parameters: padded at N_d = 2, 4
OPTIMIZERS = {"Adam": (torch.optim.Adam, dict(lr=1e-2)), "SGD momentum": (torch.optim.SGD, dict(lr=0.1, momentum=0.9))}


def build(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(SIZES[0], SIZES[1]), nn.Tanh(), nn.Linear(SIZES[1], SIZES[2]))


def my_shard():
    generator = torch.Generator().manual_seed(3)
    x, y = torch.randn(BATCH, SIZES[0], generator=generator), torch.randn(BATCH, SIZES[2], generator=generator)
    return x.chunk(dist.get_world_size())[dist.get_rank()], y.chunk(dist.get_world_size())[dist.get_rank()]


def train(engine, steps=STEPS):
    x, y = my_shard()
    for _ in range(steps):
        engine.zero_grad()
        F.mse_loss(engine(x), y).backward()
        engine.step()
    return engine


def with_and_without_offload():
    results = {}
    for stage in (1, 2):
        for name, (optimizer_class, options) in OPTIMIZERS.items():
            for offload in (False, True):
                engine = train(ZeroDP(build(seed=dist.get_rank()), optimizer_class, stage=stage, offload=offload,
                                      **options))
                results[stage, name, offload] = (engine.full_parameters(), dict(engine.offload_bytes),
                                                 engine.model_state_bytes(), engine.host_state_bytes(),
                                                 engine.layout.padded_numel, engine.shard.device)
    return results


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", ["cluster2", "cluster4"])
def test_offload_trains_bit_for_bit_and_moves_the_formulas_bytes(world, request):
    cluster = request.getfixturevalue(world)
    N = cluster.world_size
    kappa = {"Adam": 8, "SGD momentum": 4}
    for rank, results in enumerate(cluster.run(with_and_without_offload, timeout=120)):
        for stage in (1, 2):
            for name in OPTIMIZERS:
                plain, _, plain_device, plain_host, _, _ = results[stage, name, False]
                parameters, moved, device, host, padded, shard_device = results[stage, name, True]
                label = f"rank {rank}, stage {stage}, {name}"
                assert all(torch.equal(parameters[key], plain[key]) for key in plain), label
                shard = padded // N
                assert moved == offload_bytes_per_step(padded, N) == {"gradients to host": 4 * shard,
                                                                      "parameters to device": 4 * shard}, label
                assert shard_device == torch.device("cpu")
                step_count = 4 if name == "Adam" else 0  # Adam's step, one fp32 scalar
                # the host: the fp32 shard, its gradient and the optimizer state; the device: the
                # parameters, stage 1's flat gradient, no optimizer state
                on_device, on_host = offload_state_bytes(padded, N, stage, kappa[name])
                assert on_host == (4 * shard, 4 * shard, kappa[name] * shard), label
                assert on_device == (4 * padded, 4 * padded if stage == 1 else 0, 0), label
                assert host == on_host._replace(optimizer=on_host.optimizer + step_count), label
                assert device == on_device, label
                assert plain_host.total == 0 and plain_device.optimizer == kappa[name] * shard + step_count, label
                assert results[stage, name, False][1] == {}, label  # nothing moves without offload


def resume_offloaded(folder, sharded):
    engine = train(ZeroDP(build(), torch.optim.Adam, stage=2, offload=True, lr=1e-2), steps=2)
    (checkpoint.save_sharded if sharded else checkpoint.save_full)(engine, folder)
    dist.barrier()
    resumed = ZeroDP(build(seed=5), torch.optim.Adam, stage=2, offload=True, lr=1e-2)
    (checkpoint.load_sharded if sharded else checkpoint.load_full)(resumed, folder)
    return train(engine, steps=2).full_parameters(), train(resumed, steps=2).full_parameters()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("sharded", [False, True], ids=["full", "sharded"])
def test_an_offloaded_engine_resumes_from_a_checkpoint_exactly(cluster2, tmp_path, sharded):
    folder = str(tmp_path / ("sharded" if sharded else "full.pt"))
    for continued, resumed in cluster2.run(resume_offloaded, folder, sharded, timeout=60):
        assert all(torch.equal(continued[name], resumed[name]) for name in continued)


def test_offload_needs_stage_1_or_2_and_the_formula_a_padded_numel():
    with pytest.raises(ValueError, match="stage 1 or 2"):
        ZeroDP(build(), torch.optim.Adam, stage=0, offload=True)
    with pytest.raises(ValueError, match="True or False"):
        ZeroDP(build(), torch.optim.Adam, stage=1, offload="cpu")
    with pytest.raises(ValueError, match="multiple of N_d"):
        offload_bytes_per_step(113, 4)
    with pytest.raises(ValueError, match="stage 1 or 2"):
        offload_state_bytes(112, 4, 3, 8)


WIDTH = 128  # 2 x (128 x 128 + 128) = 33 024 parameters: at N_d = 2 a shard of 66 048 bytes, 129 x 512


def device_memory(stage, offload):
    """Bytes torch's CUDA allocator holds for the engine after 2 steps (at rest) and at its peak,
    above what the inputs held before. (The allocator rounds each block up to 512 bytes: the
    shard's tensors here are whole multiples of it.)"""
    device = runtime.device()
    x, y = torch.randn(4, WIDTH, device=device), torch.randn(4, WIDTH, device=device)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH)).to(device)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    engine = ZeroDP(model, torch.optim.Adam, stage=stage, offload=offload, lr=1e-3)
    for _ in range(2):
        engine.zero_grad()
        F.mse_loss(engine(x), y).backward()
        engine.step()
    torch.cuda.synchronize(device)
    at_rest = torch.cuda.memory_allocated(device) - before
    return at_rest, torch.cuda.max_memory_allocated(device) - before, engine.layout.padded_numel


def memory_with_and_without_offload(stage):
    return {offload: device_memory(stage, offload) for offload in (False, True)}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.timeout(180)
@pytest.mark.parametrize("stage", [1, 2])
def test_on_a_gpu_offload_frees_the_optimizer_state_from_device_memory(stage):
    with parlab.Cluster(2, device="cuda", timeout=120) as cluster:
        for rank, measured in enumerate(cluster.run(memory_with_and_without_offload, stage, timeout=120)):
            (rest, peak, padded), (rest_offloaded, peak_offloaded, _) = measured[False], measured[True]
            shard = padded // 2
            # Adam's exp_avg and exp_avg_sq (8 bytes a shard element; its step count stays on the CPU) and,
            # at stage 2, the averaged gradient shard (4 bytes an element) live on the host instead
            moved = 8 * shard + (4 * shard if stage == 2 else 0)
            assert rest - rest_offloaded == moved, rank
            assert peak - peak_offloaded >= 8 * shard, rank  # the state was on the device all through the 2nd step
