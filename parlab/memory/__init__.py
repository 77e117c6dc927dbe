"""Training memory: what the ZeRO paper predicts each data-parallel rank holds, what a rank
really holds (measured from its tensors' storages), and the activations of a transformer.

    model_state_bytes(psi, stage, n_d, kappa, param_bytes, grad_bytes)  ZeRO paper, per device
    communication_volume(psi, stage), ring_traffic_bytes(...)       elements and bytes moved
    ring_communication_seconds(...)                                  their alpha-beta time
    deepspeed_zero2_estimate(...), deepspeed_zero3_estimate(...)    DeepSpeed's estimators
    transformer_activation_bytes(s, b, h, a, layers, recompute)     Korthikanti et al. 2022
    storage_bytes(tensors), measure_model_state(params, grads, opt) measured on this rank
    fits(state, device_bytes)                                       does it fit on one device?

Where: ``model_states.py`` (the paper's model states and communication, ``fits``),
``deepspeed.py``, ``activations.py``, ``measure.py`` (storages counted on a rank).

What parlab's engines hold beyond the paper's table (stage 2's peak of gradient bytes during
backward, ZeRO-Offload's device/host split): ``parlab.zero.formulas``.

Model states, per parameter, in mixed-precision Adam: 2 bytes of 16-bit parameters, 2 bytes
of 16-bit gradients and kappa = 12 bytes of optimizer state (fp32 master parameters,
momentum and variance, 4 bytes each; the ZeRO paper writes K for kappa, and K counts
pipeline stages in this course). With Psi parameters on N_d data-parallel ranks, ZeRO
shards more of them at each stage (bytes per device):

    stage 0  baseline data parallelism   (2 + 2 + kappa) Psi
    stage 1  P_os                        2 Psi + 2 Psi + kappa Psi / N_d
    stage 2  P_os+g                      2 Psi + (2 + kappa) Psi / N_d
    stage 3  P_os+g+p                    (2 + 2 + kappa) Psi / N_d

7.5B parameters on N_d = 64: 120, 31.4, 16.6 and 1.9 GB (GB = 1e9 bytes).
"""

from parlab.memory.activations import RECOMPUTE, check_recompute, transformer_activation_bytes
from parlab.memory.deepspeed import Estimate, deepspeed_zero2_estimate, deepspeed_zero3_estimate
from parlab.memory.measure import measure_model_state, storage_bytes
from parlab.memory.model_states import (
    FP32_ADAM,
    FP32_SGD_MOMENTUM,
    MIXED_ADAM,
    PRECISIONS,
    STAGES,
    ModelState,
    Precision,
    check_stage,
    communication_volume,
    fits,
    model_state_bytes,
    ring_communication_seconds,
    ring_traffic_bytes,
)

__all__ = ["FP32_ADAM", "FP32_SGD_MOMENTUM", "MIXED_ADAM", "PRECISIONS", "RECOMPUTE", "STAGES", "Estimate",
           "ModelState", "Precision", "check_recompute", "check_stage", "communication_volume",
           "deepspeed_zero2_estimate", "deepspeed_zero3_estimate", "fits", "measure_model_state", "model_state_bytes",
           "ring_communication_seconds", "ring_traffic_bytes", "storage_bytes", "transformer_activation_bytes"]
