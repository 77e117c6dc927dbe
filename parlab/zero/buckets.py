"""ZeRO stage 2's gradient buckets: the gradients are reduce-scattered during backward, bucket
by bucket, so a full-size gradient of the whole model never exists (as DeepSpeed's ZeRO-2).

The trainable parameters lie end to end in the engine's padded flat layout (``FlatLayout``),
rank r owning shard r (padded Psi / N_d elements from r x padded Psi / N_d). They are grouped into
buckets of up to ``bucket_cap_mb`` in reverse order (``parlab.ddp.assign_buckets``: backward
meets the last layers first); a bucket of consecutive parameters is one range [lo, hi) of the
layout (the bucket of the last parameter also takes the padding). During backward:

    gradient of p ready   (p's post-accumulate-grad hook) add p.grad into its bucket's buffer,
                          a range-sized zero buffer made at the bucket's first gradient, then
                          free p.grad
    bucket full           reduce-scatter the buffer: rank q gets the average of the part of
                          [lo, hi) inside shard q (a part may be empty); add this rank's part
                          into this rank's averaged shard (``gradient``); free the buffer

Buckets are reduced in order, as DDP launches its all-reduces, so every rank makes the same
collectives in the same order; a bucket with a parameter that got no gradient this step is
reduced in ``finish`` (called by the engine's step), its missing gradients as zeros.

The reduce-scatter of a bucket is the ring's, ``parlab.collectives.ring_reduce_scatter``, over
the bucket's uneven parts (``parts=``): part q ends, averaged, on rank q. Each part
is summed in the same order as by a ring reduce-scatter of the whole flat buffer, so stage 2's
averaged shard is bit for bit stage 1's; and each rank sends every part but its own, so over
all buckets it sends (N_d - 1)/N_d x padded Psi elements: a ring reduce-scatter's (N_d - 1)/N_d x 4 padded
Psi bytes in fp32, in more messages (one per non-empty part and step).

Memory: the gradients live are this rank's averaged shard (4 padded Psi / N_d bytes), the buffers of the
buckets not yet reduced (one at a time when gradients arrive in bucket order) and the one
gradient just produced, against stage 1's full flat gradient of 4 padded Psi bytes. A bucket
of one parameter (padding aside) needs no buffer of its own: its gradient is its buffer.
"""

import functools

import torch
import torch.distributed as dist

from parlab import collectives, trace
from parlab.ddp import MB, assign_buckets
from parlab.zero.formulas import stage2_peak_gradient_bytes


class GradientBuckets:
    """Stage 2's buckets over ``parameters`` (the engine's trainable parameters, in the order of
    ``layout``); each bucket's averaged part for this rank is added into ``gradient``, this
    rank's shard of the averaged gradient (None until the first bucket is reduced), reduced
    over ``group`` (default: all ranks). Hooks are registered on the parameters at
    construction. ``measure()`` is called whenever a new gradient and its bucket's buffer are
    both alive (the engine measures its peak there)."""

    def __init__(self, parameters, layout, bucket_cap_mb, measure, group=None):
        self.layout, self.measure = layout, measure
        self.dtype, self.device = parameters[0].dtype, parameters[0].device  # the gradients'
        self.gradient = None
        self.group, self.rank = group, dist.get_rank(group)  # reduce-scattered over ``group``
        sizes = [p.numel() * p.element_size() for p in parameters]
        self.buckets = [self._bucket(sorted(indices)) for indices in assign_buckets(sizes, bucket_cap_mb * MB)]
        self.launched = 0  # buckets reduced so far in this round, always a prefix of self.buckets
        self.arrived = False  # a gradient arrived since the last finish
        for bucket in self.buckets:
            for index in bucket.indices:
                parameters[index].register_post_accumulate_grad_hook(functools.partial(self.gradient_ready, bucket,
                                                                                       index))

    def _bucket(self, indices):
        layout = self.layout
        lo = layout.offsets[indices[0]]
        last = indices[-1]
        hi = layout.padded_numel if last == len(layout.shapes) - 1 else layout.offsets[last] + layout.numels[last]
        shards = [layout.shard_bounds(q) for q in range(layout.world_size)]
        # rank q's part of the bucket, in the bucket's coordinates (empty where they do not meet)
        parts = [(min(max(start, lo), hi) - lo, max(min(end, hi), lo) - lo) for start, end in shards]
        return Bucket(indices, lo, hi, parts)

    def gradient_ready(self, bucket, index, param):
        """Post-accumulate-grad hook of parameter ``index``: its gradient into the bucket's
        buffer (then freed), and reduce every bucket that is now full, in order. A bucket that
        is exactly this one gradient takes the gradient itself as its buffer: no copy."""
        start = self.layout.offsets[index] - bucket.lo
        if bucket.buffer is None and param.numel() == bucket.hi - bucket.lo and param.grad.is_contiguous():
            bucket.buffer = param.grad.view(-1)  # what zeros + the gradient would hold, bit for bit
        else:
            if bucket.buffer is None:
                bucket.buffer = torch.zeros(bucket.hi - bucket.lo, dtype=param.dtype, device=param.device)
            bucket.buffer[start : start + param.numel()].add_(param.grad.reshape(-1))
        self.measure()
        param.grad = None
        bucket.ready.add(index)
        self.arrived = True
        while self.launched < len(self.buckets) and self.buckets[self.launched].is_full():
            self.reduce(self.buckets[self.launched])
        if self.launched == len(self.buckets):
            self.launched = 0  # a whole round: the next backward (gradient accumulation) starts another

    def reduce(self, bucket):
        """Reduce-scatter ``bucket``: this rank's averaged part added into ``gradient``."""
        if bucket.buffer is None:  # no gradient arrived for any of its parameters: zeros
            bucket.buffer = torch.zeros(bucket.hi - bucket.lo, dtype=self.dtype, device=self.device)
        with trace.span("reduce-scatter gradients", stage=self.launched):
            collectives.ring_reduce_scatter(bucket.buffer, op="avg", check=False, group=self.group, parts=bucket.parts)
        if self.gradient is None:
            self.gradient = torch.zeros(self.layout.shard_numel, dtype=self.dtype, device=self.device)
            self.measure()
        start, end = bucket.parts[self.rank]
        shard_start = self.layout.shard_bounds(self.rank)[0]
        self.gradient[bucket.lo + start - shard_start : bucket.lo + end - shard_start].add_(bucket.buffer[start:end])
        bucket.buffer, bucket.ready = None, set()
        self.launched += 1

    def finish(self):
        """Reduce what backward left unreduced: the rest of the round of buckets begun (a
        parameter without a gradient counts zeros), then, if a later backward (gradient
        accumulation) put gradients into buckets reduced already, one more round. Afterwards
        ``gradient`` holds the step's averaged shard. Returns whether any gradient arrived
        since the last ``finish``."""
        arrived = self.arrived
        if self.launched or self.buffers():
            for bucket in self.buckets[self.launched :]:
                self.reduce(bucket)
            if self.buffers():
                for bucket in self.buckets:
                    self.reduce(bucket)
        self.launched, self.arrived = 0, False
        return arrived

    def discard(self):
        """Forget the gradients (``zero_grad``): buffers and the averaged shard dropped."""
        for bucket in self.buckets:
            bucket.buffer, bucket.ready = None, set()
        self.launched, self.arrived, self.gradient = 0, False, None

    def sizes(self):
        """[(B_b, G_b)]: each bucket's elements and its largest gradient's, in reduce order."""
        return [(bucket.hi - bucket.lo, max(self.layout.numels[i] for i in bucket.indices)) for bucket in self.buckets]

    def peak_bytes(self):
        """The largest gradient bytes alive at once in a step, when each bucket's gradients
        arrive one at a time and before the next bucket's (a chain of layers):
        ``parlab.zero.formulas.stage2_peak_gradient_bytes`` of these buckets."""
        size = torch.finfo(self.dtype).bits // 8
        return stage2_peak_gradient_bytes(self.sizes(), self.layout.shard_numel, size)

    def buffers(self):
        """The bucket buffers alive now."""
        return [bucket.buffer for bucket in self.buckets if bucket.buffer is not None]


class Bucket:
    """Consecutive parameters (``indices``) whose gradients travel together: the range
    [lo, hi) of the flat layout, cut into the N_d ranks' ``parts``."""

    def __init__(self, indices, lo, hi, parts):
        self.indices, self.lo, self.hi, self.parts = indices, lo, hi, parts
        self.buffer = None  # the gradients summed here, allocated from its first gradient to its reduce-scatter
        self.ready = set()  # indices whose gradient arrived in this step

    def is_full(self):
        return len(self.ready) == len(self.indices)
