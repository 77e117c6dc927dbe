"""parlab.memory: bytes measured from storages, and the ZeRO paper's formulas against
hand-computed values."""

import pytest
import torch

from parlab.memory import (
    FP32_ADAM,
    FP32_SGD_MOMENTUM,
    MIXED_ADAM,
    PRECISIONS,
    STAGES,
    Estimate,
    ModelState,
    communication_volume,
    deepspeed_zero2_estimate,
    deepspeed_zero3_estimate,
    fits,
    measure_model_state,
    model_state_bytes,
    ring_communication_seconds,
    ring_traffic_bytes,
    storage_bytes,
    transformer_activation_bytes,
)
from parlab.units import GB

# --- measured bytes ---------------------------------------------------------------------------


def test_storage_bytes_counts_each_tensor_of_its_own():
    assert storage_bytes([torch.zeros(10), torch.zeros(3, dtype=torch.float64)]) == 40 + 24


def test_a_view_counts_its_whole_storage_once():
    flat = torch.zeros(100)
    views = [flat[:10], flat[10:30].view(4, 5), flat[50:]]
    assert storage_bytes(views) == 400
    assert storage_bytes([flat, *views]) == 400


def test_tensors_sharing_one_storage_count_once():
    a = torch.zeros(8)
    b = torch.empty(0).set_(a.untyped_storage())
    assert b.data_ptr() == a.data_ptr()
    assert storage_bytes([a, b, a]) == 32


def test_a_storage_resized_to_zero_counts_zero_and_none_is_skipped():
    freed, kept = torch.zeros(16), torch.zeros(4)
    freed.untyped_storage().resize_(0)
    assert storage_bytes([freed, None, kept]) == 16
    assert storage_bytes([None]) == storage_bytes([]) == 0


def test_measure_model_state_counts_a_storage_in_its_first_category_only():
    flat = torch.zeros(12)
    params = [flat[:8], flat[8:]]
    grads = [torch.zeros(8), flat[8:]]  # the second gradient shares the parameters' buffer
    exp_avg, exp_avg_sq = torch.zeros(12), torch.zeros(12)
    state = measure_model_state(params, grads, [exp_avg, exp_avg_sq, torch.tensor(3.0)])
    assert state == ModelState(params=48, grads=32, optimizer=96 + 4)
    assert state.total == 48 + 32 + 100


def test_measure_model_state_of_a_real_adam_step():
    model = torch.nn.Linear(10, 5)  # 55 fp32 parameters
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(3, 10)).sum().backward()
    optimizer.step()
    tensors = [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
    state = measure_model_state(model.parameters(), [p.grad for p in model.parameters()], tensors)
    # exp_avg and exp_avg_sq per parameter, plus a scalar step per parameter (fp32, 4 bytes)
    assert state == ModelState(params=220, grads=220, optimizer=2 * 220 + 2 * 4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_storage_bytes_on_cuda():
    flat = torch.zeros(100, device="cuda")
    freed = torch.zeros(10, device="cuda")
    freed.untyped_storage().resize_(0)
    assert storage_bytes([flat[:10], flat[20:], freed, torch.zeros(4)]) == 400 + 16


# --- the ZeRO paper's formulas ----------------------------------------------------------------


def test_the_papers_7_5b_example_on_64_ranks():
    gigabytes = [round(model_state_bytes(7.5e9, stage, 64).total / GB, 1) for stage in STAGES]
    assert gigabytes == [120.0, 31.4, 16.6, 1.9]


def test_each_stage_shards_one_more_model_state():
    psi, n_d = 1000, 4
    assert model_state_bytes(psi, 0, n_d) == ModelState(2000, 2000, 12000)
    assert model_state_bytes(psi, 1, n_d) == ModelState(2000, 2000, 3000)
    assert model_state_bytes(psi, 2, n_d) == ModelState(2000, 500, 3000)
    assert model_state_bytes(psi, 3, n_d) == ModelState(500, 500, 3000)
    assert model_state_bytes(psi, 3, 1) == model_state_bytes(psi, 0, 1)  # nothing to shard on one rank


def test_presets_give_the_bytes_per_parameter_of_each_recipe():
    assert model_state_bytes(10, 0, 1, *MIXED_ADAM).total == 10 * (2 + 2 + 12)
    assert model_state_bytes(10, 0, 1, *FP32_ADAM) == ModelState(40, 40, 80)
    assert model_state_bytes(10, 2, 2, *FP32_SGD_MOMENTUM) == ModelState(40, 20, 20)
    assert set(PRECISIONS.values()) == {MIXED_ADAM, FP32_ADAM, FP32_SGD_MOMENTUM}


def test_kappa_is_the_optimizer_bytes_per_parameter_by_name():
    # kappa, not the paper's K: K counts pipeline stages in this course (notebooks/GLOSSARY.md)
    assert MIXED_ADAM.kappa == 12 and FP32_ADAM.kappa == 8 and FP32_SGD_MOMENTUM.kappa == 4
    assert model_state_bytes(100, 1, 4, kappa=8, param_bytes=4, grad_bytes=4) == ModelState(400, 400, 200)
    with pytest.raises(TypeError):
        model_state_bytes(100, 1, 4, k=8)


@pytest.mark.parametrize(
    "arguments, message",
    [
        ((100, 4, 2), "stage must be a ZeRO stage"),
        ((100, -1, 2), "stage must be a ZeRO stage"),
        ((100, 1, 0), "n_d"),
        ((100, 1, 1.5), "n_d"),
        ((-1, 1, 2), "psi must be at least 0"),
        ((100, 1, 2, -12), "kappa must be at least 0"),
    ],
)
def test_model_state_bytes_rejects_what_cannot_be(arguments, message):
    with pytest.raises(ValueError, match=message):
        model_state_bytes(*arguments)


def test_communication_volume_is_2_psi_until_stage_3_then_3_psi():
    assert [communication_volume(100, stage) for stage in STAGES] == [200, 200, 200, 300]
    with pytest.raises(ValueError, match="stage"):
        communication_volume(100, 4)


def test_ring_traffic_bytes():
    # 4 ranks, 1000 fp32 elements: each collective sends 3 chunks of 250 x 4 bytes per rank
    assert [ring_traffic_bytes(1000, 4, 4, stage) for stage in STAGES] == [6000, 6000, 6000, 9000]
    assert ring_traffic_bytes(1000, 1, 4, 3) == 0
    with pytest.raises(ValueError, match="n_d"):
        ring_traffic_bytes(1000, 0, 4, 1)


def test_ring_communication_seconds_by_hand():
    # 1000 fp32 elements on 4 ranks: chunks of 250 x 4 = 1000 bytes, 1 ms each at 1 MB/s, plus alpha = 1 ms
    assert ring_communication_seconds([1000], 4, 4, 0, 1e-3, 1e6) == pytest.approx(2 * 3 * 2e-3)
    assert ring_communication_seconds([1000], 4, 4, 3, 1e-3, 1e6) == pytest.approx(3 * 3 * 2e-3)
    # FSDP's units: every unit pays its own messages, so its own latencies
    assert ring_communication_seconds([400, 600], 4, 4, 3, 1e-3, 1e6) == pytest.approx(
        3 * 3 * (1e-3 + 4e-4) + 3 * 3 * (1e-3 + 6e-4))
    assert ring_communication_seconds([1000], 1, 4, 3, 1e-3, 1e6) == 0  # one rank sends nothing


def test_on_a_bandwidth_bound_link_stage_3_takes_the_traffic_ratio():
    for stage in STAGES:  # without latency the time is the bytes sent over the bandwidth
        assert ring_communication_seconds([1000, 2000], 4, 4, stage, 0, 1e6) == pytest.approx(
            ring_traffic_bytes(3000, 4, 4, stage) / 1e6)
    # ZeroDP moves one flat buffer, FSDP one per unit: 4 units pay 4 times the latencies
    stage_0 = ring_communication_seconds([16000], 4, 4, 0, 1e-4, 1e6)
    stage_3 = ring_communication_seconds([4000] * 4, 4, 4, 3, 1e-4, 1e6)
    assert stage_3 / stage_0 == pytest.approx(36 * (1e-4 + 4e-3) / (6 * (1e-4 + 16e-3)))
    assert 1.5 < stage_3 / stage_0 < 1.5 * 1.1


@pytest.mark.parametrize("arguments, message", [
    (([1001], 4, 4, 0, 0, 1e6), r"each of padded_numels must be a multiple of n_d = 4, got 1001: .*padded_numel"),
    (([1000.0], 4, 4, 0, 0, 1e6), r"each of padded_numels must be a whole number"),
    (([1000], 4, 4, 0, -1, 1e6), r"latency must be at least 0 .*alpha"),
    (([1000], 4, 4, 0, 0, 0), r"bandwidth must be above 0 .*bytes per second"),
    (([1000], 4, 4, 5, 0, 1e6), r"stage must be a ZeRO stage"),
])
def test_ring_communication_seconds_refuses_what_cannot_be(arguments, message):
    with pytest.raises(ValueError, match=message):
        ring_communication_seconds(*arguments)


# --- DeepSpeed's estimators -------------------------------------------------------------------

# t5-small: 60,506,624 parameters, the largest layer its 32128 x 512 shared embedding. DeepSpeed
# prints these estimates for it on 1 node with 1 GPU (GiB, 2 decimals, CPU then GPU).
T5_SMALL, T5_SMALL_EMBEDDING = 60_506_624, 32128 * 512


def gib(estimate):
    return round(estimate.per_cpu / 2**30, 2), round(estimate.per_gpu / 2**30, 2)


def test_zero3_estimate_reproduces_deepspeeds_table_for_t5_small():
    def estimate(**options):
        return gib(deepspeed_zero3_estimate(T5_SMALL, T5_SMALL_EMBEDDING, **options))

    assert estimate(offload_optimizer=True, offload_params=True) == (1.52, 0.06)
    assert estimate(offload_optimizer=True, offload_params=True, zero_init=False) == (1.52, 0.06)
    assert estimate(offload_optimizer=True) == (1.35, 0.17)
    assert estimate() == (0.09, 1.08)
    assert estimate(zero_init=False) == (0.34, 1.08)
    with pytest.raises(ValueError, match="offload_optimizer"):
        estimate(offload_params=True)


def test_zero3_estimate_is_the_paper_plus_the_largest_layer_and_an_fp32_gradient_shard():
    psi, layer, n = 1e9, 1e7, 8
    paper = model_state_bytes(psi, 3, n).total
    assert deepspeed_zero3_estimate(psi, layer, gpus_per_node=n).per_gpu == pytest.approx(
        paper + 4 * layer + 2 * psi / n)
    # Offloaded shards are spread over the nodes' hosts; without zero.Init each process loads the model.
    assert deepspeed_zero3_estimate(psi, layer, 8, 2, offload_optimizer=True).per_cpu == 8 * psi * 1.5
    assert deepspeed_zero3_estimate(psi, layer, 8, 2, offload_optimizer=True, zero_init=False).per_cpu == 32 * psi * 1.5


def test_zero2_estimate():
    psi = 1e9
    assert deepspeed_zero2_estimate(psi, gpus_per_node=8) == Estimate(
        per_gpu=model_state_bytes(psi, 2, 8).total + 4 * psi / 8, per_cpu=4 * psi * 8 * 1.5)
    assert deepspeed_zero2_estimate(psi, 2, offload_optimizer=True) == Estimate(2 * psi, 16 * psi * 1.5)
    assert deepspeed_zero2_estimate(psi, 4, 2, offload_optimizer=True, buffer_factor=1) == Estimate(2 * psi, 32 * psi)
    with pytest.raises(ValueError, match="gpus_per_node"):
        deepspeed_zero2_estimate(psi, 0)


# --- activations ------------------------------------------------------------------------------


def test_transformer_activation_bytes_by_hand():
    # s = 4, b = 2, h = 8, a = 2: s b h = 64 and 5 a s / h = 5.
    assert transformer_activation_bytes(4, 2, 8, 2) == 64 * 39
    assert transformer_activation_bytes(4, 2, 8, 2, layers=3) == 3 * 64 * 39
    assert transformer_activation_bytes(4, 2, 8, 2, recompute="selective") == 64 * 34
    assert transformer_activation_bytes(4, 2, 8, 2, recompute="full") == 64 * 2
    # with sequence parallelism the one input kept is itself split along s
    assert transformer_activation_bytes(4, 2, 8, 2, recompute="full", t=2, sequence_parallel=True) == 64 * 2 / 2
    assert transformer_activation_bytes(4, 2, 8, 2, t=2) == 64 * (10 + 12 + 2.5)
    assert transformer_activation_bytes(4, 2, 8, 2, t=2, sequence_parallel=True) == 64 * (17 + 2.5)
    assert transformer_activation_bytes(4, 2, 8, 2, t=2, sequence_parallel=True, recompute="selective") == 64 * 17


def test_gpt3_layer_activations():
    # GPT-3 175B: s = 2048, h = 12288, a = 96; b = 1. 5 a s / h = 80, so 114 s b h per layer.
    assert transformer_activation_bytes(2048, 1, 12288, 96) == 2048 * 12288 * 114
    assert transformer_activation_bytes(2048, 1, 12288, 96, layers=96) / GB == pytest.approx(275.4, abs=0.1)


def test_transformer_activation_bytes_rejects_bad_options():
    with pytest.raises(ValueError, match="recompute"):
        transformer_activation_bytes(4, 2, 8, 2, recompute="some")
    with pytest.raises(ValueError, match="divide"):
        transformer_activation_bytes(4, 2, 8, 2, t=3)


def test_fits():
    assert fits(model_state_bytes(7.5e9, 2, 64))
    assert not fits(model_state_bytes(7.5e9, 0, 64))
    assert fits(80e9) and not fits(80e9 + 1) and fits(10, device_bytes=10)
