"""The all-to-all: rank r sends chunk j of its input to rank j and receives chunk i of its
output from rank i, on parlab's traced point-to-point layer.

    rank r, before:  x   = [chunk 0 | chunk 1 | ... | chunk N-1]    chunk j (input_splits[j] rows) for rank j
    rank r, after:   out = [from 0  | from 1  | ... | from N-1 ]    rank i's chunk r (output_splits[i] rows)

An N x N matrix of chunks, one row of it per rank, transposed: chunk (i, j) moves from rank i
to rank j. Context parallelism (Ulysses) trades a sequence split for a head split with it;
expert parallelism sends each token's row to the rank holding its expert, and back.

The schedule: ring shifts, all posted at once (``all_to_all_steps``). At step j = 1 .. N - 1
rank r sends its chunk for rank (r + j) mod N and receives rank (r - j) mod N's chunk for it;
every isend and irecv is posted before the first wait, so no rank blocks while another waits
for it and the exchange cannot deadlock, whatever the sizes. Each step is a permutation: each
rank sends one message and receives one, so with equal chunks no message waits for a busy
incoming port (had every rank sent in rank order 0, 1, ..., all N - 1 first messages would
queue at rank 0's). On an emulated link each rank's messages leave in step order, one after
another; with equal chunks of D/N bytes the call takes (N - 1) (alpha + D/N beta), the
alpha-beta model's all-to-all.

Sizes. gloo carries bytes, not shapes, so the receiver must know what comes: with no splits
every chunk has x.shape[0] / N rows; with uneven chunks the caller passes both lists, and
rank i's input_splits[j] must equal rank j's output_splits[i]. A caller that does not know
what it will receive exchanges the counts first, by an all-to-all of one-row chunks (expert
parallelism does: ``parlab.experts.dispatch``). What a rank can check alone is refused with
a ValueError; splits that disagree between ranks cannot be seen locally (``parlab.p2p``:
a shorter message leaves the rest of its receive as it was, a longer one aborts the receiver).
"""

from dataclasses import dataclass

import torch

from parlab import p2p
from parlab._checks import place_in, whole_number
from parlab.p2p import global_rank

# Its own tag: an all-to-all between two ranks must not match a ring collective's message
# (tag 0) or ring attention's K/V and gradient streams (tags 1 and 2) posted at the same time.
ALL_TO_ALL_TAG = 3
P2P_OPS = ("isend", "irecv")  # what parlab.p2p names the messages, and trace.bytes_sent counts


@dataclass(frozen=True)
class AllToAllStep:
    """Step j of the all-to-all, for all N ranks at once: rank r sends its chunk for rank
    ``send_to[r]`` = (r + j) mod N to it while it receives from ``receive_from[r]`` = (r - j) mod N."""

    j: int  # 1 .. N - 1
    send_to: tuple
    receive_from: tuple


def all_to_all_steps(N):
    """The N - 1 ring-shift steps of an all-to-all of N ranks (step 0, a rank's chunk for
    itself, is a local copy). Each step's ``send_to`` is a permutation of the ranks: every
    rank receives exactly one message per step."""
    whole_number("N (the number of ranks)", N, "give the group's size as a count, such as N = 4.")
    return [AllToAllStep(j, tuple((r + j) % N for r in range(N)), tuple((r - j) % N for r in range(N)))
            for j in range(1, N)]


def all_to_all(x, output_splits=None, input_splits=None, group=None, ops=P2P_OPS):
    """Send rows input_splits[j] of ``x`` (the j-th run of rows along dim 0) to rank j of
    ``group`` (default: every rank); return the rows received, (sum(output_splits), *x.shape[1:]):
    output_splits[i] rows from rank i, in rank order. The arguments of torch's
    ``dist.all_to_all_single(out, x, output_splits, input_splits, group)``, and its result.

    Without splits, N equal chunks (x.shape[0] a multiple of N). With uneven chunks pass both
    lists, N whole numbers >= 0 each, input_splits summing to x.shape[0] and
    input_splits[r] == output_splits[r] (the chunk a rank keeps, copied, never sent); empty
    chunks are not sent. Called by every rank of ``group``, with splits that agree.

    Each rank sends its N - 1 other chunks, sum_{j != r} input_splits[j] rows, one p2p message
    each, traced with ``ops`` (send, receive) as their names: parlab.p2p's "isend" and
    "irecv" (expert parallelism names its own). The module docstring has the schedule.
    """
    r, N = place_in(group, "call the all-to-all on every rank of its group, passing that group.")
    output_splits, input_splits = _check(x, output_splits, input_splits, r, N)
    x = x.contiguous()
    out = x.new_empty((sum(output_splits), *x.shape[1:]))
    chunks, received = x.split(input_splits), out.split(output_splits)  # views: chunk j for rank j, from rank i
    received[r].copy_(chunks[r])
    send_op, receive_op = ops
    requests = []
    for step in all_to_all_steps(N):  # post every step's messages, then wait: no rank blocks another
        to, source = step.send_to[r], step.receive_from[r]
        if chunks[to].numel():
            requests.append(p2p.isend(chunks[to], global_rank(group, to), ALL_TO_ALL_TAG, op=send_op))
        if received[source].numel():
            requests.append(p2p.irecv(received[source], global_rank(group, source), ALL_TO_ALL_TAG, op=receive_op))
    p2p.wait_all(requests)
    return out


def _check(x, output_splits, input_splits, r, N):
    """(output_splits, input_splits) as lists of ints, after the checks one rank can make."""
    if not torch.is_tensor(x) or x.dim() == 0:
        raise ValueError(f"all_to_all sends the rows (dim 0) of a tensor, got {_describe(x)}: pass a tensor of at "
                         "least one dimension, e.g. torch.cat(chunks), chunk j for rank j.")
    rows = x.shape[0]
    if output_splits is None and input_splits is None:
        if rows % N:
            raise ValueError(f"all_to_all without splits cuts the {rows} rows of x into N = {N} equal chunks: make "
                             f"x.shape[0] a multiple of {N}, or pass input_splits and output_splits.")
        return [rows // N] * N, [rows // N] * N
    if output_splits is None or input_splits is None:
        missing = "output_splits" if output_splits is None else "input_splits"
        raise ValueError(f"all_to_all with uneven chunks needs both input_splits and output_splits, got no "
                         f"{missing}: a rank must know how many rows each rank sends it; exchange the counts "
                         "first by an all_to_all of one-row chunks.")
    output_splits, input_splits = _splits("output_splits", output_splits, N), _splits("input_splits", input_splits, N)
    if sum(input_splits) != rows:
        raise ValueError(f"input_splits {input_splits} add up to {sum(input_splits)} rows, but x has {rows}: give "
                         "each rank's number of rows, summing to x.shape[0].")
    if input_splits[r] != output_splits[r]:
        raise ValueError(f"rank {r} keeps its own chunk, so input_splits[{r}] = {input_splits[r]} must equal "
                         f"output_splits[{r}] = {output_splits[r]}: the rows it sends itself are the rows it gets.")
    return output_splits, input_splits


def _splits(name, splits, N):
    values = splits.tolist() if torch.is_tensor(splits) else splits
    if isinstance(values, (str, bytes)) or not hasattr(values, "__len__") or len(values) != N:
        raise ValueError(f"{name} must list N = {N} row counts, one per rank of the group, got {splits!r}.")
    return [whole_number(f"{name}[{j}]", value, "count rows, 0 or more.", minimum=0) for j, value in enumerate(values)]


def _describe(x):
    return f"a 0-dimensional tensor ({x.item()!r})" if torch.is_tensor(x) else type(x).__name__
