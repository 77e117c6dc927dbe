"""Activation memory, measured: the bytes a rank holds for backward at its peak.

A pipeline rank holds, for every micro-batch whose forward is done and whose backward is
not, the tensors autograd saved for that backward (a Linear's input, a ReLU's output, ...)
and whatever the executor keeps (the stage input and output). ``ActivationMeter`` counts
both by storage, so a tensor and its views, or an output saved by two layers, count once:

    meter = ActivationMeter()
    meter.start(ignored=[*model.parameters(), inputs])   # not activations: never counted
    with meter.saving():                                  # counts what autograd saves
        y = model(x)
    kept = meter.hold(y)                                  # counts y while `kept` lives
    ...
    meter.peak                                            # bytes, the most held at once

A storage stops counting when the last handle to it is freed: for saved tensors, when the
backward that used them has run (or the graph is dropped).
"""

import torch


class ActivationMeter:
    """Bytes of activations held, counted by storage: ``hold(tensor)`` returns a handle that
    counts the tensor's storage while any handle to it is alive (once, however many
    tensors share it); ``saving()`` does the same for every tensor autograd saves for
    backward. ``peak`` is the most bytes held at once since ``start``."""

    def __init__(self):
        self._held, self._ignored = {}, set()
        self.current = self.peak = 0

    def start(self, ignored):
        """Begin a step; storages of ``ignored`` tensors (parameters, the batch) never count."""
        self._ignored = {_storage_key(t) for t in ignored}
        self.peak = self.current

    def hold(self, tensor):
        key = _storage_key(tensor)
        if key in self._ignored:
            return _Held(tensor, None, None)
        nbytes, count = self._held.get(key, (tensor.untyped_storage().nbytes(), 0))
        if count == 0:
            self.current += nbytes
            self.peak = max(self.peak, self.current)
        self._held[key] = (nbytes, count + 1)
        return _Held(tensor, self, key)

    def release(self, key):
        nbytes, count = self._held.pop(key)
        if count > 1:
            self._held[key] = (nbytes, count - 1)
        else:
            self.current -= nbytes

    def saving(self):
        # a detached view: a handle holding the saved tensor itself would make a reference
        # cycle through its grad_fn, and the storage would outlive the backward until a GC
        return torch.autograd.graph.saved_tensors_hooks(lambda t: self.hold(t.detach()), lambda held: held.tensor)


class _Held:
    """A tensor kept for backward; its storage stops counting when the handle is freed."""

    __slots__ = ("tensor", "_meter", "_key")

    def __init__(self, tensor, meter, key):
        self.tensor, self._meter, self._key = tensor, meter, key

    def __del__(self):
        if self._meter is not None:
            self._meter.release(self._key)


def _storage_key(tensor):
    return tensor.device, tensor.untyped_storage().data_ptr()
