# Generated from solutions/zero.py by `python -m parlab.exercises build`.
# Write your code where it raises NotImplementedError, then run `python -m parlab.grade zero`.
# parlab-generated sha256=590b48f7511cf1776e0292bc3668ca03894ffb508bddbfed42ee7c8d924224f4
"""Exercise: ZeRO stages 1 and 2: shard Adam's state, then the gradients, over N_d ranks.

Data parallelism keeps a whole replica of the model on each of the N_d ranks, and with it
the whole optimizer state: for Adam in fp32, K = 8 bytes per parameter (momentum and
variance), twice the parameters themselves. Yet once the gradients are averaged, every rank
computes the same update. ZeRO splits that work: rank r updates only its shard, 1 / N_d of
the parameters, keeps the optimizer state of that shard alone, and the ranks then all-gather
the updated shards. With Psi parameters in fp32, the bytes each rank holds:

    plain data parallelism                     4 Psi + 4 Psi + 8 Psi
    stage 1  ShardedOptimizer                  4 Psi + 4 Psi + 8 Psi / N_d
    stage 2  + reduce_scatter_gradients        4 Psi + (4 + 8) Psi / N_d

Stage 2 goes one step further: a rank that updates only its shard needs only its shard of
the averaged gradient. A reduce-scatter gives exactly that, for half the traffic of an
all-reduce, and the rest of the full gradient can be dropped.

The flat buffer (provided). The trainable parameters lie end to end in one flat buffer,
padded with zeros to a multiple of N_d and cut into N_d shards of ceil(Psi / N_d) elements
(``parlab.flat.FlatLayout``). Rank r owns shard r, as ``torch.distributed.reduce_scatter``
gives rank r chunk r: the chunk parlab's ring reduce-scatter leaves fully reduced on rank r,
and the one the ring all-gather sends from rank r. ``layout.shard(flat, rank)`` is the view of it in ``flat``.

    opt = ShardedOptimizer(model.parameters(), torch.optim.Adam, lr=1e-3)  # rank 0's weights
    opt.zero_grad()
    loss_fn(model(x_shard), y_shard).backward()     # each rank's mean loss over its shard
    # stage 1: average every p.grad over the ranks (an all-reduce, as DDP does), then
    opt.step()
    # stage 2, instead: reduce-scatter the gradients, keeping this rank's shard only, then
    opt.shard.grad = reduce_scatter_gradients(opt.params, opt.layout)
    opt.step()

Traffic. For a flat buffer of D = 4 x padded Psi bytes, a ring reduce-scatter or all-gather
makes each rank send (N_d - 1)/N_d D bytes, and an all-reduce twice that. Stage 2's
reduce-scatter of the gradients plus the all-gather of the parameters sends what DDP's
all-reduce sends: sharding costs no extra communication.

Communicate only with the provided ``reduce_scatter`` and ``all_gather`` (from
``parlab.flat``): they are traced, and the grader reads their traffic. Grade your work
with ``python -m parlab.grade zero`` (or ``parlab.check("zero")`` in a notebook).
"""

import torch
import torch.distributed as dist

from parlab.flat import FlatLayout, all_gather, reduce_scatter


class ShardedOptimizer:
    """ZeRO stage 1: ``optimizer_class`` (such as torch.optim.Adam) over this rank's shard of
    the parameters, on the default process group of N_d ranks.

    Provided: the constructor keeps the trainable parameters of ``params`` (those with
    ``requires_grad``) in ``self.params``, lays them out in ``self.layout`` (a
    ``FlatLayout`` of N_d = ``self.world_size`` shards) and copies them into ``self.flat``
    (1-D, padded), with rank 0's values on every rank. Every parameter then becomes a view
    into ``self.flat``: whatever writes into ``self.flat`` changes the model. Last, it calls
    ``build_optimizer`` with the optimizer's class and options.

    You write ``build_optimizer`` and ``step``.
    """

    def __init__(self, params, optimizer_class, **optimizer_kwargs):
        self.params = [p for p in params if p.requires_grad]
        if not self.params:
            raise ValueError("ShardedOptimizer got no trainable parameters (requires_grad=True): "
                             "pass model.parameters().")
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.layout = FlatLayout([p.shape for p in self.params], self.world_size)
        self.flat = self.layout.flatten([p.detach() for p in self.params])
        dist.broadcast(self.flat, src=0)  # the replicas start from rank 0's values
        for p, view in zip(self.params, self.layout.views(self.flat)):
            p.data = view
        self.build_optimizer(optimizer_class, **optimizer_kwargs)

    def build_optimizer(self, optimizer_class, **optimizer_kwargs):
        """Set ``self.shard``, a ``torch.nn.Parameter`` that is the VIEW of this rank's shard
        of ``self.flat`` (``self.layout.shard(self.flat, self.rank)``: shard r,
        ``self.layout.shard_numel`` elements), and ``self.optimizer``, an
        ``optimizer_class(..., **optimizer_kwargs)`` over ``[self.shard]`` alone.

        A view, so that the optimizer's in-place update lands in ``self.flat``, ready to be
        all-gathered. Over the shard alone, so that the optimizer's state (Adam's exp_avg and
        exp_avg_sq) holds K Psi / N_d bytes on each rank, not K Psi. Adam acts on each element
        separately, so stepping the N_d shards equals stepping the whole model.
        """
        raise NotImplementedError("build_optimizer is not implemented yet: the shard as a Parameter viewing self.flat, and the optimizer over it alone")

    def step(self):
        """Update the whole model with one step of the optimizer, each rank doing its shard.

        The gradients arrive averaged over the N_d ranks, in one of two ways:

        - stage 1: every ``p.grad`` of ``self.params`` holds the averaged gradient (after an
          all-reduce, as in DDP) and ``self.shard.grad`` is None: set ``self.shard.grad`` to
          this rank's shard of them, laid out like ``self.flat`` (``self.layout.flatten``);
        - stage 2: ``reduce_scatter_gradients`` has set ``self.shard.grad``: use it.

        Then ``self.optimizer.step()`` updates this rank's shard of ``self.flat`` in place,
        and ``all_gather(self.flat, self.layout)`` (provided, traced) brings every rank's
        updated shard to every rank, which updates the model: its parameters are views of
        ``self.flat``. Traffic: (N_d - 1)/N_d x 4 x padded Psi bytes sent per rank.
        """
        raise NotImplementedError("step is not implemented yet: the shard's gradient (stage 1), the optimizer's step, the all-gather")

    def zero_grad(self):
        """Drop every gradient, full and shard, before the next backward."""
        for p in self.params:
            p.grad = None
        self.shard.grad = None


def reduce_scatter_gradients(params, layout):
    """ZeRO stage 2: average the gradients over the N_d ranks, keeping this rank's shard only.

    ``params``: the tensors ``layout`` (a ``FlatLayout``) lays out, in its order, each
    ``p.grad`` holding this rank's gradient (of its mean loss over its shard of the batch).

    1. Flatten the gradients into a padded flat buffer (``layout.flatten``).
    2. ``reduce_scatter(flat, layout, rank)`` (provided, traced) averages it over the ranks
       and returns the view of this rank's shard: g[start:end] = (1 / N_d) sum_r g_r[start:end],
       the only part of the average this rank's optimizer reads.
    3. Keep a copy of that shard (a view would keep the whole flat buffer alive) and drop the
       full gradients: set every ``p.grad`` to None.

    Returns the gradient shard, ``layout.shard_numel`` elements (padding included), for
    ``ShardedOptimizer.shard.grad``. After it this rank holds 4 Psi / N_d bytes of gradient,
    not 4 Psi; each rank sent (N_d - 1)/N_d x 4 x padded Psi bytes, half an all-reduce.
    """
    raise NotImplementedError("reduce_scatter_gradients is not implemented yet: flatten, reduce-scatter, copy the own shard, drop the full gradients")
