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


import torch
import torch.distributed as dist

from parlab import background, collectives, trace
from parlab._hooks import weak_hook
from parlab.ddp import assign_buckets
from parlab.ddp.engine import regime_all_reduce
from parlab.units import MIB
from parlab.zero.formulas import stage2_peak_gradient_bytes

# Stage 0's first bucket when bucket_cap_mb is not given, torch DDP's (dist._DEFAULT_FIRST_BUCKET_BYTES)
FIRST_BUCKET_MB = 1


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
                parameters[index].register_post_accumulate_grad_hook(weak_hook(self.gradient_ready, bucket, index))

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
    gradients) cut into ranges that are all-reduced in place during backward, as
    ``parlab.ddp.DDP("bucketed")`` does: each range is launched on the rank's communication
    thread (``parlab.background``) as soon as backward has produced all its gradients, and the
    next gradients are computed meanwhile; ``finish`` waits for them. The all-reduce is DDP's
    choice for the regime (``parlab.ddp.engine.regime_all_reduce``): parlab's ring when the
    links are emulated or the run is traced (its bytes counted like every other stage's),
    torch's ``dist.all_reduce`` in real time otherwise.

    Gradients, as torch's DDP with ``gradient_as_bucket_view=True`` handles them: ``zero_grad``
    sets them to None, so backward hands each parameter a gradient of its own, which its hook
    divides by N_d into the parameter's view of the flat gradient (one pass over it; zeroing
    the flat gradient, adding into it and dividing after the all-reduce took three) and makes
    the view the parameter's gradient. Each range then holds this rank's share of the average,
    g_r / N_d, and its all-reduce, a sum, leaves the average. Every backward is one round:
    when it is over (a callback autograd makes at its end), a parameter it gave no gradient
    adds zeros, or what its view holds divided by N_d, and the buckets not launched yet are.
    A later backward without ``zero_grad`` (gradient accumulation) adds into the views, which
    hold the average so far, and the hook divides them: the round's sum leaves the average
    plus the new one. (Dividing before the sum rather than after changes no bit when N_d is a
    power of two, and otherwise only the rounding.)

    The buckets are stage 2's (``assign_buckets``, reverse order, up to ``bucket_cap_mb``), but
    for the first, which closes once it holds ``first_bucket_mb`` if given
    (``assign_buckets_with_first``); bucket b's range ends where bucket b - 1's begins (the
    first ends at padded Psi) and begins at its first parameter's offset rounded up to a
    multiple of N_d (the last begins at 0). So every range holds a multiple of N_d elements, a
    ring moves it in equal chunks and each rank sends 2 (N_d - 1)/N_d of it: over all ranges,
    exactly one ring all-reduce of padded Psi. (The few elements a rounding leaves out go with
    the next range; a range left empty is skipped.) With one bucket the range is the whole
    buffer, chunked as its N_d shards."""

    def __init__(self, parameters, layout, flat_grad, bucket_cap_mb, first_bucket_mb=None, group=None):
        self.flat_grad, self.group, self.world_size = flat_grad, group, layout.world_size
        self.sum_in_place = regime_all_reduce(group, ring_when_traced=True)  # chosen once, as DDP chooses
        sizes = [p.numel() * p.element_size() for p in parameters]
        groups = (assign_buckets(sizes, bucket_cap_mb * MIB) if first_bucket_mb is None
                  else assign_buckets_with_first(sizes, first_bucket_mb * MIB, bucket_cap_mb * MIB))
        groups = [sorted(indices) for indices in groups]
        N, end = layout.world_size, layout.padded_numel
        self.ranges, self.sizes = [], [len(indices) for indices in groups]
        for b, indices in enumerate(groups):
            start = 0 if b == len(groups) - 1 else -(-layout.offsets[indices[0]] // N) * N
            self.ranges.append((start, end))
            end = start
        self.parameters, self.views = parameters, layout.views(flat_grad)
        self.in_flight = []  # the handles of the all-reduces launched, not yet waited for
        self.new_round()
        for b, indices in enumerate(groups):
            for index in indices:
                parameters[index].register_post_accumulate_grad_hook(weak_hook(self.gradient_ready, b, index))

    def new_round(self):
        self.begun = False  # a gradient of this backward arrived (and end_of_backward is queued)
        self.reported = [False] * len(self.parameters)  # got a gradient in this backward
        self.ready = [0] * len(self.ranges)  # gradients arrived in this backward, per bucket
        self.launched = 0  # buckets launched in this backward, a prefix

    def gradient_ready(self, bucket, index, param):
        """Post-accumulate-grad hook: this rank's share of the gradient into the parameter's
        view (``share``), then launch every bucket now complete, in order. The backward's
        first gradient has autograd call ``end_of_backward`` when the backward is over."""
        if not self.begun:  # autograd's queue of calls at the end of this backward, as torch's FSDP uses it
            torch.autograd.Variable._execution_engine.queue_callback(self.end_of_backward)
            self.begun = True
        self.share(index)
        self.reported[index] = True
        self.ready[bucket] += 1
        while self.launched < len(self.ranges) and self.ready[self.launched] == self.sizes[self.launched]:
            self.launch(self.launched)

    def share(self, index):
        """Parameter ``index``'s gradient, divided by N_d, into its view of the flat gradient,
        which becomes its gradient: backward's own gradient divided into it, or a view that
        backward accumulated into divided in place; none (no gradient since ``zero_grad``): zeros."""
        param, view = self.parameters[index], self.views[index]
        if param.grad is None:
            view.zero_()
        elif param.grad.data_ptr() == view.data_ptr():
            view.div_(self.world_size)
        else:
            torch.div(param.grad, self.world_size, out=view)
        param.grad = view

    def end_of_backward(self):
        """Autograd's callback at the end of a backward: the parameters that got no gradient in
        it share what they hold (``share``), the buckets not launched yet are, in order."""
        for index, reported in enumerate(self.reported):
            if not reported:
                self.share(index)
        while self.launched < len(self.ranges):
            self.launch(self.launched)
        self.new_round()

    def launch(self, bucket):
        start, end = self.ranges[bucket]
        if end > start:
            self.in_flight.append(background.start(self.all_reduce, bucket, start, end))
        self.launched += 1

    def all_reduce(self, bucket, start, end):
        """On the communication thread: the all-reduce (sum) of the flat gradient's range
        [start, end), bucket ``bucket``'s, which holds each rank's share of the average."""
        with trace.span("all-reduce gradients", stage=bucket):
            self.sum_in_place(self.flat_grad[start:end])

    def finish(self):
        """Wait for every all-reduce. A parameter without a gradient since ``zero_grad`` (no
        backward ran) gets its view, zeroed."""
        self.wait()
        for index, param in enumerate(self.parameters):
            if param.grad is None:
                self.share(index)

    def wait(self):
        """Wait for the all-reduces in flight, in launch order."""
        for handle in self.in_flight:
            handle.wait()
        self.in_flight = []

    def discard(self):
        """``zero_grad``: wait, then set the gradients to None, as torch's ``zero_grad`` does
        (the next backward hands over gradients of its own)."""
        self.wait()
        self.new_round()
        for param in self.parameters:
            param.grad = None


def assign_buckets_with_first(sizes_in_bytes, first_bucket_bytes, bucket_cap_bytes):
    """Stage 0's buckets, as torch's DDP makes them: the first takes the last parameters (whose
    gradients backward makes first) until it holds ``first_bucket_bytes``, the gradient that
    reaches it included; the rest go to ``assign_buckets`` with ``bucket_cap_bytes``. With
    torch's defaults (1 MiB, then 25 MiB; ``ZeroDP``'s when ``bucket_cap_mb`` is not given) a
    model over 1 MiB has its first all-reduce launched once its last layer's gradients exist,
    while backward computes the others; in one bucket of up to 25 MiB, it would only start
    after backward. E.g. sizes [264, 144, 24], first 100, cap 1000: [[2, 1], [0]]."""
    count = len(sizes_in_bytes)
    first, held = count, 0
    while first and held < first_bucket_bytes:
        first -= 1
        held += sizes_in_bytes[first]
    first_bucket = [list(reversed(range(first, count)))] if first < count else []
    return first_bucket + assign_buckets(sizes_in_bytes[:first], bucket_cap_bytes)
