"""Traced point-to-point communication: the only wire that parlab's techniques use.

``send``/``recv`` block; ``isend``/``irecv`` return a :class:`Request` to ``wait()`` on.
Each call records a communication event (op, peer, bytes, start, end) when tracing is on,
so collectives and pipelines built on these helpers show up in the timeline and their
traffic can be counted exactly.

CUDA tensors on a gloo process group (ranks sharing GPUs) are staged through host memory:
gloo moves bytes between CPU buffers.
"""

import torch
import torch.distributed as dist

from parlab import trace


def send(tensor, dst, tag=0):
    """Send ``tensor`` to rank ``dst`` and wait until it has left."""
    start = trace.now()
    dist.send(_staged(tensor), dst, tag=tag)
    trace.record_comm("send", dst, _nbytes(tensor), start, trace.now())


def recv(tensor, src, tag=0):
    """Receive from rank ``src`` into ``tensor`` (in place; shape and dtype must match)."""
    start = trace.now()
    buffer = _staging_buffer(tensor)
    dist.recv(buffer, src, tag=tag)
    if buffer is not tensor:
        tensor.copy_(buffer)
    trace.record_comm("recv", src, _nbytes(tensor), start, trace.now())
    return tensor


def isend(tensor, dst, tag=0):
    """Start sending ``tensor`` to ``dst``; do not modify it before ``wait()``."""
    start = trace.now()
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
