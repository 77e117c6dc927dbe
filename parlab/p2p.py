"""Traced point-to-point communication: the only wire that parlab's techniques use.

``send``/``recv`` block; ``isend``/``irecv`` return a :class:`Request` to ``wait()`` on.
Each call records a communication event (op, peer, bytes, start, end) when tracing is on,
so collectives and pipelines built on these helpers show up in the timeline and their
traffic can be counted exactly.

CUDA tensors on a gloo process group (ranks sharing GPUs) are staged through host memory:
gloo moves bytes between CPU buffers.

Message sizes. Sender and receiver must agree on each message's size: gloo carries bytes,
not shapes. A message shorter than its receive leaves the rest of the receiving tensor as
it was, silently; one longer than its receive makes gloo abort the receiving process
("op.preamble.length <= op.nbytes. 24 vs 20", from its transport thread, where no Python
code can catch it). Its peers then lose their connections to it: they raise
``ConnectionError`` saying what they last sent to each rank, and
``explain_size_mismatch`` puts the two sides together into one sentence.
"""

import contextlib
import re

import torch
import torch.distributed as dist

from parlab import trace

# The sizes this rank last posted to each peer, {peer: [(elements, dtype), ...]}, a few
# distinct ones (a ring alternates two chunk sizes): a rank that gloo aborts on a message
# longer than its receive cannot tell who sent what; the sender can, though by the time it
# notices it may have sent its peer the next message too.
_sent = {}
_SENT_KEPT = 3


def send(tensor, dst, tag=0):
    """Send ``tensor`` to rank ``dst`` and wait until it has left."""
    start = trace.now()
    _remember_sent(tensor, dst)
    with _connection_lost("send to", dst):
        dist.send(_staged(tensor), dst, tag=tag)
    trace.record_comm("send", dst, _nbytes(tensor), start, trace.now())


def recv(tensor, src, tag=0):
    """Receive from rank ``src`` into ``tensor`` (in place; shape and dtype must match)."""
    start = trace.now()
    buffer = _staging_buffer(tensor)
    with _connection_lost("recv from", src):
        dist.recv(buffer, src, tag=tag)
    if buffer is not tensor:
        tensor.copy_(buffer)
    trace.record_comm("recv", src, _nbytes(tensor), start, trace.now())
    return tensor


def isend(tensor, dst, tag=0):
    """Start sending ``tensor`` to ``dst``; do not modify it before ``wait()``."""
    start = trace.now()
    _remember_sent(tensor, dst)
    work = dist.isend(_staged(tensor), dst, tag=tag)
    return Request(work, "isend", dst, tensor, None, start)


def irecv(tensor, src, tag=0):
    """Start receiving from ``src`` into ``tensor``; its contents are valid after ``wait()``."""
    start = trace.now()
    buffer = _staging_buffer(tensor)
    work = dist.irecv(buffer, src, tag=tag)
    return Request(work, "irecv", src, tensor, buffer, start)


class Request:
    """A pending isend/irecv. Its traced end time is when ``wait()`` saw it complete."""

    def __init__(self, work, op, peer, tensor, buffer, start):
        self._work, self.op, self.peer = work, op, peer
        self._tensor, self._buffer, self._start = tensor, buffer, start
        self._done = False

    def wait(self):
        if not self._done:
            with _connection_lost(f"wait for its {self.op} {'to' if self.op == 'isend' else 'from'}", self.peer):
                self._work.wait()
            if self._buffer is not None and self._buffer is not self._tensor:
                self._tensor.copy_(self._buffer)
            trace.record_comm(self.op, self.peer, _nbytes(self._tensor), self._start, trace.now())
            self._done = True
        return self._tensor

    def is_completed(self):
        return self._done or self._work.is_completed()


def broadcast(tensor, src, group=None):
    """Overwrite ``tensor`` with global rank ``src``'s copy (torch's broadcast, over ``group``
    or all ranks), recorded as one "broadcast" event: techniques use it to start their
    replicas from one rank's values."""
    start = trace.now()
    dist.broadcast(tensor.detach(), src=src, group=group)
    trace.record_comm("broadcast", src, _nbytes(tensor), start, trace.now())
    return tensor


def wait_all(requests):
    """Wait for every request, in order; returns their tensors."""
    return [request.wait() for request in requests]


def explain_size_mismatch(failures):
    """One sentence for a receive that gloo aborted because its message was longer than the
    tensor posted for it, or None when no rank failed that way. ``failures`` maps rank ->
    the text of its failure (``parlab.RankError.failures``): the aborted rank's output holds
    gloo's byte counts (and, with faulthandler on, the line it was receiving at); the rank
    that sent the message, if it lived on, said what it sent in its ``ConnectionError``."""
    for rank, text in failures.items():
        gloo = _GLOO_SIZE_MISMATCH.search(text)
        if gloo is None:
            continue
        sent, expected = int(gloo["sent"]), int(gloo["expected"])
        where = _receiving_line(text)
        found = _sender(failures, rank, sent)
        if found is None:
            return f"rank {rank} received {sent} bytes into a tensor of {expected} bytes{where}: {_SIZE_HINT}"
        sender, numel, dtype = found
        size = getattr(torch, dtype).itemsize
        if expected % size:  # not a whole number of the sender's elements: another dtype
            wanted, numel = f"{expected} bytes", f"{numel} {dtype} elements ({sent} bytes)"
        else:
            wanted = f"{expected // size} {dtype} elements"
        return f"rank {rank} expected {wanted} from rank {sender}{where} but rank {sender} sent {numel}: {_SIZE_HINT}"
    return None


def _sender(failures, rank, nbytes):
    """(sender, elements, dtype) of a rank whose ConnectionError says it sent ``nbytes`` to ``rank``."""
    for sender, text in failures.items():
        for message in _LAST_SENT.finditer(text):
            if int(message["dst"]) == rank and int(message["nbytes"]) == nbytes:
                return sender, message["numel"], message["dtype"]
    return None


_SIZE_HINT = (
    "sender and receiver must agree on every message's size (for chunks, check how chunk "
    "sizes are computed for uneven lengths)"
)
_GLOO_SIZE_MISMATCH = re.compile(r"op\.preamble\.length <= op\.nbytes\. (?P<sent>\d+) vs (?P<expected>\d+)")
_GLOO_CONNECTION_LOST = re.compile(r"Connection (reset|closed) by peer|Broken pipe")
_LAST_SENT = re.compile(r"to rank (?P<dst>\d+), (?P<numel>\d+) (?P<dtype>\w+) elements \((?P<nbytes>\d+) bytes\)")
_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<function>\w+)')


@contextlib.contextmanager
def _connection_lost(what, peer):
    """Turn gloo's "Connection reset by peer" into a sentence that says why it happens and
    what this rank last sent to each rank (see ``explain_size_mismatch``)."""
    try:
        yield
    except RuntimeError as exc:
        if not _GLOO_CONNECTION_LOST.search(str(exc)):
            raise
        sent = "; ".join(
            f"to rank {dst}, {numel} {str(dtype).removeprefix('torch.')} elements ({numel * dtype.itemsize} bytes)"
            for dst, sizes in sorted(_sent.items())
            for numel, dtype in sizes
        )
        raise ConnectionError(
            f"rank {dist.get_rank()} lost its connections during its {what} rank {peer}: another rank's "
            f"process ended (see its failure). The last message sizes this rank sent: {sent or 'none'}."
        ) from exc


def _remember_sent(tensor, dst):
    sizes = _sent.setdefault(dst, [])
    size = (tensor.numel(), tensor.dtype)
    if size in sizes:
        sizes.remove(size)
    sizes.append(size)
    del sizes[:-_SENT_KEPT]


def _receiving_line(text):
    """Where the aborted rank was receiving, as " (in ring_reduce_scatter, line 59)": the
    caller of parlab.p2p in the faulthandler dump in its output (most recent call first);
    "" when its output holds no dump."""
    frames = list(_FRAME.finditer(text))
    for inner, outer in zip(frames, frames[1:]):
        if inner["file"].endswith("p2p.py") and not outer["file"].endswith("p2p.py"):
            place = "" if outer["file"].startswith("<") else f"{outer['file'].rsplit('/', 1)[-1]} "
            return f" (in {outer['function']}, {place}line {outer['line']})"
    return ""


def _nbytes(tensor):
    return tensor.numel() * tensor.element_size()


def _host_staging(tensor):
    return tensor.is_cuda and dist.get_backend() == "gloo"


def _staged(tensor):
    if not tensor.is_contiguous():
        raise ValueError("p2p needs a contiguous tensor; call .contiguous() before sending it.")
    return tensor.cpu() if _host_staging(tensor) else tensor


def _staging_buffer(tensor):
    if not tensor.is_contiguous():
        raise ValueError("p2p needs a contiguous tensor to receive into; allocate one with torch.empty.")
    return torch.empty_like(tensor, device="cpu") if _host_staging(tensor) else tensor
