"""Exercise: DiLoCo's outer step, a sharded state resumed on another number of ranks, and
how often to checkpoint.

DiLoCo (Douillard et al. 2023, arXiv 2311.08105, Algorithm 1) is local SGD with an optimizer
on top: every replica starts a round from the same weights w_start, takes H inner steps on
its own data (AdamW in the paper), and then, once per round, the replicas average how far
each moved, the pseudo-gradient, and an outer optimizer (Nesterov momentum) steps w_start by
it. ``outer_step`` is that once-per-round step.

A long run fails and restarts. ``reshard`` resumes a ZeRO-sharded optimizer state (each of
N_d ranks holding its shard of a flat vector) on N_d' ranks, after a node is lost;
``young_daly`` says how often to save a checkpoint so that the time lost to saving and to
redoing work after a failure is smallest.

Symbols: N ranks in the group, w the weights, Delta_r = w_start - w_r what rank r's H inner
steps subtracted (the glossary's step: w <- w - Delta), eta the outer learning rate, nu the
outer momentum, buf the outer momentum buffer; d values of a flat vector, N_d and N_d' the
numbers of shards before and after; I the checkpoint interval (compute time between two
checkpoints), delta the seconds one checkpoint takes, Theta the mean time between failures
(MTBF).

Stuck? ``parlab.hint("diloco.outer_step")`` in a notebook (or ``parlab hint diloco.outer_step``
in a terminal) opens a hint, one level at a time. Grade your work with ``parlab grade diloco``
(or ``parlab.check("diloco")``).
"""

import math

import torch
import torch.distributed as dist


def outer_step(params, start, momentum_buffers, outer_lr, outer_momentum, group=None):
    """DiLoCo's outer step on this replica, over the N ranks of ``group`` (None: the world).

    params: this replica's weights w_r after its H inner steps, a list of tensors (a model's
    parameters, say); start: w_start, the weights every replica began the round from, tensors
    of the same shapes, equal on every rank; momentum_buffers: a list with one entry per
    tensor, None before the first outer step (as torch.optim.SGD's momentum_buffer), then buf.
    outer_lr: eta; outer_momentum: nu. The outer optimizer is torch.optim.SGD(lr=eta,
    momentum=nu, nesterov=True) stepping w_start with the averaged pseudo-gradient as its
    gradient (Algorithm 1; the update is torch/optim/sgd.py's ``_single_tensor_sgd``):

        Delta = (1/N) sum_r (w_start - w_r)     the pseudo-gradient, averaged over the group
        buf   = Delta                             on the first outer step (buf is None)
        buf   = nu buf + Delta                    on every later one
        w     = w_start - eta (Delta + nu buf)    Nesterov's step

    Afterwards every tensor of ``params`` and of ``start`` holds the new w, the same on every
    rank (the next round starts from it), and momentum_buffers[i] holds buf for tensor i. The
    average is one all-reduce over ``group``: ``dist.all_reduce(tensor, group=group)`` (a
    sum; gloo has no average) or ``parlab.collectives.ring_all_reduce``. Update ``params``
    under ``torch.no_grad()``: they may be a model's parameters. Returns nothing."""
    params, start = list(params), list(start)
    if not len(params) == len(start) == len(momentum_buffers):
        raise ValueError(f"got {len(params)} params, {len(start)} start tensors and {len(momentum_buffers)} "
                         "momentum buffers: pass one of each per tensor (momentum_buffers = [None] * len(params) "
                         "before the first outer step).")
    if not outer_lr > 0 or not 0 <= outer_momentum < 1:
        raise ValueError(f"outer_lr = {outer_lr} and outer_momentum = {outer_momentum}: the outer learning rate "
                         "must be > 0 and the momentum in [0, 1), e.g. outer_lr=0.7, outer_momentum=0.9.")
    # BEGIN SOLUTION: the averaged pseudo-gradient, then Nesterov's step
    N = dist.get_world_size(group)
    delta = torch.cat([(s - p.detach()).reshape(-1) for p, s in zip(params, start)])  # (d,): Delta_r, all tensors
    dist.all_reduce(delta, group=group)  # one message for the whole model: sum_r Delta_r
    delta /= N
    offset = 0
    with torch.no_grad():
        for i, (p, s) in enumerate(zip(params, start)):
            g = delta[offset:offset + s.numel()].view_as(s)  # Delta of tensor i
            offset += s.numel()
            if momentum_buffers[i] is None:
                momentum_buffers[i] = g.clone()
            else:
                momentum_buffers[i].mul_(outer_momentum).add_(g)
            s.sub_(outer_lr * (g + outer_momentum * momentum_buffers[i]))
            p.copy_(s)
    # END SOLUTION


def reshard(shards, numel, world_size):
    """The N_d' = ``world_size`` shards of the flat state that ``shards`` cut into N_d.

    shards: N_d tensors of shape (ceil(d/N_d),), rank r's the values r ceil(d/N_d) ..
    (r + 1) ceil(d/N_d) - 1 of a flat vector of d = ``numel`` values padded with zeros at the
    end to N_d ceil(d/N_d), as parlab's flat shards (``parlab.flat.FlatLayout``, which ZeRO's
    ShardedOptimizer and FSDP use) and torch's reduce_scatter cut it. Returns a list of N_d'
    new tensors of shape (ceil(d/N_d'),) in the same layout: the same d values, in order,
    padded with zeros at the end to N_d' ceil(d/N_d'). A pure function: no communication,
    ``shards`` left as they are. Every state tensor of the optimizer (Adam's exp_avg, ...)
    is resharded the same way."""
    if not isinstance(world_size, int) or world_size < 1 or not isinstance(numel, int) or numel < 1:
        raise ValueError(f"numel = {numel!r}, world_size = {world_size!r}: both must be whole numbers >= 1 (d, the "
                         "real values of the flat state, and N_d', the ranks that resume).")
    size = math.ceil(numel / len(shards))
    if not shards or any(shard.shape != (size,) for shard in shards):
        raise ValueError(f"d = {numel} values over {len(shards)} shards make shards of ({size},), got shapes "
                         f"{[tuple(shard.shape) for shard in shards]}: pass every rank's shard, in rank order.")
    # BEGIN SOLUTION: the d values, padded again for N_d' ranks, cut
    new_size = math.ceil(numel / world_size)
    flat = torch.zeros(new_size * world_size, dtype=shards[0].dtype, device=shards[0].device)  # (N_d' ceil(d/N_d'),)
    flat[:numel] = torch.cat(shards)[:numel]  # the old padding dropped, the new one zeros
    return [shard.clone() for shard in flat.split(new_size)]
    # END SOLUTION


def young_daly(checkpoint_seconds, mtbf_seconds, higher_order=False):
    """The optimal checkpoint interval I (compute time between two checkpoints), in seconds,
    for a job that fails at random (a Poisson process) every Theta seconds on average and
    takes delta seconds to save a checkpoint (checkpoint_seconds = delta, mtbf_seconds =
    Theta, the mean time between failures).

    - Young (1974, "A first order approximation to the optimum checkpoint interval", CACM
      17(9)): I = sqrt(2 delta Theta).
    - With ``higher_order``, Daly (2006, "A higher order estimate of the optimum checkpoint
      interval for restart dumps", FGCS 22(3)), a series in powers of sqrt(delta / (2 Theta)):

          I = sqrt(2 delta Theta) (1 + (1/3) sqrt(delta / (2 Theta)) + (1/9) delta / (2 Theta)) - delta

      for delta < 2 Theta, and I = Theta for delta >= 2 Theta. (Daly's Figs. 3-5: Theta =
      24 h, 6 h and 15 min with delta = 5 min give 117, 57 and 9.1 min.)

    Raises ValueError unless both times are > 0."""
    # BEGIN SOLUTION: refuse non-positive times, then Young's and Daly's intervals
    if not checkpoint_seconds > 0 or not mtbf_seconds > 0:
        raise ValueError(f"checkpoint_seconds = {checkpoint_seconds!r}, mtbf_seconds = {mtbf_seconds!r}: both must be "
                         "> 0 (the seconds one checkpoint takes, and the mean time between failures).")
    first_order = math.sqrt(2 * checkpoint_seconds * mtbf_seconds)
    if not higher_order:
        return first_order
    if checkpoint_seconds >= 2 * mtbf_seconds:
        return float(mtbf_seconds)
    ratio = checkpoint_seconds / (2 * mtbf_seconds)
    return first_order * (1 + math.sqrt(ratio) / 3 + ratio / 9) - checkpoint_seconds
    # END SOLUTION


# BEGIN HINTS
HINTS = {
    "outer_step": (
        """
        The outer step is an optimizer step whose "gradient" is how far the replicas moved,
        averaged. Two parts: one all-reduce for the average, then torch's SGD with Nesterov
        written out by hand, tensor by tensor, from w_start (not from w_r).
        """,
        """
        Flatten start[i] - params[i] of every tensor into one vector, all-reduce it over the
        group (a sum) and divide by N = dist.get_world_size(group). Then for each tensor i,
        with g its piece of that vector: the first time (momentum_buffers[i] is None) store a
        copy of g as the buffer, later multiply the buffer by nu and add g. The step is
        g + nu buf; subtract eta times it from start[i], and copy the result into params[i].
        """,
        """
        delta = torch.cat([(s - p.detach()).reshape(-1) for p, s in zip(params, start)])
        dist.all_reduce(delta, group=group); delta /= N
        for each tensor i (with torch.no_grad()), g = its slice of delta, viewed as start[i]:
            buf = g.clone() if momentum_buffers[i] is None else momentum_buffers[i].mul_(nu).add_(g)
            momentum_buffers[i] = buf
            start[i].sub_(eta * (g + nu * buf)); params[i].copy_(start[i])

        A sign slip (params - start) moves the weights away from where the replicas went; a
        forgotten / N makes the step N times too long.
        """,
    ),
    "reshard": (
        """
        The old shards laid end to end are the flat vector plus the old padding. Take the d
        real values, pad them again for the new number of ranks, and cut.
        """,
        """
        torch.cat(shards) has N_d ceil(d/N_d) values; keep the first d. The new shards hold
        ceil(d/N_d') values each, so the new padded vector has N_d' ceil(d/N_d') values:
        zeros, with the d values copied to the front. Cut it into N_d' equal pieces.
        """,
        """
        size = math.ceil(numel / world_size)
        flat = torch.zeros(size * world_size, dtype=shards[0].dtype)
        flat[:numel] = torch.cat(shards)[:numel]
        return [piece.clone() for piece in flat.split(size)]

        Cutting torch.cat(shards)[:numel] directly leaves the last shard short; cutting the
        whole padded torch.cat(shards) makes every shard too long when the old padding is
        larger than the new one.
        """,
    ),
    "young_daly": (
        """
        Checkpoint too often and you pay delta each time; too rarely and a failure throws away
        half an interval of work on average. Young balanced the two to first order.
        """,
        """
        First refuse times that are not > 0 with a ValueError. Young's interval is the square
        root of twice delta times Theta. Daly's multiplies it by 1 + sqrt(x)/3 + x/9 with
        x = delta / (2 Theta) and subtracts delta, unless delta >= 2 Theta, where it is Theta.
        """,
        """
        if not checkpoint_seconds > 0 or not mtbf_seconds > 0: raise ValueError(...)
        first_order = math.sqrt(2 * checkpoint_seconds * mtbf_seconds)
        if not higher_order: return first_order
        if checkpoint_seconds >= 2 * mtbf_seconds: return float(mtbf_seconds)
        x = checkpoint_seconds / (2 * mtbf_seconds)
        return first_order * (1 + math.sqrt(x) / 3 + x / 9) - checkpoint_seconds
        """,
    ),
}
# END HINTS
