# Generated from solutions/pipeline.py by `python -m parlab.course.exercises build`.
# Write your code where it raises NotImplementedError, then run `parlab grade pipeline`.
# parlab-generated sha256=c60e40de3ece10eb8c74b4abc47c750bbb35cc0960280d590671eb129c351963
"""Exercise: the 1F1B pipeline schedule, and the work one stage does for each action.

Pipeline parallelism cuts the model into K stages, one per rank, and the batch into M
micro-batches. A schedule says, per rank, in which order its stage runs the forward F and
the backward B of each micro-batch, written in torch.distributed.pipelining's notation
``{stage}{F|B}{micro-batch}``: ``1B3`` is the backward of stage 1 for micro-batch 3.

GPipe runs all M forwards, then all M backwards: every rank holds the activations of all M
micro-batches at once. 1F1B (PipeDream-Flush) has the same bubble, (K - 1) / (M + K - 1) of
the step, but starts each backward as early as it can, so that rank r holds at most K - r
micro-batches of activations. Rank r runs

    warm-up      K - r - 1 forwards (the last rank: none)
    steady       one forward then one backward, until its M forwards are done
    cool-down    the backwards still to do (K - r - 1 of them)

For K = 2, M = 3:

    rank 0: 0F0 0F1 0B0 0F2 0B1 0B2
    rank 1: 1F0 1B0 1F1 1B1 1F2 1B2

Part 1 is ``one_f_one_b(K, M)``, the schedule as data, with the signature and the return
of ``parlab.pipeline.one_f_one_b``: a ``Schedule`` that parlab's validator
(``parlab.pipeline.validate``) accepts, and whose activations parlab's simulator counts.

Part 2 is the work of one action inside parlab's executor (``parlab.pipeline.executor``),
which runs any schedule on real ranks: for each action of its rank it calls

    forward_step(executor, action)    F(s, m): the stage input, the stage, its output
    backward_step(executor, action)   B(s, m): the output's gradient, backward, the input's

and the gradients the stages accumulate over the M micro-batches must equal those of ONE
backward of the full batch's mean loss, L = (1/M) sum_m loss_m. So the backward of each
micro-batch starts from dL/dloss_m = 1/M, not 1.

What the executor gives you (``executor``, on this rank):

    executor.input_microbatches[m]         micro-batch m of the batch (on stage 0's rank)
    executor.last_stage                    S - 1, the stage that computes the loss
    executor.schedule.num_microbatches     M
    executor.losses                        a list of M slots: put loss_m (detached) in slot m
    executor.run_forward(s, m, x)          stage s on its input x; on the last stage, its
                                           loss for micro-batch m (a 0-dim tensor). Keeps
                                           what the backward of (s, m) needs.
    executor.run_backward(s, m, grad)      backward of stage s for micro-batch m from the
                                           gradient of its output (of its loss, on the
                                           last stage); returns the gradient of its input
                                           (None on stage 0: the batch needs none)
    executor.send(kind, s, m, tensor)      send without waiting; ACTIVATION goes to stage
                                           s + 1, GRADIENT to stage s - 1
    executor.receive(kind, s, m)           the message (kind, s, m), sent BY stage s
                                           (waits until it has arrived)

A message is named by its kind, the stage that SENDS it and the micro-batch: the output of
F(s, m) travels as (ACTIVATION, s, m), the input gradient of B(s, m) as (GRADIENT, s, m).
Mark each compute in the trace, ``with trace.span("forward", stage=s, microbatch=m):``
around ``run_forward`` and ``trace.span("backward", ...)`` around ``run_backward``: that is
how a measured timeline (and the grader) sees your schedule run.

Stuck? ``parlab.hint("pipeline.one_f_one_b")`` in a notebook (or ``parlab hint
pipeline.one_f_one_b``) opens a hint, one level at a time. Grade your work with
``parlab grade pipeline`` (or ``parlab.check("pipeline")`` in a notebook).
"""

import torch

from parlab import trace
from parlab.pipeline import Action, Schedule, validate
from parlab.pipeline.executor import ACTIVATION, GRADIENT


def one_f_one_b(K, M):
    """The 1F1B schedule of K ranks (one stage each: rank r holds stage r) and M micro-batches,
    validated: ``validate(Schedule("1f1b", K, M, 1, rows))``, where ``rows[r]`` lists rank r's
    ``Action(stage, kind, microbatch)`` in the order it runs them (``Action(0, "F", 2)`` is
    ``0F2``; kind "F" or "B").

    The order is 1F1B's (module docstring): on rank r, K - r - 1 warm-up forwards, then one
    forward and one backward in turn while forwards remain, then the remaining backwards;
    forwards and backwards each in micro-batch order 0, 1, ..., M - 1.

    The warm-up needs M >= K: for M < K raise ValueError with a sentence that gives the
    values of M and K and says what to change.
    """
    raise NotImplementedError("one_f_one_b is not implemented yet: the check, then each rank's actions")


def forward_step(executor, action):
    """F(s, m) on its rank. Contract: stage s runs (``executor.run_forward``, inside a
    "forward" trace span) on its input, micro-batch m of the batch on stage 0 and the
    activation F(s - 1, m) sent everywhere else; its output reaches stage s + 1, except on
    the last stage, whose output, the loss of micro-batch m, is kept (detached) in
    ``executor.losses[m]``."""
    raise NotImplementedError("forward_step is not implemented yet: the forward of one stage on one micro-batch")


def backward_step(executor, action):
    """B(s, m) on its rank. Contract: stage s runs its backward (``executor.run_backward``,
    inside a "backward" trace span) from the gradient of its output, which is
    dL/dloss_m on the last stage (L = (1/M) sum_m loss_m: module docstring) and the input
    gradient of B(s + 1, m) everywhere else; the gradient of its input reaches stage s - 1
    (stage 0 has none to send)."""
    raise NotImplementedError("backward_step is not implemented yet: the backward of one stage on one micro-batch")
