"""What a function running on a rank can ask about where it runs."""

import torch

_device = torch.device("cpu")


def device():
    """This rank's torch device: ``cpu``, or ``cuda:k`` when the cluster places ranks on GPUs.

    Use it inside a function run on the cluster: ``x = torch.ones(4, device=parlab.device())``.
    """
    return _device


def set_device(name):
    global _device
    _device = torch.device(name)
    if _device.type == "cuda":
        torch.cuda.set_device(_device)
