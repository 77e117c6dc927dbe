"""Data parallelism (DDP) from scratch: every rank holds a whole replica of the model, reads
its own shard of each batch, and the ranks average their gradients before every optimizer
step, so the N_d replicas take the same step and stay equal.

    model = DDP(model, variant="bucketed", bucket_cap_mb=25)   # broadcasts rank 0's weights
    loss_fn(model(x_shard), y_shard).backward()                  # all-reduces start here...
    model.finish_gradient_synchronization()                      # ...and are waited for here
    optimizer.step()

With a mean loss over each shard of B / N_d samples, the averaged gradient
g = (1 / N_d) sum_r g_r is the gradient of the mean loss over the whole batch of B samples.

The four variants of the lecture differ in two choices only: how gradients are grouped into
buckets (one all-reduce per bucket) and when a bucket's all-reduce is launched.

    variant        buckets                         launched
    "naive"        one per parameter               after backward, one at a time
    "flat"         one for all parameters          after backward
    "overlapped"   one per parameter               during backward, as each gradient is ready
    "bucketed"     up to bucket_cap_mb each        during backward, as each bucket is full

Fewer, larger buckets pay the per-message latency (alpha) fewer times; launching during
backward hides communication behind the gradients still being computed. "bucketed" gets
both, as torch's ``DistributedDataParallel`` does (Li et al. 2020). torch 2.13 plans its
buckets a little differently (``torch/nn/parallel/distributed.py``): a bucket closes once it
reaches the cap, the first one is 1 MiB under the default cap, and after a first step with
one bucket for all it rebuilds them in the order the gradients arrived.

Communication is traced: each all-reduce records one "all_reduce" comm event (bytes of the
bucket, start at launch, end when waited for), so ``cluster.trace`` shows how many
all-reduces a step makes, in what order, and whether they overlap backward.

The engines share one set of method names (DDP; ZeroDP and FSDP of ``parlab.zero``;
``parlab.zero.ShardedOptimizer`` is an optimizer, used after DDP):

    method                               DDP                     ZeroDP, FSDP
    engine(x)                            the module's forward    the same (FSDP gathers units)
    finish_gradient_synchronization()    wait for the averages   ZeroDP: wait (stage 1: RS); FSDP: nothing left
    step()                               none: optimizer.step()  the engine's optimizer (if built with one)
    zero_grad()                          the module's gradients  the engine's gradients
    no_sync()                            accumulate locally      FSDP accumulates locally
    full_parameters()                    {name: parameter}       {name: full parameter}, gathered
    model_state_bytes()                  params, grads, buckets  the rank's shards and state
"""

import functools
import math
from contextlib import contextmanager

import torch
import torch.distributed as dist

from parlab import background, collectives, p2p, trace
from parlab._checks import place_in, real_number
from parlab._hooks import weak_hook
from parlab.memory import measure_model_state
from parlab.runtime import emulation
from parlab.units import MIB  # bucket_cap_mb counts mebibytes, as torch's

# variant -> (the bucket cap in MiB, launched during backward?). A cap of 0 gives every
# parameter a bucket of its own, an infinite cap one bucket for all.
VARIANTS = {
    "naive": (0, False),
    "flat": (math.inf, False),
    "overlapped": (0, True),
    "bucketed": (None, True),  # None: the bucket_cap_mb argument
}


def assign_buckets(sizes_in_bytes, bucket_cap_bytes):
    """Group parameters into buckets: a list of lists of indices into ``sizes_in_bytes``.

    ``sizes_in_bytes[i]`` is the size of parameter i's gradient, parameters in registration
    order (``module.parameters()``). Buckets are filled in REVERSE order, because backward
    produces the gradients of the last layers first, so the first bucket is ready first. A
    bucket closes when adding the next parameter would take it over ``bucket_cap_bytes`` (a
    bucket may be exactly full; torch's DDP closes one once it reaches the cap, so its buckets
    may pass it by one gradient); a parameter larger than the cap gets a bucket of its own.
    Each bucket lists its indices in the order they were added (descending).

    E.g. sizes [264, 144, 24] with a cap of 168 bytes: [[2, 1], [0]], all-reduces of 168 and
    264 bytes. A cap of 0 gives every parameter a bucket of its own, ``math.inf`` one bucket
    for all; no parameters, no buckets. DDP's ``bucket_cap_mb`` is ``bucket_cap_bytes / MIB``.
    """
    real_number("bucket_cap_bytes (the size of a bucket in bytes)", bucket_cap_bytes,
                "pass a number of bytes, e.g. 25 * MIB (25 MiB, torch's default); 0 gives every parameter a bucket "
                "of its own, math.inf one bucket for all.", infinite=True)
    for i, nbytes in enumerate(sizes_in_bytes):
        real_number(f"sizes_in_bytes[{i}] (a gradient's size in bytes)", nbytes,
                    "pass each parameter's gradient size in bytes, p.numel() * p.element_size().")
    buckets, size = [], 0
    for index in reversed(range(len(sizes_in_bytes))):
        if not buckets or size + sizes_in_bytes[index] > bucket_cap_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(index)
        size += sizes_in_bytes[index]
    return buckets


def trainable_parameters(module):
    """``[(name, parameter)]`` of the parameters whose gradients DDP averages, in registration
    order: those with ``requires_grad`` (frozen ones are left alone), a tied parameter once."""
    named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
    if not named:
        raise ValueError(
            "the module has no trainable parameters (all have requires_grad=False): there are no "
            "gradients to average; unfreeze at least one parameter."
        )
    return named


class DDP(torch.nn.Module):
    """Wrap ``module`` for data-parallel training over ``group`` (N_d ranks; default: all of
    them), e.g. ``mesh.group("dp")`` of a ``parlab.Mesh``.

    Construction broadcasts the group's first rank's parameters and buffers to its other
    ranks, so the replicas start equal; the ranks must then build the same module. Gradients of the trainable
    parameters (``requires_grad``) are averaged; frozen ones are left alone, and a
    parameter reachable twice (tied weights) is one parameter, reduced once.

    variant: "naive" | "flat" | "overlapped" | "bucketed" (table above); ``bucket_cap_mb``
    is used by "bucketed".
    all_reduce: ``all_reduce(tensor)`` sums ``tensor`` in place over the group. It may
    return a handle to ``wait()`` for (asynchronous; the default, ``regime_all_reduce(group,
    async_op=True)``, is ``dist.all_reduce`` with ``async_op=True``, or, when the cluster
    emulates its links, parlab's ring all-reduce on the rank's communication thread,
    ``parlab.background``, so that its messages pay the link's time) or return when done
    (e.g. ``parlab.collectives.ring_all_reduce``: each bucket is then reduced inside backward,
    and its sends and receives show up in the trace too).
    comm_hook: ``comm_hook(bucket) -> reduced bucket``, the flat 1-D bucket of this rank's
    gradients in, their average over ranks out (or a handle whose ``wait()`` returns it,
    e.g. a ``torch.futures.Future``). Default: sum with ``all_reduce``, divide by N_d. A
    custom hook (compression: reduce in fp16, ...) does its own communication, so it
    cannot be combined with ``all_reduce``.
    broadcast_buffers: also broadcast the first rank's buffers at every forward (torch's default),
    so buffers such as BatchNorm statistics stay equal.

    Wrap a module once: the gradient hooks stay on its parameters. Every rank must use the
    same parameters in each step (a parameter without a gradient contributes zeros).
    """

    def __init__(self, module, variant="bucketed", bucket_cap_mb=25, all_reduce=None, comm_hook=None,
                 broadcast_buffers=True, group=None):
        super().__init__()
        if not isinstance(module, torch.nn.Module):
            raise ValueError(f"DDP wraps a torch.nn.Module, got {type(module).__name__}: pass the model itself.")
        if not isinstance(variant, str) or variant not in VARIANTS:
            raise ValueError(f"variant must be one of {', '.join(map(repr, VARIANTS))}; got {variant!r}: pick one "
                             "of them (\"bucketed\" is torch's DDP).")
        real_number("bucket_cap_mb (the size of a bucket in MiB)", bucket_cap_mb,
                    "a bucket must hold something: pass a number of MiB such as 25, torch's default.", above=True,
                    infinite=True)
        for name, function in (("all_reduce", all_reduce), ("comm_hook", comm_hook)):
            if function is not None and not callable(function):
                raise ValueError(f"{name} must be a function, got {function!r}: pass e.g. "
                                 f"{'parlab.collectives.ring_all_reduce' if name == 'all_reduce' else 'a comm hook'}"
                                 " itself, not its result.")
        if all_reduce is not None and comm_hook is not None:
            raise ValueError(
                "pass all_reduce or comm_hook, not both: all_reduce is what the default comm hook "
                "calls, a custom comm_hook does its own communication."
            )
        self.module = module
        self.parameters_to_sync = [p for _, p in trainable_parameters(module)]
        if len({p.dtype for p in self.parameters_to_sync}) > 1:
            raise ValueError("a bucket holds one dtype: convert the module to one dtype first, e.g. module.float().")
        self.variant, self.broadcast_buffers = variant, broadcast_buffers
        self.all_reduce = all_reduce or regime_all_reduce(group, async_op=True)
        self.comm_hook = comm_hook or self.average_with_all_reduce
        self.group = group
        _, self.world_size = place_in(group, "build DDP only on the group's members (each rank passes the group it "
                                             "belongs to).")
        p2p.broadcast_from_first([*module.parameters(), *module.buffers()], group)

        cap_mb, during_backward = VARIANTS[variant]
        sizes = [p.numel() * p.element_size() for p in self.parameters_to_sync]
        self.buckets = [
            Bucket([self.parameters_to_sync[i] for i in indices])
            for indices in assign_buckets(sizes, (bucket_cap_mb if cap_mb is None else cap_mb) * MIB)
        ]
        if during_backward:
            for bucket in self.buckets:
                for p in bucket.parameters:
                    p.register_post_accumulate_grad_hook(weak_hook(self._gradient_ready, bucket))
        self.launched = 0  # buckets launched so far in this step, always a prefix of self.buckets
        self.require_gradient_sync = True

    def extra_repr(self):
        return f"variant={self.variant!r}, bucket bytes={[bucket.buffer.nbytes for bucket in self.buckets]}"

    def forward(self, *args, **kwargs):
        if self.broadcast_buffers:
            p2p.broadcast_from_first(list(self.module.buffers()), self.group)
        with trace.span("forward"):
            return self.module(*args, **kwargs)

    def _gradient_ready(self, bucket, param):
        """Post-accumulate-grad hook of ``param``: autograd calls it with the PARAMETER once
        its ``param.grad`` holds this backward's whole gradient (a tied parameter's uses
        summed). The gradient is ``param.grad``: a hook that all-reduced ``param`` or
        ``param.data`` instead would sync the weights, which are equal already, and leave
        each rank's gradient local: every rank would step with its own shard's gradient
        and the replicas would drift apart.

        A bucket is launched when its last gradient is ready; buckets are launched in order
        so that every rank issues the same sequence of all-reduces, as torch's DDP does."""
        if not self.require_gradient_sync:
            return
        bucket.ready += 1
        while self.launched < len(self.buckets) and self.buckets[self.launched].is_full():
            self._launch(self.buckets[self.launched])

    def _launch(self, bucket):
        bucket.copy_gradients_in()
        bucket.reduction = self.comm_hook(bucket.buffer)
        self.launched += 1

    def finish_gradient_synchronization(self):
        """Call after backward, before ``optimizer.step()``: launch the buckets not launched
        yet (all of them for "naive" and "flat"), wait for every all-reduce in bucket order
        and write the averaged gradients back into ``param.grad``. Inside ``no_sync`` it does
        nothing."""
        if not self.require_gradient_sync:
            return
        for index, bucket in enumerate(self.buckets):
            if index == self.launched:
                self._launch(bucket)
            reduced = bucket.reduction.wait() if hasattr(bucket.reduction, "wait") else bucket.reduction
            bucket.copy_gradients_out(reduced)
            bucket.ready, bucket.reduction = 0, None
        self.launched = 0

    def full_parameters(self):
        """{name: parameter}, frozen ones included: a copy of this rank's replica (equal on every
        rank), as ZeroDP's and FSDP's ``full_parameters()`` give theirs."""
        return {name: p.detach().clone() for name, p in self.module.named_parameters()}

    def full_gradients(self):
        """{name: averaged gradient} of the trainable parameters (after
        ``finish_gradient_synchronization``; every rank holds them whole)."""
        return {name: p.grad.detach().clone() for name, p in self.module.named_parameters()
                if p.requires_grad and p.grad is not None}

    def model_state_bytes(self):
        """The ``parlab.memory.ModelState`` of this rank, measured: params = the whole replica,
        grads = the module's gradients and the buckets' flat buffers (each bucket's copy of its
        gradients: 4 Psi more in fp32), optimizer = 0 (DDP holds no optimizer: yours does)."""
        grads = [p.grad for p in self.module.parameters()] + [bucket.buffer for bucket in self.buckets]
        return measure_model_state(self.module.parameters(), grads, [])

    @contextmanager
    def no_sync(self):
        """Gradient accumulation: backward passes inside only accumulate into ``param.grad``
        on this rank, with no communication; the next backward outside (and its
        ``finish_gradient_synchronization``) averages the accumulated sums once.

        Loss scaling: with M micro-batches per step (the synced one included), divide each
        micro-batch's mean loss by M; the average over ranks divides by N_d. The result is
        the gradient of the mean loss over all M x N_d micro-batches, i.e. the full batch."""
        self.require_gradient_sync = False
        try:
            yield
        finally:
            self.require_gradient_sync = True

    def average_with_all_reduce(self, bucket):
        """The default comm hook: start ``all_reduce(bucket)`` and return a handle whose
        ``wait()`` returns the bucket summed over the ranks and divided by N_d."""
        return AllReduceInFlight(bucket, self.all_reduce, self.world_size)


class Bucket:
    """Parameters whose gradients travel together: copied into one flat buffer, reduced by
    one all-reduce, copied back. (torch's ``gradient_as_bucket_view=True`` skips the copies
    by making each ``param.grad`` a view into the buffer.)"""

    def __init__(self, parameters):
        self.parameters = parameters
        self.numels = [p.numel() for p in parameters]
        self.buffer = torch.zeros(sum(self.numels), dtype=parameters[0].dtype, device=parameters[0].device)
        self.ready = 0  # gradients ready in this backward
        self.reduction = None  # what the comm hook returned

    def is_full(self):
        return self.ready == len(self.parameters)

    def copy_gradients_in(self):
        # A parameter this step did not use has no gradient: it contributes zeros.
        for p, piece in zip(self.parameters, self.buffer.split(self.numels)):
            if p.grad is None:
                piece.zero_()
            else:
                piece.copy_(p.grad.reshape(-1))

    def copy_gradients_out(self, reduced):
        for p, piece in zip(self.parameters, reduced.split(self.numels)):
            if p.grad is None:
                p.grad = piece.view_as(p).clone()
            else:
                p.grad.copy_(piece.view_as(p))


class AllReduceInFlight:
    """An all-reduce of a bucket, started and perhaps not finished. ``wait()`` waits for it,
    records one "all_reduce" comm event (bytes of the bucket, from launch to now) and
    returns the bucket divided by N_d: the average."""

    def __init__(self, bucket, all_reduce, world_size):
        self.bucket, self.world_size = bucket, world_size
        self.start = trace.now()
        self.work = all_reduce(bucket)

    def wait(self):
        if hasattr(self.work, "wait"):
            self.work.wait()
        nbytes = self.bucket.numel() * self.bucket.element_size()
        trace.record_comm("all_reduce", None, nbytes, self.start, trace.now())
        return self.bucket.div_(self.world_size)


def regime_all_reduce(group=None, async_op=False, ring_when_traced=False):
    """``all_reduce(bucket)``, the all-reduce that sums a bucket of gradients in place over
    ``group`` in this rank's regime (``parlab.runtime.emulation``): when the cluster emulates
    its links, parlab's ring (``collectives.ring_all_reduce``), whose messages pay the link's
    time and show in the trace, so the lectures' timelines hold; in real time, torch's
    ``dist.all_reduce``, one gloo (or NCCL) call per bucket as torch's DDP makes (on 2 to 4 CPU
    ranks the ring's Python loop of sends and receives takes 1.15 to 1.7 times as long for a
    bucket of 16 MiB). ``all_reduce`` returns when done, or with ``async_op=True`` at once, with
    a handle to ``wait()`` for (the ring then runs on the rank's communication thread,
    ``parlab.background``). With ``ring_when_traced``, also parlab's ring inside
    ``cluster.trace`` (chosen when it is called: build the engine inside the traced function),
    so that the trace counts the bytes. DDP's default ``all_reduce``; ZeroDP's stage 0 reduces
    its buckets with it, ring when traced: lecture 04 counts every stage's bytes in the trace."""
    if emulation.shapes_links() or (ring_when_traced and trace.recording()):
        ring = functools.partial(collectives.ring_all_reduce, check=False, group=group)
        return functools.partial(background.start, ring) if async_op else ring
    return functools.partial(dist.all_reduce, async_op=async_op, group=group)


