# Generated from solutions/zero.py by `python -m parlab.course.exercises build`.
# Write your code where it raises NotImplementedError, then run `parlab grade zero`.
# parlab-generated sha256=652cda2d21466fa6ddfd1236d0a8f44e6707b7613ce0c82745015b83ce204dd8
"""Exercise: ZeRO stages 1 and 2: shard Adam's state, then the gradients, over N_d ranks.

Data parallelism keeps a whole replica of the model on each of the N_d ranks, and with it
the whole optimizer state: for Adam in fp32, kappa = 8 bytes per parameter (momentum and
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
and the one the ring all-gather sends from rank r. ``layout.shard(flat, rank)`` is the view
of it in ``flat``. The names are those of ``parlab.zero.ZeroDP``, the engine the lecture
shows: ``trainable``, ``flat_param``, ``layout``, ``shard``, ``optimizer``.

    opt = ShardedOptimizer(model.parameters(), torch.optim.Adam, lr=1e-3)  # rank 0's weights
    opt.zero_grad()
    loss_fn(model(x_shard), y_shard).backward()     # each rank's mean loss over its shard
    # stage 1: average every p.grad over the ranks (an all-reduce, as DDP does), then
    opt.step()
    # stage 2, instead: reduce-scatter the gradients, keeping this rank's shard only, then
    opt.shard.grad = reduce_scatter_gradients(opt.trainable, opt.layout)
    opt.step()

Traffic. For a flat buffer of D = 4 x padded Psi bytes, a ring reduce-scatter or all-gather
makes each rank send (N_d - 1)/N_d D bytes, and an all-reduce twice that. Stage 2's
reduce-scatter of the gradients plus the all-gather of the parameters sends what DDP's
all-reduce sends: sharding costs no extra communication.

Communicate only with the provided ``reduce_scatter`` and ``all_gather`` (from
``parlab.flat``): they are traced, and the grader reads their traffic.

Stuck? ``parlab.hint("zero.sharded_optimizer")`` in a notebook (or ``parlab hint
zero.sharded_optimizer``) opens a hint, one level at a time. Grade your work with
``parlab grade zero`` (or ``parlab.check("zero")`` in a notebook).
"""

import torch
import torch.distributed as dist

from parlab.flat import FlatLayout, all_gather, reduce_scatter


class ShardedOptimizer:
    """ZeRO stage 1: ``optimizer_class`` (such as torch.optim.Adam) over this rank's shard of
    the parameters, on the default process group of N_d ranks.

    Provided: the constructor keeps the trainable parameters of ``params`` (those with
    ``requires_grad``) in ``self.trainable``, lays them out in ``self.layout`` (a
    ``FlatLayout`` of N_d = ``self.world_size`` shards) and copies them into
    ``self.flat_param`` (1-D, padded), with rank 0's values on every rank. Every parameter
    then becomes a view into ``self.flat_param``: whatever writes into ``self.flat_param``
    changes the model. Last, it calls ``build_optimizer`` with the optimizer's class and
    options.

    You write ``build_optimizer`` and ``step``.
    """

    def __init__(self, params, optimizer_class, **optimizer_kwargs):
        self.trainable = [p for p in params if p.requires_grad]
        if not self.trainable:
            raise ValueError("ShardedOptimizer got no trainable parameters (requires_grad=True): "
                             "pass model.parameters().")
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.layout = FlatLayout([p.shape for p in self.trainable], self.world_size)
        self.flat_param = self.layout.flatten([p.detach() for p in self.trainable])
        dist.broadcast(self.flat_param, src=0)  # the replicas start from rank 0's values
        for p, view in zip(self.trainable, self.layout.views(self.flat_param)):
            p.data = view
        self.build_optimizer(optimizer_class, **optimizer_kwargs)

    def build_optimizer(self, optimizer_class, **optimizer_kwargs):
        """Set ``self.shard``, a ``torch.nn.Parameter`` that is a VIEW of this rank's shard of
        ``self.flat_param`` (shard r, ``self.layout.shard_numel`` elements), and
        ``self.optimizer``, an ``optimizer_class(..., **optimizer_kwargs)`` over
        ``[self.shard]`` alone.

        A view, so that the optimizer's in-place update lands in ``self.flat_param``, ready to
        be all-gathered. Over the shard alone, so that the optimizer's state (Adam's exp_avg
        and exp_avg_sq) holds kappa Psi / N_d bytes on each rank, not kappa Psi. Adam acts on
        each element separately, so stepping the N_d shards equals stepping the whole model.
        """
        raise NotImplementedError("build_optimizer is not implemented yet: the shard and its optimizer")

    def step(self):
        """One optimizer step of the whole model, each rank stepping its own shard only.

        The averaged gradients arrive in one of two forms:

        - stage 1: every ``p.grad`` of ``self.trainable`` holds the gradient averaged over the
          N_d ranks (after an all-reduce, as in DDP), and ``self.shard.grad`` is None;
        - stage 2: ``self.shard.grad`` holds this rank's shard of the averaged gradient
          (``reduce_scatter_gradients``), and every ``p.grad`` is None.

        Afterwards every rank's ``self.flat_param``, so its model, holds the updated values of
        every shard. Stage 1 may keep only this rank's shard of the gradient in
        ``self.shard.grad`` (a copy: a view would keep a full-size gradient alive).
        Traffic: one ``all_gather``, (N_d - 1)/N_d x 4 x padded Psi bytes sent per rank.
        """
        raise NotImplementedError("step is not implemented yet: one step of every shard")

    def zero_grad(self):
        """Drop every gradient, full and shard, before the next backward."""
        for p in self.trainable:
            p.grad = None
        self.shard.grad = None


def reduce_scatter_gradients(params, layout):
    """ZeRO stage 2: this rank's shard of the gradient averaged over the N_d ranks, and no
    full-size gradient left behind.

    ``params``: the tensors ``layout`` (a ``FlatLayout``) lays out, in its order, each
    ``p.grad`` holding this rank's gradient g_r (of its mean loss over its shard of the batch).

    Returns shard r of the padded flat average, g[start:end] = (1 / N_d) sum_k g_k[start:end]
    with (start, end) = ``layout.shard_bounds(r)``: ``layout.shard_numel`` elements, padding
    included, for ``ShardedOptimizer.shard.grad``. Afterwards every ``p.grad`` is None and the
    returned tensor does not keep a full-size buffer alive: this rank holds 4 Psi / N_d bytes
    of gradient, not 4 Psi.

    Communicate with the provided ``reduce_scatter(flat, layout, rank)`` (traced; it averages
    a padded flat buffer over the ranks and returns the view of this rank's shard). Traffic:
    (N_d - 1)/N_d x 4 x padded Psi bytes per rank, half an all-reduce.
    """
    raise NotImplementedError("reduce_scatter_gradients is not implemented yet: the averaged shard")
