"""What the collectives of ``parlab.collectives`` share: the checks of a call made on one
rank, the exchange with ring neighbours over ``parlab.p2p``, the in-place reduction and the
reused receive buffers. (The check across ranks is a ring all-gather: ``ring._prepare``.)"""

import threading

import torch
import torch.distributed as dist

from parlab import p2p
from parlab._checks import rank as check_rank

OPS = ("sum", "avg", "max", "min")
DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16,
          torch.int8, torch.uint8, torch.int32, torch.int64)
COLLECTIVES = ("naive_all_reduce", "ring_reduce_scatter", "ring_all_gather", "ring_all_reduce",
               "butterfly_all_reduce", "tree_broadcast", "tree_reduce")
MAX_DIMS = 8
_REDUCE_OPS = {dist.ReduceOp.SUM: "sum", dist.ReduceOp.AVG: "avg", dist.ReduceOp.MAX: "max", dist.ReduceOp.MIN: "min"}


def _exchange(outgoing, dst, incoming, src):
    """Send ``outgoing`` to ``dst`` while receiving ``incoming`` from ``src``. Starting the
    send with isend lets both directions overlap, and no ring deadlocks with every rank
    sending first. An empty ``outgoing`` or ``incoming`` is skipped: its peer has it empty
    too (it is the same chunk)."""
    request = p2p.isend(outgoing, dst) if outgoing.numel() else None
    if incoming.numel():
        p2p.recv(incoming, src)
    if request is not None:
        request.wait()


_scratch_buffers = threading.local()  # .of: {(dtype, device): buffer}, for each thread


def _scratch(like, numel):
    """A receive buffer of ``numel`` elements of ``like``'s dtype and device, reused from call
    to call (one per dtype, device and thread, as large as the largest message so far):
    allocating and first touching fresh megabytes on every call costs about as much as moving
    them. Per thread, because a rank's communication thread (``parlab.background``: DDP, ZeRO)
    runs collectives while its main thread may run others (tensor parallelism in backward)."""
    buffers = _scratch_buffers.__dict__.setdefault("of", {})
    key = (like.dtype, like.device)
    buffer = buffers.get(key)
    if buffer is None or buffer.numel() < numel:
        buffer = buffers[key] = torch.empty(numel, dtype=like.dtype, device=like.device)
    return buffer[:numel]


def _reduce(op, accumulator, incoming):
    """accumulator <- accumulator (op) incoming, in place ("avg" sums; see ``_average``)."""
    if op == "max":
        torch.maximum(accumulator, incoming, out=accumulator)
    elif op == "min":
        torch.minimum(accumulator, incoming, out=accumulator)
    else:
        accumulator.add_(incoming)


def _average(op, reduced, N):
    if op == "avg":
        reduced.div_(N)


def _check_locally(collective, tensor, op, root):
    """Check what one rank can check of the call; return the op's name (None without an op)."""
    if not torch.is_tensor(tensor):
        raise ValueError(f"{collective} works in place on a torch tensor, got {type(tensor).__name__}: pass one, "
                         "e.g. torch.tensor(values, dtype=torch.float32).")
    if not tensor.is_contiguous():
        raise ValueError(f"{collective} works in place on a contiguous tensor; call .contiguous() on it first.")
    if tensor.dtype not in DTYPES:
        raise ValueError(f"{collective} supports the dtypes {[str(d) for d in DTYPES]}, not {tensor.dtype}.")
    if tensor.dim() > MAX_DIMS:
        raise ValueError(f"{collective} supports tensors of at most {MAX_DIMS} dimensions; reshape yours first.")
    if op is not None:
        op = _op_name(op, tensor)
    if root is not None:
        N = dist.get_world_size()
        check_rank("root", root, N, f"choose the rank that holds (or receives) the result, 0 to {N - 1}.")
    return op


def _op_name(op, tensor):
    name = _REDUCE_OPS.get(op, op) if not isinstance(op, str) else op.lower()
    if name not in OPS:
        raise ValueError(f"unknown op {op!r}; use one of {', '.join(map(repr, OPS))} or the matching dist.ReduceOp.")
    if name == "avg" and not tensor.is_floating_point():
        raise ValueError(f"op='avg' divides by N and needs a float tensor, not {tensor.dtype}; "
                         "convert it with .float().")
    return name
