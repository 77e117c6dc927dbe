"""DDP communication hooks from compressors, for parlab's DDP and for torch's.

    model = parlab.ddp.DDP(net, comm_hook=parlab_hook(ErrorFeedback(TopK(0.01)), net))
    model = torch.nn.parallel.DistributedDataParallel(net)
    model.register_comm_hook(*torch_hook(PowerSGD(rank=2)))

Either way the bucket's gradients go through ``compressor.aggregate`` (parlab's collectives,
so an emulated link charges them and the trace counts them), and DDP steps with the average
of the ranks' reconstructions. State (error-feedback residuals, PowerSGD's warm-started Q)
is kept per bucket.

On one axis of a ``parlab.Mesh`` the hook averages over the axis's group, the same group
DDP was given:

    dp = mesh.group("dp")
    model = parlab.ddp.DDP(net, group=dp, comm_hook=parlab_hook(PowerSGD(rank=2), net, group=dp))
    model = torch.nn.parallel.DistributedDataParallel(net, process_group=dp)
    model.register_comm_hook(*torch_hook(PowerSGD(rank=2), group=dp))
"""

import torch


class ParlabHook:
    """``comm_hook`` for ``parlab.ddp.DDP``: bucket (flat) in, average over the ranks of
    ``group`` (default: all of them; pass DDP's ``group``) out.

    ``module``, the module DDP wraps, lets the hook tell each bucket's parameter shapes
    (PowerSGD views each one as a matrix): parlab's DDP fills its buckets with consecutive
    trainable parameters in reverse registration order and launches them in that order each
    step, so the hook walks the same list. Without it a bucket is one vector."""

    def __init__(self, compressor, module=None, group=None):
        if not callable(getattr(compressor, "aggregate", None)):
            raise ValueError(f"a comm hook needs a compressor such as parlab.compression.FP16(), got {compressor!r}.")
        self.compressor, self.group = compressor, group
        self.shapes = None if module is None else [p.shape for p in module.parameters() if p.requires_grad][::-1]
        self.position = 0  # where the next bucket starts in self.shapes

    def __call__(self, bucket):
        mean, _ = self.compressor.aggregate(bucket, key=bucket.data_ptr(), shapes=self._bucket_shapes(bucket.numel()),
                                            group=self.group)
        return mean

    def _bucket_shapes(self, numel):
        if self.shapes is None:
            return None
        shapes, total = [], 0
        while total < numel and self.position < len(self.shapes):
            shapes.append(self.shapes[self.position])
            total += shapes[-1].numel()
            self.position += 1
        if total != numel:
            raise ValueError(f"a bucket of {numel} elements does not match the parameters of the module given to the "
                             "hook: pass the module that DDP wraps.")
        self.position %= len(self.shapes)
        return shapes


def parlab_hook(compressor, module=None, group=None):
    """A comm hook for ``parlab.ddp.DDP(..., comm_hook=...)`` that averages over ``group``
    (see ``ParlabHook``)."""
    return ParlabHook(compressor, module, group)


def torch_hook(compressor, group=None):
    """(state, hook) for torch's ``DistributedDataParallel.register_comm_hook(state, hook)``:
    the hook compresses ``bucket.buffer()`` as parlab's hook does (shapes from
    ``bucket.parameters()``, state per ``bucket.index()``) and returns a completed
    ``torch.futures.Future`` of the average over ``group`` (default: all ranks; pass the
    ``process_group`` torch's DDP was given: its hook is not told it)."""
    if not callable(getattr(compressor, "aggregate", None)):
        raise ValueError(f"a comm hook needs a compressor such as parlab.compression.FP16(), got {compressor!r}.")

    def hook(state, bucket):
        shapes = [p.shape for p in bucket.parameters()]
        mean, _ = state.aggregate(bucket.buffer(), key=bucket.index(), shapes=shapes, group=group)
        future = torch.futures.Future()
        future.set_result(mean)
        return future

    return compressor, hook
