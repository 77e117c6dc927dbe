"""Exercise: bucketed DDP that overlaps communication with backward, like torch's DistributedDataParallel.

Every rank holds a whole replica of the model and computes the gradient of the mean loss
over its own shard of the batch; before each optimizer step the N_d ranks average their
gradients, g = (1 / N_d) sum_r g_r, so that every replica takes the same step: the step one
process would take on the whole batch.

    model = BucketedDDP(model, bucket_cap_mb=25)   # rank 0's weights are broadcast (provided)
    loss_fn(model(x_shard), y_shard).backward()    # buckets are all-reduced during backward...
    model.finish_gradient_synchronization()        # ...and waited for here
    optimizer.step()

Buckets. One all-reduce per parameter pays the per-message latency (alpha) once per
parameter; one all-reduce of everything waits for the whole backward. So the gradients
travel in buckets of about ``bucket_cap_mb`` MiB, filled in REVERSE registration order:
backward produces the last layers' gradients first, so the first bucket is ready first
(``assign_buckets``).

Overlap. A bucket's all-reduce is launched, asynchronously, as soon as the last gradient of
that bucket is ready, while backward goes on computing the earlier layers' gradients. You
learn that a gradient is ready from a hook that torch calls during backward:
``param.register_post_accumulate_grad_hook(hook)`` calls ``hook(param)`` with the PARAMETER
(not its gradient) once ``param.grad`` holds this backward's whole gradient.

Launch every all-reduce with ``launch_all_reduce(flat)`` below: it starts
``dist.all_reduce(flat, async_op=True)`` and records the call in ``parlab.trace``, where the
grader counts your all-reduces, their sizes and when they start.

Grade your work with ``python -m parlab.grade ddp`` (or ``parlab.check("ddp.bucketed_ddp")``
in a notebook).
"""

import torch
import torch.distributed as dist

from parlab import trace

MB = 1024 * 1024  # bucket_cap_mb counts mebibytes, as torch's


def assign_buckets(sizes_in_bytes, bucket_cap_bytes):
    """Group parameters into buckets: a list of lists of indices into ``sizes_in_bytes``.

    ``sizes_in_bytes[i]`` is the size of parameter i's gradient, parameters in registration
    order (``module.parameters()``). Walk them in REVERSE order (i = n - 1, ..., 0), adding
    each to the current bucket; start a new bucket when adding the parameter would take the
    current one over ``bucket_cap_bytes`` (a bucket may be exactly full). A parameter larger
    than the cap gets a bucket of its own. Each bucket lists its indices in the order they
    were added (descending).

    E.g. sizes [264, 144, 24] with a cap of 168 bytes: [[2, 1], [0]] (168 and 264 bytes);
    with a cap of 0, one bucket per parameter [[2], [1], [0]]; with an infinite cap
    (``math.inf``), one bucket [[2, 1, 0]]; no parameters, no buckets: [].
    """
    if bucket_cap_bytes < 0:
        raise ValueError(f"bucket_cap_bytes must be at least 0, got {bucket_cap_bytes}.")
    # BEGIN SOLUTION: walk the sizes in reverse, closing a bucket when the next one would not fit
    buckets, size = [], 0
    for index in reversed(range(len(sizes_in_bytes))):
        if not buckets or size + sizes_in_bytes[index] > bucket_cap_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(index)
        size += sizes_in_bytes[index]
    return buckets
    # END SOLUTION


class BucketedDDP(torch.nn.Module):
    """Wrap ``module`` for data-parallel training on the default process group (N_d ranks).

    Provided: the constructor broadcasts rank 0's parameters and buffers (the replicas
    start equal), keeps the trainable parameters (``requires_grad``; a tied parameter is
    listed once) in ``self.parameters_to_sync``, and plans the buckets:
    ``self.buckets[k]`` is the list of parameters of bucket k, from ``assign_buckets`` with
    a cap of ``bucket_cap_mb`` MiB. Then it calls ``register_gradient_hooks``.

    You write:

    - ``register_gradient_hooks()``: the state of a step (how many gradients of each bucket
      are ready, the all-reduces in flight) and one post-accumulate-grad hook per parameter
      of ``self.parameters_to_sync``, calling ``self.gradient_ready``.
    - ``gradient_ready(param)``: count ``param``'s gradient as ready; when a bucket's last
      gradient is ready, copy the bucket's gradients (``param.grad``) into one flat tensor
      (``torch.cat`` of ``p.grad.reshape(-1)``) and ``launch_all_reduce`` it. Launch the
      buckets in order 0, 1, 2, ...: if bucket k fills before bucket k - 1, launch it once
      k - 1 is launched, so that every rank issues the same sequence of all-reduces.
    - ``finish_gradient_synchronization()``: called after backward, before
      ``optimizer.step()``. Wait for every bucket's all-reduce, in bucket order; divide the
      sum by N_d and copy each parameter's piece back into its ``param.grad``
      (``flat.split(numels)``, ``view_as(param)``); reset the state for the next step.

    Every rank uses every trainable parameter in every step (each gets a gradient). The
    weights are never communicated after the constructor: only gradients are.
    """

    def __init__(self, module, bucket_cap_mb=25):
        super().__init__()
        if not bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb must be positive, got {bucket_cap_mb}; 25 is torch's default.")
        self.module = module
        self.world_size = dist.get_world_size()
        self.parameters_to_sync = [p for p in module.parameters() if p.requires_grad]
        broadcast_from_rank0([*module.parameters(), *module.buffers()])
        sizes = [p.numel() * p.element_size() for p in self.parameters_to_sync]
        self.buckets = [
            [self.parameters_to_sync[i] for i in indices] for indices in assign_buckets(sizes, bucket_cap_mb * MB)
        ]
        self.register_gradient_hooks()

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def register_gradient_hooks(self):
        """Set up the per-step state and register ``self.gradient_ready`` as the
        post-accumulate-grad hook of every parameter in ``self.parameters_to_sync``."""
        # BEGIN SOLUTION: per-step state, then one register_post_accumulate_grad_hook per parameter
        self.bucket_of = {id(p): k for k, bucket in enumerate(self.buckets) for p in bucket}
        self.ready = [0] * len(self.buckets)  # gradients ready per bucket in this backward
        self.in_flight = []  # one launch_all_reduce handle per launched bucket, in bucket order
        for p in self.parameters_to_sync:
            p.register_post_accumulate_grad_hook(self.gradient_ready)
        # END SOLUTION

    def gradient_ready(self, param):
        """The hook: ``param.grad`` is ready. Launch every bucket, in order, whose gradients
        are all ready and that is not launched yet."""
        # BEGIN SOLUTION: count param as ready, then launch the full buckets in order
        self.ready[self.bucket_of[id(param)]] += 1
        while len(self.in_flight) < len(self.buckets):
            bucket = self.buckets[len(self.in_flight)]
            if self.ready[len(self.in_flight)] < len(bucket):
                break
            self.in_flight.append(launch_all_reduce(torch.cat([p.grad.reshape(-1) for p in bucket])))
        # END SOLUTION

    def finish_gradient_synchronization(self):
        """Wait for every bucket's all-reduce in order, write the average (sum / N_d) back
        into each ``param.grad``, and reset the state for the next step."""
        # BEGIN SOLUTION: wait, divide by N_d, copy back into param.grad, reset
        for bucket, handle in zip(self.buckets, self.in_flight, strict=True):
            flat = handle.wait() / self.world_size
            for p, piece in zip(bucket, flat.split([p.numel() for p in bucket])):
                p.grad.copy_(piece.view_as(p))
        self.ready = [0] * len(self.buckets)
        self.in_flight = []
        # END SOLUTION


# --- Provided ------------------------------------------------------------------------------


def launch_all_reduce(flat):
    """Start ``dist.all_reduce(flat, async_op=True)``: a sum over the ranks, in place.

    Returns at once a handle whose ``wait()`` waits for the all-reduce to finish and returns
    ``flat``, now holding the sum. Traced: each call records one "all_reduce" comm event
    (bytes of ``flat``, from launch to wait).
    """
    return AllReduceInFlight(flat)


class AllReduceInFlight:
    """An all-reduce of ``flat``, started and perhaps not finished (see ``launch_all_reduce``)."""

    def __init__(self, flat):
        self.flat = flat
        self.start = trace.now()
        self.work = dist.all_reduce(flat, async_op=True)

    def wait(self):
        self.work.wait()
        trace.record_comm("all_reduce", None, self.flat.numel() * self.flat.element_size(), self.start, trace.now())
        return self.flat


def broadcast_from_rank0(tensors):
    """Overwrite each tensor with rank 0's copy."""
    for tensor in tensors:
        dist.broadcast(tensor.detach(), src=0)
