"""What a function running on a rank can ask about where it runs."""

_device_name = None  # set by a Cluster's worker or parlab.launch under torchrun with NCCL


def device():
    """This rank's torch device: ``cpu``, or ``cuda:k`` when the cluster places ranks on GPUs.

    Use it inside a function run on the cluster: ``x = torch.ones(4, device=parlab.device())``.
    Outside a ``Cluster`` (a plain script, ``mp.spawn``, torchrun) the current CUDA device
    where CUDA is available (``torch.cuda.set_device`` chooses it), unless the process group
    is gloo's, whose messages are CPU tensors; otherwise ``cpu``.
    """
    import torch
    import torch.distributed as dist

    if _device_name is not None:
        return torch.device(_device_name)
    if torch.cuda.is_available() and not (dist.is_initialized() and dist.get_backend() == "gloo"):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def set_device(name):
    global _device_name
    _device_name = name
    if name.startswith("cuda"):
        import torch

        torch.cuda.set_device(torch.device(name))
