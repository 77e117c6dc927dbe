"""parlab.memory: bytes measured from storages, and the ZeRO paper's formulas against
hand-computed values."""

import pytest
import torch

from parlab.memory import ModelState, measure_model_state, storage_bytes

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


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_storage_bytes_on_cuda():
    flat = torch.zeros(100, device="cuda")
    freed = torch.zeros(10, device="cuda")
    freed.untyped_storage().resize_(0)
    assert storage_bytes([flat[:10], flat[20:], freed, torch.zeros(4)]) == 400 + 16
