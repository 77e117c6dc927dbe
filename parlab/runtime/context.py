"""What a function running on a rank can ask about where it runs."""

_device_name = "cpu"


def device():
    """This rank's torch device: ``cpu``, or ``cuda:k`` when the cluster places ranks on GPUs.

    Use it inside a function run on the cluster: ``x = torch.ones(4, device=parlab.device())``.
    """
    import torch

    return torch.device(_device_name)


def set_device(name):
    global _device_name
    _device_name = name
    if name.startswith("cuda"):
        import torch

        torch.cuda.set_device(torch.device(name))
