"""Traced point-to-point communication: the only wire that parlab's techniques use.

``send``/``recv`` block; ``isend``/``irecv`` return a :class:`Request` to ``wait()`` on.
Each call records a communication event (op, peer, bytes, start, end) when tracing is on,
so collectives and pipelines built on these helpers show up in the timeline and their
traffic can be counted exactly.

Emulated links. On a cluster whose links are emulated (``parlab.Cluster(..., link=
parlab.Link(latency, bandwidth))``) every message takes latency + bytes / bandwidth of wall
time on its sender's outgoing and its receiver's incoming port (``parlab.runtime.emulation``
has the rules); its data still moves at once through gloo. ``broadcast`` below is torch's own
collective and is not shaped.

CUDA tensors on a gloo process group (ranks sharing GPUs) are staged through host memory:
gloo moves bytes between CPU buffers.

Message sizes. Sender and receiver must agree on each message's size: gloo carries bytes,
not shapes. A message shorter than its receive leaves the rest of the receiving tensor as
it was, silently; one longer than its receive makes gloo abort the receiving process
("op.preamble.length <= op.nbytes. 24 vs 20", from its transport thread, where no Python
code can catch it). Its peers then lose their connections to it: they raise
``ConnectionError`` saying what they last sent to each rank, and
``parlab.runtime.errors.explain_size_mismatch`` puts the two sides together into one
sentence, the first line of the ``RankError``.
"""

import contextlib
import re

import torch
import torch.distributed as dist

from parlab import trace
from parlab.runtime import emulation

# The sizes this rank last posted to each peer, {peer: [(elements, dtype), ...]}, a few
# distinct ones (a ring alternates two chunk sizes): a rank that gloo aborts on a message
# longer than its receive cannot tell who sent what; the sender can, though by the time it
# notices it may have sent its peer the next message too.
_sent = {}
_SENT_KEPT = 3


def send(tensor, dst, tag=0):
    """Send ``tensor`` to rank ``dst`` and wait until it has left."""
    return isend(tensor, dst, tag, op="send").wait()


def recv(tensor, src, tag=0):
    """Receive from rank ``src`` into ``tensor`` (in place; shape and dtype must match)."""
    return irecv(tensor, src, tag, op="recv").wait()


def isend(tensor, dst, tag=0, op="isend"):
    """Start sending ``tensor`` to ``dst``; do not modify it before ``wait()``."""
    start = trace.now()
    _remember_sent(tensor, dst)
    header = None
    with _connection_lost(f"{op} to", dst):  # gloo may find the peer gone as it posts, not only in wait()
        if emulation.shapes_links():
            # The emulated link: this rank's outgoing port decides when the message may leave
            # (ready) and when the port is free again (done); the receiver needs ready.
            ready, done = emulation.departure(dst, _nbytes(tensor))
            ready = torch.tensor([ready], dtype=torch.float64)
            header = (dist.isend(ready, dst, tag=tag, group=emulation.header_group()), ready, done)
        work = dist.isend(_staged(tensor), dst, tag=tag)
    return Request(work, op, dst, tensor, None, start, header)


def irecv(tensor, src, tag=0, op="irecv"):
    """Start receiving from ``src`` into ``tensor``; its contents are valid after ``wait()``."""
    start = trace.now()
    buffer = _staging_buffer(tensor)
    header = None
    with _connection_lost(f"{op} from", src):  # gloo may find the peer gone as it posts, not only in wait()
        if emulation.shapes_links():
            ready = torch.empty(1, dtype=torch.float64)
            header = (dist.irecv(ready, src, tag=tag, group=emulation.header_group()), ready, None)
        work = dist.irecv(buffer, src, tag=tag)
    return Request(work, op, src, tensor, buffer, start, header)


class Request:
    """A pending isend/irecv. Its traced end time is when ``wait()`` saw it complete.

    Under an emulated link a message travels with a header (on a process group of its own,
    so tags never collide) holding when it was ready to leave; ``wait()`` then returns no
    earlier than the emulated link lets it: a send when its port is free again, a receive
    when the message has arrived (``parlab.runtime.emulation``). The data itself moves at
    once, through gloo."""

    def __init__(self, work, op, peer, tensor, buffer, start, header=None):
        self._work, self.op, self.peer = work, op, peer
        self._tensor, self._buffer, self._start = tensor, buffer, start
        self._header = header
        self._done = False

    def wait(self):
        if not self._done:
            direction = "to" if "send" in self.op else "from"
            with _connection_lost(f"wait for its {self.op} {direction}", self.peer):
                if self._header is not None:
                    self._header[0].wait()
                self._work.wait()
            if self._buffer is not None and self._buffer is not self._tensor:
                self._tensor.copy_(self._buffer)
            if self._header is not None:
                _, ready, done = self._header
                if done is None:  # a receive: the message arrives after the ports of both ends allow
                    done = emulation.arrival(self.peer, _nbytes(self._tensor), ready.item())
                emulation.sleep_until(done)
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


def broadcast_from_first(tensors, group=None):
    """Overwrite each of ``tensors`` with the copy of ``group``'s first rank (one traced
    "broadcast" each): how the engines start their replicas from one rank's values."""
    first = global_rank(group, 0)
    for tensor in tensors:
        broadcast(tensor, src=first, group=group)


def global_rank(group, group_rank):
    """The global rank (what p2p addresses) of ``group``'s rank ``group_rank``, taken mod the
    group's size (None: the world, whose ranks are global)."""
    group_rank %= dist.get_world_size(group)
    return group_rank if group is None else dist.get_global_rank(group, group_rank)


def wait_all(requests):
    """Wait for every request, in order; returns their tensors."""
    return [request.wait() for request in requests]


_GLOO_CONNECTION_LOST = re.compile(r"Connection (reset|closed) by peer|Broken pipe")


@contextlib.contextmanager
def _connection_lost(what, peer):
    """Turn gloo's "Connection reset by peer" into a sentence that says why it happens and
    what this rank last sent to each rank. Its wording, each message as "to rank <d>, <n>
    <dtype> elements (<b> bytes)" joined by "; ", is what ``parlab.runtime.errors.
    explain_size_mismatch`` reads to name the sender: change the two together."""
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
