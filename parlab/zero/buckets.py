"""ZeRO's gradient buckets: stage 2 reduce-scatters its gradients during backward, bucket by
bucket, so a full-size gradient of the whole model never exists (as DeepSpeed's ZeRO-2 with
``overlap_comm``); stage 0 all-reduces its flat gradient in buckets during backward, as DDP.
Both launch each bucket's collective on the rank's communication thread (``parlab.background``,
one collective at a time, in launch order) and let backward compute the next gradients meanwhile.

The trainable parameters lie end to end in the engine's padded flat layout (``FlatLayout``),
rank r owning shard r (padded Psi / N_d elements from r x padded Psi / N_d). They are grouped into
buckets of up to ``bucket_cap_mb`` in reverse order (``parlab.ddp.assign_buckets``: backward
meets the last layers first); a bucket of consecutive parameters is one range [lo, hi) of the
layout (the bucket of the last parameter also takes the padding). Stage 2 during backward:

    gradient of p ready   (p's post-accumulate-grad hook) add p.grad into its bucket's buffer,
                          a range-sized zero buffer made at the bucket's first gradient, then
                          free p.grad
    bucket b full         launch its reduce-scatter on the communication thread: rank q gets
                          the average of the part of [lo, hi) inside shard q (a part may be
                          empty), and adds this rank's part into its averaged shard
                          (``gradient``); then wait for bucket b - 1's and free its buffer
    finish                launch what is left, wait for every bucket (``finish_gradient_synchronization``)

Buckets are launched in order, as DDP launches its all-reduces, so every rank makes the same
collectives in the same order; a bucket with a parameter that got no gradient this step is
launched in ``finish``, its missing gradients as zeros. Waiting for bucket b - 1 when b is
launched is DeepSpeed's double buffering: one bucket in flight while the next one fills, so the
reduce-scatter of b - 1 overlaps the backward that fills b, and the memory stays two buckets.

The reduce-scatter of a bucket is the ring's, ``parlab.collectives.ring_reduce_scatter``, over
the bucket's uneven parts (``parts=``): part q ends, averaged, on rank q. Each part
is summed in the same order as by a ring reduce-scatter of the whole flat buffer, and each
element of the shard gets one addition per bucket round, in launch order: stage 2's averaged
shard is bit for bit stage 1's. Each rank sends every part but its own, so over all buckets it
sends (N_d - 1)/N_d x padded Psi elements: a ring reduce-scatter's (N_d - 1)/N_d x 4 padded Psi
bytes in fp32, in more messages (one per non-empty part and step).

Memory: the gradients live are this rank's averaged shard (4 padded Psi / N_d bytes, from the
first launch), the buffer of the bucket filling, the buffer of the bucket in flight (alive
until waited for: when the next bucket is launched), and the one gradient just produced,
against stage 1's full flat gradient of 4 padded Psi bytes
(``parlab.zero.formulas.stage2_peak_gradient_bytes``). A bucket of one parameter (padding
aside) needs no buffer of its own: its gradient is its buffer.
"""

import functools

import torch
import torch.distributed as dist

from parlab import background, collectives, trace
from parlab.ddp import assign_buckets
from parlab.units import MIB
from parlab.zero.formulas import stage2_peak_gradient_bytes


class GradientBuckets:
    """Stage 2's buckets over ``parameters`` (the engine's trainable parameters, in the order of
    ``layout``); each bucket's averaged part for this rank is added into ``gradient``, this
    rank's shard of the averaged gradient (None until the first bucket is launched), reduced
    over ``group`` (default: all ranks). Hooks are registered on the parameters at
    construction. ``measure()`` is called whenever a new gradient and its bucket's buffer are
    both alive, and when the shard's gradient is made (the engine measures its peak there)."""

    def __init__(self, parameters, layout, bucket_cap_mb, measure, group=None):
        self.layout, self.measure = layout, measure
        self.dtype, self.device = parameters[0].dtype, parameters[0].device  # the gradients'
        self.gradient = None
        self.group, self.rank = group, dist.get_rank(group)  # reduce-scattered over ``group``
        sizes = [p.numel() * p.element_size() for p in parameters]
        groups = assign_buckets(sizes, bucket_cap_mb * MIB)
        self.buckets = [self._bucket(b, sorted(indices)) for b, indices in enumerate(groups)]
        self.launched = 0  # buckets launched so far in this round, always a prefix of self.buckets
        self.in_flight = []  # ([buffer, gradient], handle) of the buckets launched, not yet waited for, in order
        self.arrived = False  # a gradient arrived since the last finish
        for bucket in self.buckets:
            for index in bucket.indices:
                parameters[index].register_post_accumulate_grad_hook(functools.partial(self.gradient_ready, bucket,
                                                                                       index))

    def _bucket(self, number, indices):
        layout = self.layout
        lo = layout.offsets[indices[0]]
        last = indices[-1]
        hi = layout.padded_numel if last == len(layout.shapes) - 1 else layout.offsets[last] + layout.numels[last]
        shards = [layout.shard_bounds(q) for q in range(layout.world_size)]
        # rank q's part of the bucket, in the bucket's coordinates (empty where they do not meet)
        parts = [(min(max(start, lo), hi) - lo, max(min(end, hi), lo) - lo) for start, end in shards]
        return Bucket(number, indices, lo, hi, parts)

    def gradient_ready(self, bucket, index, param):
        """Post-accumulate-grad hook of parameter ``index``: its gradient into the bucket's
        buffer (then freed), and launch every bucket that is now full, in order. A bucket that
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
            self.launch(self.buckets[self.launched])
        if self.launched == len(self.buckets):
            self.launched = 0  # a whole round: the next backward (gradient accumulation) starts another

    def launch(self, bucket):
        """Start ``bucket``'s reduce-scatter on the communication thread (its buffer goes with it:
        a later backward fills a new one), then wait for the buckets launched before it."""
        if bucket.buffer is None:  # no gradient arrived for any of its parameters: zeros
            bucket.buffer = torch.zeros(bucket.hi - bucket.lo, dtype=self.dtype, device=self.device)
        if self.gradient is None:
            self.gradient = torch.zeros(self.layout.shard_numel, dtype=self.dtype, device=self.device)
            self.measure()
        tensors = [bucket.buffer, self.gradient]  # emptied when waited for, so the buffer is freed then, here
        self.in_flight.append((tensors, background.start(self.reduce_scatter, bucket, tensors)))
        bucket.buffer, bucket.ready = None, set()
        self.launched += 1
        self.wait(keep=1)

    def reduce_scatter(self, bucket, tensors):
        """On the communication thread: the ring reduce-scatter of the bucket's buffer over the
        ranks' parts (``tensors``: the buffer, the shard's gradient), then this rank's averaged
        part added into the shard's gradient."""
        buffer, gradient = tensors
        with trace.span("reduce-scatter gradients", stage=bucket.number):
            collectives.ring_reduce_scatter(buffer, op="avg", check=False, group=self.group, parts=bucket.parts)
            start, end = bucket.parts[self.rank]
            shard_start = self.layout.shard_bounds(self.rank)[0]
            gradient[bucket.lo + start - shard_start : bucket.lo + end - shard_start].add_(buffer[start:end])

    def wait(self, keep=0):
        """Wait for the buckets in flight, oldest first, until ``keep`` are left; their buffers
        are freed as they are waited for (not before: a bucket in flight is alive)."""
        while len(self.in_flight) > keep:
            tensors, handle = self.in_flight.pop(0)
            handle.wait()
            tensors.clear()

    def finish(self):
        """Launch what backward left unlaunched: the rest of the round of buckets begun (a
        parameter without a gradient counts zeros), then, if a later backward (gradient
        accumulation) put gradients into buckets launched already, one more round; wait for
        them all. Afterwards ``gradient`` holds the step's averaged shard. Returns whether any
        gradient arrived since the last ``finish``."""
        arrived = self.arrived
        if self.launched or self.filling():
            for bucket in self.buckets[self.launched :]:
                self.launch(bucket)
            if self.filling():
                for bucket in self.buckets:
                    self.launch(bucket)
        self.wait()
        self.launched, self.arrived = 0, False
        return arrived

    def discard(self):
        """Forget the gradients (``zero_grad``): wait for the buckets in flight, drop the
        buffers and the averaged shard."""
        self.wait()
        for bucket in self.buckets:
            bucket.buffer, bucket.ready = None, set()
        self.launched, self.arrived, self.gradient = 0, False, None

    def sizes(self):
        """[(B_b, G_b)]: each bucket's elements and its largest gradient's, in launch order."""
        return [(bucket.hi - bucket.lo, max(self.layout.numels[i] for i in bucket.indices)) for bucket in self.buckets]

    def peak_bytes(self):
        """The largest gradient bytes alive at once in a step, when each bucket's gradients
        arrive one at a time and before the next bucket's (a chain of layers):
        ``parlab.zero.formulas.stage2_peak_gradient_bytes`` of these buckets."""
        size = torch.finfo(self.dtype).bits // 8
        return stage2_peak_gradient_bytes(self.sizes(), self.layout.shard_numel, size)

    def filling(self):
        """The buffers of the buckets filling now (gradients added, not launched)."""
        return [bucket.buffer for bucket in self.buckets if bucket.buffer is not None]

    def buffers(self):
        """The bucket buffers alive now: filling, and in flight."""
        return [*self.filling(), *(tensors[0] for tensors, _ in self.in_flight)]


class Bucket:
    """Consecutive parameters (``indices``) whose gradients travel together, bucket ``number``
    in launch order: the range [lo, hi) of the flat layout, cut into the N_d ranks' ``parts``."""

    def __init__(self, number, indices, lo, hi, parts):
        self.number, self.indices, self.lo, self.hi, self.parts = number, indices, lo, hi, parts
        self.buffer = None  # the gradients summed here, allocated at its first gradient, handed over at its launch
        self.ready = set()  # indices whose gradient arrived in this step

    def is_full(self):
        return len(self.ready) == len(self.indices)


class AllReduceBuckets:
    """Stage 0's buckets: the flat gradient (``flat_grad``, whose views are the module
    gradients) cut into ranges that are ring all-reduced (averaged) in place during backward,
    as ``parlab.ddp.DDP("bucketed")`` does: each range is launched on the rank's communication
    thread (``parlab.background``) as soon as backward has produced all its gradients, and the
    next gradients are computed meanwhile; ``finish`` launches what is left and waits.

    The buckets are stage 2's (``assign_buckets``, reverse order, up to ``bucket_cap_mb``); bucket
    b's range ends where bucket b - 1's begins (the first ends at padded Psi) and begins at its
    first parameter's offset rounded up to a multiple of N_d (the last begins at 0). So every
    range holds a multiple of N_d elements, a ring moves it in equal chunks and each rank sends
    2 (N_d - 1)/N_d of it: over all ranges, exactly one ring all-reduce of padded Psi. (The few
    elements a rounding leaves out go with the next range; a range left empty is skipped.) With
    one bucket the range is the whole buffer, chunked as its N_d shards."""

    def __init__(self, parameters, layout, flat_grad, bucket_cap_mb, group=None):
        self.flat_grad, self.group = flat_grad, group
        sizes = [p.numel() * p.element_size() for p in parameters]
        groups = [sorted(indices) for indices in assign_buckets(sizes, bucket_cap_mb * MIB)]
        N, end = layout.world_size, layout.padded_numel
        self.ranges, self.sizes = [], [len(indices) for indices in groups]
        for b, indices in enumerate(groups):
            start = 0 if b == len(groups) - 1 else -(-layout.offsets[indices[0]] // N) * N
            self.ranges.append((start, end))
            end = start
        self.ready = [0] * len(groups)  # gradients arrived in this round
        self.launched = 0  # buckets launched in this round, a prefix
        self.in_flight = []  # the handles of the all-reduces launched, not yet waited for
        for b, indices in enumerate(groups):
            for index in indices:
                parameters[index].register_post_accumulate_grad_hook(functools.partial(self.gradient_ready, b))

    def gradient_ready(self, bucket, param):
        """Post-accumulate-grad hook: count the gradient (backward accumulated it into the flat
        gradient already); launch every bucket now complete, in order."""
        self.ready[bucket] += 1
        while self.launched < len(self.ranges) and self.ready[self.launched] == self.sizes[self.launched]:
            self.launch(self.launched)
        if self.launched == len(self.ranges):
            self.launched, self.ready = 0, [0] * len(self.ranges)  # a whole round: accumulation starts another

    def launch(self, bucket):
        start, end = self.ranges[bucket]
        if end > start:
            self.in_flight.append(background.start(self.all_reduce, bucket, start, end))
        self.launched += 1

    def all_reduce(self, bucket, start, end):
        """On the communication thread: the ring all-reduce (average) of the flat gradient's
        range [start, end), bucket ``bucket``'s."""
        with trace.span("all-reduce gradients", stage=bucket):
            collectives.ring_all_reduce(self.flat_grad[start:end], op="avg", check=False, group=self.group)

    def finish(self):
        """Launch the buckets of the round not launched yet (a parameter without a gradient
        counts zeros: its range of the flat gradient), then wait for every all-reduce."""
        if self.launched or any(self.ready):
            while self.launched < len(self.ranges):
                self.launch(self.launched)
            self.launched, self.ready = 0, [0] * len(self.ranges)
        self.wait()

    def wait(self):
        """Wait for the all-reduces in flight, in launch order."""
        for handle in self.in_flight:
            handle.wait()
        self.in_flight = []

    def discard(self):
        """Before the flat gradient is zeroed (``zero_grad``): wait, and forget the round begun."""
        self.wait()
        self.launched, self.ready = 0, [0] * len(self.ranges)
