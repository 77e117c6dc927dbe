"""The ZeRO paper's formulas: the model states one device holds at each stage
(``model_state_bytes``, in the ``Precision`` of a training recipe), whether they fit
(``fits``), and what each stage moves per step (``communication_volume``, the bytes of ring
collectives ``ring_traffic_bytes`` and their alpha-beta time ``ring_communication_seconds``).
"""

from typing import NamedTuple

from parlab._checks import real_number, refuse, whole_number
from parlab.memory._sizes import _check_ranks, _check_sizes
from parlab.units import GB  # the ZeRO paper's gigabyte, 1e9 bytes

STAGES = (0, 1, 2, 3)


class ModelState(NamedTuple):
    """Model-state bytes held by one device: parameters, gradients, optimizer state."""

    params: float
    grads: float
    optimizer: float

    @property
    def total(self):
        return self.params + self.grads + self.optimizer


class Precision(NamedTuple):
    """Bytes per parameter of a training recipe: ``kappa`` of optimizer state, ``param_bytes``
    and ``grad_bytes`` of the parameters and gradients the model computes with. In the order
    of ``model_state_bytes``' arguments: ``model_state_bytes(psi, stage, n_d, *FP32_ADAM)``."""

    kappa: float
    param_bytes: float
    grad_bytes: float


# fp16/bf16 parameters and gradients; fp32 master parameters, momentum and variance.
MIXED_ADAM = Precision(kappa=12, param_bytes=2, grad_bytes=2)
# Everything in fp32, no master copy: the parameters are the master parameters, so kappa
# counts momentum and variance only. This is what a CPU run of torch.optim.Adam holds.
FP32_ADAM = Precision(kappa=8, param_bytes=4, grad_bytes=4)
# torch.optim.SGD(momentum > 0) in fp32: one momentum buffer.
FP32_SGD_MOMENTUM = Precision(kappa=4, param_bytes=4, grad_bytes=4)
PRECISIONS = {"mixed-precision Adam": MIXED_ADAM, "fp32 Adam": FP32_ADAM, "fp32 SGD with momentum": FP32_SGD_MOMENTUM}


def model_state_bytes(psi, stage, n_d, kappa=12, param_bytes=2, grad_bytes=2):
    """The ZeRO paper's model-state bytes of ONE device, as a ``ModelState``.

    ``psi``: Psi, the number of parameters; ``stage``: the ZeRO stage, 0 (plain data
    parallelism) to 3; ``n_d``: N_d, the data-parallel degree; ``kappa``: optimizer-state
    bytes per parameter (the paper's K); ``param_bytes``, ``grad_bytes``: bytes per parameter
    and per gradient.

        params    = param_bytes Psi     (/ N_d from stage 3)
        grads     = grad_bytes Psi      (/ N_d from stage 2)
        optimizer = kappa Psi           (/ N_d from stage 1)

    Buffers, fragmentation, activations and the gathered parameters of the layer being
    computed (stage 3) are not model states and are not counted.
    """
    _check_sizes(psi=psi, kappa=kappa, param_bytes=param_bytes, grad_bytes=grad_bytes)
    check_stage(stage)
    _check_ranks(n_d)
    return ModelState(
        params=param_bytes * psi / (n_d if stage >= 3 else 1),
        grads=grad_bytes * psi / (n_d if stage >= 2 else 1),
        optimizer=kappa * psi / (n_d if stage >= 1 else 1),
    )


def communication_volume(psi, stage):
    """Elements each rank moves per training step at ``stage``, the ZeRO paper's count.

    Stages 0 to 2 move 2 Psi: an all-reduce of the gradients is a reduce-scatter (Psi) and an
    all-gather (Psi); stages 1 and 2 keep the reduce-scatter and all-gather the updated
    parameters instead, so sharding the optimizer state and gradients is free. Stage 3 moves
    3 Psi: the parameters are all-gathered once for forward and once more for backward,
    and the gradients reduce-scattered.
    """
    _check_sizes(psi=psi)
    check_stage(stage)
    return 3 * psi if stage == 3 else 2 * psi


def ring_traffic_bytes(numel, n_d, element_bytes, stage):
    """Bytes each rank sends per step at ``stage`` with ring collectives, for ``numel``
    elements of ``element_bytes`` bytes on ``n_d`` ranks.

    A ring reduce-scatter or all-gather of D bytes makes each rank send N_d - 1 chunks of
    D / N_d bytes, (N_d - 1)/N_d D; the step makes 2 such collectives (3 at stage 3):

        (N_d - 1)/N_d x communication_volume(numel, stage) x element_bytes

    Exact for every rank when N_d divides numel; with uneven chunks it is the mean over ranks.
    """
    _check_ranks(n_d)
    _check_sizes(element_bytes=element_bytes)
    return (n_d - 1) * communication_volume(numel, stage) * element_bytes / n_d


def ring_communication_seconds(padded_numels, n_d, element_bytes, stage, latency, bandwidth):
    """Seconds one step's ring collectives take at ``stage`` in the alpha-beta model, one
    collective after another: ``padded_numels`` lists the flat buffers the step moves (one for
    ZeroDP, one per unit for FSDP; each padded to a multiple of N_d), ``latency`` is alpha (s)
    and ``bandwidth`` 1/beta (bytes/s). A buffer of Psi_u elements (a unit's, padded) makes 2
    collectives, 3 at stage 3 (``communication_volume``), each N_d - 1 messages of one
    Psi_u / N_d chunk:

        sum over buffers of  (2 or 3) (N_d - 1) (alpha + Psi_u / N_d x element_bytes x beta)

    When alpha is small beside a chunk's time (a bandwidth-bound link), stage 3 takes 1.5 x
    the time of stages 0 to 2, as it moves 1.5 x the bytes; each unit's latency adds to that.
    """
    _check_ranks(n_d)
    _check_sizes(element_bytes=element_bytes, latency=latency)
    real_number("bandwidth", bandwidth, "give the link's bytes per second, e.g. 25e6.", above=True)
    collectives = communication_volume(1, stage)
    return sum(collectives * (n_d - 1) * (latency + _check_padded(numel, n_d) / n_d * element_bytes / bandwidth)
               for numel in padded_numels)


def _check_padded(numel, n_d):
    fix = "give each flat buffer's padded numel (FlatLayout.padded_numel), which N_d equal shards make up."
    whole_number("each of padded_numels", numel, fix)
    if numel % n_d:
        refuse("each of padded_numels", f"a multiple of n_d = {n_d}", numel, fix)
    return numel


def fits(state, device_bytes=80 * GB):
    """Whether ``state`` (a ``ModelState`` or a number of bytes) fits in ``device_bytes``."""
    real_number("device_bytes", device_bytes, "give the device's memory in bytes, e.g. 80 * GB.")
    total = state.total if isinstance(state, ModelState) else real_number(
        "state", state, "pass a ModelState (from model_state_bytes) or a number of bytes.")
    return total <= device_bytes


def check_stage(stage):
    """Refuse anything but a ZeRO stage 0-3 with a ValueError saying so."""
    if isinstance(stage, bool) or stage not in STAGES:
        raise ValueError(f"stage must be a ZeRO stage 0, 1, 2 or 3 (0 is plain data parallelism), got {stage!r}: "
                         "pick one of them.")
