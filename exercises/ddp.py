# Generated from solutions/ddp.py by `python -m parlab.course.exercises build`.
# Write your code where it raises NotImplementedError, then run `parlab grade ddp`.
# parlab-generated sha256=59a6dcc4c065b6cbff64885da4bdb7a6d6ed675bfb99e0da8e8b6e98ab27ea63
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

Stuck? ``parlab.hint("ddp.bucketed_ddp")`` in a notebook (or ``parlab hint
ddp.bucketed_ddp``) opens a hint, one level at a time. Grade your work with
``parlab grade ddp`` (or ``parlab.check("ddp.bucketed_ddp")`` in a notebook).
"""

import torch
import torch.distributed as dist

from parlab import trace
from parlab.units import MIB  # bucket_cap_mb counts mebibytes, as torch's


def assign_buckets(sizes_in_bytes, bucket_cap_bytes):
    """Group parameters into buckets: a list of lists of indices into ``sizes_in_bytes``
    (the signature of ``parlab.ddp.assign_buckets``, which parlab's DDP uses).

    ``sizes_in_bytes[i]`` is the size of parameter i's gradient, parameters in registration
    order (``module.parameters()``). Buckets are filled in REVERSE order, last parameter
    first. A bucket closes when adding the next parameter would take it over
    ``bucket_cap_bytes`` (a bucket may be exactly full); a parameter larger than the cap gets
    a bucket of its own. Each bucket lists its indices in the order they were added
    (descending).

    E.g. sizes [264, 144, 24] with a cap of 168 bytes: [[2, 1], [0]] (168 and 264 bytes);
    with a cap of 0, one bucket per parameter [[2], [1], [0]]; with an infinite cap
    (``math.inf``), one bucket [[2, 1, 0]]; no parameters, no buckets: [].
    """
    if bucket_cap_bytes < 0:
        raise ValueError(f"bucket_cap_bytes must be at least 0, got {bucket_cap_bytes}.")
    raise NotImplementedError("assign_buckets is not implemented yet: the buckets, last parameter first")


class BucketedDDP(torch.nn.Module):
    """Wrap ``module`` for data-parallel training on the default process group (N_d ranks).

    Provided: the constructor broadcasts rank 0's parameters and buffers (the replicas
    start equal), keeps the trainable parameters (``requires_grad``; a tied parameter is
    listed once) in ``self.parameters_to_sync``, and plans the buckets:
    ``self.buckets[k]`` is the list of parameters of bucket k, from ``assign_buckets`` with
    a cap of ``bucket_cap_mb`` MiB. Then it calls ``register_gradient_hooks``.

    You write the three methods below. The contract of one step:

    - during backward, as soon as the last gradient of bucket k is ready, the bucket's
      gradients travel as ONE flat tensor through ONE ``launch_all_reduce``; buckets are
      launched in order 0, 1, 2, ... on every rank (a bucket full before the one ahead of it
      waits for it), so that every rank issues the same sequence of all-reduces;
    - after ``finish_gradient_synchronization()`` (called after backward, before
      ``optimizer.step()``) every ``param.grad`` of ``self.parameters_to_sync`` holds the
      average over the N_d ranks, g = (1 / N_d) sum_r g_r, and the next step starts afresh.

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
            [self.parameters_to_sync[i] for i in indices] for indices in assign_buckets(sizes, bucket_cap_mb * MIB)
        ]
        self.register_gradient_hooks()

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def register_gradient_hooks(self):
        """Set up the state a step needs and register ``self.gradient_ready`` as the
        post-accumulate-grad hook of every parameter in ``self.parameters_to_sync``."""
        raise NotImplementedError("register_gradient_hooks is not implemented yet: the state of a step, then the hooks")

    def gradient_ready(self, param):
        """The hook: ``param.grad`` holds this backward's gradient. Launches every bucket
        that is now ready to go, in bucket order (see the class's contract)."""
        raise NotImplementedError("gradient_ready is not implemented yet: launch what is ready")

    def finish_gradient_synchronization(self):
        """After backward: every ``param.grad`` becomes the average over the N_d ranks
        (the all-reduce sums), and the state is ready for the next step."""
        raise NotImplementedError("finish_gradient_synchronization is not implemented yet: the averaged gradients")


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
