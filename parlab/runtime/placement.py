"""Which backend and device each rank gets: the "auto" rules of the runtime.

- no GPU (or device="cpu"): gloo, every rank on the CPU;
- at least one GPU per rank: nccl, rank r on cuda:r;
- fewer GPUs than ranks: ranks share GPUs (rank r on cuda:(r % G)) for compute and
  communicate over gloo, staging tensors through host memory.
"""

import numbers
import warnings
from dataclasses import dataclass

BACKENDS = ("auto", "gloo", "nccl")
DEVICES = ("auto", "cpu", "cuda")


@dataclass(frozen=True)
class Placement:
    world_size: int
    backend: str
    device_type: str
    gpu_count: int = 0

    def device(self, rank):
        """The torch device string of ``rank``."""
        if self.device_type == "cpu":
            return "cpu"
        return f"cuda:{rank % self.gpu_count}"

    @property
    def host_staging(self):
        """True when CUDA tensors travel over gloo through host memory."""
        return self.device_type == "cuda" and self.backend == "gloo"

    def describe(self):
        if self.device_type == "cpu":
            return f"{self.world_size} ranks on the CPU over {self.backend}"
        if self.host_staging:
            return (
                f"{self.world_size} ranks on {min(self.world_size, self.gpu_count)} GPU(s) "
                f"(rank r on cuda:r % {self.gpu_count}), communicating over gloo with host staging"
            )
        return f"{self.world_size} ranks, one GPU each, over {self.backend}"


def resolve(world_size, backend="auto", device="auto", gpu_count=None, nccl_available=None):
    """Check the learner's choices and turn "auto" into a concrete Placement.

    ``gpu_count`` and ``nccl_available`` default to what this machine's torch reports; tests
    pass them to check the GPU rules on any machine.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, numbers.Integral):
        raise ValueError(f"world_size must be a whole number of ranks, got {world_size!r}.")
    world_size = int(world_size)  # a slider's or numpy's integer is as good as Python's
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}; ask for 1 or more ranks.")
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; use one of {', '.join(map(repr, BACKENDS))}.")
    if device not in DEVICES:
        raise ValueError(f"unknown device {device!r}; use one of {', '.join(map(repr, DEVICES))}.")
    if gpu_count is None:
        gpu_count = _visible_gpus()
    if nccl_available is None:
        nccl_available = _nccl_available()

    if device == "cuda" and gpu_count == 0:
        raise ValueError("device='cuda' but torch sees no CUDA GPU; use device='cpu' (or 'auto').")
    if backend == "nccl":
        if gpu_count == 0:
            raise ValueError(
                "backend='nccl' needs CUDA GPUs and torch sees none; use backend='gloo' or 'auto'."
            )
        if device == "cpu":
            raise ValueError("backend='nccl' cannot run on device='cpu'; use backend='gloo'.")
        if not nccl_available:
            raise ValueError("this torch build has no nccl backend; use backend='gloo' or 'auto'.")
        if gpu_count < world_size:
            raise ValueError(
                f"backend='nccl' needs one GPU per rank: {world_size} ranks but {gpu_count} "
                "GPU(s); use backend='auto' to share GPUs over gloo, or fewer ranks."
            )

    device_type = "cuda" if gpu_count and device != "cpu" else "cpu"
    if backend == "auto":
        one_gpu_each = device_type == "cuda" and gpu_count >= world_size
        backend = "nccl" if one_gpu_each and nccl_available else "gloo"
    placement = Placement(world_size, backend, device_type, gpu_count if device_type == "cuda" else 0)

    if placement.host_staging:
        reason = " (this torch build has no nccl)" if not nccl_available else ""
        warnings.warn(f"{placement.describe()}{reason}.", stacklevel=3)
    return placement


def _visible_gpus():
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _nccl_available():
    import torch.distributed as dist

    return dist.is_available() and dist.is_nccl_available()
